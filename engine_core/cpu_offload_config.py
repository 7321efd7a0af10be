"""``--cpu-offload-gb`` (vLLM's flag), checked once at start-up: how many bytes of each GPU
worker's weights stay in pinned host memory (``worker/cpu_offload.py`` streams them in)."""

from __future__ import annotations

import logging
import math

logger = logging.getLogger(__name__)


class CPUOffloadConfigError(ValueError):
    """``--cpu-offload-gb`` is malformed or combined with what it does not support yet."""


def cpu_offload_bytes(gb: float, *, gpu_stages: bool, quantized: bool, compiled: bool,
                      lora: bool, embedding: bool = False) -> int:
    """Bytes per GPU worker; 0 when off. ``gpu_stages``: some worker runs on a GPU. On a CPU
    the weights already live in host memory: the flag saves nothing and is ignored (as vLLM
    does), with a warning."""
    if not math.isfinite(gb) or gb < 0:
        raise CPUOffloadConfigError(f"--cpu-offload-gb must be a number >= 0, got {gb}")
    if gb == 0:
        return 0
    if not gpu_stages:
        logger.warning("--cpu-offload-gb %s is ignored: every worker runs on the CPU, where "
                       "the weights already live in host memory", gb)
        return 0
    for on, what in ((quantized, "--quantization"), (compiled, "--compilation-config"),
                     (lora, "--enable-lora"), (embedding, "an embedding model")):
        if on:
            raise CPUOffloadConfigError(f"--cpu-offload-gb with {what} is not yet supported")
    return int(gb * 2**30)
