"""Triton kernels of block-wise FP8 W8A8 (``fp8_block_torch`` holds the semantics and the
reference): a per-token, per-group activation quantizer and a GEMM on e4m3 ``tl.dot`` that
applies one activation scale and one weight scale per ``block_k`` slice of K.

- ``_quant_groups``: one program per (row block, group); each group's ``amax / 448`` (at
  least ``MIN_SCALE``) and the quotient IEEE-rounded (``div_rn``, as torch divides), clamped,
  then rounded to nearest-even e4m3: bit-identical to ``fp8_block_torch.quantize_groups``.
- ``_block_mm``: ``[BLOCK_M, BLOCK_N]`` output tiles, grouped along M for L2 reuse of the
  weight tiles; each step of ``BLOCK_K`` (at most one scale block) adds
  ``dot(x_q, w_q^T) * sx[:, None] * sw[None, :]`` to a float32 accumulator; the bias and the
  cast to the activation dtype in the epilogue.

Launch shapes: by row count, the best of a six-shape sweep on one H200, not tuned per weight
shape (``_config``). Importing this module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.fp8_torch import FP8_DTYPE, FP8_MAX, MIN_SCALE

MIN_BLOCK_K = 32  # e4m3 tensor-core products take K in steps of 32
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def supported(x: torch.Tensor, w_q: torch.Tensor, block_k: int) -> bool:
    """Whether these kernels take ``x`` [M, K] times ``w_q`` [N, K] with ``block_k`` groups."""
    return (x.dtype in _DTYPES and w_q.dtype == FP8_DTYPE and x.dim() == 2
            and block_k >= MIN_BLOCK_K and block_k & (block_k - 1) == 0
            and x.shape[-1] == w_q.shape[1] and x.shape[-1] % 16 == 0)


@triton.jit
def _quant_groups(x_ptr, q_ptr, s_ptr, M, K, KB, stride_x, GROUP: tl.constexpr,
                  ROWS: tl.constexpr, QMAX: tl.constexpr, SMIN: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=ok,
                other=0.0).to(tl.float32)
    # (div_rn: IEEE division, as torch's; Triton's "/" is the approximate one on the GPU.)
    s = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), QMAX), SMIN)
    q = tl.minimum(tl.maximum(tl.div_rn(x, s[:, None]), -QMAX), QMAX)
    tl.store(q_ptr + rows64[:, None] * K + cols[None, :], q.to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + rows64 * KB + g, s, mask=rows < M)


@triton.jit
def _block_mm(xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, KB, stride_om,
              SCALE_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    # Programs sweep GROUP_M row tiles per column tile: a weight tile serves them from L2.
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_ok = ks < K
        a = tl.load(xq_ptr + rm64[:, None] * K + ks[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + rn64[:, None] * K + ks[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        kb = k0 // SCALE_K
        sa = tl.load(xs_ptr + rm64 * KB + kb, mask=m_ok, other=0.0)
        sb = tl.load(ws_ptr + rn64 * KB + kb, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm64[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] in e4m3 and its float32 scales [M, ceil(K / group)] (see the module)."""
    m, k = x.shape
    kb = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    s = torch.empty(m, kb, dtype=torch.float32, device=x.device)
    if m:
        rows = 1 if group >= 512 else 4
        _quant_groups[(triton.cdiv(m, rows), kb)](
            x, q, s, m, k, kb, x.stride(0), GROUP=group, ROWS=rows, QMAX=FP8_MAX,
            SMIN=MIN_SCALE, num_warps=4)
    return q, s


def _config(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for ``m`` rows: the best of six shapes on
    Llama-3.1-8B's projections at 1, 16, 256 and 2,048 rows (H200,
    ``tools/bench_fp8_block.py``); 17 to 64 rows were not measured."""
    if m <= 16:
        return 16, 32, 4, 4
    if m <= 64:
        return 64, 64, 4, 3
    return 64, 128, 4, 3


def fp8_block_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block_k: int,
                     bias: torch.Tensor | None = None,
                     config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``fp8_block_torch.fp8_block_linear`` on the Triton kernels (``supported`` first, on
    the 2-D ``x``); ``config`` overrides the launch shape (``_config``; sweeps)."""
    m, k = x.shape
    n = w_q.shape[0]
    kb = w_scale.shape[1]
    if kb != triton.cdiv(k, block_k) or w_scale.shape[0] != n:
        raise ValueError(f"a block scale for a {n} x {k} weight in groups of {block_k} is "
                         f"[{n}, {triton.cdiv(k, block_k)}], got {tuple(w_scale.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    x_q, x_s = quantize_groups(x, block_k)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    block_m, block_n, warps, stages = config or _config(m)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _block_mm[grid](x_q, x_s, w_q, w_scale, bias if bias is not None else out, out, m, n, k, kb,
                    out.stride(0), SCALE_K=block_k, HAS_BIAS=bias is not None,
                    BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=min(block_k, 128), GROUP_M=8,
                    num_warps=warps, num_stages=stages)
    return out
