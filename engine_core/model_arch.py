"""The architecture of a model, normalised from an HF ``config.json`` (or GGUF metadata).

One decoder implementation serves every supported family; this struct carries the few ways the
families differ, so the worker never reads raw HF configs.
"""

from __future__ import annotations

from typing import Any

import msgspec

# HF architecture name -> family. Families differ only in flags set below.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

EMBEDDING_ARCHITECTURES: dict[str, str] = {
    "BertModel": "bert",
    "BertForMaskedLM": "bert",
}


class ArchSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    architecture: str
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    # Embedding (encoder) models only.
    layer_norm_eps: float = 1e-12
    type_vocab_size: int = 0

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_embedding(self) -> bool:
        return self.family in EMBEDDING_ARCHITECTURES.values()


def arch_from_hf_dict(cfg: dict[str, Any], source: str) -> ArchSpec:
    """Build an :class:`ArchSpec` from an HF config dict; ``source`` names the file for errors."""
    archs = cfg.get("architectures") or []
    arch = next(
        (a for a in archs if a in SUPPORTED_ARCHITECTURES or a in EMBEDDING_ARCHITECTURES), None
    )
    if arch is None:
        known = ", ".join(sorted({*SUPPORTED_ARCHITECTURES, *EMBEDDING_ARCHITECTURES}))
        raise ValueError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"tidal supports {known}"
        )
    if arch in EMBEDDING_ARCHITECTURES:
        return _bert_arch(cfg, arch)
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    rope_theta, rope_scaling = _rope(cfg)
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"{source}: unsupported activation {act!r} (tidal supports silu)")
    sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    if family == "llama" and arch == "MistralForCausalLM":
        sliding = cfg.get("sliding_window")
    return ArchSpec(
        architecture=arch,
        family=family,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 2048),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else bool(cfg.get("attention_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
    )


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 folds theta and scaling into ``rope_parameters``; older versions keep
    # ``rope_theta`` and ``rope_scaling`` apart. Accept both.
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or None
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return theta, None
        scaling["rope_type"] = kind
    return theta, scaling


def _bert_arch(cfg: dict[str, Any], arch: str) -> ArchSpec:
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    act = cfg.get("hidden_act", "gelu")
    return ArchSpec(
        architecture=arch,
        family="bert",
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings") or 512),
        hidden_act=act,
        layer_norm_eps=float(cfg.get("layer_norm_eps", 1e-12)),
        type_vocab_size=int(cfg.get("type_vocab_size", 2)),
    )
