"""Tiny random DeepSeek-V3 checkpoints with a multi-token-prediction layer, for the tests of
``models.deepseek_v3`` / ``models.deepseek_mtp`` and the ``mtp`` speculative method.

HF transformers' ``DeepseekV3ForCausalLM`` holds no MTP layer (it ignores
``model.layers.{num_hidden_layers}.*`` on load), so the layer's tensors are made here: the block
from HF's own ``DeepseekV3DecoderLayer`` (its names and layout are the checkpoint's), plus
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head`` and ``embed_tokens``, and added to the saved
``model.safetensors``.
"""

from __future__ import annotations

from pathlib import Path

import torch

LAYERS = 2  # decoder layers; the MTP layer is ``model.layers.2``
VOCAB = 256
H = 64


def hf_config(nextn: int = 1):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=32,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_nextn_predict_layers=nextn, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="eager",
        rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 64, "mscale": 0.9,
                         "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1})


def _peaked(module: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():  # peaked distributions: greedy choices are not near-ties
        for name, p in module.named_parameters():
            if "norm" not in name:
                p.mul_(scale)


def mtp_tensors(hf, seed: int, *, echo: float | None = None) -> dict[str, torch.Tensor]:
    """The MTP layer's tensors under their checkpoint names (``model.layers.{LAYERS}.``).

    ``echo``: instead of random weights, a layer that predicts what the target would after the
    next token (``eh_proj`` passes the embedding through, the block's outputs are scaled by
    ``echo``, the target's final norm and LM head): with a target whose attention and MLPs
    barely matter (``make_model(..., echo=...)``) most drafts are then accepted."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    torch.manual_seed(seed)
    cfg = hf.config
    block = DeepseekV3DecoderLayer(cfg, LAYERS).float().eval()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.02)
        _peaked(block, 3.0 if echo is None else echo)
        block.mlp.gate.e_score_correction_bias.uniform_(0.0, 0.1)
    t = {f"{n}": p.detach().clone() for n, p in block.state_dict().items()}
    h = cfg.hidden_size
    if echo is None:
        t["enorm.weight"] = 1.0 + 0.1 * torch.randn(h)
        t["hnorm.weight"] = 1.0 + 0.1 * torch.randn(h)
        t["eh_proj.weight"] = 0.2 * torch.randn(h, 2 * h)
        t["shared_head.norm.weight"] = 1.0 + 0.1 * torch.randn(h)
        t["shared_head.head.weight"] = 0.3 * torch.randn(cfg.vocab_size, h)
    else:
        t["enorm.weight"] = torch.ones(h)
        t["hnorm.weight"] = torch.ones(h)
        t["eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        t["shared_head.norm.weight"] = hf.model.norm.weight.detach().clone()
        t["shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    t["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    return {f"model.layers.{LAYERS}.{n}": v.contiguous() for n, v in t.items()}


def make_model(folder: Path, seed: int, *, nextn: int = 1, echo: float | None = None):
    """Save a tiny DeepSeek-V3 (+ its MTP layer when ``nextn``) to ``folder``; returns (the HF
    model, the MTP tensors). ``echo``: the attention and MLP outputs of the target scaled by
    it, so that its next token depends mostly on the current one (see ``mtp_tensors``)."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(hf_config(nextn)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                torch.nn.init.normal_(p, std=0.02)
        _peaked(hf, 3.0)
        if echo is not None:
            hf.model.embed_tokens.weight.mul_(20.0)
            for layer in hf.model.layers:
                layer.self_attn.o_proj.weight.mul_(echo)
                mlp = layer.mlp
                if hasattr(mlp, "experts"):
                    mlp.experts.down_proj.mul_(echo)
                    mlp.shared_experts.down_proj.weight.mul_(echo)
                else:
                    mlp.down_proj.weight.mul_(echo)
        for layer in hf.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.uniform_(0.0, 0.1)
    hf.save_pretrained(folder)
    mtp = mtp_tensors(hf, seed + 100, echo=echo) if nextn else {}
    if mtp:
        path = folder / "model.safetensors"
        tensors = load_file(path)
        tensors.update(mtp)
        save_file(tensors, path, metadata={"format": "pt"})
    return hf, mtp
