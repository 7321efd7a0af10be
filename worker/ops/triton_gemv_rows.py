"""A GEMV over a few rows (2 to ``MAX_ROWS``): ``x [M, K] @ weight[N, K].T``, each weight tile
read once for every row, for the steps that are still bound by the weight bytes but have more
than one row: decode at batch 2 to 8, a speculative verify at batch 1 (1 + k tokens).

The rows are padded to 16 and multiplied on the tensor cores (``tl.dot``), so the accumulators
stay small whatever the row count, and the K loop's weight loads are software-pipelined
(``num_stages``). The one-row GEMV's plan (``_gemv_rows_fma_kernel``: few weight rows per
program, one elementwise accumulator per input row, weights prefetched before the
programmatic-dependent-launch wait) loses to it at four rows on every Llama-3.1-8B weight
(H100 sweep, 2026-11-28: none in any shape's four best) but wins where the tensor-core grid is
too small to cover the chip (a 2048 x 2048 weight: 64 programs); ``ROWS_CONFIGS`` picks it
per shape. Two more variants of the tensor-core kernel, not in the table: K split over several
programs per tile (a fifth element of the launch shape; a float32 workspace of partial sums,
the tile's last program adds them in order), for the projections whose grids hold fewer than
four programs per SM; and programmatic dependent launch (``PDL_DOT``). Together they took
Llama-3.1-8B's four-row q/k/v, o and down 2-7 % lower per call on an H200 (2026-11-28), and
an EAGLE-3 batch-1 run no faster (1.91x -> 1.89x), so neither is on.

FP8 (e4m3) weights run on the tensor-core kernel too, from one row (widened to float16 in
registers, weight-only; ``FP8_ROWS_CONFIGS``): the engine takes it at 2-8 rows, where it beat
quantizing the rows for cuBLASLt 1.4-2.6x per weight on an H200.

H100, Llama-3.1-8B's projections, device time per call in a CUDA graph, weights cycled past
the L2 cache (``tools/bench_gemv_rows.py``; cuBLAS -> this, us): four rows q/k/v 20.6 -> 20.0,
o 15.6 -> 14.4, gate/up + SiLU 89.7 -> 80.5, down 43.5 -> 42.2, LM head 379.6 -> 338.8; two
and eight rows within 1 % of those. Optional bias, and the gated epilogue of a fused
``[gate; up]`` weight (SiLU or tanh-GELU times up), rounded as torch rounds the unfused ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tidal.worker.ops.gpu_info import device_index
from tidal.worker.ops.triton_decode import (_fp8_on_device, _w_chunk, gated_product, launch,
                                            pdl_enabled)

MAX_ROWS = 8  # measured up to here (the tile holds 16)
# The table's elementwise launch shapes were measured at four rows; past that their per-row
# accumulators crowd the registers, and such calls stay on cuBLAS (``tuned_for``).
FMA_TUNED_ROWS = 4


# Split-K launches (a fifth element of a tensor-core launch shape): one float32 workspace of
# partial sums and one set of tile counters per device, shared by every call (the calls on a
# device run one after another on its stream; a tile's last program re-zeroes its counter).
SPLIT_WS_FLOATS = 1 << 22  # 16 MiB
SPLIT_WS_TILES = 1 << 14
_split_ws: dict[tuple[str, int | None], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (device.type, device.index)
    ws = _split_ws.get(key)
    if ws is None:
        ws = _split_ws[key] = (
            torch.empty(SPLIT_WS_FLOATS, dtype=torch.float32, device=device),
            torch.zeros(SPLIT_WS_TILES, dtype=torch.int32, device=device))
    return ws


@triton.jit
def split_share(total, SPLIT: tl.constexpr, STEP: tl.constexpr):
    """[lo, hi) of ``total`` that program ``program_id(1)`` of ``SPLIT`` sums: equal shares in
    whole ``STEP``s (the last ones shorter or empty); all of it when ``SPLIT`` is 1."""
    lo = 0
    hi = total
    if SPLIT > 1:
        per = tl.cdiv(tl.cdiv(total, SPLIT), STEP) * STEP
        lo = tl.program_id(1) * per
        hi = tl.minimum(total, lo + per)
    return lo, hi


@triton.jit
def split_arrive(count_ptr, tile, SPLIT: tl.constexpr):
    """Counts this program's share of ``tile`` as stored; True for the tile's last, to which
    the others' stores are then visible. That one re-zeroes the counter (``split_done``)."""
    tl.debug_barrier()  # every thread's share stored before the count (released with it)
    seen = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
    return seen == SPLIT - 1


