"""A GEMV over a few rows (2 to ``MAX_ROWS``): ``x [M, K] @ weight[N, K].T``, each weight tile
read once for every row, for the steps that are still bound by the weight bytes but have more
than one row: decode at batch 2 to 8, a speculative verify at batch 1 (1 + k tokens).

The rows are padded to 16 and multiplied on the tensor cores (``tl.dot``), so the accumulators
stay small whatever the row count, and the K loop's weight loads are software-pipelined
(``num_stages``). A register-only version with one elementwise accumulator per row (the
one-row GEMV's plan) was measured first: as fast at two rows, 0.73-0.86x cuBLAS at four.

H100, Llama-3.1-8B's projections, device time per call in a CUDA graph, weights cycled past
the L2 cache (``tools/bench_gemv_rows.py``; cuBLAS -> this, us): four rows q/k/v 20.6 -> 20.0,
o 15.6 -> 14.4, gate/up + SiLU 89.7 -> 80.5, down 43.5 -> 42.2, LM head 379.6 -> 338.8; two
and eight rows within 1 % of those. Optional bias, and the gated epilogue of a fused
``[gate; up]`` weight (SiLU or tanh-GELU times up), rounded as torch rounds the unfused ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.triton_decode import gated_product

MAX_ROWS = 8  # measured up to here (the tile holds 16)

# Launch shapes (BLOCK_N, BLOCK_K, num_warps, num_stages) per (N outputs, K, gated), from the
# sweep above (H100); others take DEFAULT_CONFIG (the gated weights' best, which reads two
# tiles per stage and so fits any of these in the shared memory).
ROWS_CONFIGS: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (64, 256, 4, 3),
    (4096, 4096, False): (32, 512, 4, 5),
    (14336, 4096, True): (32, 256, 4, 3),
    (4096, 14336, False): (32, 512, 4, 5),
    (128256, 4096, False): (32, 512, 4, 5),
    # Qwen3-0.6B: gate/up + SiLU 12.6 -> 7.0 us, LM head 112.5 -> 104.1 (four rows); its
    # q/k/v, o and down projections stayed faster on cuBLAS (0.77-0.93x): not here.
    (3072, 1024, True): (32, 128, 4, 5),
    (151936, 1024, False): (64, 256, 4, 3),
}
DEFAULT_CONFIG = (32, 256, 4, 3)


@triton.jit
def _gemv_rows_kernel(out_ptr, x_ptr, w_ptr, b_ptr, M, N, K, stride_x, stride_w, stride_o,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, GATED: tl.constexpr, GELU: tl.constexpr,
                      EVICT: tl.constexpr):
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + cols
        km = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & km[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=row_ok[:, None] & km[None, :], other=0.0,
                    eviction_policy=EVICT)
        acc = tl.dot(x, tl.trans(w), acc)
        if GATED:
            wu = tl.load(wu_rows + kk[None, :], mask=row_ok[:, None] & km[None, :], other=0.0,
                         eviction_policy=EVICT)
            acc_up = tl.dot(x, tl.trans(wu), acc_up)
    dt = out_ptr.dtype.element_ty
    y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    if GATED:
        y = gated_product(y, acc_up, out_ptr, GELU)
    tl.store(out_ptr + ms[:, None] * stride_o + rows[None, :], y.to(dt),
             mask=m_ok[:, None] & row_ok[None, :])


def gemv_rows_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv_rows`` takes these: 2 to ``MAX_ROWS`` rows of 16-bit floats on the GPU,
    the weight 2-D and row-major, of the same dtype, width and device."""
    if x.dim() < 1 or not x.shape[-1]:
        return False
    rows = x.numel() // x.shape[-1]
    return (2 <= rows <= MAX_ROWS and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.dim() == 2 and weight.stride(1) == 1
            and weight.shape[1] == x.shape[-1] and weight.device == x.device)


def gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              act: str | None = None, config: tuple[int, int, int, int] | None = None
              ) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for 2 to ``MAX_ROWS`` rows; with ``act`` ("silu" or
    "gelu_tanh") ``weight`` is a fused ``[gate; up]`` one and the result ``act(gate) * up``
    ([..., N / 2]). ``config``: (BLOCK_N, BLOCK_K, num_warps, num_stages), else the tuned or
    default one."""
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
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = config or ROWS_CONFIGS.get((n, k, gated), DEFAULT_CONFIG)
    _gemv_rows_kernel[(triton.cdiv(n, block_n),)](
        out, x2, weight, bias if bias is not None else x2, m, n, k, x2.stride(0),
        weight.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=min(block_k, max(16, triton.next_power_of_2(k))), HAS_BIAS=bias is not None,
        GATED=gated, GELU=act == "gelu_tanh", EVICT="evict_first", num_warps=warps,
        num_stages=stages)
    return out.view(*x.shape[:-1], n)
