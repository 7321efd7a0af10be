"""Fused ops used by the model layers, dispatched to the fastest available implementation.

Each op has a plain-torch version (``torch_ops``, the CPU path and the reference), a Triton
version (``triton_ops``) and a CUDA-extension version (``cuda_ops``, sources in ``csrc/``). For
tensors on a GPU the choice follows ``set_op_impl`` (default ``"auto"``: CUDA extension if it
builds, else Triton, else torch); CPU tensors always use torch. Importing this package imports
neither triton nor the extension.

    from tidal.worker import ops
    ops.set_op_impl("torch")          # force the reference path (tests)
    ops.prepare_ops(torch.device("cuda"))  # build/resolve now, before CUDA-graph capture
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.engine_core import envs
from tidal.worker.distributed.pending_sum import PendingSum
from tidal.worker.ops import torch_ops
from tidal.worker.ops.dispatch import OpDispatch, OpImpl
from tidal.worker.ops.gpu_info import triton_available

# Process-wide, explicit: kernels are a per-process resource and the choice holds no engine
# state, so two engines in one process share it safely.
DISPATCH = OpDispatch()


def set_op_impl(choice: OpImpl) -> None:
    """'auto' | 'torch' | 'triton' | 'cuda' for the fused ops on GPU tensors."""
    DISPATCH.set(choice)


def get_op_impl() -> OpImpl:
    return DISPATCH.choice


def prepare_ops(device: torch.device) -> str:
    """Resolve (and build, for the CUDA extension) the implementation used on ``device``.

    Returns 'cuda', 'triton' or 'torch'. Call it before capturing CUDA graphs so that no build
    or first-call compilation happens inside a capture.
    """
    if device.type != "cuda":
        return "torch"
    return DISPATCH.active_name(device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return DISPATCH.impl_for(x).rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    return DISPATCH.impl_for(x).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return DISPATCH.impl_for(x).silu_and_mul(x)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return DISPATCH.impl_for(query).rotary_embedding(positions, query, key, cos_sin_cache, is_neox)


# --- fused decode ops (Triton; ``triton_decode``) ----------------------------------------------
#
# They apply to CUDA tensors when the GPU ops are on (not ``set_op_impl("torch")``), triton
# imports, and ``TIDAL_DECODE_KERNELS`` is not 0; ``TIDAL_GEMV=0`` turns off only the one-row
# GEMV (and the norm / SiLU fusions built on it), ``TIDAL_GEMV_MAX_MB`` keeps larger weights on
# cuBLAS. Everything else takes the unfused path.

_DECODE_KERNELS = envs.decode_kernels()
_GEMV = _DECODE_KERNELS and envs.gemv()
# Weights larger than this (MiB) stay on cuBLAS even for one row (default: no limit).
_GEMV_MAX_BYTES = envs.gemv_max_bytes()
GEMV_MAX_ROWS = 1  # decode batches with more rows stay on cuBLAS (its tiles suit them)
ARGMAX_MAX_ROWS = 16  # larger batches already fill the GPU with torch's one-block-per-row argmax


def _decode_kernels_on(x: torch.Tensor) -> bool:
    return (x.is_cuda and _DECODE_KERNELS and DISPATCH.choice != "torch"
            and triton_available())


def one_row_fusion_applies(x: torch.Tensor | PendingSum) -> bool:
    """Whether a layer fed ``x`` (one row on the GPU, decode kernels on) should go through
    ``rms_norm_linear``: it fuses where the GEMV applies and composes the plain ops elsewhere.
    A ``PendingSum`` (only ever made for such rows) always does."""
    if isinstance(x, PendingSum):
        return True
    return _GEMV and x.dim() >= 1 and x.numel() == x.shape[-1] and _decode_kernels_on(x)


def gemv_applies(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether ``linear`` / ``rms_norm_linear`` on ``x`` run the one-row GEMV kernel."""
    if not (_GEMV and x.dim() >= 1 and x.numel() == x.shape[-1] and _decode_kernels_on(x)):
        return False
    from tidal.worker.ops import triton_decode

    return all(triton_decode.gemv_supported(x, w)
               and w.numel() * w.element_size() <= _GEMV_MAX_BYTES for w in weights)


