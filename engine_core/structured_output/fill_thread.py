"""A thread for the grammar backends' mask fills, so the engine thread goes on while one runs.

The backends fill a batch of masks in one native call that releases the GIL (llguidance's
executor, xgrammar's batch matcher: each with its own worker threads). Run on the engine's
thread, that call is host time on every constrained step; run here, it overlaps what the engine
thread does next (the previous step's output processing, the next step's scheduling) and the
step's sampling waits only for what is left of it.

A woken thread waits for the engine thread to give up the GIL, which a busy Python thread
does only every ``sys.getswitchinterval()`` (5 ms by default). The job needs the GIL to start
and again after each native call (between advancing the matchers and filling their masks, and
to say it is done) while the engine thread runs Python, so the first fill thread lowers the
switch interval of the process ($TIDAL_GRAMMAR_SWITCH_INTERVAL_US). With ``handoff``
($TIDAL_GRAMMAR_FILL_HANDOFF) ``submit`` also waits until this thread has started the job: the
job starts at once, but the engine thread pays two thread wake-ups for it.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from tidal.engine_core import envs

logger = logging.getLogger(__name__)


class FillJob:
    # (Bare locks, not Events: a job is made every step, and an Event is a Condition and a
    # lock, several times the cost to make, set and wait on.)
    __slots__ = ("fn", "args", "started", "_running", "error", "seconds")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...],
                 handoff: bool = False) -> None:
        self.fn = fn
        self.args = args
        self.started = threading.Event() if handoff else None
        self._running = threading.Lock()  # held until the job has run
        self._running.acquire()
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        if self.started is not None:
            self.started.set()
        start = time.perf_counter()
        try:
            self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the engine thread by wait()
            self.error = exc
        self.seconds = time.perf_counter() - start
        self._running.release()

    @property
    def done(self) -> bool:
        return not self._running.locked()

    def wait(self) -> float:
        """Block until the job ran; re-raises its error. Returns its run time (seconds)."""
        if self._running.locked():
            with self._running:  # (acquired once run() releases it)
                pass
        if self.error is not None:
            raise self.error
        return self.seconds


class FillThread:
    def __init__(self, handoff: bool | None = None) -> None:
        self._jobs: queue.SimpleQueue[FillJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.handoff = envs.grammar_fill_handoff() if handoff is None else handoff

    def submit(self, fn: Callable[..., Any], *args: Any) -> FillJob:
        """Run ``fn(*args)`` on the fill thread; with ``handoff``, returns once it started."""
        if self._thread is None or not self._thread.is_alive():
            _lower_switch_interval()
            self._thread = threading.Thread(target=self._loop, name="tidal-mask-fill",
                                            daemon=True)
            self._thread.start()
        job = FillJob(fn, args, self.handoff)
        self._jobs.put(job)
        if job.started is not None:
            job.started.wait()
        return job

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()

    def shutdown(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=5)
        self._thread = None


def _lower_switch_interval() -> None:
    # Measured on an H100 host (16 cores), batch 256 under a JSON schema: at the default 5 ms
    # the advance part of the job took 1.45 ms a step against 0.42-0.92 ms of native time: the
    # rest was the wait for the GIL, and the masks were late by as much. (Only ever lowered,
    # never put back: other threads of the process may rely on the lower value by then.)
    target = envs.grammar_switch_interval()
    current = sys.getswitchinterval()
    if 0 < target < current:
        sys.setswitchinterval(target)
        logger.debug("GIL switch interval %.0f us -> %.0f us (mask fill thread)",
                     current * 1e6, target * 1e6)
