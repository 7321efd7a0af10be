"""FP8 KV cache: the storage type, the quantize / dequantize semantics every backend follows,
and the per-layer scales' loading from a checkpoint.

Semantics (``engine_core.kv_cache_dtype``): a cache write stores
``clamp(x / scale, -448, 448)`` cast to ``float8_e4m3fn``; a read computes ``fp8 * scale`` in
float32. Each attention layer owns two float32 one-element tensors, ``k_scale`` and
``v_scale``, on its device: kernels read them through pointers, so a CUDA graph replays
whatever value they hold (they are final once the weights have loaded, before any capture).
"""

from __future__ import annotations

import math

import torch
from torch import nn

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# Checkpoint name endings of the scales: compressed-tensors writes them on ``self_attn``;
# other exporters on the attention module inside it (``self_attn.attn``).
_SCALE_SUFFIXES = {
    ".self_attn.k_scale": ("k_scale", ".self_attn"),
    ".self_attn.v_scale": ("v_scale", ".self_attn"),
    ".self_attn.attn.k_scale": ("k_scale", ".self_attn.attn"),
    ".self_attn.attn.v_scale": ("v_scale", ".self_attn.attn"),
}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV cache tensors for ``CacheConfig.cache_dtype``."""
    return FP8_KV_DTYPE if cache_dtype == "fp8_e4m3" else model_dtype


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x`` as the cache stores it: divided by ``scale`` (None: 1), saturated, e4m3."""
    y = x.float()
    if scale is not None:
        y = y / scale
    return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
                  ) -> torch.Tensor:
    """Cache entries ``x`` (FP8) back in ``dtype``: ``x * scale`` computed in float32."""
    y = x.float()
    if scale is not None:
        y = y * scale
    return y.to(dtype)


def new_scale() -> torch.Tensor:
    """A layer's scale before anything sets it: 1.0 (vLLM's default too)."""
    return torch.ones(1, dtype=torch.float32)


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Load a checkpoint's K/V cache scale (``name`` without the ``model.`` prefix) into the
    attention layer it names; True when ``name`` is such a scale. Scales of layers another
    pipeline stage owns are skipped (their module is not here)."""
    for suffix, (attr, owner) in _SCALE_SUFFIXES.items():
        if not name.endswith(suffix):
            continue
        path = name[: -len(suffix)] + owner
        try:
            module = model.get_submodule(path)
        except AttributeError:
            return True  # a layer of another pipeline stage
        attn = getattr(module, "attn", module)
        target = getattr(attn, attr, None)
        if not isinstance(target, torch.Tensor):
            raise ValueError(f"{path} has no {attr} (not an attention layer)")
        if math.prod(tensor.shape) != 1:
            raise ValueError("a per-tensor KV cache scale has one element, "
                             f"got shape {tuple(tensor.shape)} (per-head scales are not yet "
                             "implemented in tidal)")
        if not isinstance(tensor, torch.Tensor):  # a checkpoint tensor not read yet
            tensor = tensor.materialize()
        value = float(tensor.float().reshape(()))
        if not (value > 0.0 and value != float("inf")):
            raise ValueError("a KV cache scale must be finite and > 0, got "
                             f"{value}")
        target.fill_(value)
        return True
    return False


def check_device(kv_dtype: torch.dtype, attention: str, device: torch.device) -> None:
    """Refuse an FP8 cache where the chosen attention kernels cannot convert e4m3: Triton has
    the conversion only from compute capability 8.9 (Ada, Hopper); the torch path runs
    anywhere."""
    if kv_dtype != FP8_KV_DTYPE or attention != "triton" or device.type != "cuda":
        return
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise RuntimeError(f"--kv-cache-dtype fp8 with the triton attention backend needs "
                           f"compute capability 8.9 or newer (this GPU: {major}.{minor}); use "
                           "--attention-backend torch or --kv-cache-dtype auto")
