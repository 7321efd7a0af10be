"""Picks the attention implementation for a device.

``get_attention_impl(None, device)`` gives the best available: Triton on a CUDA device when
triton imports, else torch. Named choices: "torch", "triton", "cuda". A named GPU backend that
can't run here (no GPU, no triton, the CUDA extension failed to build) falls back along
cuda -> triton -> torch with one warning instead of failing; an unknown name is an error.
Backends that import triton are imported only when chosen.
"""

from __future__ import annotations

import logging

import torch

from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.attention.torch_backend import TorchAttention
from tidal.worker.ops.gpu_info import triton_available

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("torch", "triton", "cuda")


def _triton_or_torch(device: torch.device, wanted: str) -> AttentionImpl:
    if device.type == "cuda" and triton_available():
        from tidal.worker.attention.triton_attn import TritonAttention

        return TritonAttention()
    if wanted != "auto":
        logger.warning(
            "%s attention unavailable on %s (triton %s); using torch attention",
            wanted,
            device,
            "importable" if triton_available() else "missing",
        )
    return TorchAttention()


def get_attention_impl(name: str | None, device: torch.device) -> AttentionImpl:
    device = torch.device(device)
    if name is None:
        return _triton_or_torch(device, "auto")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {ATTENTION_BACKENDS}")
    if name == "torch":
        return TorchAttention()
    if name == "cuda" and device.type == "cuda":
        from tidal.worker.ops.cuda_ext import load_extension

        if load_extension() is not None:  # the loader logs its own single warning on failure
            from tidal.worker.attention.cuda_attn import CudaAttention

            return CudaAttention()
        return _triton_or_torch(device, "auto")
    return _triton_or_torch(device, name)
