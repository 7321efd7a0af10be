"""The fused ops as Triton kernels, with torch_ops' signatures and semantics.

The fallback when the CUDA extension can't be built. Rounding mirrors torch_ops (see there).
Outputs are freshly allocated; unsupported inputs go to the torch version. Importing this module
imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops import torch_ops
from tidal.worker.ops.attention_plan import next_pow2

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_ROW = 65536  # one program holds a whole row in registers; wider rows use torch


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_warps(block: int) -> int:
    return min(16, max(1, block // 512))


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    res_out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    stride_out,
    stride_res_out,
    stride_x,
    stride_res,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    FUSED_ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if FUSED_ADD:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def _norm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.dtype in _DTYPES and weight.dtype == x.dtype and 0 < x.shape[-1] <= _MAX_ROW


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _norm_supported(x, weight) or x.numel() == 0:
        return torch_ops.rms_norm(x, weight, eps)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = next_pow2(x2.shape[1])
    _rms_norm_kernel[(x2.shape[0],)](
        out, out, x2, x2, weight.contiguous(), out.stride(0), out.stride(0), x2.stride(0),
        x2.stride(0), x2.shape[1], float(eps), BLOCK=block, FUSED_ADD=False,
        num_warps=_row_warps(block),
    )  # fmt: skip
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        not _norm_supported(x, weight)
        or residual.dtype != x.dtype
        or residual.shape != x.shape
        or x.numel() == 0
    ):
        return torch_ops.fused_add_rms_norm(x, residual, weight, eps)
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    block = next_pow2(x2.shape[1])
    _rms_norm_kernel[(x2.shape[0],)](
        out, res_out, x2, r2, weight.contiguous(), out.stride(0), res_out.stride(0),
        x2.stride(0), r2.stride(0), x2.shape[1], float(eps), BLOCK=block, FUSED_ADD=True,
        num_warps=_row_warps(block),
    )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, stride_out, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(x_ptr.dtype.element_ty)
    y = (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _DTYPES or x.shape[-1] % 2 != 0 or x.numel() == 0:
        return torch_ops.silu_and_mul(x)
    x2 = _rows(x)
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(2048, next_pow2(d))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        out, x2, out.stride(0), x2.stride(0), d, BLOCK=block, num_warps=4
    )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _gelu_tanh_and_mul_kernel(out_ptr, x_ptr, stride_out, stride_x, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    # tanh(a) = 1 - 2 / (1 + exp(2a)): exact at both ends in float32 (exp overflows to inf).
    a = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * a))
    s = (0.5 * g * (1.0 + t)).to(x_ptr.dtype.element_ty)
    y = (s.to(tl.float32) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in _DTYPES or x.shape[-1] % 2 != 0 or x.numel() == 0:
        return torch_ops.gelu_tanh_and_mul(x)
    x2 = _rows(x)
    d = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(2048, next_pow2(d))
    _gelu_tanh_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
        out, x2, out.stride(0), x2.stride(0), d, BLOCK=block, num_warps=4
    )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _gemma_norm_kernel(
    out_ptr,
    res_out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    w_next_ptr,
    stride_out,
    stride_res_out,
    stride_x,
    stride_res,
    hidden,
    eps,
    BLOCK: tl.constexpr,
    ADD_NORM: tl.constexpr,
):
    """One row: y = cast(norm(x) * (1 + w)) in float32; with ADD_NORM, r = residual + y is
    stored too and the output is cast(norm(r) * (1 + w_next))."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    xf = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = (xf * inv_rms * (1.0 + w)).to(x_ptr.dtype.element_ty)
    if ADD_NORM:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        r = (res.to(tl.float32) + y.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, r, mask=mask)
        rf = r.to(tl.float32)
        w2 = tl.load(w_next_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        inv2 = tl.rsqrt(tl.sum(rf * rf, axis=0) / hidden + eps)
        y = (rf * inv2 * (1.0 + w2)).to(x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, y, mask=mask)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _norm_supported(x, weight) or x.numel() == 0:
        return torch_ops.gemma_rms_norm(x, weight, eps)
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = next_pow2(x2.shape[1])
    _gemma_norm_kernel[(x2.shape[0],)](
        out, out, x2, x2, weight, weight, out.stride(0), out.stride(0), x2.stride(0),
        x2.stride(0), x2.shape[1], float(eps), BLOCK=block, ADD_NORM=False,
        num_warps=_row_warps(block),
    )  # fmt: skip
    return out.view(x.shape)


def gemma_add_norm_norm(
    x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        not _norm_supported(x, post_weight)
        or next_weight.dtype != x.dtype
        or residual.dtype != x.dtype
        or residual.shape != x.shape
        or x.numel() == 0
    ):
        return torch_ops.gemma_add_norm_norm(x, residual, post_weight, next_weight, eps)
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    block = next_pow2(x2.shape[1])
    _gemma_norm_kernel[(x2.shape[0],)](
        out, res_out, x2, r2, post_weight, next_weight, out.stride(0), res_out.stride(0),
        x2.stride(0), r2.stride(0), x2.shape[1], float(eps), BLOCK=block, ADD_NORM=True,
        num_warps=_row_warps(block),
    )  # fmt: skip
    return out.view(x.shape), res_out.view(x.shape)


@triton.jit
def _rotate_heads(
    out_ptr,
    in_ptr,
    stride_out_head,
    stride_in_head,
    cos,
    sin,
    num_heads,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    h = tl.arange(0, HEADS_P)
    j = tl.arange(0, HALF_P)
    mask = (h < num_heads)[:, None] & (j < ROT_HALF)[None, :]
    if IS_NEOX:
        x_idx = j
        y_idx = j + ROT_HALF
    else:
        x_idx = 2 * j
        y_idx = 2 * j + 1
    src = in_ptr + h[:, None] * stride_in_head
    dst = out_ptr + h[:, None] * stride_out_head
    x = tl.load(src + x_idx[None, :], mask=mask, other=0.0).to(tl.float32)
    y = tl.load(src + y_idx[None, :], mask=mask, other=0.0).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    tl.store(dst + x_idx[None, :], (x * c - y * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + y_idx[None, :], (y * c + x * s).to(out_ptr.dtype.element_ty), mask=mask)
    if PASS_P > 0:
        k = 2 * ROT_HALF + tl.arange(0, PASS_P)
        pmask = (h < num_heads)[:, None] & (k < HEAD_DIM)[None, :]
        tl.store(dst + k[None, :], tl.load(src + k[None, :], mask=pmask), mask=pmask)


@triton.jit
def _rotary_kernel(
    q_out_ptr,
    k_out_ptr,
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    stride_qo_tok,
    stride_qo_head,
    stride_ko_tok,
    stride_ko_head,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_cache,
    num_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    ROT_HALF: tl.constexpr,
    HEADS_P: tl.constexpr,
    HALF_P: tl.constexpr,
    PASS_P: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_P)
    cos = tl.load(cache_ptr + pos * stride_cache + j, mask=j < ROT_HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + ROT_HALF + j, mask=j < ROT_HALF, other=0.0)
    _rotate_heads(
        q_out_ptr + t * stride_qo_tok, q_ptr + t * stride_q_tok, stride_qo_head, stride_q_head,
        cos, sin, num_heads, HEAD_DIM, ROT_HALF, HEADS_P, HALF_P, PASS_P, IS_NEOX,
    )  # fmt: skip
    _rotate_heads(
        k_out_ptr + t * stride_ko_tok, k_ptr + t * stride_k_tok, stride_ko_head, stride_k_head,
        cos, sin, num_kv_heads, HEAD_DIM, ROT_HALF, HEADS_P, HALF_P, PASS_P, IS_NEOX,
    )  # fmt: skip


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
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rot_half = cos_sin_cache.shape[1] // 2
    pass_dim = head_dim - 2 * rot_half
    pos = positions.reshape(-1)
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    _rotary_kernel[(num_tokens,)](
        q_out, k_out, query, key, pos, cos_sin_cache,
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads,
        HEAD_DIM=head_dim, ROT_HALF=rot_half, HEADS_P=next_pow2(max(num_heads, num_kv_heads)),
        HALF_P=next_pow2(rot_half), PASS_P=next_pow2(pass_dim) if pass_dim > 0 else 0,
        IS_NEOX=is_neox, num_warps=4,
    )  # fmt: skip
    return q_out, k_out


@triton.jit
def _vocab_shard_embedding_kernel(out_ptr, ids_ptr, w_ptr, start, shard, hidden, stride_w,
                                  BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    local = tl.load(ids_ptr + t).to(tl.int64) - start
    mine = (local >= 0) & (local < shard)
    cm = cols < hidden
    row = tl.load(w_ptr + local * stride_w + cols, mask=cm & mine, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * hidden + cols, row, mask=cm)


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """``torch_ops.vocab_shard_embedding`` in one kernel (five elementwise kernels and the
    lookup in torch: ~9 us of a tensor-parallel decode step)."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        return torch_ops.vocab_shard_embedding(ids, weight, start)
    flat = ids.reshape(-1)
    hidden = weight.shape[1]
    out = torch.empty((flat.numel(), hidden), dtype=weight.dtype, device=weight.device)
    if flat.numel():
        block = min(1024, next_pow2(hidden))
        _vocab_shard_embedding_kernel[(flat.numel(), triton.cdiv(hidden, block))](
            out, flat, weight, start, weight.shape[0], hidden, weight.stride(0), BLOCK=block,
            num_warps=4)
    return out.view(*ids.shape, hidden)
