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


# Index and key arrays are staged slices of one upload at any 8-byte offset: compiling per
# alignment would compile again while serving (tests/worker/test_gpu_warmup.py).
@triton.jit(do_not_specialize_on_alignment=["rows_ptr", "keys_ptr"])
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


@triton.jit(do_not_specialize_on_alignment=["rows_ptr"])
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


_SAMPLE_BLOCK = 4096


@triton.jit(do_not_specialize=["n_masks"],
            do_not_specialize_on_alignment=["temp_ptr", "keys_ptr", "mrow_ptr"])
def _gumbel_partial_kernel(logits_ptr, temp_ptr, keys_ptr, mask_ptr, mrow_ptr, n_masks,
                           best_ptr, where_ptr, n_cols, stride_l, stride_m, n_blocks,
                           MASKS: tl.constexpr, BLOCK: tl.constexpr):
    # One block of one row: the best score and its column, for the row's second stage.
    # MASKS: 0 none, 1 mask row r for logits row r < n_masks, 2 the mask row of each logits
    # row in mrow_ptr (-1: none).
    r = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(logits_ptr + r * stride_l + cols, mask=inside,
                other=float("-inf")).to(tl.float32)
    if MASKS != 0:
        if MASKS == 1:
            g = tl.where(r < n_masks, r, -1)
        else:
            g = tl.load(mrow_ptr + r).to(tl.int64)
        if g >= 0:
            words = tl.load(mask_ptr + g * stride_m + (cols >> 5), mask=inside, other=0)
            x = tl.where(((words >> (cols & 31)) & 1) != 0, x, float("-inf"))
    t = tl.load(temp_ptr + r)
    if t > 0:
        key = tl.load(keys_ptr + r)
        lo = (key & 0xFFFFFFFF).to(tl.uint32)
        hi = ((key >> 32) & 0xFFFFFFFF).to(tl.uint32)
        a = _mix32(lo ^ 0x243F6A88)
        b = _mix32(hi ^ 0x85A308D3 ^ a)
        h = _mix32((cols.to(tl.uint32) * 0x9E3779B1) ^ a)
        h = _mix32(h + b)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        score = x / t - tl.log(-tl.log(u))
    else:
        score = x
    best, where = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + r * n_blocks + blk, best)
    tl.store(where_ptr + r * n_blocks + blk, blk * BLOCK + where)


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  bitmask: torch.Tensor | None = None,
                  grammar_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``sample/gumbel_sample.gumbel_sample``: one launch over [rows, column blocks], then
    the best block of each row."""
    from tidal.worker.sample import gumbel_sample as ref

    if (not logits.is_cuda or logits.stride(1) != 1
            or (bitmask is not None and bitmask.stride(1) != 1)):
        return ref.gumbel_sample(logits, temperature, keys, bitmask, grammar_rows)
    rows, n = logits.shape
    blocks = triton.cdiv(n, _SAMPLE_BLOCK)
    best = torch.empty((rows, blocks), dtype=torch.float32, device=logits.device)
    where = torch.empty((rows, blocks), dtype=torch.int32, device=logits.device)
    mrow = best  # (unread unless mode 2)
    if bitmask is None or not bitmask.shape[0]:
        bitmask, mode = best, 0  # (unread)
    elif grammar_rows is None:  # the first rows, in order: no per-row table to build
        mode = 1
    else:
        mrow, mode = ref.mask_rows(rows, bitmask.shape[0], grammar_rows, logits.device), 2
    n_masks = 0 if mode == 0 else bitmask.shape[0]
    _gumbel_partial_kernel[(rows, blocks)](
        logits, temperature, keys, bitmask, mrow, n_masks, best, where, n, logits.stride(0),
        bitmask.stride(0), blocks, MASKS=mode, BLOCK=_SAMPLE_BLOCK, num_warps=8)
    if blocks == 1:
        return where[:, 0].to(torch.int64)
    return where.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1).to(torch.int64)
