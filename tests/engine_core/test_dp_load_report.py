"""A data-parallel rank's load report counts the requests that came during the step as waiting
(issue 26): they are not in the scheduler yet, and a report without them makes every API
server's coordinator read the rank lighter than it is all through a burst."""

from __future__ import annotations

import queue

from tidal.engine_core.core_proc import Broadcast, EngineCoreProc
from tidal.engine_core.protocol import EngineCoreOutputs, SchedulerStats


def _proc(dp: bool, received: int, taken: int) -> EngineCoreProc:
    """Just what ``_publish`` reads: no sockets, no engine."""
    proc = EngineCoreProc.__new__(EngineCoreProc)
    proc._outputs = queue.SimpleQueue()
    proc._owners = {}
    proc._unsent_stats = None
    proc._engine_index = 1
    proc._share_load = dp
    proc._load_sent = 0.0
    proc._adds_received = received
    proc._adds_taken = taken
    return proc


def _published(proc: EngineCoreProc, stats: SchedulerStats) -> list:
    proc._publish(EngineCoreOutputs(timestamp=10.0, scheduler_stats=stats, engine_index=1))
    out = []
    while True:
        try:
            out.append(proc._outputs.get_nowait())
        except queue.Empty:
            return out


def test_requests_received_during_the_step_count_as_waiting():
    proc = _proc(dp=True, received=12, taken=5)
    (msg,) = _published(proc, SchedulerStats(num_running=3, num_waiting=2))
    assert isinstance(msg, Broadcast)
    stats = msg.message.outputs.scheduler_stats
    assert (stats.num_waiting, stats.num_running) == (2 + 12 - 5, 3)
    # The step's stats (kept for the next output batch) say the same.
    assert proc._unsent_stats.num_waiting == 9


def test_one_engine_reports_its_scheduler_alone():
    proc = _proc(dp=False, received=12, taken=5)
    assert _published(proc, SchedulerStats(num_running=3, num_waiting=2)) == []
    assert proc._unsent_stats.num_waiting == 2
