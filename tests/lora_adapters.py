"""Random PEFT LoRA adapters on tiny random models, written by ``peft`` itself, and the
HF transformers + PEFT reference outputs the engine is compared with."""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def make_peft_adapter(base_model, folder: Path, *, r: int, targets: list[str],
                      alpha: float = 16.0, rslora: bool = False, seed: int = 0,
                      **config) -> Path:
    """Save a PEFT adapter for ``base_model`` (an HF model) with random A and B (PEFT
    initialises B to zero, which would make every adapter the base model)."""
    from peft import LoraConfig, get_peft_model

    base_model = copy.deepcopy(base_model)  # get_peft_model wraps the modules in place
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                     lora_dropout=0.0, **config)
    peft_model = get_peft_model(base_model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, 0.2)
    peft_model.save_pretrained(folder)
    return folder


def peft_reference(base_model, adapter: Path | None):
    """The HF model with ``adapter`` applied (PEFT), or the base model for None."""
    if adapter is None:
        return base_model
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(base_model), str(adapter)).eval()
