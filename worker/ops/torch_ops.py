"""Plain-torch versions of the fused ops: the CPU path and the reference for every kernel.

Rounding follows HF transformers (normalise in float32, cast back, then scale by the weight), so
that tidal's tokens match transformers' in half precision too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, H, D]`` and ``key [T, Hkv, D]`` by their positions.

    ``cos_sin_cache`` is ``[max_position, rot_dim]``: cos in the first half, sin in the second,
    float32. Only the first ``rot_dim`` channels of each head rotate. ``is_neox``: rotate the two
    halves of the rotary channels (HF's rotate_half); otherwise rotate even/odd pairs (GPT-J).
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rot_dim // 2]
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    dtype = x.dtype
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if is_neox:
        cos = torch.cat((cos, cos), dim=-1).to(dtype)
        sin = torch.cat((sin, sin), dim=-1).to(dtype)
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        cos = cos.repeat_interleave(2, dim=-1).to(dtype)
        sin = sin.repeat_interleave(2, dim=-1).to(dtype)
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    out = x_rot * cos + rotated * sin
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat((out, x_pass), dim=-1)
