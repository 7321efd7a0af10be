"""Picks the attention implementation for a device.

``get_attention_impl(None, device)`` gives the best available: Triton on a CUDA device when
triton imports, else torch. Named choices: "torch", "triton", "cuda". A named GPU backend that
can't run here (no GPU, no triton, the CUDA extension failed to build) falls back along
cuda -> triton -> torch with one warning instead of failing; an unknown name is an error.
Backends that import triton are imported only when chosen. Once the model is built,
``fit_attention_to_layers`` moves a model whose layers need a sliding window or soft-cap off a
backend without those kernels (the CUDA extension's).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from tidal.engine_core.config import ConfigError
from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.attention.torch_backend import TorchAttention
from tidal.worker.layers.attention import Attention
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


# Backends whose kernels take a per-layer sliding window and logit soft-cap.
LAYER_FEATURE_BACKENDS = ("triton", "torch")


def _layer_needs(layers: Iterable[Attention]) -> list[str]:
    needs: list[str] = []
    for i, layer in enumerate(layers):
        if layer.sliding_window is not None:
            needs.append(f"sliding window {layer.sliding_window} (attention layer {i})")
        if layer.logits_soft_cap is not None:
            needs.append(f"logit soft-cap {layer.logits_soft_cap} (attention layer {i})")
    return needs


def fit_attention_to_layers(
    impl: AttentionImpl, model: nn.Module, requested: str | None, device: torch.device
) -> AttentionImpl:
    """The backend every attention layer of ``model`` can run on: ``impl``, unless a layer has a
    sliding window or soft-cap that ``impl`` has no kernel for; then Triton (or torch), bound to
    every layer, or an error when the user asked for ``impl`` by name."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if impl.name in LAYER_FEATURE_BACKENDS:
        return impl
    needs = _layer_needs(layers)
    if not needs:
        return impl
    first = needs[0] + (f" and {len(needs) - 1} more" if len(needs) > 1 else "")
    if requested == impl.name:
        raise ConfigError(
            f"attention backend {impl.name!r} has no kernel for this model's {first}; "
            f"use one of {', '.join(LAYER_FEATURE_BACKENDS)} (or leave the backend unset)"
        )
    fitted = _triton_or_torch(torch.device(device), "auto")
    logger.info("%s attention has no kernel for %s: using %s attention", impl.name, first,
                fitted.name)
    for layer in layers:
        layer.impl = fitted
    return fitted