def gemv_tuned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """``gemv_applies`` and the weight's shape has a measured launch shape (for weights where
    cuBLAS is already close to the copy rate, such as LM heads, only a tuned GEMV beats it)."""
    if not gemv_applies(x, weight):
        return False
    from tidal.worker.ops import triton_decode

    return (weight.shape[0], weight.shape[1], False, weight.element_size()) in \
        triton_decode.GEMV_CONFIGS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; a single row on the GPU runs the GEMV kernel."""
    if gemv_applies(x, weight) and (bias is None or bias.dtype == x.dtype):
        from tidal.worker.ops import triton_decode

        y, _ = triton_decode.gemv(x, weight, bias)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


# The RMSNorm before a GEMV of at least this many bytes runs once, in its own one-program kernel,
# rather than as the GEMV's prologue (which every one of the GEMV's programs runs over the whole
# row): measured on H200 for Llama-3.1-8B's q/k/v (50 MB) 12.2 + 1.2 us against 15.5, and
# 3.32 against 3.58 ms for a whole TP=1 step's GEMVs. Qwen3-0.6B's weights (8-12 MB) keep the
# prologue. Under tensor parallelism the signal-free all-reduce before the norm computes its
# statistics instead, for weights of any size. TIDAL_NORM_APART=0: always the prologue.
NORM_APART_MIN_BYTES = 16 << 20
_NORM_APART = envs.norm_apart()


def rms_norm_linear(
    x: torch.Tensor | PendingSum,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), x + residual)``; see ``torch_ops.rms_norm_linear``.
    One row on the GPU: the GEMV kernel with the norm as its prologue (or, before a large
    weight, a one-row norm kernel first) and SiLU-and-mul as its epilogue. ``x`` may be a
    tensor-parallel ``PendingSum``: its all-reduce then completes inside the GEMV (pushed
    rows, summed as they are read) or inside the all-reduce kernel that hands the GEMV the
    norm's statistics."""
    pending = x if isinstance(x, PendingSum) else None
    if pending is not None:
        x = pending.like
    fused = (gemv_applies(x, weight) and norm_weight.dtype == x.dtype
             and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
             and (bias is None or (bias.dtype == x.dtype and not silu))
             and not (silu and weight.shape[0] % 2))
    if fused:
        from tidal.worker.ops import triton_decode

    parts = stats = None
    if pending is not None:
        if fused and residual is not None:
            # The sum, residual add and norm statistics in one small kernel, so the GEMV
            # reads a finished row; else pushed rows summed by the GEMV as it reads them.
            if _NORM_APART:
                stats = pending.reduce_add_stats(residual)
            if stats is None:
                parts = pending.parts()
        if parts is None and stats is None:
            # No kernel can take the pending sum (or, with no residual, the sum itself would
            # be returned as one): complete the all-reduce first.
            x = pending.wait()
    n = weight.shape[0] // 2 if silu else weight.shape[0]
    if stats is not None:
        h, ss = stats
        y, _ = triton_decode.gemv(h, weight, bias, norm_weight=norm_weight, eps=eps, silu=silu,
                                  norm_ss=ss)
        return y.view(*h.shape[:-1], n), h
    if (fused and parts is None and _NORM_APART and x.dtype in (torch.bfloat16, torch.float16)
            and weight.numel() * weight.element_size() >= NORM_APART_MIN_BYTES
            and x.shape[-1] <= triton_decode.ADD_NORM_MAX):
        h, residual = triton_decode.add_rms_norm_row(x, residual, norm_weight, eps)
        y, _ = triton_decode.gemv(h, weight, bias, silu=silu)
        return y.view(*h.shape[:-1], n), residual
    if fused:
        y, res = triton_decode.gemv(x, weight, bias, norm_weight=norm_weight, residual=residual,
                                    eps=eps, silu=silu, parts=parts)
        return y.view(*x.shape[:-1], n), res
    if residual is None:
        h, residual = rms_norm(x, norm_weight, eps), x
    else:
        h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    y = F.linear(h, weight, bias)
    return (silu_and_mul(y) if silu else y), residual


def qk_norm_rope_applies(
    qkv: torch.Tensor, head_dim: int, cos_sin_cache: torch.Tensor, is_neox: bool,
    kv_cache: torch.Tensor,
) -> bool:
    """Whether ``qk_norm_rope_write_kv`` has a kernel for these tensors (else: the unfused ops)."""
    if not _decode_kernels_on(qkv):
        return False
    from tidal.worker.ops import triton_decode

    return triton_decode.qk_norm_rope_supported(qkv, head_dim, cos_sin_cache, is_neox, kv_cache)


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
) -> torch.Tensor:
    """q/k RMSNorm (Qwen3), neox rotary and the K/V cache write in one pass; returns q
    ``[T, H, D]``. Semantics: ``torch_ops.qk_norm_rope_write_kv``."""
    args = (qkv, positions, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
            eps, cos_sin_cache, kv_cache, slot_mapping)
    if qk_norm_rope_applies(qkv, head_dim, cos_sin_cache, True, kv_cache):
        from tidal.worker.ops import triton_decode

        return triton_decode.qk_norm_rope_write_kv(*args)
    return torch_ops.qk_norm_rope_write_kv(*args)


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Embedding rows of ``ids`` from the vocabulary shard ``weight`` that starts at token
    ``start``; zeros for tokens outside it. Semantics: ``torch_ops.vocab_shard_embedding``."""
    if ids.is_cuda and DISPATCH.choice != "torch" and triton_available():
        from tidal.worker.ops import triton_ops

        return triton_ops.vocab_shard_embedding(ids, weight, start)
    return torch_ops.vocab_shard_embedding(ids, weight, start)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of ``[rows, n]``; few rows on the GPU: a two-stage kernel that
    spreads each row over many programs (torch reduces a row in one block)."""
    if x.dim() == 2 and x.shape[0] <= ARGMAX_MAX_ROWS and _decode_kernels_on(x):
        from tidal.worker.ops import triton_decode

        if triton_decode.argmax_supported(x):
            return triton_decode.argmax(x)
    return x.argmax(dim=-1)


__all__ = [
    "DISPATCH",
    "OpImpl",
    "argmax",
    "fused_add_rms_norm",
    "gemv_applies",
    "gemv_tuned",
    "get_op_impl",
    "linear",
    "one_row_fusion_applies",
    "prepare_ops",
    "qk_norm_rope_applies",
    "qk_norm_rope_write_kv",
    "rms_norm",
    "rms_norm_linear",
    "rotary_embedding",
    "set_op_impl",
    "silu_and_mul",
    "vocab_shard_embedding",
]
