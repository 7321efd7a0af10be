"""tidal's EngineCore: config, wire protocol, scheduler, KV cache manager, busy loop."""

from __future__ import annotations

from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.sampling_params import SamplingParams

__all__ = ["LoRARequest", "SamplingParams"]
