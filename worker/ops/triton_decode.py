"""Triton kernels for small decode steps, where launch count and latency, not bytes, set the time.

- ``gemv``: ``y = x @ W^T (+ bias)`` for a single row ``x`` (batch-1 decode). cuBLAS picks
  64-row tiles for these shapes, so a 1024-output projection runs on 16 CTAs; here every program
  owns ``BLOCK_N`` output rows and streams their whole K extent, so the grid covers the chip.
  Optional prologue: the RMSNorm of ``x`` (with the residual add before it) computed in every
  program from the ``K``-wide input (a few KiB, L2-resident), replacing the separate norm kernel;
  program 0 writes the new residual. Optional epilogue: SiLU(gate) * up (SwiGLU) or
  tanh-GELU(gate) * up (Gemma's GeGLU) over a fused ``[gate | up]`` weight, replacing the
  split-K reduction and the activation kernel. Optional LoRA term (``LoRAArgs``): each row adds
  its adapter's expand product, from the shrink's partial sums, before that epilogue, replacing
  the expand kernel (and the zeroing of the shrink's output).
- ``qk_norm_rope_write_kv``: per token, the per-head q/k RMSNorm (Qwen3's, or Gemma 3's
  ``(1 + w)`` one), neox rotary on q and k, and the K/V write into the paged cache, in one
  kernel (four launches before).
- ``argmax``: a two-stage row argmax (many programs over vocabulary chunks, then one per row).
- the tensor-parallel all-reduce fused into the GEMV (opt-in, ``distributed/push_allreduce.py``): a
  producer GEMV (``push``) stores its rows into every rank's buffer; a consumer GEMV (``parts``)
  or ``sum_parts`` polls its buffer until no element holds the sentinel any more, sums the
  ranks' rows as it reads its input, and re-arms the buffer of the call before.

Rounding follows ``torch_ops`` (normalise in float32, round to the dtype, scale by the weight,
round; bf16 products accumulated in float32), so these match the unfused Triton path. Importing
this module imports triton.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tidal.engine_core.kernel_config import GemvShapes
from tidal.worker.ops.attention_plan import next_pow2
from tidal.worker.ops.triton_attention_kernels import fp8_quantize
from tidal.worker.ops.gpu_info import device_index, num_sms
from tidal.worker.ops.triton_probe import stamp

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Programmatic dependent launch (Hopper and later): the decode kernels launch while their
# predecessor in the stream finishes, prefetch what does not depend on it (weights, step
# metadata), and wait (griddepcontrol.wait) before touching anything it writes or reads; CUDA
# graphs keep the programmatic edges. KernelConfig.pdl (TIDAL_PDL=0) turns it off.
_PDL = True


@functools.cache
def _pdl_on_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    return _PDL and device.type == "cuda" and _pdl_on_device(device_index(device))


def launch(kernel, grid, args: tuple, kwargs: dict, pdl: bool) -> None:
    """``kernel[grid](*args, **kwargs, PDL=pdl)``, with the programmatic-dependent-launch
    attribute when ``pdl``. Should that launch fail outside a graph capture (an old driver, a
    compiler without griddepcontrol) and the same launch without any griddepcontrol (PDL and
    a ``TRIGGER`` of its dependents off) succeed, PDL is switched off for the process. A
    launch that fails either way is the kernel's own error (bad arguments, out of resources):
    the plain launch's error is raised (the PDL one its cause), and PDL stays on for every
    other kernel."""
    global _PDL
    if pdl:
        try:
            kernel[grid](*args, **kwargs, PDL=True, launch_pdl=True)
            return
        except Exception as exc:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            pdl_error = exc
        plain = dict(kwargs, TRIGGER=False) if "TRIGGER" in kwargs else kwargs
        try:
            kernel[grid](*args, **plain, PDL=False)
        except Exception as exc:
            raise exc from pdl_error
        logger.warning("programmatic dependent launch failed (%s: %s) where the plain launch "
                       "works; launching without it from now on", type(pdl_error).__name__,
                       pdl_error)
        _PDL = False
        return
    kernel[grid](*args, **kwargs, PDL=False)


# ----------------------------------------------------------------------------------------- gemv


@triton.jit
def gelu_tanh(g):
    """``gelu(g, approximate="tanh")`` in float32. tanh(a) = 1 - 2 / (1 + exp(2a)): exact at
    both ends in float32 (exp overflows to inf), and no libdevice call."""
    a = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * a)))


@triton.jit
def gated_product(g, u, like_ptr, GELU: tl.constexpr):
    """``act(g) * u`` (SiLU, or tanh-GELU) of float32 gate and up projections, rounded as torch
    rounds the unfused ops: each projection to the dtype of ``like_ptr``'s elements, then
    act(g), then the product (returned in float32)."""
    dt = like_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    if GELU:
        s = gelu_tanh(g).to(dt).to(tl.float32)
    else:
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return s * u


@triton.jit
def _load_x(x_ptr, kk, km, K, PARTS: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns ``kk`` of the GEMV input, in its dtype. With ``PARTS`` > 0, ``x_ptr`` holds that
    many partial rows of ``K`` (one per tensor-parallel rank, pushed by ``_push_rows``) and the
    input is their sum, taken in float32 in rank order (so every rank gets the same bits) and
    rounded once. The program has seen every element land (``_wait_parts``) before it gets
    here, so ordinary (L1-cached) loads are correct, and they matter: every program reads the
    whole row, and L1 serves the programs after the first on each SM."""
    if PARTS > 0:
        if EVEN_K:
            xs = tl.load(x_ptr + kk).to(tl.float32)
        else:
            xs = tl.load(x_ptr + kk, mask=km, other=0.0).to(tl.float32)
        for j in tl.static_range(1, PARTS):
            if EVEN_K:
                xs += tl.load(x_ptr + j * K + kk).to(tl.float32)
            else:
                xs += tl.load(x_ptr + j * K + kk, mask=km, other=0.0).to(tl.float32)
        return xs.to(x_ptr.dtype.element_ty)
    if EVEN_K:
        return tl.load(x_ptr + kk)
    return tl.load(x_ptr + kk, mask=km, other=0.0)


