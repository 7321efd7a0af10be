"""The host KV tier's tensors in one worker: a host copy of each layer's KV cache with
``num_slots`` blocks, and the copies between pool blocks and host slots.

Copies go in runs: consecutive pool blocks into consecutive host slots are one ``copy_`` per K
and per V of a layer. When the pool blocks are scattered but the slots are not (a prefix stored
in position order, loaded back into whatever blocks the pool hands out), the blocks are gathered
through a device buffer instead: one ``index_select`` / ``index_copy_`` per layer and one copy
per run of host slots, not one per block (an 8k-token prefix was ~65k small copies, slower than
recomputing it).

On a GPU the host copy is pinned and the copies run on two side streams, one for stores and one
for loads, so a load never queues behind write-through stores:

- ``save_async`` (write-through, after the step's forward): the store stream waits for the
  work issued so far (the forward that wrote the blocks) and copies; nothing waits for it. Its
  event is kept per block and per slot while it is in flight.
- ``wait_blocks`` (before a forward that overwrites pool blocks): the forward's stream waits for
  the events of those blocks' stores still in flight, and for nothing else.
- ``save`` (eviction stores, before the forward): as ``save_async``, then the forward's stream
  waits for it.
- ``load``: the load stream waits for the work issued so far and for stores still in flight
  into the slots it reads; one event per layer, which ``wait_layer`` hands to the forward's
  stream. Stores wait for the last load, so a slot is not overwritten while being read.

On a CPU every copy is done when the call returns.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Device buffer of a gathered copy, per layer: blocks beyond it go in several batches.
_STAGING_BYTES = 64 << 20


def block_runs(block_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of each run where both ids go up by one."""
    runs: list[tuple[int, int, int]] = []
    if not block_ids:
        return runs
    b0, s0, n = block_ids[0], slots[0], 1
    for b, s in zip(block_ids[1:], slots[1:]):
        if b == b0 + n and s == s0 + n:
            n += 1
        else:
            runs.append((b0, s0, n))
            b0, s0, n = b, s, 1
    runs.append((b0, s0, n))
    return runs


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first slot, its position in ``slots``, length) of each run of consecutive slots."""
    runs: list[tuple[int, int, int]] = []
    if not slots:
        return runs
    s0, p0, n = slots[0], 0, 1
    for i, s in enumerate(slots[1:], 1):
        if s == s0 + n:
            n += 1
        else:
            runs.append((s0, p0, n))
            s0, p0, n = s, i, 1
    runs.append((s0, p0, n))
    return runs


@dataclass(slots=True)
class _Gather:
    """One batch of a gathered copy: pool block ids (a device tensor, in slot order), the
    runs of host slots (slot, position in the batch, length) and the batch's size."""

    index: torch.Tensor
    runs: list[tuple[int, int, int]]
    size: int


@dataclass(slots=True)
class _Flight:
    """A batch of stores issued on the store stream and maybe not finished."""

    event: torch.cuda.Event
    blocks: list[int]
    slots: list[int]


