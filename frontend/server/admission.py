"""Which requests the server takes on: draining, a dead engine, and the waiting-queue bound.

The waiting-queue length behind ``--max-queued-requests`` (429) is estimated in the server, not
read from the engine alone, because the engine's ``SchedulerStats.num_waiting`` lags: it comes
once per step, and misses requests accepted since. The estimate is the larger of

* the server's own count: sequences accepted but without a first token yet, less the free
  running slots (``max_num_seqs`` minus sequences already producing tokens); and
* the engine's latest ``num_waiting`` (only while sequences are in flight: an idle engine sends
  no stats, so its last report would go stale).

A lone request is never refused (the engine can always start it), so ``0`` means "no queue".

With several API server processes the counts live on an ``AdmissionBoard`` in shared memory:
each process writes its own row, and the estimate reads the sums, so the limit holds for the
server as a whole, not per process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.frontend.server.errors import APIError, engine_unavailable

logger = logging.getLogger(__name__)


class AdmissionBoard:
    """Admission counts shared by the API server processes of one server.

    Rows ``0..count-1``: (sequences pending a first token, sequences in flight, HTTP requests
    counted by ``GET /load``) of each process; row ``count``, column 0: the engine's latest
    ``num_waiting``. Each cell is written by one process at a time (its own row; the waiting
    count by whichever process got the report), and a read may mix rows from slightly different
    moments: fine for an estimate.
    """

    __slots__ = ("_cells", "_row")
    _COLUMNS = 3

    def __init__(self, cells: np.ndarray, index: int) -> None:
        self._cells = cells.reshape(-1, self._COLUMNS)
        self._row = self._cells[index]

    @staticmethod
    def allocate(count: int, ctx: Any) -> Any:
        """Shared memory for ``count`` processes (a ``multiprocessing`` ``RawArray``, which
        can be handed to spawned processes)."""
        return ctx.RawArray("q", AdmissionBoard._COLUMNS * (count + 1))

    @classmethod
    def attach(cls, raw: Any, index: int) -> AdmissionBoard:
        return cls(np.frombuffer(raw, dtype=np.int64), index)

    @classmethod
    def private(cls) -> AdmissionBoard:
        return cls(np.zeros(2 * cls._COLUMNS, dtype=np.int64), 0)

    def add_load(self, delta: int) -> None:
        self._row[2] += delta

    def load_total(self) -> int:
        """Requests counted by ``GET /load``, summed over the processes."""
        return int(self._cells[:-1, 2].sum())

    def publish(self, pending: int, active: int) -> None:
        row = self._row
        row[0] = pending
        row[1] = active

    def totals(self) -> tuple[int, int]:
        """(pending, active) summed over the processes."""
        sums = self._cells[:-1].sum(axis=0)
        return int(sums[0]), int(sums[1])

    @property
    def engine_waiting(self) -> int:
        return int(self._cells[-1, 0])

    @engine_waiting.setter
    def engine_waiting(self, value: int) -> None:
        self._cells[-1, 0] = value


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
    board: AdmissionBoard = field(default_factory=AdmissionBoard.private)
    draining: bool = False
    engine_dead: bool = False
    # A standalone engine-core gone for now (the client reconnects): set and cleared by the
    # server's engine watchdog, so a new stream gets its 503 before its 200 goes out.
    engine_unavailable: bool = False
    tickets: set[Ticket] = field(default_factory=set)
    _pending: int = 0
    _active: int = 0  # sequences in flight (pending or producing)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self.tickets)

    @property
    def engine_waiting(self) -> int:
        """The engine's latest ``SchedulerStats.num_waiting``."""
        return self.board.engine_waiting

    @engine_waiting.setter
    def engine_waiting(self, value: int) -> None:
        self.board.engine_waiting = value

    def waiting_estimate(self) -> int:
        return self._estimate(*self.board.totals())

    def _estimate(self, pending: int, active: int) -> int:
        if active == 0:
            return 0
        producing = active - pending
        free_slots = max(0, self.max_num_seqs - producing)
        return max(pending - free_slots, self.engine_waiting)

    def check_available(self) -> None:
        """Raise the 503 a new request gets while draining or after the engine died."""
        if self.engine_dead:
            raise APIError(503, "the engine has stopped; this server cannot take requests",
                           code="engine_dead")
        if self.engine_unavailable:
            raise engine_unavailable()
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry "
                           "against another replica", code="server_draining",
                           headers={"Connection": "close"})

    def admit(self, weight: int) -> Ticket:
        """Take a request of ``weight`` sequences, or raise 503 / 429."""
        self.check_available()
        if self.max_queued is not None:
            pending, active = self.board.totals()
            waiting = self._estimate(pending, active)
            if active > 0 and waiting + weight > self.max_queued:
                raise APIError(429, f"the server's queue is full ({waiting} requests waiting, "
                               f"limit {self.max_queued}); retry later with backoff",
                               code="queue_full", headers={"Retry-After": "1"})
        ticket = Ticket(weight=weight, pending=weight)
        self.tickets.add(ticket)
        self._pending += weight
        self._active += weight
        self.board.publish(self._pending, self._active)
        self._idle.clear()
        return ticket

    def started(self, ticket: Ticket, sequences: int) -> None:
        """``sequences`` of the ticket produced their first output."""
        n = min(sequences, ticket.pending)
        if n:
            ticket.pending -= n
            self._pending -= n
            self.board.publish(self._pending, self._active)

    def release(self, ticket: Ticket) -> None:
        if ticket not in self.tickets:
            return
        self.tickets.discard(ticket)
        self._pending -= ticket.pending
        self._active -= ticket.weight
        ticket.pending = 0
        self.board.publish(self._pending, self._active)
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
