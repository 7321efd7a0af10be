"""A thread for the grammar backends' mask fills, so the engine thread goes on while one runs.

The backends fill a batch of masks in one native call that releases the GIL (llguidance's
executor, xgrammar's batch matcher: each with its own worker threads). Run on the engine's
thread, that call is host time on every constrained step; run here, it overlaps what the engine
thread does next (the previous step's output processing, the next step's scheduling) and the
step's sampling waits only for what is left of it.

Handing over is explicit: ``submit`` waits until this thread has started the job. A thread
merely woken would otherwise wait for the engine thread to give up the GIL, which a busy Python
thread does only every ``sys.getswitchinterval()`` (5 ms by default). The job itself needs the
GIL back after each native call (between advancing the matchers and filling their masks, and
to say it is done) while the engine thread runs Python, so the first fill thread lowers the
switch interval of the process ($TIDAL_GRAMMAR_SWITCH_INTERVAL_US).
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
    __slots__ = ("fn", "args", "started", "done", "error", "seconds")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn = fn
        self.args = args
        self.started = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.seconds = 0.0

    def run(self) -> None:
        self.started.set()
        start = time.perf_counter()
        try:
            self.fn(*self.args)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the engine thread by wait()
            self.error = exc
        self.seconds = time.perf_counter() - start
        self.done.set()

    def wait(self) -> float:
        """Block until the job ran; re-raises its error. Returns its run time (seconds)."""
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.seconds


class FillThread:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[FillJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> FillJob:
        """Run ``fn(*args)`` on the fill thread; returns once it has started."""
        if self._thread is None or not self._thread.is_alive():
            _lower_switch_interval()
            self._thread = threading.Thread(target=self._loop, name="tidal-mask-fill",
                                            daemon=True)
            self._thread.start()
        job = FillJob(fn, args)
        self._jobs.put(job)
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
