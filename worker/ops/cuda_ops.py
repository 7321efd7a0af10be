"""The fused ops on tidal's CUDA extension, with torch_ops' signatures and semantics.

Outputs are freshly allocated (the torch versions never modify their inputs, and callers may
rely on that). Inputs the kernels don't cover (other dtypes, a weight of another dtype, odd
layouts) go to the torch version instead of failing. Only imported once the extension loaded.
"""

from __future__ import annotations

import torch

from tidal.worker.ops import torch_ops
from tidal.worker.ops.cuda_ext import require_extension

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """2-D view ``[rows, last]`` keeping a row stride where possible (no copy for slices)."""
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in _DTYPES or weight.dtype != x.dtype or x.numel() == 0:
        return torch_ops.rms_norm(x, weight, eps)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    require_extension().rms_norm(out, x2, weight.contiguous(), float(eps))
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        x.dtype not in _DTYPES
        or residual.dtype != x.dtype
        or weight.dtype != x.dtype
        or residual.shape != x.shape
        or x.numel() == 0
    ):
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    require_extension().fused_add_rms_norm(out, res_out, x2, r2, weight.contiguous(), float(eps))
    return out.view(x.shape), res_out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _DTYPES or x.shape[-1] % 2 != 0 or x.numel() == 0:
        return torch_ops.silu_and_mul(x)
    x2 = _rows(x)
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    require_extension().silu_and_mul(out, x2)
    return out.view(*x.shape[:-1], d)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        query.dim() != 3
        or key.dim() != 3
        or query.dtype not in _DTYPES
        or key.dtype != query.dtype
        or cos_sin_cache.dtype != torch.float32
        or query.stride(-1) != 1
        or key.stride(-1) != 1
        or cos_sin_cache.stride(-1) != 1
        or query.shape[0] == 0
    ):
        return torch_ops.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    pos = positions.reshape(-1)
    if pos.dtype != torch.int64 or not pos.is_contiguous():
        pos = pos.to(torch.int64).contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    require_extension().rotary_embedding(q_out, k_out, pos, query, key, cos_sin_cache, is_neox)
    return q_out, k_out


# Gemma's ops have no kernel in the extension: the Triton ones serve (triton is present wherever
# the extension builds), else the torch ones.
def _triton_or_torch(name: str):
    try:
        from tidal.worker.ops import triton_ops
    except ImportError:
        return getattr(torch_ops, name)
    return getattr(triton_ops, name)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _triton_or_torch("gelu_tanh_and_mul")(x)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _triton_or_torch("gemma_rms_norm")(x, weight, eps)


def gemma_add_norm_norm(
    x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_or_torch("gemma_add_norm_norm")(x, residual, post_weight, next_weight, eps)
