"""Rotary position embeddings with the scaling schemes of the supported families.

The cos/sin table is computed once in float32, the way HF transformers computes it, so
positions rotate identically in both.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tidal.worker.kernel_policy import current_kernels


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by ``factor``, short ones kept, and the band in
    # between blended smoothly.
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``factor`` times the trained one."""
    return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _yarn_inv_freq(base: float, dim: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor = float(s["factor"])
    orig = float(s.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(s.get("beta_fast", 32)), float(s.get("beta_slow", 1))
    mscale = s.get("attention_factor")
    if not mscale:
        # DeepSeek's YaRN scales cos/sin by mscale over mscale_all_dim (1 when equal, as in
        # V2-Lite); the softmax scale takes yarn_mscale(factor, mscale_all_dim)^2 instead.
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        mscale = (yarn_mscale(factor, float(m)) / yarn_mscale(factor, float(m_all))
                  if m and m_all else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolate = 1.0 / pos_freqs
    interpolate = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: high frequency, kept as trained
    return interpolate * (1 - keep) + extrapolate * keep, float(mscale)


def _longrope_inv_freq(base: float, dim: int, max_position: int,
                       s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    # Phi-3 LongRoPE ("su"): per-frequency divisors, one set for contexts within the trained
    # length and one beyond it, and cos/sin scaled up to keep attention entropy in check.
    # HF switches sets per forward pass by the sequence length, which leaves keys already
    # cached under the other set; tidal chooses once, by the context the table is built for
    # (vLLM does the same with max_model_len), so the two agree whenever every sequence of a
    # run stays on the same side of ``original_max_position_embeddings`` as that context.
    orig = int(s["original_max_position_embeddings"])
    factor = float(s.get("factor") or max_position / orig)
    mscale = s.get("attention_factor")
    if mscale is None:
        mscale = math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1.0 else 1.0
    key = "long_factor" if max_position > orig else "short_factor"
    ext = torch.tensor(s[key], dtype=torch.float32)
    if ext.shape != (dim // 2,):
        raise ValueError(f"rope scaling {key} has {ext.numel()} entries; the rotary dimension "
                         f"{dim} needs {dim // 2}")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**exponents), float(mscale)


def build_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    kind = (scaling or {}).get("rope_type", "default")
    mscale = 1.0
    if kind == "default":
        inv_freq = _base_inv_freq(base, rotary_dim)
    elif kind == "linear":
        inv_freq = _base_inv_freq(base, rotary_dim) / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(_base_inv_freq(base, rotary_dim), scaling)
    elif kind == "yarn":
        inv_freq, mscale = _yarn_inv_freq(base, rotary_dim, scaling)
    elif kind == "longrope":
        inv_freq, mscale = _longrope_inv_freq(base, rotary_dim, max_position, scaling)
    else:
        raise ValueError(f"unsupported rope scaling type {kind!r} (tidal supports default, "
                         "linear, llama3, yarn, longrope)")
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos() * mscale, freqs.sin() * mscale), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None, is_neox: bool = True) -> None:
        super().__init__()
        self.is_neox = is_neox
        self.kernels = current_kernels()
        cache = build_cos_sin_cache(head_dim, max_position, base, scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.rotary_embedding(positions, q, k, self.cos_sin_cache, self.is_neox)