class HostKVStore:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int,
                 gather: bool | None = None) -> None:
        """``gather``: copy scattered blocks through a device buffer (default: on a GPU,
        where each copy costs a launch; tests turn it on for a CPU)."""
        if not kv_caches:
            raise ValueError("the host KV tier needs this worker's KV cache tensors")
        self.caches = kv_caches
        self.num_slots = num_slots
        self.on_gpu = kv_caches[0].is_cuda
        self.gather = self.on_gpu if gather is None else gather
        # One block of one layer (K and V), the largest layer's: sizes the gather buffer.
        self._block_elems = max(c[:, 0].numel() for c in kv_caches)
        self._block_bytes = self._block_elems * kv_caches[0].element_size()
        # Same layout as the pool ([2, blocks, block_size, kv_heads, head_dim]) with slots in
        # place of blocks, so a run of blocks is one contiguous chunk on both sides.
        # Uninitialised: a slot is read only after a store filled it (and zeroing tens of GB
        # of pinned memory would cost seconds at start-up).
        self.host = [torch.empty((c.shape[0], num_slots, *c.shape[2:]), dtype=c.dtype,
                                 pin_memory=self.on_gpu) for c in kv_caches]
        dev = kv_caches[0].device
        self.store_stream = torch.cuda.Stream(dev) if self.on_gpu else None
        self.load_stream = torch.cuda.Stream(dev) if self.on_gpu else None
        self._layer_done: list[torch.cuda.Event] = []
        self._last_load: torch.cuda.Event | None = None
        # Stores in flight, oldest first, and the newest store event of each block and slot.
        self._inflight: deque[_Flight] = deque()
        self._block_event: dict[int, torch.cuda.Event] = {}
        self._slot_event: dict[int, torch.cuda.Event] = {}
        # Times a forward's stream was made to wait for a store (``save`` or ``wait_blocks``).
        self.forward_waits = 0
        total = sum(h.numel() * h.element_size() for h in self.host)
        logger.info("host KV tier: %d slots, %.2f GB of %s host memory", num_slots, total / 1e9,
                    "pinned" if self.on_gpu else "pageable")

    # --- the copies -----------------------------------------------------------------------------

    def _plan(self, block_ids: list[int], slots: list[int]
              ) -> list[tuple[int, int, int]] | list[_Gather]:
        """Runs of (block, slot) pairs, or gathered batches when that takes fewer copies. On a
        GPU, call on the side stream that copies (the index tensors are allocated there)."""
        runs = block_runs(block_ids, slots)
        if not self.gather or len(runs) < 2:
            return runs
        order = sorted(range(len(slots)), key=slots.__getitem__)
        ordered = [slots[i] for i in order]
        if len(slot_runs(ordered)) >= len(runs):
            return runs
        device = self.caches[0].device
        step = max(1, _STAGING_BYTES // self._block_bytes)
        batches: list[_Gather] = []
        for start in range(0, len(order), step):
            part = order[start:start + step]
            index = torch.tensor([block_ids[i] for i in part], dtype=torch.long)
            if self.on_gpu:
                index = index.pin_memory().to(device, non_blocking=True)
            batches.append(_Gather(index, slot_runs(ordered[start:start + step]), len(part)))
        return batches

    def _copy_layer(self, layer: int, plan: list[tuple[int, int, int]] | list[_Gather],
                    out: bool, staging: torch.Tensor | None) -> None:
        """One layer's copies: pool -> host (``out``) or host -> pool."""
        cache, host = self.caches[layer], self.host[layer]
        nb = self.on_gpu
        kinds = range(cache.shape[0])
        if staging is None:
            for b, s, n in plan:  # type: ignore[misc]
                for kv in kinds:
                    if out:
                        host[kv, s:s + n].copy_(cache[kv, b:b + n], non_blocking=nb)
                    else:
                        cache[kv, b:b + n].copy_(host[kv, s:s + n], non_blocking=nb)
            return
        if cache.element_size() == 1 and cache.dtype.is_floating_point:
            # FP8 caches: the gather kernels are not built for float8; the bytes are the same.
            cache, host, staging = (t.view(torch.uint8) for t in (cache, host, staging))
        inner = cache[:, 0].numel()
        for batch in plan:
            assert isinstance(batch, _Gather)
            buf = staging[:inner * batch.size].view(cache.shape[0], batch.size, *cache.shape[2:])
            if out:
                torch.index_select(cache, 1, batch.index, out=buf)
            for s, p, n in batch.runs:
                for kv in kinds:
                    if out:
                        host[kv, s:s + n].copy_(buf[kv, p:p + n], non_blocking=nb)
                    else:
                        buf[kv, p:p + n].copy_(host[kv, s:s + n], non_blocking=nb)
            if not out:
                cache.index_copy_(1, batch.index, buf)

    def _staging(self, plan: list[tuple[int, int, int]] | list[_Gather]
                 ) -> torch.Tensor | None:
        """The device buffer a gathered plan goes through (reused by every layer and batch:
        the copies of one call run in order on one stream)."""
        if not plan or not isinstance(plan[0], _Gather):
            return None
        cache = self.caches[0]
        biggest = max(b.size for b in plan)  # type: ignore[union-attr]
        return torch.empty(self._block_elems * biggest, dtype=cache.dtype, device=cache.device)

    def _copy_all(self, block_ids: list[int], slots: list[int], out: bool
                  ) -> list[torch.cuda.Event]:
        """Every layer's copies on the current stream; for a load on a GPU, an event after
        each layer (what ``wait_layer`` waits for)."""
        plan = self._plan(block_ids, slots)
        staging = self._staging(plan)
        events: list[torch.cuda.Event] = []
        for layer in range(len(self.caches)):
            self._copy_layer(layer, plan, out, staging)
            if self.on_gpu and not out:
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        return events

    # --- stores ---------------------------------------------------------------------------------

    def _prune(self) -> None:
        """Forget stores that have finished (the store stream runs them in order)."""
        inflight = self._inflight
        while inflight and inflight[0].event.query():
            flight = inflight.popleft()
            for b in flight.blocks:
                if self._block_event.get(b) is flight.event:
                    del self._block_event[b]
            for s in flight.slots:
                if self._slot_event.get(s) is flight.event:
                    del self._slot_event[s]

    def _store(self, block_ids: list[int], slots: list[int]) -> torch.cuda.Event | None:
        if self.store_stream is None:
            self._copy_all(block_ids, slots, out=True)
            return None
        self._prune()
        stream = self.store_stream
        # The blocks' K/V: written by the forwards issued so far.
        stream.wait_stream(torch.cuda.current_stream())
        if self._last_load is not None:
            stream.wait_event(self._last_load)  # a slot being read is not overwritten
        with torch.cuda.stream(stream):
            self._copy_all(block_ids, slots, out=True)
            event = torch.cuda.Event()
            event.record(stream)
        flight = _Flight(event, list(block_ids), list(slots))
        self._inflight.append(flight)
        for b in flight.blocks:
            self._block_event[b] = event
        for s in flight.slots:
            self._slot_event[s] = event
        return event

    def save_async(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy pool blocks into host slots after the forward that wrote them, without making
        any later work wait (write-through). A forward that overwrites one of these blocks
        calls ``wait_blocks`` first."""
        if block_ids:
            self._store(block_ids, slots)

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy pool blocks into host slots before this step's forward overwrites them: the
        forward waits for these copies."""
        event = self._store(block_ids, slots)
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
            self.forward_waits += 1

    def wait_blocks(self, block_ids: list[int]) -> None:
        """This step overwrites ``block_ids``: its stream waits for their stores still in
        flight (their events only; usually there are none)."""
        if not self._block_event:
            return
        self._prune()
        compute = torch.cuda.current_stream()
        seen: set[int] = set()
        for b in block_ids:
            event = self._block_event.get(b)
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                compute.wait_event(event)
        self.forward_waits += len(seen)

    def stores_in_flight(self) -> int:
        """Store batches issued and not yet known to be finished."""
        self._prune()
        return len(self._inflight)

    # --- loads ----------------------------------------------------------------------------------

    def load(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy host slots into pool blocks; the forward reads layer i after ``wait_layer(i)``."""
        if self.load_stream is None:
            self._copy_all(block_ids, slots, out=False)
            return
        self._prune()
        stream = self.load_stream
        # The target blocks are free to overwrite after the work issued so far (which waits
        # for stores out of them: ``wait_blocks``).
        stream.wait_stream(torch.cuda.current_stream())
        seen: set[int] = set()
        for s in slots:
            event = self._slot_event.get(s)
            if event is not None and id(event) not in seen:
                seen.add(id(event))
                stream.wait_event(event)  # its store is still in flight
        with torch.cuda.stream(stream):
            self._layer_done = self._copy_all(block_ids, slots, out=False)
        self._last_load = self._layer_done[-1]

    def wait_layer(self, layer_idx: int) -> None:
        """Make the forward's stream wait for layer ``layer_idx``'s loads of this step."""
        if self._layer_done:
            torch.cuda.current_stream().wait_event(self._layer_done[layer_idx])
            if layer_idx == len(self._layer_done) - 1:
                self._layer_done = []

    def close(self) -> None:
        """Let every copy finish before the tensors go (pinned memory freed under a DMA)."""
        for stream in (self.store_stream, self.load_stream):
            if stream is not None:
                stream.synchronize()
        self._inflight.clear()
        self._block_event.clear()
        self._slot_event.clear()
