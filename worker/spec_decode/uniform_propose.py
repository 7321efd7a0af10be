"""The common propose step, made from device tensors only, and its CUDA graphs.

In steady decoding with speculation every request brings the same number of rows to a
proposal: an EAGLE-3 head reads the target's verify step, ``k + 1`` rows per request; a draft
model is fed each request's newest ``k + 1`` tokens (the accepted drafts, the target's token,
and older ones it has seen already, rewritten with the same K/V). Such a step has a shape fixed
by the request count alone, so the whole proposal (first pass, then ``k - 1`` chain steps,
greedy) is captured once per padded request count and replayed: one launch instead of a few
hundred from Python, and no host work between the passes.

``UniformBuffers`` are the step's fixed inputs and outputs; ``propose_uniform`` (on the
proposer) computes positions, slots and sequence lengths on the device from them, eagerly or
under capture; ``ProposeGraphs`` captures and replays it. Steps of any other shape (a request's
first proposal, a prompt chunk, drafts cut short, sampled drafts) take the general path.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from tidal.worker.spec_decode.draft_proposer import _ChainProposer

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class UniformBuffers:
    """Fixed device tensors of uniform propose steps, ``max_reqs`` requests of ``q`` rows."""

    q: int
    ids: torch.Tensor  # int64 [max_reqs * q]: the rows' tokens (target vocabulary)
    pos_start: torch.Tensor  # int64 [max_reqs]: position of each request's first row
    last: torch.Tensor  # int64 [max_reqs]: the row (0 .. q - 1) whose output starts the chain
    valid: torch.Tensor  # bool [max_reqs]: padding requests write nothing
    table: torch.Tensor  # int32 [max_reqs, width]: block tables (scratch past own blocks)
    hidden: torch.Tensor | None  # EAGLE-3: the target's auxiliary hidden states buffer
    # Written by the step itself.
    qsl: torch.Tensor  # int32 [max_reqs + 1]: arange * q (fixed)
    qsl1: torch.Tensor  # int32 [max_reqs + 1]: arange (fixed, the chain's)
    offsets: torch.Tensor  # int64 [q]: arange (a row's place in its request)
    seq: torch.Tensor  # int32 [max_reqs]
    chain_seq: torch.Tensor  # int32 [max_reqs]
    slots: torch.Tensor  # int64 [max_reqs * q]
    chain_slots: torch.Tensor  # int64 [max_reqs]
    out: torch.Tensor  # int64 [max_reqs, k]: the drafts

    @classmethod
    def allocate(cls, max_reqs: int, q: int, k: int, width: int, device: torch.device,
                 hidden: torch.Tensor | None) -> UniformBuffers:
        def i64(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        arange = torch.arange(max_reqs + 1, dtype=torch.int32, device=device)
        return cls(
            q=q, ids=i64(max_reqs * q), pos_start=i64(max_reqs), last=i64(max_reqs),
            valid=torch.zeros(max_reqs, dtype=torch.bool, device=device),
            table=torch.zeros(max_reqs, width, dtype=torch.int32, device=device),
            hidden=hidden, qsl=arange * q, qsl1=arange,
            offsets=torch.arange(q, dtype=torch.int64, device=device),
            seq=torch.zeros(max_reqs, dtype=torch.int32, device=device),
            chain_seq=torch.zeros(max_reqs, dtype=torch.int32, device=device),
            slots=i64(max_reqs * q), chain_slots=i64(max_reqs), out=i64(max_reqs, k))

    @property
    def max_reqs(self) -> int:
        return self.pos_start.shape[0]


@dataclass(slots=True)
class UniformHost:
    """Host copies of an eager uniform step's inputs (every request real: no padding), for
    attention backends that plan on the host (the torch one); a captured step has none."""

    pos_start: np.ndarray  # int64 [n]
    last: np.ndarray  # int64 [n]


class ProposeGraphs:
    """Uniform propose steps captured per padded request count."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(sizes)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0

    def size_for(self, num_reqs: int) -> int | None:
        i = bisect.bisect_left(self.sizes, num_reqs)
        if i == len(self.sizes) or self.sizes[i] not in self._graphs:
            return None
        return self.sizes[i]

    def capture(self, proposer: _ChainProposer, bufs: UniformBuffers) -> None:
        """Capture ``proposer.propose_uniform`` for every size, largest first, into one pool.
        Every request is padding during capture (nothing is written to the cache)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        bufs.valid.fill_(False)
        bufs.pos_start.zero_()
        bufs.last.fill_(bufs.q - 1)
        for size in reversed(self.sizes):
            proposer.propose_uniform(bufs, size)  # compiles and heuristics outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                proposer.propose_uniform(bufs, size)
            graph.replay()
            self._graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d propose graphs (requests %d..%d, %d rows each) in %.2f s",
                    len(self._graphs), self.sizes[0], self.sizes[-1], bufs.q,
                    self.capture_seconds)

    def replay(self, size: int) -> None:
        self._graphs[size].replay()
