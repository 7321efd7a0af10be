"""Which requests the server takes on: draining, a dead engine, and the waiting-queue bound.

The waiting-queue length behind ``--max-queued-requests`` (429) is estimated in the server, not
read from the engine alone, because the engine's ``SchedulerStats.num_waiting`` lags: it comes
once per step, and misses requests accepted since. The estimate is the larger of

* the server's own count: sequences accepted but without a first token yet, less the free
  running slots (``max_num_seqs`` minus sequences already producing tokens); and
* the engine's latest ``num_waiting`` (only while sequences are in flight: an idle engine sends
  no stats, so its last report would go stale).

A lone request is never refused (the engine can always start it), so ``0`` means "no queue".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from tidal.frontend.server.errors import APIError

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted API request: ``weight`` engine sequences, ``started`` once tokens flow."""

    weight: int
    pending: int  # sequences without a first output yet
    abort: Callable[[], None] | None = None  # ends the request early (drain timeout)


@dataclass(slots=True)
class Admission:
    max_num_seqs: int
    max_queued: int | None
    draining: bool = False
    engine_dead: bool = False
    engine_waiting: int = 0  # the latest SchedulerStats.num_waiting
    tickets: set[Ticket] = field(default_factory=set)
    _pending: int = 0
    _active: int = 0  # sequences in flight (pending or producing)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self.tickets)

    def waiting_estimate(self) -> int:
        if self._active == 0:
            return 0
        producing = self._active - self._pending
        free_slots = max(0, self.max_num_seqs - producing)
        return max(self._pending - free_slots, self.engine_waiting)

    def check_available(self) -> None:
        """Raise the 503 a new request gets while draining or after the engine died."""
        if self.engine_dead:
            raise APIError(503, "the engine has stopped; this server cannot take requests",
                           code="engine_dead")
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry "
                           "against another replica", code="server_draining",
                           headers={"Connection": "close"})

    def admit(self, weight: int) -> Ticket:
        """Take a request of ``weight`` sequences, or raise 503 / 429."""
        self.check_available()
        if self.max_queued is not None and self._active > 0:
            waiting = self.waiting_estimate()
            if waiting + weight > self.max_queued:
                raise APIError(429, f"the server's queue is full ({waiting} requests waiting, "
                               f"limit {self.max_queued}); retry later with backoff",
                               code="queue_full", headers={"Retry-After": "1"})
        ticket = Ticket(weight=weight, pending=weight)
        self.tickets.add(ticket)
        self._pending += weight
        self._active += weight
        self._idle.clear()
        return ticket

    def started(self, ticket: Ticket, sequences: int) -> None:
        """``sequences`` of the ticket produced their first output."""
        n = min(sequences, ticket.pending)
        ticket.pending -= n
        self._pending -= n

    def release(self, ticket: Ticket) -> None:
        if ticket not in self.tickets:
            return
        self.tickets.discard(ticket)
        self._pending -= ticket.pending
        self._active -= ticket.weight
        ticket.pending = 0
        if not self.tickets:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if ``timeout`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def abort_all(self) -> int:
        """End every in-flight request early (its clients see finish_reason "abort")."""
        n = 0
        for ticket in list(self.tickets):
            if ticket.abort is not None:
                ticket.abort()
                n += 1
        return n
