"""CUDA graphs for decode steps: capture the model's forward once per batch size, replay it.

A decode step of a small model is hundreds of tiny kernel launches; replaying a graph turns them
into one launch, so the GPU never waits for Python. Graphs are captured for batch sizes 1, 2, 4,
8, then every 8 up to 256 and every 16 beyond (up to the largest decode batch the scheduler can
form, capped at 512), largest first into one shared memory pool: each smaller graph reuses the
memory of the larger ones instead of adding its own. A decode batch runs the graph of the next
captured size, its extra rows padded (no context, no query, KV slot -1).

Graphs read their inputs from the runner's fixed device buffers (``StepBuffers``), which the
runner refreshes in place before each replay. Attention launches depend only on the request and
token counts (see ``ops.attention_plan``), so one graph serves every context length.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes to capture for decode batches of up to ``max_batch`` requests, ascending."""
    if max_batch < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, min(256, max_batch) + 1, 8))
    sizes += list(range(272, min(512, max_batch) + 1, 16))
    cap = min(512, max_batch)
    if sizes[-1] < cap:
        sizes.append(cap)  # so every decode batch the scheduler can form has a graph
    return sizes


class CudaGraphRunner:
    """Captured decode graphs, keyed by padded batch size."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def size_for(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of ``num_reqs`` runs at, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        if i == len(self.sizes):
            return None
        size = self.sizes[i]
        return size if size in self._graphs else None

    def capture(self, prepare: Callable[[int], None],
                forward: Callable[[int], torch.Tensor]) -> None:
        """Capture ``forward(size)`` (the model on the fixed buffers) for every size, largest
        first, into one memory pool. ``prepare(size)`` fills the buffers with a dummy decode
        batch first, outside the capture (writes inside it would be replayed too)."""
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            prepare(size)
            # Eager warm-up first: Triton compiles and cuBLAS heuristics must not run inside a
            # capture.
            forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(size)
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved() - reserved
        logger.info("captured %d CUDA graphs (decode batches %d..%d) in %.2f s, %.0f MiB",
                    len(self._graphs), self.sizes[0], self.sizes[-1], self.capture_seconds,
                    self.pool_bytes / 2**20)

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size``; returns its (static) output, ``size`` rows."""
        graph, out = self._graphs[size]
        graph.replay()
        return out
