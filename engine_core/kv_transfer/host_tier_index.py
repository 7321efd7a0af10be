"""The host KV tier's bookkeeping on the scheduler side: which block hash sits in which host
slot, in LRU order.

The tensors live in the workers (``worker/kv_transfer/host_kv_store.py``); every worker keeps
its shard of a block in the same slot, so this one index serves them all. A slot read by a load
this step is pinned until the step's metadata is built: the workers run a step's eviction
stores before its loads, so a slot reused by a store of the same step would hand the load other
tokens' KV. (A slot being written by a store still in flight may be loaded from: the workers
order that load after the store.)
"""

from __future__ import annotations

import logging
from collections import OrderedDict

logger = logging.getLogger(__name__)


class HostTierIndex:
    __slots__ = ("num_slots", "_slots", "_free", "_pinned")

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        # hash -> slot, least recently used first.
        self._slots: OrderedDict[bytes, int] = OrderedDict()
        # Free slots, lowest first at the end (pop() takes the lowest): consecutive stores get
        # consecutive slots, which the workers copy as one chunk.
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (no LRU change), or None."""
        return self._slots.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        """Make ``block_hash`` most recently used, if present."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)

    def take(self, block_hash: bytes) -> int:
        """Mark ``block_hash``'s slot as read this step: most recently used, and pinned until
        ``end_step``. The hash must be present."""
        slot = self._slots[block_hash]
        self._slots.move_to_end(block_hash)
        self._pinned.add(slot)
        return slot

    def store(self, block_hash: bytes) -> int | None:
        """A slot to copy ``block_hash``'s block into, or None when nothing needs copying (it
        is here already: it only becomes most recently used) or every slot is pinned."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return None
        if self._free:
            slot = self._free.pop()
        else:
            slot = self._evict_lru()
            if slot is None:
                return None
        self._slots[block_hash] = slot
        return slot

    def _evict_lru(self) -> int | None:
        for victim, slot in self._slots.items():
            if slot not in self._pinned:
                del self._slots[victim]
                return slot
        return None

    def reorder(self, hashes: list[bytes]) -> list[int] | None:
        """Give ``hashes`` (each stored this step, in the order wanted) their own slots in
        ascending order, keeping their LRU places; returns the slots, or None when it cannot
        (a hash is gone or two share a slot: a store of this step evicted another's)."""
        slots = [self._slots.get(h) for h in hashes]
        if None in slots or len(set(slots)) != len(slots):
            return None
        ordered = sorted(slots)  # type: ignore[type-var]
        for h, slot in zip(hashes, ordered):
            self._slots[h] = slot  # an existing key: its LRU place stays
        return ordered

    def end_step(self) -> None:
        """The step's loads are on their way: their slots may be reused from the next step."""
        self._pinned.clear()

    def clear(self) -> None:
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()

    def check_invariants(self) -> None:
        used = set(self._slots.values())
        if len(used) != len(self._slots):
            raise AssertionError("two hashes share a host slot")
        if used & set(self._free) or len(used) + len(self._free) != self.num_slots:
            raise AssertionError("host slots lost or both free and used")
