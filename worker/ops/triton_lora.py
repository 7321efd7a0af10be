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

A third shrink serves the one-row (batch-1 decode) path, where kernel count sets the time: it
stores each slice of the inputs' partial sums apart (no zeroed output, no atomics) for the
GEMV that adds the adapter's product in its epilogue (``triton_decode.gemv(lora=...)``), and can
apply the RMSNorm before the linear itself (writing the normed row the GEMV then reads).

Loop bounds are compile-time constants (the feature sizes), which the Triton interpreter needs.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from tidal.worker.ops.triton_decode import _row_inv_rms, _x_chunk, launch, pdl_enabled

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
def _shrink_chunk(av, x_row, res_row, nw_ptr, h_row, k, kmask, inv, rb, IN: tl.constexpr,
                  NORM: tl.constexpr, ADD: tl.constexpr):
    xv = _x_chunk(x_row, res_row, nw_ptr, k, kmask, inv, IN, NORM, ADD, False, 0)
    if NORM:  # (exact: _x_chunk rounded the normed row to the dtype already)
        tl.store(h_row + k, xv.to(h_row.dtype.element_ty), mask=kmask & (rb == 0))
    return tl.sum(av.to(tl.float32) * xv[None, :], axis=1)


@triton.jit
def _shrink_partials(x_ptr, res_ptr, nw_ptr, h_ptr, res_out_ptr, a_ptr, slots_ptr, out_ptr,
                     stride_xt, stride_al, stride_ar, stride_os, stride_ot, eps,
                     IN: tl.constexpr, SR: tl.constexpr, BLOCK_R: tl.constexpr,
                     BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr, NORM: tl.constexpr,
                     ADD: tl.constexpr, ROW_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Program (token, block of outputs, slice of the inputs) stores its partial sums at
    ``out[slice, token]``: the reader sums the slices. With ``NORM`` the input is
    ``rms_norm(x (+ res))``, rounded as ``triton_decode``'s GEMV rounds it (``_x_chunk``);
    the first block of outputs stores its slice of that row to ``h`` (and of ``x + res`` to
    ``res_out``), so the GEMV after reads the very row this product used."""
    t = tl.program_id(0)
    rb = tl.program_id(1)
    split = tl.program_id(2)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    k_first = split * K_PER_SPLIT
    cols = tl.arange(0, BLOCK_K)
    # The slot is step metadata and A a weight: both load while the previous kernel finishes.
    slot = tl.load(slots_ptr + t).to(tl.int64)
    has = slot >= 0
    a_rows = a_ptr + tl.maximum(slot, 0) * stride_al + r[:, None] * stride_ar
    amask = (r < SR)[:, None] & has
    k = k_first + cols
    kmask = k < IN
    av = tl.load(a_rows + k[None, :], mask=amask & kmask[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # x comes from the previous kernel, and the outputs may reuse memory it still reads.
        tl.extra.cuda.gdc_wait()
    x_row = x_ptr + t * stride_xt
    res_row = res_ptr + t * stride_xt
    h_row = h_ptr + t * IN
    inv = 1.0
    if NORM:  # (the first block of outputs writes its slice of the new residual)
        inv = _row_inv_rms(x_row, res_row, res_out_ptr + t * IN, IN, eps, k_first,
                           k_first + (rb == 0).to(tl.int32) * K_PER_SPLIT, ADD, 0, ROW_CHUNK)
    acc = _shrink_chunk(av, x_row, res_row, nw_ptr, h_row, k, kmask, inv, rb, IN, NORM, ADD)
    for k0 in range(BLOCK_K, K_PER_SPLIT, BLOCK_K):
        k = k_first + k0 + cols
        kmask = k < IN
        av = tl.load(a_rows + k[None, :], mask=amask & kmask[None, :], other=0.0)
        acc += _shrink_chunk(av, x_row, res_row, nw_ptr, h_row, k, kmask, inv, rb, IN, NORM,
                             ADD)
    # (A base-model token: zeros, whatever its row holds.)
    tl.store(out_ptr + split * stride_os + t * stride_ot + r, tl.where(has, acc, 0.0),
             mask=r < SR)


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
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PERM: tl.constexpr):
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
        # A tile may straddle two slices: each slice's product keeps only its own columns,
        # and a slice with none of the tile's columns is skipped (most tiles meet one).
        s_first = tl.min(tl.where(nmask, s_of_n, NUM_SLICES))
        s_last = tl.max(tl.where(nmask, s_of_n, 0))
        for s in tl.static_range(NUM_SLICES):
            if (s >= s_first) & (s <= s_last):
                xs = tl.load(xa_ptr + rows[:, None] * stride_xat + s * R + r[None, :],
                             mask=mmask[:, None] & rmask[None, :], other=0.0)
                bmask = rmask[:, None] & (nmask & (s_of_n == s))[None, :]
                bv = tl.load(b_ptr + slot * stride_bl + n[None, :] * stride_bn + r[:, None],
                             mask=bmask, other=0.0)
                # A split shrink's sums stay float32 (as the per-token expand reads them): B
                # is widened to meet them, not they rounded to B's dtype.
                bv = bv.to(xs.dtype)
                acc += tl.dot(xs, bv, input_precision=PRECISION)
        yp = y_ptr + rows[:, None] * stride_yt + n[None, :]
        ymask = mmask[:, None] & nmask[None, :]
        yv = tl.load(yp, mask=ymask, other=0.0).to(tl.float32)
        tl.store(yp, (yv + acc).to(y_ptr.dtype.element_ty), mask=ymask)


def _expand_precision(xa: torch.Tensor, y: torch.Tensor) -> str:
    """The segmented expand's ``tl.dot`` precision. A float32 model: exact. Float32 sums of a
    split shrink into a 16-bit output: three TF32 products (B, a 16-bit weight, is exact in
    TF32; the sums keep ~21 bits, as the per-token expand's do), on the tensor cores where
    "ieee" would run them on the CUDA cores. 16-bit operands: any (the dot is exact)."""
    if y.dtype == torch.float32:
        return "ieee"
    return "tf32x3" if xa.dtype == torch.float32 else "tf32"


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
# The grouped (segmented) shrink of a decode batch wants more: its tiles read A once per 16
# tokens, not per token. With the expand's wider blocks of outputs below, Llama-8B's LoRA
# kernels of a batch of 64 in 8 adapters took 1.14 ms a step against 1.45 at 256 programs and
# 64 outputs (tools/results/lora_grouped_sweep_h100.json; 32 and 128 tokens alike).
_GROUPED_SHRINK_PROGRAMS = 1024


def _expand_block_n(out_features: int, block_r: int) -> int:
    """Outputs per program of the segmented expand: wide blocks (gate/up's 28,672 outputs at
    64 a program were 3,584 programs of one load each, 19 µs; 12 µs at 256; measured at rank
    16), narrower for large ranks: B's [BLOCK_R, BLOCK_N] tile sits in registers, widened to
    float32 (and split in two for tf32x3) when the shrink's sums are float32, so at most 8,192
    elements (rank 64: 128 outputs, rank 256: 32)."""
    return max(16, min(256 if out_features >= 16384 else 128, 8192 // block_r))


_ROW_CHUNK = 4096  # elements of the row the normed shrink sums squares over at a time


def _shrink_splits(programs: int, in_features: int, block_k: int,
                   wanted: int = _SHRINK_PROGRAMS) -> int:
    """Slices of the inputs a shrink sums over (atomically): about ``wanted`` programs for a
    small batch, no split for a large one."""
    if programs >= wanted // 2:
        return 1
    most = max(1, in_features // max(_SHRINK_MIN_K, block_k))
    return max(1, min(most, triton.cdiv(wanted, programs)))


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                segments: Any | None = None, split_k: int | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [T, in] -> [T, S*R] (rows of base-model tokens are zero). ``segments``: the
    step's runs (``start``, ``length``, ``slot`` device tensors, ``num``, ``max_len``) for the
    segmented kernel (output in ``x``'s dtype, float32 when split); None: the per-token one,
    float32 output. A grid of few programs gets the inputs split in slices summed atomically
    (``split_k`` forces a count, for tests). ``out``: a zeroed float32 [T, S*R] to write
    instead of allocating (and zeroing) one; the result is then float32 in both variants."""
    if out is not None and (out.shape != (x.shape[0], a.shape[1]) or
                            out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"lora_shrink: out {tuple(out.shape)} {out.dtype} is not a "
                         f"float32 [{x.shape[0]}, {a.shape[1]}] with contiguous rows")
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
        if out is None:
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
        tiles * triton.cdiv(sr, block_r) * segments.num, in_features, block_k,
        _GROUPED_SHRINK_PROGRAMS)
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
    splits = triton.cdiv(in_features, k_per_split)
    if out is None:
        out = torch.zeros(t, sr, dtype=torch.float32 if splits > 1 else x.dtype,
                          device=x.device)
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


def lora_shrink_partials(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, *,
                         norm_weight: torch.Tensor | None = None,
                         residual: torch.Tensor | None = None, eps: float = 0.0,
                         split_k: int | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The per-token shrink for the one-row path, in one kernel: ``(partials, h,
    new_residual)``. ``partials`` [SPLITS, T, S*R] float32 holds each slice of the inputs'
    share of ``h @ a[slot]^T`` (summed over the first axis: ``lora_shrink``'s output; zeros
    for base-model tokens), every element stored, so nothing is zeroed first; the consumer
    (``triton_decode.gemv(lora=...)``) sums the slices as it reads them.

    ``h`` is ``x``, or with ``norm_weight`` ``rms_norm(x + residual)`` (``residual`` None:
    ``rms_norm(x)``), rounded as ``torch_ops`` and the GEMV's norm prologue round it, and
    written by this kernel for the linear after; ``new_residual`` is then ``x + residual``
    (``residual`` given) or ``x``, else None, as ``gemv`` returns them. ``split_k`` forces the
    slice count (tests)."""
    shape = x.shape
    in_features = shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()
    t = x2.shape[0]
    sr = a.shape[1]
    if a.stride(2) != 1:
        raise ValueError("lora_shrink_partials needs A's rows contiguous")
    norm = norm_weight is not None
    add = norm and residual is not None
    # One row: narrow blocks of outputs (more programs) and one chunk of inputs per slice,
    # so a program's whole share of A loads before the wait for the previous kernel, and
    # what is left after it is one read of x and a short sum. (Llama-3.1-8B, batch 1: slices
    # of 256 inputs, 16 x 256 tiles; 48 programs before q/k/v, 56 before down.)
    block_r = min(_pow2(sr, 16), 16 if t == 1 else 64)
    splits = split_k if split_k is not None else _shrink_splits(
        t * triton.cdiv(sr, block_r), in_features, _SHRINK_MIN_K)
    block_k = min(256 if t == 1 else 128, _pow2(triton.cdiv(in_features, splits), 16))
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
    splits = triton.cdiv(in_features, k_per_split)
    out = torch.empty(splits, t, sr, dtype=torch.float32, device=x.device)
    h = torch.empty_like(x2) if norm else x2
    res_in = residual.reshape(t, in_features).contiguous() if add else x2
    res_out = torch.empty_like(x2) if add else x2
    new_residual = res_out.view(shape) if add else (x if norm else None)
    if t == 0:
        return out, h.view(shape), new_residual
    launch(_shrink_partials, (t, triton.cdiv(sr, block_r), splits),
           (x2, res_in, norm_weight if norm else x2, h, res_out, a, slots, out, x2.stride(0),
            a.stride(0), a.stride(1), out.stride(0), out.stride(1), float(eps)),
           dict(IN=in_features, SR=sr, BLOCK_R=block_r, BLOCK_K=block_k,
                K_PER_SPLIT=k_per_split, NORM=norm, ADD=add,
                ROW_CHUNK=min(_pow2(in_features, 16), _ROW_CHUNK) if norm else 16,
                num_warps=4),
           pdl_enabled(x.device))
    return out, h.view(shape), new_residual


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
    block_n = _expand_block_n(out_features, block_r)
    grid = (triton.cdiv(segments.max_len, _BLOCK_M), triton.cdiv(out_features, block_n),
            segments.num)
    perm = getattr(segments, "perm", None)
    _expand_segmented[grid](xa, b, segments.start, segments.length, segments.slot,
                            segments.start if perm is None else perm, y,
                            xa.stride(0), b.stride(0), b.stride(1), y.stride(0),
                            OUT=out_features, R=rank, BLOCK_R=block_r,
                            NUM_SLICES=len(offsets), OFF1=off1, OFF2=off2, BLOCK_M=_BLOCK_M,
                            BLOCK_N=block_n, PRECISION=_expand_precision(xa, y),
                            PERM=perm is not None)
