"""Which adapter sits in which device slot.

``max_loras`` slots, shared by every LoRA layer (slot k of each layer holds the same adapter).
A step's adapters (never more than the slots: the scheduler caps a running batch) keep their
slot if they have one; the others take a free slot, else the least recently used slot no
adapter of this step needs (one whose adapter no live request runs, if any), filled by copy
from the host cache.
"""

from __future__ import annotations

import logging

from tidal.worker.lora.layers import LoRALayer
from tidal.worker.lora.peft_loader import AdapterKey, LoadedAdapter

logger = logging.getLogger(__name__)


class GPUSlots:
    def __init__(self, num_slots: int, layers: dict[tuple[int, str], LoRALayer]) -> None:
        self.num_slots = num_slots
        # (layer index, projection) -> the LoRA layer holding that projection
        self.by_proj = layers
        self.layers = list(dict.fromkeys(layers.values()))
        self.keys: list[AdapterKey | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._clock = 0
        self.loads = 0  # adapters copied in since start-up (tests, stats)

    def slot_of(self, key: AdapterKey) -> int | None:
        try:
            return self.keys.index(key)
        except ValueError:
            return None

    def assign(self, keys: list[AdapterKey], fetch,
               live: frozenset[AdapterKey] | set[AdapterKey] = frozenset()
               ) -> dict[AdapterKey, int]:
        """Slots for this step's adapters (distinct); ``fetch(key) -> LoadedAdapter`` gives
        an adapter that must be copied in; ``live``: adapters of requests that still run
        (kept in their slots rather than an idle adapter, where there is a choice)."""
        if len(keys) > self.num_slots:
            raise RuntimeError(f"a step needs {len(keys)} LoRA adapters but there are "
                               f"{self.num_slots} slots (--max-loras)")
        self._clock += 1
        out: dict[AdapterKey, int] = {}
        missing = []
        for key in keys:
            slot = self.slot_of(key)
            if slot is None:
                missing.append(key)
            else:
                out[key] = slot
                self._last_used[slot] = self._clock
        for key in missing:
            free = [s for s in range(self.num_slots) if self._last_used[s] != self._clock]
            empty = [s for s in free if self.keys[s] is None]
            idle = [s for s in free if self.keys[s] not in live]
            slot = empty[0] if empty else min(idle or free, key=lambda s: self._last_used[s])
            self.load(slot, fetch(key))
            out[key] = slot
            self._last_used[slot] = self._clock
        return out

    def load(self, slot: int, adapter: LoadedAdapter) -> None:
        for layer in self.layers:
            layer.clear_slot(slot)
        for (layer_idx, proj), (a, b) in adapter.weights.items():
            target = self.by_proj.get((layer_idx, proj))
            if target is not None:  # (another pipeline stage's layer)
                target.load_slot(slot, proj, a, b)
        self.keys[slot] = adapter.key
        self.loads += 1
        logger.debug("LoRA adapter %s (id %d) loaded into slot %d", adapter.name,
                     adapter.key[0], slot)

    def forget(self, lora_int_id: int) -> None:
        """Drop an adapter's slot claim (the slot's contents stay until reused)."""
        for s, key in enumerate(self.keys):
            if key is not None and key[0] == lora_int_id:
                self.keys[s] = None
