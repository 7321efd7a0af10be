"""The LoRA section of the engine config (``--enable-lora`` and its limits).

``max_loras`` adapters live on the device at once (the workers' stacked slot buffers, allocated
at start-up); ``max_cpu_loras`` stay loaded in each worker's host LRU; a running batch never
holds more distinct adapters than ``max_loras`` (the scheduler). What LoRA does not combine with
yet is refused here, by name, rather than left to misbehave.
"""

from __future__ import annotations

import msgspec

from tidal.engine_core.model_arch import ArchSpec

# The projections an adapter may target: every linear of the attention and the gated MLP.
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Families built from the plain decoder (worker/models/decoder.py), whose linears take LoRA.
LORA_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MIN_RANK, MAX_RANK = 8, 256


class LoRAConfigError(ValueError):
    pass


class LoRAConfig(msgspec.Struct, frozen=True, kw_only=True):
    max_loras: int = 1
    max_cpu_loras: int = 1
    max_lora_rank: int = 16


def build_lora_config(enable: bool, max_loras: int, max_cpu_loras: int | None,
                      max_lora_rank: int, *, arch: ArchSpec, task: str, quantized: bool,
                      speculative: bool, pipeline_parallel_size: int) -> LoRAConfig | None:
    """The validated LoRA section, or None when LoRA is off. Raises ``LoRAConfigError``."""
    if not enable:
        return None
    if max_loras < 1:
        raise LoRAConfigError(f"--max-loras must be >= 1, got {max_loras}")
    cpu = max_loras if max_cpu_loras is None else max_cpu_loras
    if cpu < max_loras:
        raise LoRAConfigError(f"--max-cpu-loras ({cpu}) must be >= --max-loras ({max_loras})")
    if not MIN_RANK <= max_lora_rank <= MAX_RANK:
        raise LoRAConfigError(f"--max-lora-rank must be in [{MIN_RANK}, {MAX_RANK}], got "
                              f"{max_lora_rank}")
    # Each "not yet" names what it does not combine with.
    if task != "generate":
        raise LoRAConfigError(f"--enable-lora with task {task!r} (pooling models) is not yet "
                              "implemented in tidal")
    if arch.family not in LORA_FAMILIES:
        raise LoRAConfigError(f"--enable-lora with model family {arch.family!r} is not yet "
                              f"implemented in tidal (supported: {', '.join(LORA_FAMILIES)})")
    if quantized:
        raise LoRAConfigError("--enable-lora with --quantization is not yet implemented in tidal")
    if speculative:
        raise LoRAConfigError("--enable-lora with speculative decoding is not yet implemented "
                              "in tidal")
    if pipeline_parallel_size > 1:
        raise LoRAConfigError("--enable-lora with pipeline parallelism is not yet implemented "
                              "in tidal")
    return LoRAConfig(max_loras=max_loras, max_cpu_loras=cpu, max_lora_rank=max_lora_rank)
