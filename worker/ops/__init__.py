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

from tidal.worker.ops.dispatch import OpDispatch, OpImpl

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


__all__ = [
    "DISPATCH",
    "OpImpl",
    "fused_add_rms_norm",
    "get_op_impl",
    "prepare_ops",
    "rms_norm",
    "rotary_embedding",
    "set_op_impl",
    "silu_and_mul",
]
