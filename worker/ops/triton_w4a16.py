"""Triton W4A16 kernels: 16-bit activations times INT4 weights in tidal's layout
(``int4_torch``: ``qweight`` int32 [N, K / 8], ``scales`` / ``qzeros`` [N, G], optional
act-order ``g_idx`` [K]), the 4-bit values dequantized in registers (``(q - z) * s`` rounded to
the activation dtype, as the torch reference does), accumulated in float32.

- ``_w4a16_mm``: a tiled GEMM on ``tl.dot`` for prefill (and, with split-K, for 5-16 rows).
- ``_w4a16_gemv_rows``: batch-1 decode for the other group sizes (no act-order): each
  program owns ``BLOCK_N`` output rows and streams their whole K extent in long chunks, as the
  16-bit GEMV does (``triton_decode.gemv``); no partial sums, the bias and the cast to the
  dtype in the kernel. The 4-bit values become the floats ``1 + q / 16`` by moving them into
  the mantissa of 1.0 (no integer-to-float conversion); each packed word contributes
  ``s * (sum((q - z) * x))`` over its 8 values, from ``sum((1 + q / 16) * x)`` and ``sum(x)``.
- ``_w4a16_gemv_groups``: the same plan on a tile shaped by the quantization groups (one
  scale and zero a row a group, not a gather per word), with fewer instructions a weight:
  batch-1 decode wherever the group is a power-of-two number of packed words (1.3-1.6x the
  whole-row kernel on every Llama-3.1-8B projection, H200).
- ``_w4a16_gemv``: one program per (row, column block, K split) without ``tl.dot``, for the
  decode steps the kernel above does not take (2-4 rows, act-order, groups over
  ``ROWS_MAX_GROUP``); its K splits give the GPU enough programs for a narrow weight.

Split-K partial sums land in a float32 buffer [splits, M, N] that one torch sum folds (no
atomics: the result does not depend on the order programs finish).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.triton_decode import gated_product
from tidal.worker.ops.triton_gemv_rows import (SPLIT_WS_FLOATS, SPLIT_WS_TILES, _split_workspace,
                                              split_arrive, split_done, split_share)

GEMV_MAX_ROWS = 4  # more rows: the tl.dot kernel (reading each weight tile once for 16 rows)
SPLITK_MAX_ROWS = 16  # up to here the dot kernel splits K for more programs
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, mask_k, mask_n, K8, NG,
                  GROUP: tl.constexpr, HAS_GIDX: tl.constexpr, DTYPE: tl.constexpr):
    """The weight tile [BLOCK_K, BLOCK_N] (input channels ``offs_k`` of output rows
    ``offs_n``) in ``DTYPE``."""
    mask = mask_k[:, None] & mask_n[None, :]
    rows = offs_n[None, :].to(tl.int64)
    words = tl.load(qw_ptr + rows * K8 + (offs_k[:, None] // 8), mask=mask, other=0)
    q = (words >> ((offs_k[:, None] % 8) * 4)) & 0xF
    if HAS_GIDX:
        g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
    else:
        g = offs_k // GROUP
    sz = rows * NG + g[:, None]
    s = tl.load(s_ptr + sz, mask=mask, other=0.0)
    z = tl.load(z_ptr + sz, mask=mask, other=0).to(tl.int32)
    return ((q - z).to(tl.float32) * s.to(tl.float32)).to(DTYPE)


@triton.jit
def _w4a16_mm(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, b_ptr, out_ptr, M, N, K, NG, stride_xm,
              stride_om, stride_os, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr,
              HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, s_ptr, z_ptr, g_ptr, offs_k, offs_n, mask_k, mask_n, K // 8,
                          NG, GROUP, HAS_GIDX, dtype)
        if IEEE:  # float32 activations: no TF32 rounding of the inputs
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + pid_k * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _rows_chunk(qw_ptr, s_ptr, z_ptr, rows64, row_ok, k0, offs_w, k8, NG,
                GROUP: tl.constexpr):
    """One chunk of packed words ``[rows, BLOCK_K / 8]`` with each word's group scale and zero
    (float32), and the word indices."""
    wi = k0 // 8 + offs_w
    mask = row_ok[:, None] & (wi < k8)[None, :]
    words = tl.load(qw_ptr + rows64[:, None] * k8 + wi[None, :], mask=mask, other=0,
                    eviction_policy="evict_first")
    sz = rows64[:, None] * NG + (wi // (GROUP // 8))[None, :]
    s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + sz, mask=mask, other=0).to(tl.float32)
    return words, s, z, wi


@triton.jit
def _w4a16_gemv_rows(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, K, K8, NG,
                     GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """Output rows ``[BLOCK_N]`` of one activation row over the whole K; ``GROUP`` is a
    multiple of 8. Every tensor is a [rows, packed words] tile in one layout (no reshapes,
    which Triton turns into shuffles through shared memory): nibble ``j`` of every word is
    unpacked in place and meets column ``j`` of the activation (a strided read of a row that
    stays in L1 / L2); each word's group scale and zero come from a gather that L1 serves.
    (Loading the next chunk before computing this one measured no faster on an H100.)"""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    k8 = K8
    offs_w = tl.arange(0, BLOCK_K // 8)
    acc = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        words, s, z, wi = _rows_chunk(qw_ptr, s_ptr, z_ptr, rows64, row_ok, k0, offs_w, k8, NG,
                                      GROUP)
        w_ok = wi < k8
        # Nibble q lands in the top four mantissa bits of 1.0: the float 1 + q / 16, in one
        # shift and one and-or (no integer-to-float conversion, no subtraction per value);
        # sum((q - z) * x) = 16 * sum((1 + q / 16) * x) - (16 + z) * sum(x).
        dot = tl.zeros((BLOCK_N, BLOCK_K // 8), dtype=tl.float32)
        sx = tl.zeros((BLOCK_K // 8,), dtype=tl.float32)
        for j in tl.static_range(8):
            x = tl.load(x_ptr + wi * 8 + j, mask=w_ok, other=0.0).to(tl.float32)
            if 4 * j <= 19:
                t = words << (19 - 4 * j)
            else:
                t = words >> (4 * j - 19)
            f = ((t & 0x00780000) | 0x3F800000).to(tl.float32, bitcast=True)
            dot += f * x[None, :]
            sx += x
        acc += s * (16.0 * dot - (16.0 + z) * sx[None, :])
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _w4a16_gemv_groups(x_ptr, qw_ptr, s_ptr, z_ptr, b_ptr, out_ptr, ws_ptr, count_ptr, N, K8,
                       NG, one_bits, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_N: tl.constexpr, GPC: tl.constexpr, PREFETCH: tl.constexpr,
                       SPLIT: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr):
    """``_w4a16_gemv_rows`` with the chunk shaped by the quantization groups: a
    ``[rows, GPC groups, GROUP / 8 words]`` tile, so each row's scale and zero are loaded
    once a group (``[rows, GPC]``) instead of gathered for every packed word, and applied to
    the group's sum after an in-tile reduction over its words. ``GROUP / 8`` and ``GPC`` are
    powers of two.

    Fewer instructions per weight than the whole-row kernel (its SASS loop, compiled for sm_90
    on the CPU: about 7.5 a weight there, 3.6 to 4.8 here at one warp of 16 to 64 rows):
    - One shift serves two nibbles: nibble 2p + 1 lands in bits 19-22 of the float's mantissa
      (``1 + q / 16``) and nibble 2p in bits 15-18 (``1 + q / 256``; its activation is scaled
      by 16, exactly, so both products are ``x + q x / 16`` in the same units). Each nibble's
      unit part is at most 256 / q times its ``q`` part, eight bits of float32's 24.
    - The exponent bits come from ``one_bits`` (0x3F800000, an argument): as a register it
      lets the mask and the or be one LOP3 (two immediates take two).
    - Rows share the activation: a one-warp program of 16 to 64 rows converts each
      activation value once for all of them.

    ``PREFETCH``: the next chunk's words are loaded before this one is computed (a manual
    double buffer). ``SPLIT`` > 1: program (n, s) sums the s-th share of the groups into a
    float32 workspace (``ws_ptr`` [SPLIT, N]); the last of a row block's programs to count
    itself in (``count_ptr``, zeroed, re-zeroed by it) adds the shares in order, so the result
    does not depend on which finishes last (as ``triton_gemv_rows``'s split).

    ``GATED``: the weight is a fused ``[gate; up]`` one (N rows, N / 2 outputs) and the output
    ``act(gate) * up`` (SiLU, or tanh-GELU with ``GELU``), rounded as the unfused ops round: a
    program's first ``BLOCK_N / 2`` rows are gate rows, the others the matching up rows, so
    the activation is the epilogue of the program (or of a row block's last split) that holds
    both, and the launch the separate activation kernel took is saved.

    (Reading the activation as contiguous runs of eight, one vector load per packed word, with
    each word unpacked along a fourth axis, measured slower on every Llama-3.1-8B projection:
    H200, 2026-11-28.)"""
    WPG: tl.constexpr = GROUP // 8
    pid = tl.program_id(0)
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        i = tl.arange(0, BLOCK_N)
        col = pid * HALF + i % HALF  # the output each row feeds
        rows = tl.where(i < HALF, col, col + N // 2)
        row_ok = col < N // 2
    else:
        rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
    rows64 = rows.to(tl.int64)
    g_off = tl.arange(0, GPC)
    w_off = tl.arange(0, WPG)
    w_base = qw_ptr + rows64[:, None, None] * K8
    g_lo, g_hi = split_share(NG, SPLIT, GPC)
    acc = tl.zeros((BLOCK_N, GPC), dtype=tl.float32)
    if PREFETCH:
        words = _groups_chunk(w_base, row_ok, g_lo + g_off, w_off, g_hi, K8, WPG)
    for g0 in range(g_lo, g_hi, GPC):
        gi = g0 + g_off
        wi = gi[:, None] * WPG + w_off[None, :]
        w_ok = (gi[:, None] < g_hi) & (wi < K8)
        if PREFETCH:
            nxt = _groups_chunk(w_base, row_ok, gi + GPC, w_off, g_hi, K8, WPG)
        else:
            words = _groups_chunk(w_base, row_ok, gi, w_off, g_hi, K8, WPG)
        sz = rows64[:, None] * NG + gi[None, :]
        sz_ok = row_ok[:, None] & (gi < g_hi)[None, :]
        s = tl.load(s_ptr + sz, mask=sz_ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + sz, mask=sz_ok, other=0).to(tl.float32)
        dot = tl.zeros((BLOCK_N, GPC, WPG), dtype=tl.float32)
        sx = tl.zeros((GPC, WPG), dtype=tl.float32)  # the unit parts: x_hi + 16 x_lo
        sx1 = tl.zeros((GPC, WPG), dtype=tl.float32)  # sum(x), for the zero points
        for p in tl.static_range(4):
            if 15 - 8 * p >= 0:
                t = words << (15 - 8 * p)
            else:
                t = words >> (8 * p - 15)
            x_hi = tl.load(x_ptr + wi * 8 + (2 * p + 1), mask=w_ok, other=0.0).to(tl.float32)
            x_lo = tl.load(x_ptr + wi * 8 + 2 * p, mask=w_ok, other=0.0).to(tl.float32)
            f_hi = ((t & 0x00780000) | one_bits).to(tl.float32, bitcast=True)
            f_lo = ((t & 0x00078000) | one_bits).to(tl.float32, bitcast=True)
            dot += f_hi * x_hi[None, :, :]
            dot += f_lo * (16.0 * x_lo)[None, :, :]
            sx += x_hi + 16.0 * x_lo
            sx1 += x_hi + x_lo
        # sum(q x) = 16 (sum(f x) - unit parts); minus z sum(x)
        acc += s * (16.0 * (tl.sum(dot, axis=2) - tl.sum(sx, axis=1)[None, :])
                    - z * tl.sum(sx1, axis=1)[None, :])
        if PREFETCH:
            words = nxt
    y = tl.sum(acc, axis=1)
    if SPLIT > 1:
        tl.store(ws_ptr + tl.program_id(1) * N + rows, y, mask=row_ok)
        if split_arrive(count_ptr, pid, SPLIT):  # the block's last: all shares visible
            y = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for sp in tl.static_range(SPLIT):
                y += tl.load(ws_ptr + sp * N + rows, mask=row_ok, other=0.0,
                             cache_modifier=".cg")
            split_done(count_ptr, pid)
            _groups_store(out_ptr, b_ptr, y, rows, row_ok, N, pid, HAS_BIAS, BLOCK_N, GATED,
                          GELU)
    else:
        _groups_store(out_ptr, b_ptr, y, rows, row_ok, N, pid, HAS_BIAS, BLOCK_N, GATED, GELU)


@triton.jit
def _groups_chunk(w_base, row_ok, gi, w_off, g_hi, K8, WPG: tl.constexpr):
    """Packed words ``[rows, groups gi, WPG]`` (groups from ``g_hi`` on read as 0)."""
    wi = gi[:, None] * WPG + w_off[None, :]
    ok = (gi[:, None] < g_hi) & (wi < K8)
    return tl.load(w_base + wi[None, :, :], mask=row_ok[:, None, None] & ok[None, :, :],
                   other=0, eviction_policy="evict_first")


@triton.jit
def _groups_store(out_ptr, b_ptr, y, rows, row_ok, N, pid, HAS_BIAS: tl.constexpr,
                  BLOCK_N: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if GATED:  # (rows: the gate half, then the up half; see _w4a16_gemv_groups)
        HALF: tl.constexpr = BLOCK_N // 2
        halves = tl.reshape(y, (2, HALF))
        which = tl.arange(0, 2)[:, None]
        g = tl.sum(tl.where(which == 0, halves, 0.0), axis=0)
        u = tl.sum(tl.where(which == 1, halves, 0.0), axis=0)
        cols = pid * HALF + tl.arange(0, HALF)
        tl.store(out_ptr + cols, gated_product(g, u, out_ptr, GELU).to(out_ptr.dtype.element_ty),
                 mask=cols < N // 2)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _w4a16_gemv(x_ptr, qw_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, NG, stride_xm, stride_om,
                stride_os, GROUP: tl.constexpr, HAS_GIDX: tl.constexpr,
                TILE_GROUP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Rows of the output ``[BLOCK_N]`` for one activation row, over this program's share
    of K. The packed words are read as ``[BLOCK_N, BLOCK_K / 8]`` tiles along each weight row
    (coalesced: a row's words are contiguous) and unpacked in registers. ``TILE_GROUP``: a
    tile lies in one quantization group, so its scale and zero are one value per output row
    and ``sum((q - z) * s * x) = s * (sum(q * x) - z * sum(x))``; else (act-order, or a tile
    that straddles groups) they are gathered per element."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    k8 = K // 8
    offs_w = tl.arange(0, BLOCK_K // 8)
    shifts = tl.arange(0, 8) * 4
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        wi = k0 // 8 + offs_w
        words = tl.load(qw_ptr + rows[:, None] * k8 + wi[None, :],
                        mask=mask_n[:, None] & (wi < k8)[None, :], other=0)
        q = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 0xF,
                       (BLOCK_N, BLOCK_K)).to(tl.float32)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        if TILE_GROUP:
            sz = rows * NG + k0 // GROUP
            s = tl.load(s_ptr + sz, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=mask_n, other=0).to(tl.float32)
            acc += s * (tl.sum(q * x[None, :], axis=1) - z * tl.sum(x, axis=0))
        else:
            if HAS_GIDX:
                g = tl.load(g_ptr + offs_k, mask=mask_k, other=0)
            else:
                g = offs_k // GROUP
            sz = rows[:, None] * NG + g[None, :]
            mask = mask_n[:, None] & mask_k[None, :]
            s = tl.load(s_ptr + sz, mask=mask, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + sz, mask=mask, other=0).to(tl.float32)
            acc += tl.sum((q - z) * s * x[None, :], axis=1)
    tl.store(out_ptr + pid_k * stride_os + m * stride_om + offs_n, acc, mask=mask_n)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter (tests): a few programs
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def _splits(programs: int, k_blocks: int, device: torch.device) -> int:
    """K splits that give about two programs per SM, never more than there are K blocks."""
    want = -(-2 * _sm_count(device) // max(programs, 1))
    return max(1, min(want, k_blocks, 16))


# Launch shapes (BLOCK_N, BLOCK_K, num_warps) of ``_w4a16_gemv_rows`` per (N, K, group), where
# a sweep (tools/sweep_int4_gemv.py) found better than its default rule. The kernel now runs
# only the group sizes ``_w4a16_gemv_groups`` does not take, which no measured model has.
GEMV_ROWS_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int]] = {}
# Launch shapes (BLOCK_N, GPC, num_warps, num_stages, prefetch, K splits) of
# ``_w4a16_gemv_groups`` per (N, K, group), where the sweep found better than
# ``gemv_groups_config``'s rule. Llama-3.1-8B at group 128, H200 (2026-11-28,
# tools/results/int4_gemv_groups3_h200_llama8b.json; the rule's shape, then the whole-row
# kernel's best): q/k/v 8.7 us (8.9; 12.2), o 7.2 (7.8; 9.3), gate/up 29.1 (30.2; 45.3), down
# 17.6 (18.8; 26.8). Two pipeline stages measured no faster on any of them.
GEMV_GROUPS_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, bool, int]] = {
    (6144, 4096, 128): (64, 1, 1, 1, False, 16),
    (4096, 4096, 128): (32, 1, 1, 1, False, 16),
    (28672, 4096, 128): (32, 2, 1, 1, False, 4),
    (4096, 14336, 128): (32, 1, 1, 1, False, 16),
}
ONE_BITS = 0x3F800000  # float32 1.0
GROUPS_MAX_GROUP = 1024
ROWS_MAX_GROUP = 1 << 20  # per-channel scales (one group over the whole K) included


def rows_kernel_takes(group: int) -> bool:
    """Whether ``_w4a16_gemv_rows`` handles weights of this group size: a multiple of 8 (one
    packed word) up to ``ROWS_MAX_GROUP``."""
    return 8 <= group <= ROWS_MAX_GROUP and group % 8 == 0


def groups_kernel_takes(group: int) -> bool:
    """Whether ``_w4a16_gemv_groups`` handles this group size: a power-of-two number of packed
    words (8 to ``GROUPS_MAX_GROUP`` values)."""
    words = group // 8
    return group % 8 == 0 and 1 <= words and words & (words - 1) == 0 and group <= GROUPS_MAX_GROUP


def gemv_groups_config(n: int, k: int, group: int,
                       device: torch.device) -> tuple[int, int, int, int, bool, int]:
    """The group-tiled GEMV's launch shape for an ``n`` x ``k`` INT4 weight: a measured one,
    else one warp of 32 rows over two groups a chunk, K split in two until the grid holds
    about eight programs an SM (at most 8 shares, each of at least two chunks). On the
    Llama-3.1-8B sweeps (H200) this rule came within 2-8 % of the best shape of every
    projection: one-warp programs of few rows need many of them in flight to cover the memory
    latency."""
    hit = GEMV_GROUPS_CONFIGS.get((n, k, group))
    if hit is not None:
        return hit
    block_n, gpc = 32, 2
    blocks, chunks = triton.cdiv(n, block_n), triton.cdiv(triton.cdiv(k, group), gpc)
    split = 1
    while split < 8 and blocks * split < 8 * _sm_count(device) and chunks >= 4 * split:
        split *= 2
    return block_n, gpc, 1, 1, False, split


def gemv_rows_config(n: int, k: int, group: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an ``n`` x ``k`` INT4 weight: a measured
    one, else the rule the Llama-3.1-8B sweep on an H100 found best for all four of its
    projections (8 rows of 1024 K, 512 bytes of packed weight a row, a chunk; two warps)."""
    hit = GEMV_ROWS_CONFIGS.get((n, k, group))
    if hit is not None:
        return hit
    return 8, 1024, 2


def gated_gemv_applies(x: torch.Tensor, qweight: torch.Tensor, group_size: int,
                       g_idx: torch.Tensor | None) -> bool:
    """Whether ``w4a16_gated_gemv`` takes ``x`` times this fused ``[gate; up]`` weight: one
    row, no act-order, a group the group-tiled GEMV takes, an even number of rows."""
    return (x.numel() == x.shape[-1] and g_idx is None and groups_kernel_takes(group_size)
            and qweight.shape[0] % 2 == 0 and qweight.shape[1] * 8 == x.shape[-1])


def w4a16_gated_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     qzeros: torch.Tensor, group_size: int, act: str,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``act(gate) * up`` (``act``: "silu" or "gelu_tanh") of one row ``x`` [..., K] times a
    fused ``[gate; up]`` INT4 weight, the activation the GEMV's epilogue
    (``gated_gemv_applies`` first)."""
    x2 = x.reshape(1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = _groups_gemv(x2, qweight, scales, qzeros, group_size, bias, act)
    return out.reshape(*x.shape[:-1], qweight.shape[0] // 2)


def _groups_gemv(x2: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 qzeros: torch.Tensor, group: int, bias: torch.Tensor | None,
                 act: str | None) -> torch.Tensor:
    """``_w4a16_gemv_groups`` over one row ``x2`` [1, K]; ``act``: gated (see the kernel)."""
    n, k, ng = qweight.shape[0], x2.shape[1], scales.shape[1]
    block_n, gpc, warps, stages, prefetch, split = gemv_groups_config(n, k, group, x2.device)
    gated = act is not None
    out = torch.empty(1, n // 2 if gated else n, dtype=x2.dtype, device=x2.device)
    blocks = triton.cdiv(n // 2, block_n // 2) if gated else triton.cdiv(n, block_n)
    if split > 1 and (split * n > SPLIT_WS_FLOATS or blocks > SPLIT_WS_TILES):
        split = 1  # (beyond the shared workspace: every program takes all of K)
    ws, counts = _split_workspace(x2.device) if split > 1 else (out, out)
    _w4a16_gemv_groups[(blocks, split)](
        x2, qweight, scales, qzeros, bias if bias is not None else x2, out, ws, counts,
        n, k // 8, ng, ONE_BITS, GROUP=group, HAS_BIAS=bias is not None,
        BLOCK_N=block_n, GPC=gpc, PREFETCH=prefetch, SPLIT=split, GATED=gated,
        GELU=act == "gelu_tanh", num_warps=warps, num_stages=stages)
    return out


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 qzeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] (16/32-bit) times the INT4 weight [N, K]; see the module docstring."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    n, ng = qweight.shape[0], scales.shape[1]
    if qweight.shape[1] * 8 != k:
        raise ValueError(f"x has {k} input features, the INT4 weight {qweight.shape[1] * 8}")
    has_gidx = g_idx is not None
    g_arg = g_idx if has_gidx else qweight  # (unread without act-order)
    group = 1 if has_gidx else group_size  # (a launch constant: one compile per group size)
    if m == 0:
        return x.new_empty(*lead, n)
    if m == 1 and not has_gidx and groups_kernel_takes(group):
        return _groups_gemv(x2, qweight, scales, qzeros, group, bias, None).reshape(*lead, n)
    if m == 1 and not has_gidx and rows_kernel_takes(group):
        block_n, block_k, warps = gemv_rows_config(n, k, group)
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
        _w4a16_gemv_rows[(triton.cdiv(n, block_n),)](
            x2, qweight, scales, qzeros, bias if bias is not None else x2, out, n, k, k // 8, ng,
            GROUP=group, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps)
        return out.reshape(*lead, n)
    if m <= GEMV_MAX_ROWS:
        block_n = 64
        # The widest K tile (up to 128) inside one group: one scale and zero per row a tile.
        block_k = next((b for b in (128, 64, 32, 16, 8) if group % b == 0), 8)
        tile_group = not has_gidx and group % block_k == 0
        if not tile_group:
            block_k = 128
        n_blocks = triton.cdiv(n, block_n)
        split = _splits(n_blocks * m, triton.cdiv(k, block_k), x.device)
        part = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _w4a16_gemv[(n_blocks, split, m)](
            x2, qweight, scales, qzeros, g_arg, part, n, k, ng, x2.stride(0), part.stride(1),
            part.stride(0), GROUP=group, HAS_GIDX=has_gidx, TILE_GROUP=tile_group,
            SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
        y = part[0] if split == 1 else part.sum(0)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*lead, n)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, block_k = (64, 64) if m <= SPLITK_MAX_ROWS else (128, 64)
    grid_mn = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = _splits(grid_mn, triton.cdiv(k, block_k), x.device) if m <= SPLITK_MAX_ROWS else 1
    if split == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        stride_os = 0
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        stride_os = out.stride(0)
    fuse_bias = bias is not None and split == 1
    _w4a16_mm[(triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)](
        x2, qweight, scales, qzeros, g_arg, bias if fuse_bias else x2, out, m, n, k, ng,
        x2.stride(0), out.stride(-2), stride_os, GROUP=group, HAS_GIDX=has_gidx,
        HAS_BIAS=fuse_bias, SPLIT_K=split, IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    if split > 1:
        y = out.sum(0)
        if bias is not None:
            y = y + bias.float()
        out = y.to(x.dtype)
    return out.reshape(*lead, n)
