"""Fused ops used by the model layers, dispatched to the fastest available implementation.

Each op has a plain-torch version (``torch_ops``); faster CUDA/Triton versions plug in here and
are chosen automatically when the tensors live on a GPU and the implementation is available.
"""

from __future__ import annotations

from tidal.worker.ops.torch_ops import (
    fused_add_rms_norm,
    rms_norm,
    rotary_embedding,
    silu_and_mul,
)

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]
