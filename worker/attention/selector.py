"""Builds the attention implementation a worker's ``KernelPolicy`` names.

Which backend runs is the policy's decision (``tidal.worker.kernel_policy.resolve``: Triton on
a CUDA device with triton, else torch; "cuda" only where the extension built and no layer has a
sliding window or soft-cap). This module only constructs it; backends that import triton or
the extension are imported only when named.
"""

from __future__ import annotations

import torch

from tidal.engine_core.kernel_config import ATTENTION_BACKENDS, KernelConfig
from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.attention.torch_backend import TorchAttention


def attention_impl(name: str) -> AttentionImpl:
    """A new instance of the backend ``name`` ("torch", "triton" or "cuda"), as resolved."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from tidal.worker.attention.triton_attn import TritonAttention

        return TritonAttention()
    if name == "cuda":
        from tidal.worker.attention.cuda_attn import CudaAttention

        return CudaAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose from {ATTENTION_BACKENDS}")


def get_attention_impl(name: str | None, device: torch.device) -> AttentionImpl:
    """The backend a worker on ``device`` asked for ``name`` (None: the best) would run, for
    code outside a worker (tests, tools). A named GPU backend that cannot run there falls back
    along cuda -> triton -> torch, as the policy does; an unknown name is an error."""
    from tidal.worker.kernel_policy import probe_device, resolve

    if name is not None and name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {ATTENTION_BACKENDS}")
    kc = KernelConfig(attention_backend=name, ops="torch")
    return attention_impl(resolve(kc, probe_device(torch.device(device), kc)).attention)
