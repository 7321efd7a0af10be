"""Fused ops used by the model layers, and their implementations.

Each op has a plain-torch version (``torch_ops``, the CPU path and the reference), a Triton
version (``triton_ops``) and a CUDA-extension version (``cuda_ops``, sources in ``csrc/``); the
batch-1 decode fusions are Triton only (``triton_decode``). Which one runs is no global setting:
each worker resolves its ``KernelPolicy`` once (``tidal.worker.kernel_policy``) and the layers
get a ``Kernels`` bound to it when the model is built. Importing this package imports neither
triton nor the extension.

    from tidal.worker.kernel_policy import kernels_for
    kernels = kernels_for(torch.device("cuda"))   # probe, resolve, bind
    y = kernels.linear(x, w)
"""

from __future__ import annotations

from tidal.worker.ops import torch_ops
from tidal.worker.ops.kernels import (
    ARGMAX_MAX_ROWS,
    GEMV_MAX_ROWS,
    NORM_APART_MIN_WEIGHTS,
    Kernels,
    op_module,
)

__all__ = [
    "ARGMAX_MAX_ROWS",
    "GEMV_MAX_ROWS",
    "NORM_APART_MIN_WEIGHTS",
    "Kernels",
    "op_module",
    "torch_ops",
]
