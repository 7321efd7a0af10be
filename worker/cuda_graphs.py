"""CUDA graphs for decode steps and mixed steps: capture the model's forward once per batch
size, replay it.

A decode step of a small model is hundreds of tiny kernel launches; replaying a graph turns them
into one launch, so the GPU never waits for Python. Graphs are captured for batch sizes 1, 2, 4,
8, then every 8 up to 256 and every 16 beyond (up to the largest decode batch the scheduler can
form, capped at 512), largest first into one shared memory pool: each smaller graph reuses the
memory of the larger ones instead of adding its own. A decode batch runs the graph of the next
captured size, its extra rows padded (no context, no query, KV slot -1).

Mixed steps (prompt tokens, with or without decodes) are captured per token count
(``mixed_capture_sizes``) with as many request slots as the count allows (at most the batch's
request limit): the Triton attention launch of a mixed batch depends only on the token and
request counts once the longest query fills a tile (``ops.attention_plan``), so a step of any
split of its tokens into requests replays the graph of the next captured count. Without them an
arrival's prefill step runs eagerly: hundreds of launches from Python. For a 0.6B model on an
H100 such a step took 6.5 ms median and up to 35 ms, against 2 ms for a decode step, and these
steps were the inter-token-latency tail under Poisson arrivals (tools/results/README.md).

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


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts to capture for mixed steps of up to ``max_tokens`` tokens, ascending: 8, 16,
    32, then every 64 up to 256, every 128 up to 1024, every 256 beyond. Padding adds fewer
    tokens than that step, so the padded rows' matmul work stays small next to the step's
    attention and launch savings. The small sizes are for speculative verify steps (k + 1
    tokens a request): on an H200, Llama-3.1-8B's layer matmuls took 118 us at 4 or 8 rows
    against 125 us at 64 (tools/bench_small_m_gemm.py), 0.2 ms a step over 32 layers."""
    if max_tokens < 1:
        return []
    sizes = [s for s in (8, 16, 32) if s < max_tokens]
    sizes += [s for s in range(64, 257, 64) if s <= max_tokens]
    sizes += [s for s in range(384, 1025, 128) if s <= max_tokens]
    sizes += list(range(1280, max_tokens + 1, 256))
    if not sizes or sizes[-1] < max_tokens:
        sizes.append(max_tokens)
    return sizes


class CudaGraphRunner:
    """Captured decode graphs, keyed by padded batch size, and mixed-step graphs, keyed by
    padded token count."""

    def __init__(self, sizes: list[int], mixed_sizes: list[int] | None = None) -> None:
        self.sizes = sorted(sizes)
        self.mixed_sizes = sorted(mixed_sizes or [])
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._mixed: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        self.mixed_replays = 0  # mixed steps replayed (a counter for tests and benches)

    def __len__(self) -> int:
        return len(self._graphs) + len(self._mixed)

    def mixed_size_for(self, num_tokens: int) -> int | None:
        """The captured token count a mixed step of ``num_tokens`` runs at, or None (eager)."""
        i = bisect.bisect_left(self.mixed_sizes, num_tokens)
        if i == len(self.mixed_sizes):
            return None
        size = self.mixed_sizes[i]
        return size if size in self._mixed else None

    def size_for(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of ``num_reqs`` runs at, or None (run eagerly)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        if i == len(self.sizes):
            return None
        size = self.sizes[i]
        return size if size in self._graphs else None

    def capture(self, prepare: Callable[[int], None],
                forward: Callable[[int], torch.Tensor],
                prepare_mixed: Callable[[int], None] | None = None,
                forward_mixed: Callable[[int], torch.Tensor] | None = None) -> None:
        """Capture ``forward(size)`` (the model on the fixed buffers) for every size, largest
        first, into one memory pool, and ``forward_mixed(tokens)`` for every mixed size (before
        the decode sizes: they are the larger). ``prepare(size)`` / ``prepare_mixed(tokens)``
        fill the buffers with a dummy batch first, outside the capture (writes inside it would
        be replayed too)."""
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        pool = torch.cuda.graph_pool_handle()
        plan = [(self._graphs, prepare, forward, size) for size in reversed(self.sizes)]
        if prepare_mixed is not None and forward_mixed is not None:
            plan = [(self._mixed, prepare_mixed, forward_mixed, size)
                    for size in reversed(self.mixed_sizes)] + plan
        for table, prep, fwd, size in plan:
            prep(size)
            # Eager warm-up first: Triton compiles and cuBLAS heuristics must not run inside a
            # capture.
            fwd(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fwd(size)
            # A graph's first launch also uploads it to the device: pay that here, not in the
            # first request that needs the size. The dummy batch writes no KV (slots -1).
            graph.replay()
            table[size] = (graph, out)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        self.pool_bytes = torch.cuda.memory_reserved() - reserved
        mixed = (f", mixed steps of {self.mixed_sizes[0]}..{self.mixed_sizes[-1]} tokens"
                 if self._mixed else ", mixed steps eager")
        logger.info("captured %d CUDA graphs (decode batches %d..%d%s) in %.2f s, %s",
                    len(self), self.sizes[0], self.sizes[-1], mixed, self.capture_seconds,
                    self.pool_size())

    def pool_size(self) -> str:
        """The graphs' pool for the start-up log. It is measured as the growth of reserved
        memory over the capture: after warm-up the allocator may hand cached blocks back
        meanwhile, and the growth can come out negative."""
        if self.pool_bytes < 0:
            return "pool size not measured"
        return f"{self.pool_bytes / 2**20:.0f} MiB"

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of ``size``; returns its (static) output, ``size`` rows."""
        graph, out = self._graphs[size]
        graph.replay()
        return out

    def replay_mixed(self, tokens: int) -> torch.Tensor:
        """Run the mixed-step graph of ``tokens``; returns its (static) output, ``tokens`` rows."""
        graph, out = self._mixed[tokens]
        graph.replay()
        self.mixed_replays += 1
        return out
