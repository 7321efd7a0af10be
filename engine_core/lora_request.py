"""Which LoRA adapter a request runs with (names follow vLLM's ``LoRARequest``).

A frozen msgspec struct: it travels inside ``EngineCoreRequest`` to the EngineCore and on to the
workers (``NewRequestData``), never pickled. ``lora_int_id`` identifies the adapter everywhere
below the frontend (the scheduler's slot accounting, the prefix cache's block hashes, the
workers' adapter caches); ``lora_path`` is a local folder in PEFT's format.
"""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    lora_name: str
    lora_int_id: int  # > 0, unique per adapter (0 and below are the base model)
    lora_path: str  # a folder with adapter_config.json + adapter_model.safetensors
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if not self.lora_path:
            raise ValueError("lora_path must not be empty")
