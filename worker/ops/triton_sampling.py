"""Sampling kernels in Triton: seeded noise for many rows in one launch, and the grammar
bitmask applied in place. Their torch twins (``sample/seeded_random.py``,
``sample/grammar_mask.py``) are the CPU path and the reference they are tested against.
Importing this module imports triton."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.sample import seeded_random as sr

_NOISE_BLOCK = 4096
_MASK_BLOCK = 4096


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _seeded_exponential_kernel(q_ptr, rows_ptr, keys_ptr, n_cols, stride_q,
                               BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    key = tl.load(keys_ptr + r)
    lo = (key & 0xFFFFFFFF).to(tl.uint32)
    hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _mix32(lo ^ 0x243F6A88)
    b = _mix32(hi ^ 0x85A308D3 ^ a)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _mix32((cols.to(tl.uint32) * 0x9E3779B1) ^ a)
    h = _mix32(h + b)
    u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    tl.store(q_ptr + row * stride_q + cols, -tl.log(u), mask=cols < n_cols)


def seeded_exponential_(q: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> None:
    """``seeded_random.seeded_exponential_`` in one launch: rows ``rows`` of ``q`` (float32
    [B, n]) get the noise of their keys."""
    if q.dtype != torch.float32 or q.stride(1) != 1 or not q.is_cuda:
        sr.seeded_exponential_(q, rows, keys)
        return
    if not rows.numel():
        return
    n = q.shape[1]
    grid = (rows.numel(), triton.cdiv(n, _NOISE_BLOCK))
    _seeded_exponential_kernel[grid](q, rows, keys.to(torch.int64), n, q.stride(0),
                                     BLOCK=_NOISE_BLOCK, num_warps=8)


@triton.jit
def _apply_bitmask_kernel(logits_ptr, mask_ptr, rows_ptr, n_cols, stride_l, stride_m,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + g).to(tl.int64) if HAS_ROWS else g
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    words = tl.load(mask_ptr + g * stride_m + (cols >> 5), mask=inside, other=-1)
    allowed = ((words >> (cols & 31)) & 1) != 0
    # Only the banned columns are written; the logits themselves are never read.
    tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=inside & ~allowed)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | None) -> None:
    """``grammar_mask.apply_token_bitmask_`` in one launch."""
    from tidal.worker.sample import grammar_mask

    if not logits.is_cuda or logits.stride(1) != 1 or bitmask.stride(1) != 1:
        grammar_mask.apply_token_bitmask_(logits, bitmask, rows)
        return
    g = bitmask.shape[0]
    if not g:
        return
    n = logits.shape[1]
    grid = (g, triton.cdiv(n, _MASK_BLOCK))
    _apply_bitmask_kernel[grid](logits, bitmask, bitmask if rows is None else rows, n,
                                logits.stride(0), bitmask.stride(0), HAS_ROWS=rows is not None,
                                BLOCK=_MASK_BLOCK, num_warps=8)