@triton.jit
def split_done(count_ptr, tile):
    tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


class FmaLaunch(NamedTuple):
    """A launch shape of the elementwise kernel (``_gemv_rows_fma_kernel``); a plain 4-tuple
    (BLOCK_N, BLOCK_K, num_warps, num_stages) is one of the tensor-core kernel."""

    block_n: int
    block_k: int
    warps: int
    prefetch: int  # weight chunks loaded before the wait for the previous kernel (1 or 2)


# Launch shapes per (N outputs, K, gated), from the sweep above (H100): the tensor-core kernel's
# (BLOCK_N, BLOCK_K, num_warps, num_stages), or an ``FmaLaunch``; others take DEFAULT_CONFIG
# (the gated weights' best, which reads two tiles per stage and so fits any of these in the
# shared memory).
ROWS_CONFIGS: dict[tuple[int, int, bool], tuple] = {
    (6144, 4096, False): (64, 256, 4, 3),
    (4096, 4096, False): (32, 512, 4, 5),
    (14336, 4096, True): (32, 256, 4, 3),
    (4096, 14336, False): (32, 512, 4, 5),
    (128256, 4096, False): (32, 512, 4, 5),
    # Qwen3-0.6B: gate/up + SiLU 12.6 -> 7.0 us, LM head 112.5 -> 104.1 (four rows); its
    # q/k/v, o and down projections stayed faster on cuBLAS (0.77-0.93x): not here.
    (3072, 1024, True): (32, 128, 4, 5),
    (151936, 1024, False): (64, 256, 4, 3),
    # Speculative drafters' first pass (four rows at batch 1, k = 3; H100, cuBLAS -> this, us).
    # Llama-3.2-1B as a draft model: o 6.36 -> 5.75 (the elementwise kernel: 64 tensor-core
    # programs cannot cover the chip), gate/up + SiLU 31.3 -> 24.8, down 15.2 -> 15.0, LM head
    # 189.8 -> 171.8; its q/k/v stayed faster on cuBLAS (7.0 against 7.5).
    (2048, 2048, False): FmaLaunch(4, 512, 4, 2),
    (8192, 2048, True): (64, 128, 4, 3),
    (2048, 8192, False): (16, 512, 4, 5),
    (128256, 2048, False): (32, 512, 4, 5),
    # Llama-3.1-8B's EAGLE-3 head: fc over three hidden states 38.9 -> 37.0, q/k/v over two
    # 39.0 -> 37.4, its LM head over the 32k draft vocabulary 98.0 -> 88.7.
    (4096, 12288, False): (32, 512, 4, 5),
    (6144, 8192, False): (64, 256, 4, 3),
    (32000, 4096, False): (64, 256, 4, 5),
}
DEFAULT_CONFIG = (32, 256, 4, 3)
# FP8 (e4m3) weights on the tensor-core kernel (weight-only, as the one-row GEMV), for every
# FP8 weight at FP8_MIN_ROWS to FP8_MAX_ROWS rows (decode at batch 2-8, a speculative verify at
# batch 1): launch shapes per (N outputs, K, gated), else FP8_DEFAULT_CONFIG. H200,
# tools/sweep_fp8_gemv.py --dot-rows 2,4,8, the norm before it included; the engine's path for
# these rows before (the rows normed and quantized to FP8, then cuBLASLt; timed with the norm
# and the quantization apart, one launch more than the engine for q/k/v and gate/up) -> this,
# us at 2 / 4 / 8 rows. Llama-3.1-8B: q/k/v 21.9 / 23.2 / 22.7 -> 12.6 / 12.5 / 12.6, o 16.5 / 16.4 / 16.1
# -> 9.0, gate/up + SiLU 57.1 / 54.2 / 56.5 -> 34.8 / 35.8 / 35.8, down 50.0 / 52.0 / 48.7 ->
# 20.2 / 20.3 / 20.4. Qwen3-0.6B: q/k/v 9.0-10.4 -> 6.4-6.5, o 10.3-10.4 -> 4.7, gate/up
# 11.9-12.2 -> 7.2-7.3, down 13.6 -> 5.2-5.3. The default beat the old path in all 24 cases
# (by 1.3x at the least: Llama's gate/up 40.3-41.4 us). At one row the kernel only tied the
# elementwise GEMV (Llama's gate/up 34.9 against 35.0 us, the others 14-42 % slower): not used
# there.
FP8_ROWS_CONFIGS: dict[tuple[int, int, bool], tuple] = {
    (6144, 4096, False): (64, 128, 4, 3, 4),
    (4096, 4096, False): (64, 256, 4, 3, 4),
    (14336, 4096, True): (64, 256, 4, 3, 1),
    (4096, 14336, False): (64, 256, 4, 3, 4),
    (4096, 1024, False): (128, 128, 4, 3, 4),
    (1024, 2048, False): (32, 256, 4, 3, 4),
    (3072, 1024, True): (32, 128, 4, 3, 4),
    (1024, 3072, False): (32, 256, 4, 3, 4),
}
FP8_DEFAULT_CONFIG = (32, 256, 4, 3, 4)
FP8_MIN_ROWS = 2
FP8_MAX_ROWS = 8
# Programmatic dependent launch for the tensor-core kernel (its first weight chunk loaded before
# the wait): KernelConfig.gemv_rows_pdl, set at start-up (``kernel_policy.apply_tuning``). Off:
# on an H200 it paid per call (tools/bench_gemv_rows.py --pdl both) but not end to end.
PDL_DOT = False


