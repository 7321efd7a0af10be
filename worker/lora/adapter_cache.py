"""The worker's host-memory LRU of loaded adapters (``--max-cpu-loras`` entries)."""

from __future__ import annotations

import logging
from collections import OrderedDict

from tidal.worker.lora.peft_loader import AdapterKey, LoadedAdapter

logger = logging.getLogger(__name__)


class AdapterCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"the adapter cache needs room for one adapter, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[AdapterKey, LoadedAdapter] = OrderedDict()

    def __contains__(self, key: AdapterKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[AdapterKey]:
        """Least recently used first."""
        return list(self._entries)

    def get(self, key: AdapterKey) -> LoadedAdapter | None:
        adapter = self._entries.get(key)
        if adapter is not None:
            self._entries.move_to_end(key)
        return adapter

    def put(self, adapter: LoadedAdapter) -> list[AdapterKey]:
        """Insert (most recent); returns the keys evicted to make room, least recent first.
        An older entry of the same id (other files) goes too."""
        evicted = [k for k in self._entries if k[0] == adapter.key[0] and k != adapter.key]
        for k in evicted:
            del self._entries[k]
        self._entries[adapter.key] = adapter
        self._entries.move_to_end(adapter.key)
        while len(self._entries) > self.capacity:
            key, _ = self._entries.popitem(last=False)
            evicted.append(key)
        if evicted:
            logger.debug("LoRA host cache evicted %s", evicted)
        return evicted