@triton.jit
def _row_inv_rms(x_ptr, res_ptr, res_out_ptr, K, eps, keep_lo, keep_hi, ADD: tl.constexpr,
                 PARTS: tl.constexpr, ROW_CHUNK: tl.constexpr):
    """1/RMS of the input row (``x``, or with ``ADD`` ``x + res`` rounded to the dtype), for a
    norm every program needs whole: the row is a few KiB and sits in L2, read in chunks of
    ``ROW_CHUNK`` (up to 8192 elements: one round trip). With ``ADD`` the sum's columns in
    ``[keep_lo, keep_hi)`` are stored to ``res_out_ptr``: this program's share of the new
    residual."""
    rc = tl.arange(0, ROW_CHUNK)
    ss = tl.zeros([ROW_CHUNK], tl.float32)
    for k0 in range(0, K, ROW_CHUNK):
        kk = k0 + rc
        km = kk < K
        xv = _load_x(x_ptr, kk, km, K, PARTS, False)
        if ADD:
            rv = tl.load(res_ptr + kk, mask=km, other=0.0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(res_out_ptr + kk, xv, mask=km & (kk >= keep_lo) & (kk < keep_hi))
        xf = xv.to(tl.float32)
        ss += xf * xf
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _x_chunk(x_ptr, res_ptr, nw_ptr, kk, km, inv, K, NORM: tl.constexpr, ADD: tl.constexpr,
             EVEN_K: tl.constexpr, PARTS: tl.constexpr):
    """Columns ``kk`` of the GEMV input in float32: ``x``, or ``rms_norm(x (+ res))`` rounded
    to the dtype as torch_ops does (``inv``: the row's 1/RMS)."""
    dt = x_ptr.dtype.element_ty
    xv = _load_x(x_ptr, kk, km, K, PARTS, EVEN_K)
    if NORM:
        if ADD:
            if EVEN_K:
                rv = tl.load(res_ptr + kk)
            else:
                rv = tl.load(res_ptr + kk, mask=km, other=0.0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(dt)
        if EVEN_K:
            nw = tl.load(nw_ptr + kk)
        else:
            nw = tl.load(nw_ptr + kk, mask=km, other=0.0)
        xv = ((xv.to(tl.float32) * inv).to(dt).to(tl.float32) * nw.to(tl.float32)).to(dt)
    return xv.to(tl.float32)


# --- the all-reduce fused into the GEMVs (``PushArgs``, ``PartsArgs``): signal-free, as
# ``triton_allreduce``: every element of a partial-sum buffer is its own ready flag.

SENTINEL = -32768  # int16 0x8000: negative zero in bfloat16 and float16; "not arrived yet"


@triton.jit
def _push_rows(y, rows, row_ok, push_ptrs, push_off, SENT: tl.constexpr, WORLD: tl.constexpr):
    """Store this program's output rows (16-bit) at ``push_off`` in every rank's partial-sum
    buffer. A value whose bits are the sentinel (negative zero) goes as positive zero. Nothing
    is signalled: the consumer polls the values themselves."""
    bits = y.to(tl.int16, bitcast=True)
    bits = tl.where(bits == SENT, 0, bits)
    for j in tl.static_range(WORLD):
        base = tl.load(push_ptrs + j).to(tl.pointer_type(tl.int16))
        tl.store(base + push_off + rows, bits, mask=row_ok)


@triton.jit
def _wait_parts(bits_ptr, K, cols, cmask, PARTS: tl.constexpr, SENT: tl.constexpr):
    """Spin until no element in columns ``cols`` (where ``cmask``) of the ``PARTS`` pushed rows
    of ``K`` at ``bits_ptr`` (int16) still holds the sentinel: every rank's rows, this one's
    included, have landed. Volatile loads go to L2, where NVLink stores from the peers arrive.
    The loop carries a scalar: Triton 3.6 fails to compile a spin whose loaded tensor is
    carried and then left unused."""
    for j in tl.static_range(PARTS):
        src = bits_ptr + j * K + cols
        pending = 1
        while pending > 0:
            got = tl.load(src, mask=cmask, other=0, volatile=True)
            pending = tl.sum((got == SENT).to(tl.int32), axis=0)


@triton.jit
def _rearm(rearm_ptr, n, SENT: tl.constexpr, BLOCK: tl.constexpr):
    """Put the sentinel back into ``n`` int16 elements (the previous call's buffer, consumed
    by then), spread over the grid's programs."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    offs = tl.arange(0, BLOCK)
    for start in range(pid * BLOCK, n, step):
        idx = start + offs
        tl.store(rearm_ptr + idx, tl.full([BLOCK], SENT, tl.int16), mask=idx < n)


@triton.jit
def _w_chunk(w_rows, kk, row_ok, km, EVEN_NK: tl.constexpr, EVICT: tl.constexpr):
    if EVEN_NK:
        w = tl.load(w_rows + kk[None, :], eviction_policy=EVICT)
    else:
        w = tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & km[None, :], other=0.0,
                    eviction_policy=EVICT)
    return w


@triton.jit
def _lora_b_rows(b_ptr, rows, row_ok, j, stride_bn, R: tl.constexpr, OFF1: tl.constexpr,
                 OFF2: tl.constexpr):
    """B's ``rows`` (one slot) laid over the shrink's S*R outputs ``j``: row n holds its R
    values in the columns of its own output slice (q/k/v, gate/up: rows from ``OFF1``, from
    ``OFF2``) and zeros elsewhere, so one product with the whole shrink output gives every row
    its slice's term, wherever the block of rows starts."""
    s = (rows >= OFF1).to(tl.int32) + (rows >= OFF2).to(tl.int32)
    r = j[None, :] - s[:, None] * R
    m = row_ok[:, None] & (r >= 0) & (r < R)
    return tl.load(b_ptr + rows.to(tl.int64)[:, None] * stride_bn + r, mask=m, other=0.0)


@triton.jit(do_not_specialize=["push_off"])  # one compile for every slot
def _gemv_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    w_ptr,
    b_ptr,
    N,
    K,
    stride_w,
    eps,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    ADD: tl.constexpr,
    SILU: tl.constexpr,  # a gated epilogue over a [gate; up] weight: SiLU, or with GELU tanh-GELU
    GELU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,
    ROW_CHUNK: tl.constexpr,
    PREFETCH: tl.constexpr,  # weight chunks loaded before waiting for the previous kernel
    # NORM with the row's sum of squares given in SS_PARTS partial sums (ss_ptr, float32) by
    # the kernel before: no whole-row read in every program. (Not with ADD: x is the sum.)
    ss_ptr,
    SS_PARTS: tl.constexpr,
    # Consumer of pushed partial sums (PARTS ranks): x_ptr holds them, parts_bits_ptr is the
    # same memory as int16 (polled until complete); rearm_ptr / rearm_n: the previous call's
    # buffer, re-armed here.
    parts_bits_ptr,
    rearm_ptr,
    rearm_n,
    PARTS: tl.constexpr,
    # Producer: push the output rows to every rank instead of storing them to out_ptr.
    push_ptrs,
    push_off,
    PUSH_WORLD: tl.constexpr,
    SENT: tl.constexpr,
    # L2 policy of the weight loads: "evict_first" (STREAM_WEIGHTS: read once per step, so the
    # activations, step metadata and K/V the other kernels read stay in L2) or "".
    EVICT: tl.constexpr,
    # FP8 (e4m3) weights: a float32 scale per weight row (ws_ptr), applied once to the row's
    # float32 sum. The activation is not quantized (weight-only): at one row the GEMV is bound
    # by the weight bytes alone, so quantizing x would cost a pass and precision for nothing.
    ws_ptr,
    W_SCALE: tl.constexpr,
    # LoRA (``LoRAArgs``): each row's float32 sum gets its adapter term before the epilogue,
    # B's row of the token's slot (lora_slot_ptr[0]; -1: none, the base result exactly) times
    # the shrink's output, read as LORA_SPLITS partial sums of LORA_SR floats (lora_xa_ptr).
    lora_xa_ptr,
    lora_b_ptr,
    lora_slot_ptr,
    stride_bl,
    stride_bn,
    LORA: tl.constexpr,
    LORA_R: tl.constexpr,
    LORA_SR: tl.constexpr,
    LORA_SR_P: tl.constexpr,
    LORA_SPLITS: tl.constexpr,
    LORA_SPLITS_P: tl.constexpr,
    LORA_OFF1: tl.constexpr,
    LORA_OFF2: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    # With SILU the weight is [gate; up]: the up row of output j is row N + j.
    wu_rows = w_ptr + (rows + N).to(tl.int64)[:, None] * stride_w
    cols = tl.arange(0, BLOCK_K)
    even = EVEN_N and EVEN_K
    # The first chunk of weights depends on nothing the previous kernel writes: with
    # programmatic dependent launch it streams in while that kernel finishes.
    km0 = cols < K
    w0 = _w_chunk(w_rows, cols, row_ok, km0, even, EVICT)
    if SILU:
        wu0 = _w_chunk(wu_rows, cols, row_ok, km0, even, EVICT)
    if PREFETCH > 1:  # the wrapper checks that K holds a second chunk
        kk1 = BLOCK_K + cols
        km1 = kk1 < K
        w1 = _w_chunk(w_rows, kk1, row_ok, km1, even, EVICT)
        if SILU:
            wu1 = _w_chunk(wu_rows, kk1, row_ok, km1, even, EVICT)
    if LORA:
        # The slot is step metadata and B a weight: both load while the previous kernel runs.
        lslot = tl.load(lora_slot_ptr).to(tl.int64)
        lhas = lslot >= 0
        lb = lora_b_ptr + tl.maximum(lslot, 0) * stride_bl
        lj = tl.arange(0, LORA_SR_P)
        lb_rows = _lora_b_rows(lb, rows, row_ok & lhas, lj, stride_bn, LORA_R, LORA_OFF1,
                               LORA_OFF2)
        if SILU:
            lb_up = _lora_b_rows(lb, rows + N, row_ok & lhas, lj, stride_bn, LORA_R,
                                 LORA_OFF1, LORA_OFF2)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        # x and the residual come from the previous kernel; our outputs may reuse memory it
        # still reads: nothing past this point runs before it completes.
        tl.extra.cuda.gdc_wait()
    if PARTS > 0:
        # The peers' rows are their own signal; poll the whole row at once (the wrapper
        # checks that ROW_CHUNK covers K). The previous call's consumer has completed: re-arm.
        rc = tl.arange(0, ROW_CHUNK)
        _wait_parts(parts_bits_ptr, K, rc, rc < K, PARTS, SENT)
        _rearm(rearm_ptr, rearm_n, SENT, 256)
    if LORA:  # (the previous kernel wrote them: after the wait; summed after the K loop)
        lsp = tl.arange(0, LORA_SPLITS_P)
        lxa_parts = tl.load(lora_xa_ptr + lsp[:, None] * LORA_SR + lj[None, :],
                            mask=((lsp < LORA_SPLITS)[:, None] & (lj < LORA_SR)[None, :]
                                  & lhas), other=0.0)
    inv = 1.0
    if SS_PARTS > 0:
        sp = tl.arange(0, SS_PARTS)
        inv = tl.rsqrt(tl.sum(tl.load(ss_ptr + sp), axis=0) / K + eps)
    elif NORM:  # (program 0 writes the new residual)
        inv = _row_inv_rms(x_ptr, res_ptr, res_out_ptr, K, eps, 0, (pid == 0).to(tl.int32) * K,
                           ADD, PARTS, ROW_CHUNK)
    xf = _x_chunk(x_ptr, res_ptr, nw_ptr, cols, km0, inv, K, NORM, ADD, EVEN_K, PARTS)[None, :]
    acc = w0.to(tl.float32) * xf
    if SILU:
        acc_up = wu0.to(tl.float32) * xf
    if PREFETCH > 1:
        xf = _x_chunk(x_ptr, res_ptr, nw_ptr, kk1, km1, inv, K, NORM, ADD, EVEN_K, PARTS)[None, :]
        acc += w1.to(tl.float32) * xf
        if SILU:
            acc_up += wu1.to(tl.float32) * xf
    for k0 in range(PREFETCH * BLOCK_K, K, BLOCK_K):
        kk = k0 + cols
        km = kk < K
        xf = _x_chunk(x_ptr, res_ptr, nw_ptr, kk, km, inv, K, NORM, ADD, EVEN_K, PARTS)[None, :]
        acc += _w_chunk(w_rows, kk, row_ok, km, even, EVICT).to(tl.float32) * xf
        if SILU:
            acc_up += _w_chunk(wu_rows, kk, row_ok, km, even, EVICT).to(tl.float32) * xf
    y = tl.sum(acc, axis=1)
    if W_SCALE:
        y *= tl.load(ws_ptr + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if LORA:
        lxa = tl.sum(lxa_parts, axis=0)[None, :]
        # (Not even a zero added without an adapter: the base bits, -0.0 included.)
        y = tl.where(lhas, y + tl.sum(lb_rows.to(tl.float32) * lxa, axis=1), y)
    if SILU:
        u = tl.sum(acc_up, axis=1)
        if W_SCALE:
            u *= tl.load(ws_ptr + rows + N, mask=row_ok, other=0.0)
        if LORA:
            u = tl.where(lhas, u + tl.sum(lb_up.to(tl.float32) * lxa, axis=1), u)
        y = gated_product(y, u, x_ptr, GELU)
    if PUSH_WORLD > 0:
        _push_rows(y.to(out_ptr.dtype.element_ty), rows, row_ok, push_ptrs, push_off, SENT,
                   PUSH_WORLD)
    else:
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _sum_parts_kernel(out_ptr, parts_ptr, bits_ptr, rearm_ptr, rearm_n, K, res_ptr, ss_ptr,
                      PARTS: tl.constexpr, BLOCK: tl.constexpr, SENT: tl.constexpr,
                      PDL: tl.constexpr, ADD_SS: tl.constexpr):
    """out = the sum of the pushed partial rows, once they have all landed; re-arms the
    previous call's buffer. ``ADD_SS``: out = sum + residual, and each program's sum of the
    squares of its part of out to ``ss_ptr`` (the statistics of ``gemv(norm_ss=)``)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # out may reuse memory the previous kernel still reads
    pid = tl.program_id(0)
    kk = pid * BLOCK + tl.arange(0, BLOCK)
    km = kk < K
    _wait_parts(bits_ptr, K, kk, km, PARTS, SENT)
    _rearm(rearm_ptr, rearm_n, SENT, 256)
    x = _load_x(parts_ptr, kk, km, K, PARTS, False)
    if ADD_SS:
        dt = out_ptr.dtype.element_ty
        x = (x.to(tl.float32) + tl.load(res_ptr + kk, mask=km, other=0.0).to(tl.float32)).to(dt)
        xf = x.to(tl.float32)
        tl.store(ss_ptr + pid, tl.sum(xf * xf, axis=0))
    tl.store(out_ptr + kk, x, mask=km)


# GEMV weights loaded with the evict-first L2 policy (KernelConfig.gemv_stream off,
# TIDAL_GEMV_STREAM=0: the default policy).
# Llama-3.1-8B batch-1 decode on 2xH200, two calls, order swapped: TP1 3.780 -> 3.730 ms, TP2
# 2.266 -> 2.219 ms; 64 x 1024/1024 unchanged.
STREAM_WEIGHTS = True

# Launch shapes (BLOCK_N, BLOCK_K, num_warps, PREFETCH) per (N outputs, K, fused gate/up,
# element size). Qwen3-0.6B (norm as the GEMV's prologue, H100 sweep of
# tools/gpu_kernel_check.py section decode1): qkv 4.4, o 2.2, gate/up 5.7, down 3.3 us.
# Llama-3.1-8B at TP 1 and 2 (H200 sweep, section decode1_norm, each weight 32 times back to
# back; the norm done before the GEMV, the way the engine runs these sizes): TP1 qkv 12.7 ->
# 12.2, o 9.0 -> 8.3, gate/up 55.8 -> 51.9, down 27.2 -> 26.6; TP2 qkv 8.7 -> 7.0, gate/up 35.1
# -> 27.3, down 14.0 -> 13.9 (o kept). TP4 (H200 sweep of section decode1_tp, norm in the
# prologue; no 4-GPU machine since): qkv 6.6 -> 5.1, down 9.5 -> 8.1.
# Few rows per program and long K chunks win: more programs, each with all its loads in flight;
# the larger weights also gain from a second chunk fetched before the wait.
GEMV_CONFIGS: dict[tuple[int, int, bool, int], tuple[int, int, int, int]] = {
    (4096, 1024, False, 2): (8, 1024, 4, 1),
    (1024, 2048, False, 2): (2, 2048, 4, 1),
    (3072, 1024, True, 2): (8, 512, 4, 1),
    (1024, 3072, False, 2): (2, 2048, 4, 1),
    (6144, 4096, False, 2): (2, 1024, 4, 2),
    (4096, 4096, False, 2): (4, 1024, 4, 1),
    (14336, 4096, True, 2): (2, 2048, 8, 2),
    (4096, 14336, False, 2): (4, 2048, 8, 2),
    (3072, 4096, False, 2): (2, 1024, 4, 1),
    (4096, 2048, False, 2): (4, 1024, 4, 1),
    (7168, 4096, True, 2): (2, 2048, 4, 2),
    (4096, 7168, False, 2): (4, 1024, 4, 2),
    (1536, 4096, False, 2): (4, 2048, 4, 1),
    (4096, 3584, False, 2): (4, 2048, 4, 1),
    # Llama-3.1-8B's LM head at TP 1 and 2 (2xH200, whole decode steps): 3.876 / 2.331 ms
    # against 3.884 / 2.340 on cuBLAS; the default rule's 8 rows of 4 KiB chunks lost (2.364).
    (128256, 4096, False, 2): (4, 1024, 4, 1),
    (64128, 4096, False, 2): (4, 1024, 4, 1),
    # Gemma's q/k/v and Gemma-3-12B's down projection (H100 sweep of section decode1; their
    # norms are (1 + w), run apart): Gemma-2-9B qkv 23.5 -> 20.0 us, Gemma-3-12B qkv 24.7 ->
    # 21.5, down 52.6 -> 41.1. Their other GEMVs were already at the sweep's best.
    (8192, 3584, False, 2): (4, 2048, 4, 1),
    (8192, 3840, False, 2): (4, 2048, 4, 1),
    (3840, 15360, False, 2): (4, 2048, 4, 1),
    # Their gate/up GEMVs with GeGLU as the epilogue (H100 sweep of section decode1): Gemma-2-9B
    # 74.4 -> 70.0 us, Gemma-3-12B 82.8 -> 77.5 against the default rule's (4, 1024, 4).
    (14336, 3584, True, 2): (2, 4096, 8, 1),
    (15360, 3840, True, 2): (2, 4096, 8, 1),
    # FP8 (e4m3) weights of Llama-3.1-8B at batch 1 (H100, tools/sweep_fp8_gemv.py, norm and
    # SiLU fused as served): qkv 17.6 -> 11.7 us, o 8.8 -> 7.3, gate/up 66.9 -> 44.3, down
    # 25.6 -> 22.4 (the default rule, written for 2-byte weights, read 4 KiB rows of K).
    (6144, 4096, False, 1): (16, 512, 4, 1),
    (4096, 4096, False, 1): (8, 1024, 4, 2),
    (14336, 4096, True, 1): (4, 1024, 4, 2),
    (4096, 14336, False, 1): (4, 1024, 4, 1),
}


_MEASURED_GEMV_CONFIGS = dict(GEMV_CONFIGS)


def configure(*, pdl: bool, stream_weights: bool, gemv_configs: GemvShapes) -> None:
    """The kernel variants of this worker's ``KernelPolicy`` (``kernel_policy.apply_tuning``):
    set once at start-up, before anything compiles or a graph is captured. ``gemv_configs``
    (``KernelConfig.gemv_configs``, parsed) add to or replace the measured launch shapes."""
    global _PDL, STREAM_WEIGHTS
    _PDL = pdl
    STREAM_WEIGHTS = stream_weights
    GEMV_CONFIGS.clear()
    GEMV_CONFIGS.update(_MEASURED_GEMV_CONFIGS)
    GEMV_CONFIGS.update(gemv_configs)
    gemv_config.cache_clear()


@functools.cache
def gemv_config(n: int, k: int, silu: bool, elem: int, sms: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, PREFETCH) for an ``n`` x ``k`` GEMV (``n``: output rows
    computed)."""
    hit = GEMV_CONFIGS.get((n, k, silu, elem))
    if hit is not None:
        return hit
    # The sweep's pattern: 2 rows x up to 4 KiB of K per program (4 x 2 KiB with the up half),
    # 4 warps; more rows per program only when the grid would otherwise outrun 16 waves.
    block_k = max(64, min(next_pow2(k), (2048 if silu else 4096) // elem))
    block_n = 4 if silu else 2
    while block_n < 16 and -(-n // block_n) > 16 * 4 * sms:
        block_n *= 2
    return block_n, block_k, 4, 1


@functools.cache
def _fp8_on_device(index: int) -> bool:
    # Triton converts e4m3 in registers from compute capability 8.9 (Ada, Hopper) on.
    return torch.cuda.get_device_capability(index) >= (8, 9)


def gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` takes ``x`` and ``weight``: the same 16/32-bit dtype, or an FP8
    (e4m3) weight, which then needs its ``weight_scale``."""
    fp8 = weight.dtype == torch.float8_e4m3fn and (
        not x.is_cuda or _fp8_on_device(device_index(x.device)))
    return (
        x.dtype in _DTYPES
        and (weight.dtype == x.dtype or fp8)
        and weight.dim() == 2
        and weight.stride(1) == 1
        and x.shape[-1] == weight.shape[1]
        and x.numel() == x.shape[-1]
    )


PUSH_DTYPES = (torch.bfloat16, torch.float16)  # the sentinel is a 16-bit pattern
PARTS_MAX_K = 8192  # a consumer polls its whole input row at once


@dataclass(frozen=True, slots=True)
class PushArgs:
    """Where a producer GEMV pushes its output rows (``worker/distributed/push_allreduce.py``
    owns the buffers): to ``offset`` (elements) past every rank's partial-sum base in
    ``data_ptrs``, each buffer holding ``SENTINEL`` there until the rows land."""

    data_ptrs: torch.Tensor  # int64 [world]: each rank's partial-sum buffer (16-bit elements)
    offset: int
    world: int


@dataclass(frozen=True, slots=True)
class PartsArgs:
    """Pushed partial rows a consumer sums: ``data [world, K]`` (this rank's buffer for the
    call), complete once no element holds ``SENTINEL``; ``rearm``: the buffer of the call
    before (1-D), which the consumer fills with ``SENTINEL`` again."""

    data: torch.Tensor
    rearm: torch.Tensor

    @property
    def world(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True, slots=True)
class LoRAArgs:
    """A LoRA adapter's product for ``gemv`` to add to its rows before the epilogue
    (``lora_torch`` for the layout): ``partials`` [splits, 1, S*R] float32, the shrink's
    output as slices of its inputs to sum (``triton_lora.lora_shrink_partials``); ``b``
    [slots, N, R], B's rows in the weight's row order (both halves with a gated epilogue);
    ``slots``: the token's slot at ``slots[0]`` (int32 on the device, -1: none); ``offsets``:
    the output slices' first rows (at most 3)."""

    partials: torch.Tensor
    b: torch.Tensor
    slots: torch.Tensor
    offsets: tuple[int, ...]
    rank: int


def _lora_kernel_args(lora: LoRAArgs | None, n_total: int, dummy: torch.Tensor) -> dict:
    if lora is None:  # (fixed constants: one compile of the plain kernel)
        return dict(lora_xa_ptr=dummy, lora_b_ptr=dummy, lora_slot_ptr=dummy, stride_bl=0,
                    stride_bn=0, LORA=False, LORA_R=1, LORA_SR=1, LORA_SR_P=1, LORA_SPLITS=1,
                    LORA_SPLITS_P=1, LORA_OFF1=0, LORA_OFF2=0)
    parts, b, rank = lora.partials, lora.b, lora.rank
    sr = len(lora.offsets) * rank
    if not 0 < len(lora.offsets) <= 3:
        raise ValueError(f"1 to 3 LoRA output slices, got {len(lora.offsets)}")
    if b.dim() != 3 or b.shape[1] != n_total or b.shape[2] != rank or b.stride(2) != 1:
        raise ValueError(f"LoRA B {tuple(b.shape)} does not fit [slots, {n_total}, {rank}] "
                         "with contiguous rows")
    if (parts.dtype != torch.float32 or not parts.is_contiguous()
            or parts.numel() != parts.shape[0] * sr):
        raise ValueError(f"LoRA partial sums {tuple(parts.shape)} {parts.dtype}: want "
                         f"contiguous float32 [splits, 1, {sr}]")
    bounds = list(lora.offsets[1:]) + [n_total] * (3 - len(lora.offsets))
    return dict(lora_xa_ptr=parts, lora_b_ptr=b, lora_slot_ptr=lora.slots,
                stride_bl=b.stride(0), stride_bn=b.stride(1), LORA=True, LORA_R=rank,
                LORA_SR=sr, LORA_SR_P=next_pow2(sr), LORA_SPLITS=parts.shape[0],
                LORA_SPLITS_P=next_pow2(parts.shape[0]), LORA_OFF1=bounds[0],
                LORA_OFF2=bounds[1])


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 0.0,
    silu: bool = False,
    gelu: bool = False,
    config: tuple[int, ...] | None = None,
    parts: PartsArgs | None = None,
    push: PushArgs | None = None,
    prefetch: int | None = None,
    norm_ss: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,
    lora: LoRAArgs | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row ``x [1, K]`` times ``weight [N, K]``; see the module docstring for the fusions.

    An FP8 (e4m3) ``weight`` takes ``weight_scale`` (float32, one per weight row: ``[N, 1]``
    or ``[N]``, ``N`` counting both halves with ``silu``); the product is then ``x @ (weight *
    weight_scale)^T`` with ``x`` as it is (weight-only dequantization,
    ``fp8_torch.fp8_weight_only_linear``).

    ``silu`` / ``gelu``: the weight is a fused ``[gate; up]`` one and ``y`` is ``silu(gate) *
    up`` / ``gelu_tanh(gate) * up`` (one of the two).

    Returns ``(y, new_residual)``: ``y`` is ``[1, N]`` (``[1, N // 2]`` when gated);
    ``new_residual`` is ``x + residual`` when ``residual`` is given, ``x`` itself when only
    ``norm_weight`` is, else None. The caller checks ``gemv_supported``.

    With ``parts`` the input is the sum of the pushed partial rows (``x`` only gives the shape,
    dtype and device); with ``push`` the output goes to every rank's buffer instead, and ``y``
    is not written (the returned tensor is ``x``'s row buffer, not a result).

    ``norm_ss`` (float32, a power-of-two count of partial sums, zero-padded): the sum of the
    squares of ``x``, from the kernel that wrote ``x``; the RMSNorm then reads no whole row.
    It takes ``norm_weight`` and no ``residual``. ``config``: (BLOCK_N, BLOCK_K, num_warps[,
    PREFETCH]); ``prefetch=2`` (default: the config's) loads two chunks of weights before
    waiting for the previous kernel instead of one (where ``K`` has two).

    ``lora``: every output row (each half's with a gated epilogue) gets the adapter's term of
    the token's slot added to its float32 sum, after the weight scale and bias and before the
    activation; the partial sums must come from a kernel before this one (read past the
    dependent-launch wait). Not with ``parts`` or ``push``.
    """
    if silu and gelu:
        raise ValueError("one gated activation: silu or gelu, not both")
    gated = silu or gelu
    k = x.shape[-1]
    n_total = weight.shape[0]
    n = n_total // 2 if gated else n_total
    if (weight_scale is not None) != (weight.element_size() == 1):
        raise ValueError("an FP8 weight takes a weight_scale, and only an FP8 weight does")
    if weight_scale is not None and weight_scale.numel() != n_total:
        raise ValueError(f"weight_scale has {weight_scale.numel()} values for {n_total} rows")
    if lora is not None and (parts is not None or push is not None):
        raise ValueError("a LoRA term is not added to pushed or summed partial rows")
    if parts is not None:
        if k > PARTS_MAX_K:
            raise ValueError(f"pushed rows of {k} > {PARTS_MAX_K} elements are not supported")
        xr = parts.data.view(-1)
    else:
        xr = x.reshape(k)
        if xr.stride(0) != 1:
            xr = xr.contiguous()
    out = xr if push is not None else torch.empty((1, n), dtype=x.dtype, device=x.device)
    norm = norm_weight is not None
    add = norm and residual is not None
    if norm_ss is not None and (add or not norm):
        raise ValueError("norm_ss takes a norm_weight and no residual")
    res_in = residual.reshape(k).contiguous() if add else xr
    res_out = torch.empty((1, k), dtype=x.dtype, device=x.device) if add else out
    block_n, block_k, warps, *more = config or gemv_config(
        n, k, gated, weight.element_size(), num_sms(device_index(x.device))
    )
    prefetch = more[0] if more and prefetch is None else (prefetch or 1)
    pdl = pdl_enabled(x.device)
    if parts is not None:
        wa = (parts.data.view(torch.int16), parts.rearm.view(torch.int16), parts.rearm.numel())
    else:
        wa = (xr, xr, 0)
    pa = (push.data_ptrs, push.offset) if push is not None else (xr, 0)
    launch(
        _gemv_kernel, (triton.cdiv(n, block_n),),
        (out, xr, res_in, res_out, norm_weight if norm else xr, weight,
         bias if bias is not None else xr, n, k, weight.stride(0), float(eps)),
        dict(BLOCK_N=block_n, BLOCK_K=block_k, NORM=norm, ADD=add, SILU=gated, GELU=gelu,
             HAS_BIAS=bias is not None, EVEN_N=n % block_n == 0, EVEN_K=k % block_k == 0,
             ROW_CHUNK=(min(next_pow2(k), PARTS_MAX_K)
                        if (norm and norm_ss is None) or parts is not None else 16),
             PREFETCH=2 if prefetch > 1 and k >= 2 * block_k else 1,
             ss_ptr=norm_ss if norm_ss is not None else xr,
             SS_PARTS=norm_ss.numel() if norm_ss is not None else 0,
             num_warps=warps, parts_bits_ptr=wa[0], rearm_ptr=wa[1], rearm_n=wa[2],
             PARTS=parts.world if parts is not None else 0, push_ptrs=pa[0], push_off=pa[1],
             PUSH_WORLD=push.world if push is not None else 0, SENT=SENTINEL,
             EVICT="evict_first" if STREAM_WEIGHTS else "",
             ws_ptr=weight_scale if weight_scale is not None else xr,
             W_SCALE=weight_scale is not None, **_lora_kernel_args(lora, n_total, xr)),
        pdl,
    )  # fmt: skip
    if add:
        return out, res_out.view(x.shape)
    return out, (x if norm else None)


SUM_PARTS_BLOCK = 512  # elements per program of sum_parts (so 8 programs for 4096)


def sum_parts(parts: PartsArgs, residual: torch.Tensor | None = None,
              sum_squares: torch.Tensor | None = None) -> torch.Tensor:
    """``[1, K]``: the sum of pushed partial rows, once they have all landed (for a consumer
    that cannot take ``gemv(parts=...)``); re-arms ``parts.rearm`` too. With ``residual``: the
    sum plus ``residual``, and ``sum_squares`` (float32, ``cdiv(K, SUM_PARTS_BLOCK)`` or more)
    gets each block's sum of squares of it (for ``gemv(norm_ss=...)``)."""
    k = parts.data.shape[-1]
    out = torch.empty((1, k), dtype=parts.data.dtype, device=parts.data.device)
    block = min(next_pow2(k), SUM_PARTS_BLOCK)
    add_ss = residual is not None
    if add_ss:
        assert (sum_squares is not None and sum_squares.dtype == torch.float32
                and sum_squares.numel() >= triton.cdiv(k, block) and residual.numel() == k)
        residual = residual.reshape(k).contiguous()
    launch(_sum_parts_kernel, (triton.cdiv(k, block),),
           (out, parts.data, parts.data.view(torch.int16), parts.rearm.view(torch.int16),
            parts.rearm.numel(), k, residual if add_ss else out,
            sum_squares if add_ss else out),
           dict(PARTS=parts.world, BLOCK=block, SENT=SENTINEL, ADD_SS=add_ss,
                num_warps=4 if block >= 1024 else 2),
           pdl_enabled(out.device))
    return out


# ------------------------------------------------------------------------------- add + norm row


@triton.jit
def _add_rms_norm_row_kernel(x_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, n, eps, stride_x,
                             stride_r, stride_o, stride_ro, BLOCK: tl.constexpr,
                             HAS_RES: tl.constexpr, PDL: tl.constexpr):
    """One row per program (``stride_*``: between rows of each tensor)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    dt = out_ptr.dtype.element_ty
    idx = tl.arange(0, BLOCK)
    m = idx < n
    h = tl.load(x_ptr + row * stride_x + idx, mask=m, other=0.0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res_ptr + row * stride_r + idx, mask=m, other=0.0
                                        ).to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * stride_ro + idx, h, mask=m)
    hf = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(hf * hf, axis=0) / n + eps)
    nw = tl.load(nw_ptr + idx, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + idx, ((hf * inv).to(dt).to(tl.float32) * nw).to(dt),
             mask=m)


ADD_NORM_MAX = 16384  # elements of the row one program norms


def add_rms_norm_row(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` (``residual`` None: ``(rms_norm(x), x)``) for
    one row of up to ``ADD_NORM_MAX`` elements, in one program, rounded as
    ``torch_ops.fused_add_rms_norm``. Before a large GEMV this is cheaper than the GEMV's norm
    prologue, which every one of its programs runs over the whole row."""
    n = x.shape[-1]
    if x.numel() != n or not 0 < n <= ADD_NORM_MAX:
        raise ValueError(f"one row of 1..{ADD_NORM_MAX} elements, not {tuple(x.shape)}")
    return add_rms_norm_rows(x, residual, weight, eps)


def add_rms_norm_rows(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rms_norm_row`` over every row of ``x`` (one program each), launched as a
    programmatic dependent: before the few-row GEMV of a speculative verify (or a decode of a
    few rows), whose weights then stream in while this runs, as they cannot after the CUDA
    norm kernel."""
    n = x.shape[-1]
    if not 0 < n <= ADD_NORM_MAX or not x.numel():
        raise ValueError(f"rows of 1..{ADD_NORM_MAX} elements, not {tuple(x.shape)}")
    xr = x.reshape(-1, n)
    if xr.stride(-1) != 1:
        xr = xr.contiguous()
    rows = xr.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if residual is None:
        res, res_out = xr, xr
    else:
        res = residual.reshape(-1, n)
        if res.stride(-1) != 1:
            res = res.contiguous()
        res_out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block = next_pow2(n)
    launch(_add_rms_norm_row_kernel, (rows,),
           (xr, res, weight, out, res_out, n, float(eps), xr.stride(0), res.stride(0),
            out.stride(0), res_out.stride(0)),
           dict(BLOCK=block, HAS_RES=residual is not None, num_warps=max(4, min(16, block // 512))),
           pdl_enabled(x.device))
    return out.view(x.shape), (x if residual is None else res_out.view(x.shape))


# ------------------------------------------------------------- q/k norm + rotary + K/V write


@triton.jit
def _norm_rope_heads(
    src,
    dst,
    w1,
    w2,
    cos,
    sin,
    num_heads,
    eps,
    HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    DST_MASK,
    qscale,
    QUANT: tl.constexpr,
    GEMMA: tl.constexpr,
):
    """RMSNorm (when ``NORM``; ``w1``/``w2``: the two halves of its weight, float32; with
    ``GEMMA`` they hold ``1 + w`` and scale before the one rounding, as Gemma's norm does) and
    neox-rotate ``num_heads`` heads of ``HEAD_DIM`` stored back to back at ``src``; store them
    at ``dst`` (same layout) where ``DST_MASK`` holds. ``QUANT``: ``dst`` is an FP8 KV cache;
    the rotated heads, rounded to the model dtype as the unfused path has them, are stored as
    ``clamp(x / qscale, +-448)`` in e4m3 (``attention.fp8_kv``)."""
    h = tl.arange(0, HEADS_P)
    j = tl.arange(0, HALF)
    hm = (h < num_heads)[:, None]
    off = h[:, None] * HEAD_DIM + j[None, :]
    dt = src.dtype.element_ty
    x1 = tl.load(src + off, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(src + off + HALF, mask=hm, other=0.0).to(tl.float32)
    if NORM:
        ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        inv = tl.rsqrt(ss / HEAD_DIM + eps)[:, None]
        if GEMMA:
            x1 = (x1 * inv * w1[None, :]).to(dt).to(tl.float32)
            x2 = (x2 * inv * w2[None, :]).to(dt).to(tl.float32)
        else:
            x1 = ((x1 * inv).to(dt).to(tl.float32) * w1[None, :]).to(dt).to(tl.float32)
            x2 = ((x2 * inv).to(dt).to(tl.float32) * w2[None, :]).to(dt).to(tl.float32)
    c = cos[None, :]
    s = sin[None, :]
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    if QUANT:
        o1 = fp8_quantize(o1.to(dt), qscale)
        o2 = fp8_quantize(o2.to(dt), qscale)
    m = hm & DST_MASK
    tl.store(dst + off, o1.to(dst.dtype.element_ty), mask=m)
    tl.store(dst + off + HALF, o2.to(dst.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["num_slots"])  # the token count: one compile serves all
def _qk_norm_rope_kv_kernel(
    q_out_ptr,
    qkv_ptr,
    pos_ptr,
    cs_ptr,
    qw_ptr,
    kw_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_slots,
    stride_qkv,
    stride_qo,
    stride_cs,
    stride_c_blk,
    stride_c_tok,
    eps,
    times_ptr,  # triton_probe stamps (TIMES): entry, past the wait, stores issued
    k_scale_ptr,  # FP8 cache (KV_FP8): the layer's float32 K and V scales
    v_scale_ptr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P: tl.constexpr,
    KV_HEADS_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NORM: tl.constexpr,
    PDL: tl.constexpr,
    TIMES: tl.constexpr,
    KV_FP8: tl.constexpr,
    GEMMA: tl.constexpr,  # the norm weights are offsets from 1 (Gemma 3)
):
    t = tl.program_id(0).to(tl.int64)
    if TIMES:
        stamp(times_ptr, t, 0, t)
    # Step metadata, the rotary table and the norm weights: none of it is written by the
    # previous kernel (the runner fills the step buffers before the graph or forward starts).
    pos = tl.load(pos_ptr + t).to(tl.int64)
    if KV_FP8:  # (fixed after load: read through pointers, so graphs replay current values)
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)
    else:  # unused
        k_scale = 1.0
        v_scale = 1.0
    slot = tl.load(slot_ptr + t, mask=t < num_slots, other=-1).to(tl.int64)
    j = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * stride_cs + j)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j)
    if NORM:
        qw1 = tl.load(qw_ptr + j).to(tl.float32)
        qw2 = tl.load(qw_ptr + HALF + j).to(tl.float32)
        kw1 = tl.load(kw_ptr + j).to(tl.float32)
        kw2 = tl.load(kw_ptr + HALF + j).to(tl.float32)
        if GEMMA:
            qw1 += 1.0
            qw2 += 1.0
            kw1 += 1.0
            kw2 += 1.0
    else:  # unused
        qw1 = cos
        qw2 = cos
        kw1 = cos
        kw2 = cos
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # qkv comes from the previous kernel
    if TIMES:
        stamp(times_ptr, t, 1, t)
    row = qkv_ptr + t * stride_qkv
    _norm_rope_heads(
        row, q_out_ptr + t * stride_qo, qw1, qw2, cos, sin, NUM_HEADS, eps,
        HEADS_P, HEAD_DIM, HALF, NORM, True, 1.0, False, GEMMA,
    )  # fmt: skip
    # K and V go straight to their cache slot (head stride HEAD_DIM: the cache is contiguous in
    # [heads, head_dim] for one token); padding tokens (slot < 0) write nothing.
    keep = slot >= 0
    safe = tl.where(keep, slot, 0)
    dst = (safe // PAGE_SIZE) * stride_c_blk + (safe % PAGE_SIZE) * stride_c_tok
    _norm_rope_heads(
        row + NUM_HEADS * HEAD_DIM, k_cache_ptr + dst, kw1, kw2, cos, sin, NUM_KV_HEADS, eps,
        KV_HEADS_P, HEAD_DIM, HALF, NORM, keep, k_scale, KV_FP8, GEMMA,
    )  # fmt: skip
    h = tl.arange(0, KV_HEADS_P)
    d = tl.arange(0, HEAD_DIM)
    off = h[:, None] * HEAD_DIM + d[None, :]
    vm = (h < NUM_KV_HEADS)[:, None] & keep
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + off, mask=vm, other=0.0)
    if KV_FP8:
        v = fp8_quantize(v, v_scale)
    tl.store(v_cache_ptr + dst + off, v.to(v_cache_ptr.dtype.element_ty), mask=vm)
    if TIMES:
        stamp(times_ptr, t, 4, t)


def qk_norm_rope_supported(
    qkv: torch.Tensor, head_dim: int, cos_sin_cache: torch.Tensor, is_neox: bool,
    kv_cache: torch.Tensor,
) -> bool:
    return (
        is_neox
        and qkv.dim() == 2
        and qkv.dtype in _DTYPES
        and qkv.stride(1) == 1
        and head_dim >= 16
        and head_dim == next_pow2(head_dim)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.stride(-1) == 1
        and cos_sin_cache.shape[-1] == head_dim
        and kv_cache.dim() == 5
        and kv_cache.shape[0] == 2
        and kv_cache.shape[-1] == head_dim
        and kv_cache.stride(-1) == 1
        and kv_cache.stride(-2) == head_dim
        and kv_cache.device == qkv.device
        and (kv_cache.dtype == qkv.dtype
             or (kv_cache.dtype == torch.float8_e4m3fn
                 and (not qkv.is_cuda or _fp8_on_device(device_index(qkv.device)))))
    )


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    times: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    gemma_norm: bool = False,
) -> torch.Tensor:
    """``qkv [T, (H + 2 Hkv) D]`` -> rotated (normed) ``q [T, H, D]``; K (normed, rotated) and V
    land in ``kv_cache`` at ``slot_mapping`` (< 0, or past its end: skipped), quantized with the
    layer's ``k_scale`` / ``v_scale`` into an FP8 cache. The caller checks support. ``times``:
    int64, ``triton_probe.STAMPS`` per token, for the kernel's stamps. ``gemma_norm``: the norms
    are Gemma's (``torch_ops.gemma_rms_norm``), not Qwen3's."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    norm = q_norm_weight is not None
    pos = positions.reshape(-1)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    heads_p = next_pow2(num_heads)
    width = (heads_p + next_pow2(num_kv_heads)) * head_dim
    pdl = pdl_enabled(qkv.device)
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if kv_fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 KV cache needs the layer's k_scale and v_scale")
    launch(
        _qk_norm_rope_kv_kernel, (t,),
        (q, qkv, pos, cos_sin_cache, q_norm_weight if norm else qkv,
         k_norm_weight if norm else qkv, k_cache, v_cache, slot_mapping, slot_mapping.shape[0],
         qkv.stride(0), q.stride(0), cos_sin_cache.stride(0), k_cache.stride(0),
         k_cache.stride(1), float(eps), times if times is not None else pos,
         k_scale if kv_fp8 else pos, v_scale if kv_fp8 else pos),
        dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEADS_P=heads_p,
             KV_HEADS_P=next_pow2(num_kv_heads), HEAD_DIM=head_dim, HALF=head_dim // 2,
             PAGE_SIZE=k_cache.shape[1], NORM=norm, TIMES=times is not None, KV_FP8=kv_fp8,
             GEMMA=norm and gemma_norm, num_warps=4 if width <= 4096 else 8),
        pdl,
    )  # fmt: skip
    return q


# --------------------------------------------------------------------------------------- argmax


@triton.jit
def _argmax_part_kernel(
    x_ptr, val_ptr, idx_ptr, n_cols, stride_x, num_chunks, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < n_cols, other=float("-inf"))
    x = x.to(tl.float32)
    # torch.argmax counts NaN as the largest value: the first NaN wins.
    nan = x != x
    key = tl.where(nan, float("inf"), x)
    m = tl.max(key, axis=0)
    big = 2147483647
    first_nan = tl.min(tl.where(nan, offs, big), axis=0)
    first_max = tl.min(tl.where(key == m, offs, big), axis=0)
    has_nan = first_nan < big
    out = row * num_chunks + c
    # A NaN chunk reports +inf (wins every non-NaN chunk) and a flag in the index's sign.
    tl.store(val_ptr + out, tl.where(has_nan, float("inf"), m))
    tl.store(idx_ptr + out, tl.where(has_nan, -1 - first_nan, first_max))


@triton.jit
def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS_P: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_P)
    ok = c < num_chunks
    v = tl.load(val_ptr + row * num_chunks + c, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * num_chunks + c, mask=ok, other=2147483647)
    big = 2147483647
    nan_pos = tl.where(ok & (i < 0), -1 - i, big)
    first_nan = tl.min(nan_pos, axis=0)
    m = tl.max(v, axis=0)
    # Chunks are in column order and each reports its first maximum: the smallest index of
    # the chunks that reach the maximum is the row's first maximum.
    first_max = tl.min(tl.where(ok & (v == m) & (i >= 0), i, big), axis=0)
    res = tl.where(first_nan < big, first_nan, first_max)
    # A row of all -inf (or all NaN-free -inf): torch returns 0.
    res = tl.where(res == big, 0, res)
    tl.store(out_ptr + row, res.to(tl.int64))


ARGMAX_CHUNK = 2048


def argmax_supported(x: torch.Tensor) -> bool:
    return (
        x.dim() == 2
        and x.dtype in _DTYPES
        and x.stride(1) == 1
        and 0 < x.shape[1] < 2**31 - 1
        and x.shape[0] > 0
    )


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor, as int64 (first maximum; NaN counts as largest)."""
    rows, cols = x.shape
    chunks = triton.cdiv(cols, ARGMAX_CHUNK)
    vals = torch.empty((rows, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((rows, chunks), dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    _argmax_part_kernel[(rows, chunks)](
        x, vals, idx, cols, x.stride(0), chunks, BLOCK=ARGMAX_CHUNK, num_warps=4
    )
    _argmax_final_kernel[(rows,)](
        vals, idx, out, chunks, CHUNKS_P=max(16, next_pow2(chunks)), num_warps=1
    )
    return out
