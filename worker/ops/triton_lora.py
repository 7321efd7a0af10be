"""Triton kernels for LoRA's shrink and expand products over a batch that mixes adapters.

Same layout and math as the torch reference (``lora_torch``): ``a`` [L, S*R, in] and ``b``
[L, out, R] slot buffers, ``slots`` [T] (-1: the base model, nothing added).

Two variants of each product:

- per-token: one program per (token, block of outputs) reads its token's slot from device
  memory; nothing depends on host data, so CUDA graphs capture it (decode batches, where each
  token is its own request anyway);
- segmented: the step's tokens in runs that share an adapter (a request's prompt chunk is one
  run; the batch order needs no sorting), one program per (block of a run's tokens, block of
  outputs) with ``tl.dot`` tiles, so a prompt's tokens share each weight load. The runs come
  from the host each step: eager (prefill) steps. With a permutation (``segments.perm``) the
  runs are of the tokens sorted by adapter, cut in tiles of at most ``_BLOCK_M``: a decode
  batch mixing adapters, whose tile table and permutation a CUDA graph reads from fixed
  buffers (``lora.manager``: grouped decode).

Loop bounds are compile-time constants (the feature sizes), which the Triton interpreter needs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

_BLOCK_M = 16  # tokens per tile of the segmented kernels (tl.dot's minimum)


@triton.jit
def _shrink_per_token(x_ptr, a_ptr, slots_ptr, out_ptr, stride_xt, stride_al, stride_ar,
                      stride_ot, IN: tl.constexpr, SR: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, ATOMIC: tl.constexpr):
    t = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_first = tl.program_id(2) * K_PER_SPLIT
    rmask = r < SR
    slot = tl.load(slots_ptr + t).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k = k_first + k0 + tl.arange(0, BLOCK_K)
            kmask = k < IN
            xv = tl.load(x_ptr + t * stride_xt + k, mask=kmask, other=0.0).to(tl.float32)
            av = tl.load(a_ptr + slot * stride_al + r[:, None] * stride_ar + k[None, :],
                         mask=rmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        if ATOMIC:  # one slice of the inputs: summed into the zeroed output
            tl.atomic_add(out_ptr + t * stride_ot + r, acc, mask=rmask)
    if not ATOMIC:
        tl.store(out_ptr + t * stride_ot + r, acc, mask=rmask)


@triton.jit
def _expand_per_token(xa_ptr, b_ptr, slots_ptr, y_ptr, stride_xat, stride_bl, stride_bn,
                      stride_yt, OUT: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
                      OFF1: tl.constexpr, OFF2: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < OUT
        # The output slice of each column (q/k/v, gate/up): which R columns of xa it reads.
        s = (n >= OFF1).to(tl.int32) + (n >= OFF2).to(tl.int32)
        r = tl.arange(0, BLOCK_R)
        m2 = nmask[:, None] & (r[None, :] < R)
        xav = tl.load(xa_ptr + t * stride_xat + s[:, None] * R + r[None, :], mask=m2,
                      other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + slot * stride_bl + n[:, None] * stride_bn + r[None, :], mask=m2,
                     other=0.0).to(tl.float32)
        acc = tl.sum(xav * bv, axis=1)
        yp = y_ptr + t * stride_yt + n
        yv = tl.load(yp, mask=nmask, other=0.0).to(tl.float32)
        tl.store(yp, (yv + acc).to(y_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def _shrink_segmented(x_ptr, a_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, perm_ptr, out_ptr,
                      stride_xt, stride_al, stride_ar, stride_ot, IN: tl.constexpr,
                      SR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PERM: tl.constexpr,
                      K_PER_SPLIT: tl.constexpr, SPLITS: tl.constexpr):
    # The grid's third axis: segment * SPLITS + slice of the inputs (summed atomically).
    seg = tl.program_id(2) // SPLITS
    k_first = (tl.program_id(2) % SPLITS) * K_PER_SPLIT
    length = tl.load(seg_len_ptr + seg)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < length:
        start = tl.load(seg_start_ptr + seg).to(tl.int64)
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        m = m0 + tl.arange(0, BLOCK_M)
        mmask = m < length
        if PERM:  # a run of the tokens sorted by adapter: its rows through the permutation
            rows = tl.load(perm_ptr + start + m, mask=mmask, other=0).to(tl.int64)
        else:
            rows = start + m
        r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < SR
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(0, K_PER_SPLIT, BLOCK_K):
            k = k_first + k0 + tl.arange(0, BLOCK_K)
            kmask = k < IN
            xv = tl.load(x_ptr + rows[:, None] * stride_xt + k[None, :],
                         mask=mmask[:, None] & kmask[None, :], other=0.0)
            # A's rows as the tile's columns: [BLOCK_K, BLOCK_R].
            av = tl.load(a_ptr + slot * stride_al + r[None, :] * stride_ar + k[:, None],
                         mask=kmask[:, None] & rmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xv, av, input_precision="ieee")
            else:
                acc += tl.dot(xv, av)
        optrs = out_ptr + rows[:, None] * stride_ot + r[None, :]
        omask = mmask[:, None] & rmask[None, :]
        if SPLITS > 1:  # one slice of the inputs: summed into the zeroed float32 output
            tl.atomic_add(optrs, acc, mask=omask)
        else:
            tl.store(optrs, acc.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _expand_segmented(xa_ptr, b_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr, perm_ptr, y_ptr,
                      stride_xat, stride_bl, stride_bn, stride_yt, OUT: tl.constexpr,
                      R: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SLICES: tl.constexpr,
                      OFF1: tl.constexpr, OFF2: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, IEEE: tl.constexpr, PERM: tl.constexpr):
    seg = tl.program_id(2)
    length = tl.load(seg_len_ptr + seg)
    m0 = tl.program_id(0) * BLOCK_M
    if m0 < length:
        start = tl.load(seg_start_ptr + seg).to(tl.int64)
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        m = m0 + tl.arange(0, BLOCK_M)
        mmask = m < length
        if PERM:
            rows = tl.load(perm_ptr + start + m, mask=mmask, other=0).to(tl.int64)
        else:
            rows = start + m
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < OUT
        s_of_n = (n >= OFF1).to(tl.int32) + (n >= OFF2).to(tl.int32)
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # A tile may straddle two slices: each slice's product keeps only its own columns.
        for s in tl.static_range(NUM_SLICES):
            xs = tl.load(xa_ptr + rows[:, None] * stride_xat + s * R + r[None, :],
                         mask=mmask[:, None] & rmask[None, :], other=0.0)
            bmask = rmask[:, None] & (nmask & (s_of_n == s))[None, :]
            bv = tl.load(b_ptr + slot * stride_bl + n[None, :] * stride_bn + r[:, None],
                         mask=bmask, other=0.0)
            # (A split shrink's float32 sums: rounded as an unsplit shrink's output is.)
            xs = xs.to(bv.dtype)
            if IEEE:
                acc += tl.dot(xs, bv, input_precision="ieee")
            else:
                acc += tl.dot(xs, bv)
        yp = y_ptr + rows[:, None] * stride_yt + n[None, :]
        ymask = mmask[:, None] & nmask[None, :]
        yv = tl.load(yp, mask=ymask, other=0.0).to(tl.float32)
        tl.store(yp, (yv + acc).to(y_ptr.dtype.element_ty), mask=ymask)


def _pow2(n: int, at_least: int) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _slice_bounds(offsets: tuple[int, ...], out_features: int) -> tuple[int, int]:
    if len(offsets) > 3:
        raise ValueError(f"at most 3 output slices, got {len(offsets)}")
    bounds = list(offsets[1:]) + [out_features] * (3 - len(offsets))
    return bounds[0], bounds[1]


# Per-token shrink: programs wanted at least (a few waves of an H100's 132 SMs), and inputs
# per program at least. One program per token reading a whole A (Llama-8B's down projection:
# 14,336 inputs, 112 dependent loads) took ~0.17 ms, most of a batch-1 decode step's LoRA cost.
_SHRINK_PROGRAMS = 256
_SHRINK_MIN_K = 256


def _shrink_splits(programs: int, in_features: int, block_k: int) -> int:
    """Slices of the inputs the per-token shrink sums over (atomically): enough programs for a
    small batch, none for a large one."""
    if programs >= _SHRINK_PROGRAMS // 2:
        return 1
    most = max(1, in_features // max(_SHRINK_MIN_K, block_k))
    return max(1, min(most, triton.cdiv(_SHRINK_PROGRAMS, programs)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                segments: Any | None = None, split_k: int | None = None) -> torch.Tensor:
    """``x`` [T, in] -> [T, S*R] (rows of base-model tokens are zero). ``segments``: the
    step's runs (``start``, ``length``, ``slot`` device tensors, ``num``, ``max_len``) for the
    segmented kernel (output in ``x``'s dtype, float32 when split); None: the per-token one,
    float32 output. A grid of few programs gets the inputs split in slices summed atomically
    (``split_k`` forces a count, for tests)."""
    x = x.contiguous()
    t, in_features = x.shape
    sr = a.shape[1]
    if segments is None:
        block_r = min(_pow2(sr, 16), 64)
        block_k = 128 if in_features >= 256 else 32
        splits = split_k if split_k is not None else _shrink_splits(
            t * triton.cdiv(sr, block_r), in_features, block_k)
        k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
        splits = triton.cdiv(in_features, k_per_split)
        make = torch.zeros if splits > 1 else torch.empty
        out = make(t, sr, dtype=torch.float32, device=x.device)
        if t == 0:
            return out
        grid = (t, triton.cdiv(sr, block_r), splits)
        _shrink_per_token[grid](x, a, slots, out, x.stride(0), a.stride(0), a.stride(1),
                                out.stride(0), IN=in_features, SR=sr, BLOCK_R=block_r,
                                BLOCK_K=block_k, K_PER_SPLIT=k_per_split, ATOMIC=splits > 1)
        return out
    block_r = min(_pow2(sr, 16), 64)
    block_k = 64 if in_features >= 256 else 32
    tiles = triton.cdiv(segments.max_len, _BLOCK_M)
    # A decode batch grouped by adapter is a few tiles: split their inputs as the per-token
    # shrink does (Llama-8B, batch 64 in 8 adapters: ~12 programs each reading all of A).
    splits = split_k if split_k is not None else _shrink_splits(
        tiles * triton.cdiv(sr, block_r) * segments.num, in_features, block_k)
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
    splits = triton.cdiv(in_features, k_per_split)
    out = torch.zeros(t, sr, dtype=torch.float32 if splits > 1 else x.dtype, device=x.device)
    if segments.num == 0:
        return out
    grid = (tiles, triton.cdiv(sr, block_r), segments.num * splits)
    perm = getattr(segments, "perm", None)
    _shrink_segmented[grid](x, a, segments.start, segments.length, segments.slot,
                            segments.start if perm is None else perm, out,
                            x.stride(0), a.stride(0), a.stride(1), out.stride(0),
                            IN=in_features, SR=sr, BLOCK_M=_BLOCK_M, BLOCK_R=block_r,
                            BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
                            PERM=perm is not None, K_PER_SPLIT=k_per_split, SPLITS=splits)
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                offsets: tuple[int, ...], rank: int, segments: Any | None = None) -> None:
    """``y`` [T, out] += each token's slice products (in place); see ``lora_torch``."""
    t, out_features = y.shape
    if t == 0:
        return
    if y.stride(1) != 1:
        raise ValueError("lora_expand needs the output's rows contiguous")
    xa = xa.contiguous()
    off1, off2 = _slice_bounds(offsets, out_features)
    block_r = _pow2(rank, 16)
    if segments is None:
        # [BLOCK_N, BLOCK_R] tiles in registers: narrower for large ranks.
        block_n = min(64, max(16, 4096 // block_r))
        grid = (t, triton.cdiv(out_features, block_n))
        _expand_per_token[grid](xa, b, slots, y, xa.stride(0), b.stride(0), b.stride(1),
                                y.stride(0), OUT=out_features, R=rank, BLOCK_R=block_r,
                                OFF1=off1, OFF2=off2, BLOCK_N=block_n)
        return
    if segments.num == 0:
        return
    block_n = 64
    grid = (triton.cdiv(segments.max_len, _BLOCK_M), triton.cdiv(out_features, block_n),
            segments.num)
    perm = getattr(segments, "perm", None)
    _expand_segmented[grid](xa, b, segments.start, segments.length, segments.slot,
                            segments.start if perm is None else perm, y,
                            xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
                            OUT=out_features, R=rank, BLOCK_R=block_r,
                            NUM_SLICES=len(offsets), OFF1=off1, OFF2=off2, BLOCK_M=_BLOCK_M,
                            BLOCK_N=block_n, IEEE=y.dtype == torch.float32,
                            PERM=perm is not None)
