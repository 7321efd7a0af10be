"""RMSNorm (with the residual add before it) and the FP8 (e4m3) quantization of its output in
one pass over each row, for the FP8 W8A8 GEMMs of prefill and large decode batches; and the
quantization alone (``quantize``: the inputs of the layers after no norm, o and down).

Unfused, an FP8 layer after a norm reads and writes each row three times: the norm writes it
in 16 bits, the per-token quantizer reads it for its amax and again to scale it, and writes the
FP8 row. Here one program per row keeps the normed row in registers: it writes the new residual
(when there is one), the e4m3 row and its float32 scale, and nothing else.

Semantics, rounding included, are ``torch_ops.fused_add_rms_norm`` (or ``rms_norm``) followed
by ``fp8_torch.quantize_activations``: the sum rounds to the dtype, the norm rounds to the dtype
before and after the weight, the scale is ``max(amax / 448, MIN_SCALE)`` (or the static one),
the quotient is IEEE-rounded and clamped to +-448, then rounded to nearest-even e4m3. Importing
this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.fp8_torch import FP8_DTYPE, FP8_MAX, MIN_SCALE

MAX_K = 16384  # elements of a row one program holds (every dense model's hidden size so far)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _store_quantized(h, row, cols, m, K, q_ptr, scale_ptr, static_ptr, STATIC: tl.constexpr,
                     QMAX: tl.constexpr, SMIN: tl.constexpr):
    """Row ``row`` of ``q`` (e4m3) and its scale for the float32 row ``h``: the static scale,
    or the row's amax / QMAX (at least SMIN); the quotient IEEE-rounded and clamped."""
    if STATIC:
        s = tl.load(static_ptr).to(tl.float32)
    else:
        s = tl.maximum(tl.max(tl.abs(h), axis=0) / QMAX, SMIN)
    # Masked columns are zero, so they neither raise the amax nor get stored.
    q = tl.minimum(tl.maximum(tl.div_rn(h, s), -QMAX), QMAX)
    tl.store(q_ptr + row * K + cols, q.to(tl.float8e4nv), mask=m)
    tl.store(scale_ptr + row, s)


@triton.jit
def _norm_quant_kernel(x_ptr, res_ptr, nw_ptr, q_ptr, scale_ptr, res_out_ptr, static_ptr, K,
                       stride_x, stride_r, eps, ADD: tl.constexpr, STATIC: tl.constexpr,
                       BLOCK: tl.constexpr, QMAX: tl.constexpr, SMIN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0)
    if ADD:
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * K + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    nw = tl.load(nw_ptr + cols, mask=m, other=0.0).to(tl.float32)
    h = ((xf * inv).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
    _store_quantized(h, row, cols, m, K, q_ptr, scale_ptr, static_ptr, STATIC, QMAX, SMIN)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, scale_ptr, static_ptr, K, stride_x, STATIC: tl.constexpr,
                  BLOCK: tl.constexpr, QMAX: tl.constexpr, SMIN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < K
    h = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    _store_quantized(h, row, cols, m, K, q_ptr, scale_ptr, static_ptr, STATIC, QMAX, SMIN)


def supported(x: torch.Tensor) -> bool:
    """Whether ``add_rms_norm_quant`` takes ``x`` [M, K] (a CUDA tensor, or any tensor under
    the Triton interpreter in tests)."""
    return (x.dim() == 2 and x.dtype in _DTYPES and x.shape[-1] <= MAX_K
            and x.stride(-1) == 1 and x.shape[0] > 0)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float, input_scale: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q [M, K] e4m3, scale [M, 1] float32, new residual)`` for ``x`` [M, K]: ``q * scale``
    approximates ``rms_norm(x + residual) * weight``; the new residual is ``x + residual``
    (``x`` itself without ``residual``). ``input_scale``: a static per-tensor scale instead of
    each row's amax / 448. The caller checks ``supported``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    add = residual is not None
    if add:
        if residual.shape != x.shape or residual.stride(-1) != 1:
            residual = residual.reshape(m, k).contiguous()
        res_out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    else:
        res_out = x
    block = triton.next_power_of_2(k)
    static = input_scale.float().reshape(1) if input_scale is not None else scale
    _norm_quant_kernel[(m,)](
        x, residual if add else x, weight, q, scale, res_out, static, k, x.stride(0),
        residual.stride(0) if add else 0, float(eps), ADD=add, STATIC=input_scale is not None,
        BLOCK=block, QMAX=FP8_MAX, SMIN=MIN_SCALE,
        num_warps=max(1, min(16, block // 256)))
    return q, scale, res_out


def quantize(x: torch.Tensor, input_scale: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] e4m3, scale [M, 1] float32)`` for ``x`` [M, K] in one pass over each row:
    ``fp8_torch.quantize_activations(x, input_scale)``, the same numbers. (The torch ops pass
    over a float32 copy several times: with them, FP8 prefill on an H100 was no faster than
    bf16; with this, 1.44x faster.) The caller checks ``supported``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(k)
    static = input_scale.float().reshape(1) if input_scale is not None else scale
    _quant_kernel[(m,)](
        x, q, scale, static, k, x.stride(0), STATIC=input_scale is not None, BLOCK=block,
        QMAX=FP8_MAX, SMIN=MIN_SCALE, num_warps=max(1, min(16, block // 256)))
    return q, scale
