"""The few-row product on tensor cores (``csrc/skinny_gemm.cu``): ``x [M, K] @ w.T`` for 1 to 8
activation rows and a weight that is 16-bit, FP8 e4m3 (per-row scale, weight-only) or INT4 in
tidal's layout (``int4_torch``), the decode steps bound by the weight's bytes.

``supported`` says whether a call fits the kernel (rows, alignment, K a multiple of its chunk,
an extension that built); ``launch_shape`` picks the kernel's launch shape (tiles of eight
weight rows per block, warps splitting K, 16-byte loads in flight per lane), from the sweep
in ``tools/bench_skinny_gemm.py``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from tidal.worker.ops import cuda_ext

MAX_ROWS = 8
FORMAT_W16, FORMAT_FP8, FORMAT_INT4, FORMAT_FP8_GROUPS = 0, 1, 2, 3
# K per lane's 16-byte load
_LANE_K = {FORMAT_W16: 8, FORMAT_FP8: 16, FORMAT_INT4: 32, FORMAT_FP8_GROUPS: 16}
ACTS = {None: 0, "silu": 1, "gelu_tanh": 2}


class Launch(NamedTuple):
    tiles: int   # blocks of 8 weight rows per thread block (even when gated)
    warps: int   # warps splitting K: 2, 4 or 8
    unroll: int  # loads in flight per lane and tile: 1, 2 or 4 (tiles 4: up to 2)


# Programmatic dependent launch on compute capability 9.0 and later: a call launches while the
# stream's previous kernel ends and its blocks fetch their first weights meanwhile
# (``dependent_launch_point`` in the .cu file); set from ``KernelConfig.pdl`` at start-up
# (``configure``), before any CUDA graph is captured.
PDL = True


def configure(*, pdl: bool) -> None:
    global PDL
    PDL = pdl


# The launch shapes the extension is built with (``launch_typed`` in the .cu file).
BUILT = frozenset(Launch(t, w, u) for t in (1, 2, 4) for w in (2, 4, 8) for u in (1, 2, 4)
                  if not (t == 4 and u == 4))


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def weight_format(w: torch.Tensor, x: torch.Tensor) -> int | None:
    """The kernel's format code for a weight ``w`` times ``x``, or None."""
    if w.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16):
        return FORMAT_W16
    if w.dtype == torch.float8_e4m3fn and x.dtype in (torch.bfloat16, torch.float16):
        return FORMAT_FP8
    if w.dtype == torch.int32 and x.dtype in (torch.bfloat16, torch.float16):
        return FORMAT_INT4
    return None


def supported(x: torch.Tensor, w: torch.Tensor, group_size: int = 0,
              gated: bool = False, fp8_groups: bool = False) -> bool:
    """Whether ``skinny_gemm`` takes ``x`` [..., K] (1-8 rows) times ``w`` on this device;
    ``fp8_groups``: an e4m3 ``w`` with a scale per row and group of ``group_size`` inputs."""
    if not (x.is_cuda and w.is_cuda) or x.dim() < 1:
        return False
    fmt = weight_format(w, x)
    if fp8_groups:
        # (A chunk's 64 inputs share one FP8 scale: groups from 64.)
        if fmt != FORMAT_FP8 or not group_ok(group_size, x.shape[-1], smallest=64):
            return False
        fmt = FORMAT_FP8_GROUPS
    if fmt is None or w.dim() != 2 or w.stride(-1) != 1:
        return False
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not 1 <= rows <= MAX_ROWS or k % (4 * _LANE_K[fmt]) != 0:
        return False
    if (w.shape[1] * (8 if fmt == FORMAT_INT4 else 1)) != k:
        return False
    n = w.shape[0] // 2 if gated else w.shape[0]
    if n % 8 or (gated and w.shape[0] % 2):
        return False
    if fmt == FORMAT_INT4 and not group_ok(group_size, k):
        return False
    if (w.data_ptr() % 16 or (w.stride(0) * w.element_size()) % 16
            or x.data_ptr() % 16 or (x.dim() > 1 and x.stride(-2) % 8 and rows > 1)):
        return False
    fp8 = fmt in (FORMAT_FP8, FORMAT_FP8_GROUPS)
    if _capability(x.device.index) < ((8, 9) if fp8 else (8, 0)):
        return False
    return cuda_ext.load_extension() is not None


def group_ok(group_size: int, k: int, smallest: int = 32) -> bool:
    """Whether the kernel takes groups of ``group_size`` over ``k`` inputs: a power of two from
    ``smallest`` (INT4: 32; FP8 scales: 64), or one group over all of K."""
    return group_size >= k or (group_size >= smallest
                               and group_size & (group_size - 1) == 0)


