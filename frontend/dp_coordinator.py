"""Which data-parallel rank serves a request: the least loaded, prefix-cache affinity on a tie.

Every API server has one ``DPCoordinator`` over all the ranks (``--data-parallel-size``); there
is no central process. Its view of a rank's load is the rank's latest report (waiting, running,
KV usage: the ``SchedulerStats`` that come with outputs, and that a DP rank also sends to every
frontend while busy, ``core_proc.LOAD_REPORT_INTERVAL_S``) plus the requests this frontend sent
there since that report (the report cannot know them yet; without the count a burst between two
reports would all go to one rank).

The load of a rank is ``4 * (waiting + sent since the report) + running``: a waiting request
delays everything behind it, a running one only shares the steps (vLLM's weighting). KV usage,
in tenths, breaks ties of that. Ranks still tied go by prefix-cache affinity: a prompt of at
least one KV block prefers the rank its first block (and cache salt) hashes to, the same rank in
every API server, so requests sharing a prefix meet its cached blocks; a shorter prompt takes
the tied ranks in turn.

Aborts go to the rank that owns the request: the owner map holds each unfinished request's
rank until its last output or its abort.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field

import numpy as np

from tidal.engine_core.protocol import SchedulerStats

logger = logging.getLogger(__name__)

WAITING_WEIGHT = 4
# KV usage breaks ties only when it differs by at least a tenth: finer differences are noise
# (one request's blocks) and would defeat prefix affinity.
_KV_STEPS = 10


@dataclass(slots=True)
class RankLoad:
    """One rank as this frontend sees it."""

    waiting: int = 0  # reported
    running: int = 0  # reported
    kv_usage: float = 0.0  # reported, 0..1
    sent_since_report: int = 0  # requests this frontend sent after the latest report
    in_flight: int = 0  # this frontend's unfinished requests on the rank
    routed: int = 0  # requests this frontend sent there, ever

    def score(self) -> tuple[int, int]:
        return (WAITING_WEIGHT * (self.waiting + self.sent_since_report) + self.running,
                int(self.kv_usage * _KV_STEPS))


@dataclass(slots=True)
class DPCoordinator:
    size: int
    block_size: int
    ranks: list[RankLoad] = field(default_factory=list)
    owners: dict[str, int] = field(default_factory=dict)  # request id -> rank
    _turn: int = 0

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a DP coordinator needs at least one rank, got {self.size}")
        if not self.ranks:
            self.ranks = [RankLoad() for _ in range(self.size)]

    def preferred_rank(self, prompt_token_ids: list[int], cache_salt: str | None) -> int | None:
        """The rank the prompt's first KV block belongs to (None: shorter than a block).
        crc32, not ``hash``: every API server process must pick the same rank."""
        if len(prompt_token_ids) < self.block_size:
            return None
        key = np.asarray(prompt_token_ids[:self.block_size], dtype=np.int64).tobytes()
        if cache_salt:
            key += cache_salt.encode()
        return zlib.crc32(key) % self.size

    def pick(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> int:
        """The rank for a new request (does not record it: ``route`` does)."""
        scores = [r.score() for r in self.ranks]
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        if len(tied) == 1:
            return tied[0]
        preferred = self.preferred_rank(prompt_token_ids, cache_salt)
        if preferred is not None and preferred in tied:
            return preferred
        self._turn += 1
        return tied[self._turn % len(tied)]

    def route(self, request_id: str, prompt_token_ids: list[int],
              cache_salt: str | None = None) -> int:
        """Pick a rank for the request and count it there until it finishes."""
        rank = self.pick(prompt_token_ids, cache_salt)
        self.assign(request_id, rank)
        return rank

    def assign(self, request_id: str, rank: int) -> None:
        """Count the request on ``rank`` until it finishes (a sibling of one already routed:
        the children of an ``n > 1`` request share their prompt's blocks on one rank)."""
        self.owners[request_id] = rank
        load = self.ranks[rank]
        load.sent_since_report += 1
        load.in_flight += 1
        load.routed += 1

    def owner(self, request_id: str) -> int | None:
        return self.owners.get(request_id)

    def release(self, request_id: str) -> int | None:
        """The request finished or was aborted: forget it; returns the rank it was on."""
        rank = self.owners.pop(request_id, None)
        if rank is not None:
            load = self.ranks[rank]
            load.in_flight = max(0, load.in_flight - 1)
        return rank

    def report(self, rank: int, stats: SchedulerStats) -> None:
        """A rank's load report (it counts what this frontend had sent before it)."""
        load = self.ranks[rank]
        load.waiting = stats.num_waiting
        load.running = stats.num_running
        load.kv_usage = stats.kv_cache_usage
        load.sent_since_report = 0
