"""The host KV tier's tensors in one worker: a host copy of each layer's KV cache with
``num_slots`` blocks, and the copies between pool blocks and host slots.

Copies go in runs: consecutive pool blocks into consecutive host slots are one ``copy_`` per K
and per V of a layer (the scheduler hands out consecutive slots where it can). On a GPU the host
copy is pinned and the copies run on a side stream: the step's forward waits for its stores
(they read blocks it overwrites) and, layer by layer, for its loads; on a CPU they are plain
copies, done when ``save``/``load`` return.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


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


class HostKVStore:
    def __init__(self, kv_caches: list[torch.Tensor], num_slots: int) -> None:
        if not kv_caches:
            raise ValueError("the host KV tier needs this worker's KV cache tensors")
        self.caches = kv_caches
        self.num_slots = num_slots
        self.on_gpu = kv_caches[0].is_cuda
        # Same layout as the pool ([2, blocks, block_size, kv_heads, head_dim]) with slots in
        # place of blocks, so a run of blocks is one contiguous chunk on both sides.
        # Uninitialised: a slot is read only after a store filled it (and zeroing tens of GB
        # of pinned memory would cost seconds at start-up).
        self.host = [torch.empty((c.shape[0], num_slots, *c.shape[2:]), dtype=c.dtype,
                                 pin_memory=self.on_gpu) for c in kv_caches]
        self.stream = torch.cuda.Stream(kv_caches[0].device) if self.on_gpu else None
        self._layer_done: list[torch.cuda.Event] = []
        total = sum(h.numel() * h.element_size() for h in self.host)
        logger.info("host KV tier: %d slots, %.2f GB of %s host memory", num_slots, total / 1e9,
                    "pinned" if self.on_gpu else "pageable")

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy pool blocks into host slots, before this step's forward may overwrite them."""
        runs = block_runs(block_ids, slots)
        if self.stream is None:
            self._copy_out(runs)
            return
        compute = torch.cuda.current_stream()
        self.stream.wait_stream(compute)  # the blocks' K/V written by earlier steps
        with torch.cuda.stream(self.stream):
            self._copy_out(runs)
        compute.wait_stream(self.stream)  # the forward overwrites them after the copies

    def _copy_out(self, runs: list[tuple[int, int, int]]) -> None:
        nb = self.on_gpu
        for cache, host in zip(self.caches, self.host):
            for b, s, n in runs:
                for kv in range(cache.shape[0]):
                    host[kv, s:s + n].copy_(cache[kv, b:b + n], non_blocking=nb)

    def load(self, block_ids: list[int], slots: list[int]) -> None:
        """Copy host slots into pool blocks; the forward reads layer i after ``wait_layer(i)``."""
        runs = block_runs(block_ids, slots)
        if self.stream is None:
            for cache, host in zip(self.caches, self.host):
                for b, s, n in runs:
                    cache[:, b:b + n].copy_(host[:, s:s + n])
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        events = []
        with torch.cuda.stream(self.stream):
            for cache, host in zip(self.caches, self.host):
                for b, s, n in runs:
                    for kv in range(cache.shape[0]):
                        cache[kv, b:b + n].copy_(host[kv, s:s + n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                events.append(event)
        self._layer_done = events

    def wait_layer(self, layer_idx: int) -> None:
        """Make the forward's stream wait for layer ``layer_idx``'s loads of this step."""
        if self._layer_done:
            torch.cuda.current_stream().wait_event(self._layer_done[layer_idx])
            if layer_idx == len(self._layer_done) - 1:
                self._layer_done = []