# The staged INT4 form (``stage_x`` in the .cu file): with groups of 128 or more, the activation
# rows are copied once per block into shared memory as paired f16, when they fit in
# ``XS_MAX_BYTES``; ``XS_LANE`` bytes per lane and chunk of 128 inputs, rows padded.
XS_LANE, XS_MAX_BYTES = 80, 40 * 1024


def xs_row_bytes(k: int) -> int:
    """Shared-memory bytes of one staged activation row of ``k`` inputs (``xs_row_bytes``)."""
    units = k // 128 * (4 * XS_LANE // 16)
    return k // 128 * 4 * XS_LANE + (4 - units % 8 + 8) % 8 * 16


def stages_activations(rows: int, k: int, group_size: int) -> bool:
    """Whether an INT4 call of ``rows`` x ``k`` runs the staged form: one row, groups of 128
    or more, a row that fits. (The extension itself also reads ``TIDAL_SKINNY_STAGED=0``, a
    switch for side-by-side benchmarks that this function does not see.)"""
    return rows == 1 and group_size >= 128 and xs_row_bytes(k) <= XS_MAX_BYTES


def launch_shape(n: int, fmt: int, gated: bool, staged: bool = False) -> Launch:
    """The launch shape for ``n`` outputs: the best (or within 1 %) of every
    built shape for each Llama-3.1-8B weight at one and four rows on an H200
    (``tools/results/skinny_gemm_h200_llama8b.json``), as a rule for other weights. Many
    output rows take two tiles a block; fewer take one tile and eight warps over K; a fused
    gate/up takes few warps (its grid alone covers the GPU). ``staged``: the one-row INT4
    form with its activations in shared memory (``stages_activations``), whose best shapes
    differ for the smaller weights and the LM head
    (``tools/results/skinny_gemm_h200_llama8b_int4_staged.json``). Block-wise FP8 (a scale
    per row and group) has its own best shapes
    (``tools/results/skinny_gemm_h200_llama8b_fp8_block.json``)."""
    if fmt == FORMAT_INT4:
        if gated:
            return Launch(2, 2, 1)
        if staged:
            if n >= 6144:
                return Launch(2, 8, 1) if n <= 16384 else Launch(4, 2, 1)
            return Launch(2, 8, 2)
        if n >= 6144:
            return Launch(2, 8 if n <= 16384 else 4, 1)
        return Launch(1, 8, 4)
    if fmt == FORMAT_FP8_GROUPS:
        if gated:
            return Launch(2, 4, 2)
        if n >= 16384:
            return Launch(2, 4, 1)
        return Launch(1, 8, 4) if n <= 4096 else Launch(1, 8, 1)
    return Launch(2, 4, 1) if gated else Launch(1, 8, 1)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                w_scale: torch.Tensor | None = None, scales: torch.Tensor | None = None,
                zeros: torch.Tensor | None = None, group_size: int = 0,
                act: str | None = None, config: Launch | None = None) -> torch.Tensor:
    """``x [..., K] @ w.T`` (+ ``bias``); ``act`` ("silu" / "gelu_tanh"): ``w`` is a fused
    ``[gate; up]`` and the result ``act(gate) * up``. FP8 weights take ``w_scale`` [N] (float32),
    or ``scales`` [N, G] (float32, block-wise FP8: a scale per row and group of ``group_size``
    inputs; weight-only, the activations stay 16-bit); INT4 ones (int32 [N, K / 8])
    ``scales`` / ``zeros`` [N, G] and ``group_size``. Call ``supported`` first."""
    fmt = weight_format(w, x)
    if fmt == FORMAT_FP8 and scales is not None:
        fmt = FORMAT_FP8_GROUPS
    k = x.shape[-1]
    if fmt is None or not 1 <= x.numel() // max(k, 1) <= MAX_ROWS:
        raise ValueError(f"skinny_gemm takes 1 to {MAX_ROWS} rows of 16-bit activations times "
                         f"a 16-bit, e4m3 or int32 (INT4) weight; got x {tuple(x.shape)} "
                         f"{x.dtype}, w {w.dtype}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) % 8):
        x2 = x2.contiguous()
    m = x2.shape[0]
    n = w.shape[0] // 2 if act is not None else w.shape[0]
    staged = fmt == FORMAT_INT4 and stages_activations(m, k, group_size)
    cfg = config or launch_shape(n, fmt, act is not None, staged)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    cuda_ext.require_extension().skinny_gemm(
        out, x2, w, fmt, bias, None if w_scale is None else w_scale.reshape(-1), scales, zeros,
        group_size, ACTS[act], cfg.tiles, cfg.warps, cfg.unroll,
        PDL and _capability(x.device.index)[0] >= 9)
    return out.view(*x.shape[:-1], n)
