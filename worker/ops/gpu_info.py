"""Cheap, cached facts about the GPU stack that the kernel choosers need.

Nothing here imports triton or builds anything unless asked; importing this module on a CPU-only
machine is free.
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

logger = logging.getLogger(__name__)


@functools.cache
def triton_available() -> bool:
    """Whether triton imports and a CUDA device exists (Triton kernels are CUDA-only here)."""
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # a broken install must not take the engine down
        logger.warning("triton is installed but failed to import (%s); Triton kernels are off", exc)
        return False
    return True


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()
