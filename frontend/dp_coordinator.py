"""Which data-parallel rank serves a request: the least loaded, prefix-cache affinity on a tie.

Every API server has one ``DPCoordinator`` over all the ranks (``--data-parallel-size``); there
is no central process. A rank's load, as this frontend sees it, is the count of this frontend's
requests unfinished there (exact: counted at dispatch, uncounted at the last output or the
abort) plus the load of the other frontends there beyond what they put on the least loaded
rank, less a dead band (``OTHERS_DEAD_BAND`` requests, or half their mean load per rank if
more). The other frontends' load comes from the rank's reports (waiting, with the requests
received during the step, + running: the ``SchedulerStats`` that come with outputs, and that a
DP rank also sends to every frontend while busy, ``core_proc.LOAD_REPORT_INTERVAL_S``) less
this frontend's own count there.

Why not the reports alone (issue 26: DP=2 served 1.73x DP=1): during a burst a report is
stale by the step it closes (the requests that came during that step are not in it), and every
API server reacts to the same stale picture, so they all pile onto the rank that looked light.
A burst of 1000 requests over eight API servers split about 590/410; with 512 sequences a rank,
the heavier rank then runs a second, almost empty wave of ~80 requests for their whole output.
Each frontend balancing its own requests exactly splits any burst within one request per API
server. The reports still count where other frontends' load differs by more than the noise of
their timing (a frontend outside this server, or a persistent skew): the dead band. The ranks
report at different moments, so in a burst their counts of the others differ by what arrived
in between, which grows with the load: hence a band that grows with it too.

Requests are counted, not weighted (vLLM weighs a waiting request 4x a running one): in a burst
a rank that admitted its queue sooner looked lighter and took more than its half.

KV usage, in tenths, breaks ties of the load. Ranks still tied go by prefix-cache affinity: a
prompt of at least one KV block prefers the rank its first block (and cache salt) hashes to,
the same rank in every API server, so requests sharing a prefix meet its cached blocks; a
shorter prompt takes the tied ranks in turn.

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

# Other frontends' load on a rank counts only beyond this many requests (or half their mean load
# per rank) over their least loaded rank: below it the difference is the reports' timing (each
# frontend's own requests are split evenly already), and acting on it moves every API server
# the same way at once.
OTHERS_DEAD_BAND = 64
# KV usage breaks ties only when it differs by at least a tenth: finer differences are noise
# (one request's blocks) and would defeat prefix affinity.
_KV_STEPS = 10


@dataclass(slots=True)
class RankLoad:
    """One rank as this frontend sees it."""

    waiting: int = 0  # reported
    running: int = 0  # reported
    kv_usage: float = 0.0  # reported, 0..1
    others: int = 0  # other frontends' unfinished requests there, as of the latest report
    in_flight: int = 0  # this frontend's unfinished requests on the rank
    routed: int = 0  # requests this frontend sent there, ever


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
        ranks = self.ranks
        others = [r.others for r in ranks]
        floor = min(others) + max(OTHERS_DEAD_BAND, sum(others) // (2 * len(ranks)))
        scores = [(r.in_flight + max(0, r.others - floor), int(r.kv_usage * _KV_STEPS))
                  for r in ranks]
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
        """A rank's load report. What it counts beyond this frontend's unfinished requests there
        is the other frontends' (an undercount while ours are in transit, or finished there
        and not yet here: at least zero)."""
        load = self.ranks[rank]
        load.waiting = stats.num_waiting
        load.running = stats.num_running
        load.kv_usage = stats.kv_cache_usage
        load.others = max(0, stats.num_waiting + stats.num_running - load.in_flight)
