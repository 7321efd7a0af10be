"""A LoRA resolver: ``plugin-<name>`` is the adapter folder ``$TIDAL_TEST_LORA_DIR/<name>``."""

from __future__ import annotations

import os

from tidal.engine_core.lora_request import LoRARequest

PREFIX = "plugin-"


class PrefixedDirResolver:
    def __init__(self) -> None:
        self.root = os.environ.get("TIDAL_TEST_LORA_DIR")

    async def resolve(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        if self.root is None or not lora_name.startswith(PREFIX):
            return None
        name = lora_name[len(PREFIX):]
        if not name or "/" in name or name.startswith("."):
            return None
        path = os.path.join(self.root, name)
        if not os.path.isdir(path):
            return None
        return LoRARequest(lora_name, 1, path, base_model_name)