@triton.jit
def _gemv_rows_kernel(out_ptr, x_ptr, w_ptr, b_ptr, M, N, K, stride_x, stride_w, stride_o,
                      ws_ptr, count_ptr, scale_ptr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr,
                      EVICT: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
                      W_FP8: tl.constexpr):
    """``SPLIT`` > 1: program (n, s) sums the s-th of ``SPLIT`` slices of K into a float32
    workspace (``ws_ptr``: [SPLIT, M, N, or 2N gated]); the last of a tile's programs to count
    itself in (``count_ptr``, one zeroed counter per tile, re-zeroed by it) adds the slices in
    order and writes the tile: a grid of SPLIT times as many programs for weights too small to
    cover the chip, the result independent of which program finishes last.

    ``W_FP8``: e4m3 weights with a float32 scale per weight row (``scale_ptr``), weight-only
    as the one-row GEMV (``fp8_torch.fp8_weight_only_linear``): each tile widened to float16
    in registers (exact), x multiplied by 2^-4 into float16 (exact from 2^-10 up to 2^20 in
    magnitude, float16's normal range shifted; below, steps of 2^-20; activations past 2^20
    would overflow), the product in float32 times 2^4 and the row's scale at the end."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    # Gated: the weight is [gate; up], the up row of output j is row N + j.
    wu_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w
    x_rows = x_ptr + ms[:, None] * stride_x
    k_lo, k_hi = split_share(K, SPLIT, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PDL:
        # The first weight chunk depends on nothing the previous kernel writes: it streams in
        # while that kernel finishes (the loop's pipeline starts after the wait).
        kk0 = k_lo + cols
        km0 = kk0 < k_hi
        w0 = _w_chunk(w_rows, kk0, row_ok, km0, False, EVICT)
        if GATED:
            wu0 = _w_chunk(wu_rows, kk0, row_ok, km0, False, EVICT)
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # x comes from it; our output may reuse memory it reads
        x0 = _rows_dot_x(x_rows, kk0, m_ok, km0, W_FP8)
        acc = tl.dot(x0, tl.trans(_rows_dot_w(w0, W_FP8)), acc)
        if GATED:
            acc_up = tl.dot(x0, tl.trans(_rows_dot_w(wu0, W_FP8)), acc_up)
        k_lo += BLOCK_K
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + cols
        km = kk < k_hi
        x = _rows_dot_x(x_rows, kk, m_ok, km, W_FP8)
        acc = tl.dot(x, tl.trans(_rows_dot_w(_w_chunk(w_rows, kk, row_ok, km, False, EVICT),
                                             W_FP8)), acc)
        if GATED:
            acc_up = tl.dot(x, tl.trans(_rows_dot_w(_w_chunk(wu_rows, kk, row_ok, km, False,
                                                             EVICT), W_FP8)), acc_up)
    tile_ok = m_ok[:, None] & row_ok[None, :]
    if SPLIT > 1:
        width = 2 * N if GATED else N
        slot = ws_ptr + ms[:, None] * width + rows[None, :]
        tl.store(slot + tl.program_id(1) * M * width, acc, mask=tile_ok)
        if GATED:
            tl.store(slot + tl.program_id(1) * M * width + N, acc_up, mask=tile_ok)
        if split_arrive(count_ptr, pid, SPLIT):  # the tile's last: all slices visible
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in tl.static_range(SPLIT):
                acc += tl.load(slot + s * M * width, mask=tile_ok, other=0.0,
                               cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(slot + s * M * width + N, mask=tile_ok, other=0.0,
                                      cache_modifier=".cg")
            split_done(count_ptr, pid)
            _rows_epilogue(out_ptr, b_ptr, scale_ptr, acc, acc_up, ms, rows, row_ok, tile_ok,
                           stride_o, N, HAS_BIAS, GATED, GELU, W_FP8)
    else:
        _rows_epilogue(out_ptr, b_ptr, scale_ptr, acc, acc_up, ms, rows, row_ok, tile_ok,
                       stride_o, N, HAS_BIAS, GATED, GELU, W_FP8)


@triton.jit
def _rows_dot_x(x_rows, kk, m_ok, km, W_FP8: tl.constexpr):
    """Columns ``kk`` of the input rows as the dot's left operand: as they are, or for FP8
    weights times 2^-4 in float16 (``_gemv_rows_kernel``)."""
    x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & km[None, :], other=0.0)
    if W_FP8:
        x = (x.to(tl.float32) * 0.0625).to(tl.float16)
    return x


@triton.jit
def _rows_dot_w(w, W_FP8: tl.constexpr):
    if W_FP8:
        w = w.to(tl.float16)
    return w


@triton.jit
def _rows_epilogue(out_ptr, b_ptr, scale_ptr, acc, acc_up, ms, rows, row_ok, tile_ok, stride_o,
                   N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr,
                   W_FP8: tl.constexpr):
    y = acc
    if W_FP8:  # (x was taken times 2^-4)
        y *= 16.0 * tl.load(scale_ptr + rows, mask=row_ok, other=0.0)[None, :]
        if GATED:
            acc_up *= 16.0 * tl.load(scale_ptr + rows + N, mask=row_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y = gated_product(y, acc_up, out_ptr, GELU)
    tl.store(out_ptr + ms[:, None] * stride_o + rows[None, :], y.to(out_ptr.dtype.element_ty),
             mask=tile_ok)


@triton.jit
def _gemv_rows_fma_kernel(out_ptr, x_ptr, w_ptr, b_ptr, M, N, K, stride_x, stride_w, stride_o,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr,
                          EVEN: tl.constexpr, EVICT: tl.constexpr, PREFETCH: tl.constexpr,
                          PDL: tl.constexpr):
    """The one-row GEMV's plan for a few rows: few weight rows per program (a grid that covers
    the chip many times over, every program's loads in flight at once), each weight chunk
    multiplied elementwise into one float32 accumulator per input row, summed once at the end.
    The first ``PREFETCH`` weight chunks depend on nothing the previous kernel writes: with
    programmatic dependent launch they stream in while it finishes."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    ms = tl.arange(0, BLOCK_M)
    m_ok = ms < M
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    wu_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w  # (GATED: [gate; up])
    x_rows = x_ptr + ms[:, None] * stride_x
    km0 = cols < K
    w0 = _w_chunk(w_rows, cols, row_ok, km0, EVEN, EVICT)
    if GATED:
        wu0 = _w_chunk(wu_rows, cols, row_ok, km0, EVEN, EVICT)
    if PREFETCH > 1:  # (the wrapper checks that K holds a second chunk)
        kk1 = BLOCK_K + cols
        km1 = kk1 < K
        w1 = _w_chunk(w_rows, kk1, row_ok, km1, EVEN, EVICT)
        if GATED:
            wu1 = _w_chunk(wu_rows, kk1, row_ok, km1, EVEN, EVICT)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # x comes from the previous kernel, and our output may reuse memory it still reads.
        tl.extra.cuda.gdc_wait()
    x = _rows_x_chunk(x_rows, cols, m_ok, km0, EVEN)
    acc = w0.to(tl.float32)[None, :, :] * x
    if GATED:
        acc_up = wu0.to(tl.float32)[None, :, :] * x
    if PREFETCH > 1:
        x = _rows_x_chunk(x_rows, kk1, m_ok, km1, EVEN)
        acc += w1.to(tl.float32)[None, :, :] * x
        if GATED:
            acc_up += wu1.to(tl.float32)[None, :, :] * x
    for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        km = kk < K
        x = _rows_x_chunk(x_rows, kk, m_ok, km, EVEN)
        acc += _w_chunk(w_rows, kk, row_ok, km, EVEN, EVICT).to(tl.float32)[None, :, :] * x
        if GATED:
            acc_up += _w_chunk(wu_rows, kk, row_ok, km, EVEN, EVICT
                                    ).to(tl.float32)[None, :, :] * x
    y = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y = gated_product(y, tl.sum(acc_up, axis=2), out_ptr, GELU)
    tl.store(out_ptr + ms[:, None] * stride_o + rows[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _rows_x_chunk(x_rows, kk, m_ok, km, EVEN: tl.constexpr):
    """Columns ``kk`` of every input row, float32, as [BLOCK_M, 1, BLOCK_K] (rows past M: 0)."""
    if EVEN:
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
    else:
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & km[None, :], other=0.0)
    return x.to(tl.float32)[:, None, :]


def tuned_for(n: int, k: int, gated: bool, rows: int, fp8: bool = False) -> bool:
    """Whether a launch shape was measured for this weight at ``rows`` rows (``n``: the
    outputs, half a gated weight's rows): ``ROWS_CONFIGS``; FP8 weights of any shape from
    ``FP8_MIN_ROWS`` to ``FP8_MAX_ROWS`` rows (``FP8_ROWS_CONFIGS``, else
    ``FP8_DEFAULT_CONFIG``)."""
    if fp8:  # (every shape: the default launch shape was measured too)
        return FP8_MIN_ROWS <= rows <= FP8_MAX_ROWS
    cfg = ROWS_CONFIGS.get((n, k, gated))
    return cfg is not None and (rows <= FMA_TUNED_ROWS or not isinstance(cfg, FmaLaunch))


def gemv_rows_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv_rows`` takes these: 2 to ``MAX_ROWS`` rows of 16-bit floats on the GPU
    (from one row with an FP8 e4m3 weight on a GPU that converts it: compute capability 8.9
    on), the weight 2-D and row-major, of the same dtype (or FP8), width and device."""
    if x.dim() < 1 or not x.shape[-1]:
        return False
    rows = x.numel() // x.shape[-1]
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 and not (x.is_cuda and _fp8_on_device(device_index(x.device))):
        return False
    return ((1 if fp8 else 2) <= rows <= MAX_ROWS and x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and (fp8 or weight.dtype == x.dtype) and weight.dim() == 2 and weight.stride(1) == 1
            and weight.shape[1] == x.shape[-1] and weight.device == x.device)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              act: str | None = None, config: tuple | None = None,
              weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2 to ``MAX_ROWS`` rows; with ``act`` ("silu" or
    "gelu_tanh") ``weight`` is a fused ``[gate; up]`` one and the result ``act(gate) * up``
    ([..., N / 2]). ``config``: a launch shape (``FmaLaunch``, or the tensor-core kernel's
    (BLOCK_N, BLOCK_K, num_warps, num_stages[, split])), else the tuned or default one.

    An FP8 e4m3 ``weight`` (from one row) takes ``weight_scale`` (float32, one per weight row)
    and runs on the tensor-core kernel, weight-only: ``fp8_torch.fp8_weight_only_linear``."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > 16:
        raise ValueError(f"gemv_rows takes at most 16 rows, got {m}")
    gated = act is not None
    if gated and act not in ("silu", "gelu_tanh"):
        raise ValueError(f"unknown gated activation {act!r}")
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (weight_scale is not None):
        raise ValueError("an FP8 weight takes a weight_scale, and only an FP8 weight does")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if fp8:
        cfg = config or FP8_ROWS_CONFIGS.get((n, k, gated), FP8_DEFAULT_CONFIG)
        scale = weight_scale.reshape(-1)
        if scale.dtype != torch.float32 or scale.numel() != weight.shape[0]:
            raise ValueError("weight_scale: one float32 scale per weight row")
    else:
        cfg = config or ROWS_CONFIGS.get((n, k, gated), DEFAULT_CONFIG)
        scale = x2
    common = dict(HAS_BIAS=bias is not None, GATED=gated, GELU=act == "gelu_tanh",
                  EVICT="evict_first")
    args = (out, x2, weight, bias if bias is not None else x2, m, n, k, x2.stride(0),
            weight.stride(0), out.stride(0))
    if isinstance(cfg, FmaLaunch) and m <= MAX_ROWS and not fp8:
        block_k = min(cfg.block_k, max(16, triton.next_power_of_2(k)))
        launch(_gemv_rows_fma_kernel, (triton.cdiv(n, cfg.block_n),), args,
               dict(common, BLOCK_M=triton.next_power_of_2(m), BLOCK_N=cfg.block_n,
                    BLOCK_K=block_k, EVEN=n % cfg.block_n == 0 and k % block_k == 0,
                    PREFETCH=2 if cfg.prefetch > 1 and k >= 2 * block_k else 1,
                    num_warps=cfg.warps),
               pdl_enabled(x.device))
    else:
        if isinstance(cfg, FmaLaunch):  # (more rows than its accumulators were sized for)
            cfg = DEFAULT_CONFIG
        block_n, block_k, warps, stages, *more = cfg
        block_k = min(block_k, max(16, triton.next_power_of_2(k)))
        tiles = triton.cdiv(n, block_n)
        split = min(more[0] if more else 1, triton.cdiv(k, block_k))
        if split > 1 and (split * m * (2 * n if gated else n) > SPLIT_WS_FLOATS
                          or tiles > SPLIT_WS_TILES):
            split = 1  # (beyond the workspace: whole rows of K per program)
        ws, counts = _split_workspace(x.device) if split > 1 else (x2, x2)
        launch(_gemv_rows_kernel, (tiles, split), args + (ws, counts, scale),
               dict(common, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                    W_FP8=fp8, num_warps=warps, num_stages=stages),
               pdl_enabled(x.device) and PDL_DOT)
    return out.view(*x.shape[:-1], n)
