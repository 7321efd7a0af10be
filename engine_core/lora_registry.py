"""The EngineCore's table of known LoRA adapters (``AddLora`` / ``RemoveLora`` / ``ListLoras``).

An adapter is checked once, when it is added (explicitly, or by the first request naming it):
its files against the base model (``lora_adapter.inspect_adapter``, the safetensors header
only). The workers load its weights when a scheduled request first needs them.
"""

from __future__ import annotations

import logging

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.lora_adapter import LoRAAdapterError, inspect_adapter
from tidal.engine_core.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.adapters: dict[int, LoRARequest] = {}

    @property
    def enabled(self) -> bool:
        return self.config.lora is not None

    def add(self, lora: LoRARequest) -> bool:
        """Register (and check) an adapter; False when this very adapter was known already.
        Raises ``LoRAAdapterError`` for an adapter that cannot be served."""
        lora_cfg = self.config.lora
        if lora_cfg is None:
            raise LoRAAdapterError("LoRA adapters need the engine started with --enable-lora")
        known = self.adapters.get(lora.lora_int_id)
        if known is not None:
            if (known.lora_name, known.lora_path) == (lora.lora_name, lora.lora_path):
                return False
            raise LoRAAdapterError(
                f"lora_int_id {lora.lora_int_id} is already adapter {known.lora_name!r} at "
                f"{known.lora_path!r}; remove it first or use another id")
        spec = inspect_adapter(lora.lora_path, self.config.model.arch, lora_cfg.max_lora_rank)
        self.adapters[lora.lora_int_id] = lora
        logger.info("LoRA adapter %s (id %d) added: %d modules, rank up to %d, from %s",
                    lora.lora_name, lora.lora_int_id, len(spec.modules), spec.max_rank,
                    lora.lora_path)
        return True

    def remove(self, lora_int_id: int) -> bool:
        return self.adapters.pop(lora_int_id, None) is not None

    def list(self) -> list[int]:
        return sorted(self.adapters)

    def check_request(self, lora: LoRARequest | None) -> None:
        """A request's adapter: known (or added now). Raises ``LoRAAdapterError``."""
        if lora is None:
            return
        if not self.enabled:
            raise LoRAAdapterError(f"request names LoRA adapter {lora.lora_name!r} but the "
                                   "engine was not started with --enable-lora")
        self.add(lora)
