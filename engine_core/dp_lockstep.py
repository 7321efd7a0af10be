"""Data-parallel ranks that step in lockstep (``--data-parallel-lockstep``).

Expert parallelism needs every DP rank in every step: the experts' all-to-alls are collectives
over all ranks, so a rank without requests must still take part. Here the ranks' busy loops
move in *waves*:

* A wave starts when any rank gets work while all are idle: that rank sets the wave's key in
  the ranks' rendezvous store (a ``TCPStore`` on loopback, served by the process that started
  the ranks for as long as they live: frontend/dp_engines.py); a thread in
  every rank waits on that key and queues ``WaveStarted`` to its busy loop, which wakes up
  from its (blocking, CPU-free) wait for input.
* In a wave, every step begins with one small all-reduce (MAX over a gloo group of the ranks)
  of ``[has work, stopping]``. With work anywhere, every rank steps: a rank with requests runs
  a real step, one without runs an empty one (no batch: the place where expert parallelism's
  dummy forward goes), so all ranks count the same steps.
* When the all-reduce says nobody has work, all ranks leave the wave at the same step, the
  next wave's number agreed by construction, and block again: no busy loop while idle.
* A rank asked to stop (SIGTERM) says so in the all-reduce, and every rank leaves with it:
  none is left waiting in a collective for a rank that is gone. A rank that dies makes its
  peers' all-reduce fail, which fails their engines: the server ends, as for any engine death.
* A rank with no work of its own in a wave never touches its workers, so it checks their
  health at the idle loop's cadence; the wave watcher failing (the store gone) fails the
  engine too: a rank that can no longer hear of waves must not sit idle while its peers wait.

With experts split across the ranks (``--enable-expert-parallel``, worker/layers/moe_ep.py) every
step reaches every rank's workers: a rank whose step launched no forward (no work, or nothing
it could schedule) runs an empty one (``EngineCore.empty_forward``), whose MoE layers join the
exchange with zero tokens.

How each such forward runs is agreed just before it, in a second small all-reduce
(``agree_graph_batch``, from ``EngineCore.before_forward``): when every rank runs a decode
batch, all replay the CUDA graph of the size the largest of them pads to (the exchange of that
many rows per rank is captured inside: ``SchedulerOutput.dp_graph_batch``), a rank without
work on a dummy batch; when any rank runs prompt tokens (or none has a token), all run eagerly
and exchange their real token counts inside the forward. Both kinds of step meet the other
ranks' collectives of the same shapes. (An eager step of a large MoE model is tens of
milliseconds of Python: one lone request's decode on an H200 took 117 ms a token that way
against 1.8 ms in TP=2's graph.)

Not yet: the KV-connector polls of the plain busy loop.
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from tidal.engine_core.core import EngineCore
from tidal.engine_core.core_proc import (
    HEALTH_CHECK_INTERVAL_S,
    Broadcast,
    EngineCoreProc,
    Stop,
)
from tidal.engine_core.protocol import CoreOutputs, OutputBatch

logger = logging.getLogger(__name__)

# How long the ranks may take to meet at start-up (each loads its model first; a rank that
# dies meanwhile ends them all sooner: whoever started them watches their processes).
_RENDEZVOUS_S = 600.0
# A collective waits this long for the slowest rank's step; a rank that vanished fails it
# sooner (its connections close).
_COLLECTIVE_S = 1800.0
_WAVE_WAIT_S = 3600.0
# A forward's proposal in ``agree_graph_batch`` when it cannot replay a decode graph (prompt
# tokens, drafts): larger than any batch, so the MAX over the ranks says "eager".
_EAGER = 1 << 40


def graph_batch_proposal(sched: Any) -> int:
    """What a rank proposes for its forward ``sched`` (a ``SchedulerOutput``): its batch size
    when the step is a plain decode batch (one token a request, no drafts), 0 for an empty
    step (it replays the others' graph on a dummy batch), else ``_EAGER``."""
    n = len(sched.num_scheduled_tokens)
    if sched.total_num_scheduled_tokens == n and not sched.scheduled_spec_decode_tokens:
        return n
    return _EAGER


@dataclass(slots=True)
class WaveStarted:
    """A rank started wave ``wave`` (queued to every rank's busy loop)."""

    wave: int


def _wave_key(wave: int) -> str:
    return f"tidal/dp/wave/{wave}"


class DPGroup:
    """The ranks' gloo group, met through the store the launcher serves at ``port`` on
    loopback (every rank is on this host)."""

    def __init__(self, rank: int, size: int, port: int) -> None:
        import torch
        from torch.distributed import ProcessGroupGloo, TCPStore

        if not port:
            raise RuntimeError("data-parallel lockstep: no rendezvous store port (the ranks "
                               "are started by frontend/dp_engines.py, which serves it)")
        self.rank = rank
        self.size = size
        self.port = port
        timeout = datetime.timedelta(seconds=_RENDEZVOUS_S)
        self.store = TCPStore("127.0.0.1", port, size, False, timeout=timeout)
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=_COLLECTIVE_S)
        self.group = ProcessGroupGloo(self.store, rank, size, options)
        self._flags = torch.zeros(2, dtype=torch.int64)
        self._batch = torch.zeros(1, dtype=torch.int64)
        self._closed = False

    def start_wave(self, wave: int) -> None:
        self.store.set(_wave_key(wave), b"1")

    def wave_started(self, wave: int) -> bool:
        """Whether some rank started wave ``wave`` (False once the store's host, the
        launcher, is gone: then the ranks are being stopped anyway)."""
        try:
            return self.store.check([_wave_key(wave)])
        except Exception as exc:  # noqa: BLE001 - torch's DistNetworkError and kin
            logger.debug("the ranks' store is gone: %s", exc)
            return False

    def agree(self, has_work: bool, stopping: bool) -> tuple[bool, bool]:
        """(any rank has work, any rank is stopping): one all-reduce, every rank calls it."""
        import torch.distributed as dist

        flags = self._flags
        flags[0] = int(has_work)
        flags[1] = int(stopping)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([flags], options).wait()
        return bool(flags[0]), bool(flags[1])

    def agree_graph_batch(self, proposal: int) -> int:
        """The largest decode batch over the ranks when every rank proposed one or an empty
        step (a ``graph_batch_proposal``), else 0 (every rank runs the forward eagerly): one
        all-reduce, every rank calls it once per forward."""
        import torch.distributed as dist

        value = self._batch
        value[0] = proposal
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MAX
        self.group.allreduce([value], options).wait()
        agreed = int(value[0])
        return 0 if agreed >= _EAGER else agreed

    def watch_waves(self, inputs: queue.SimpleQueue[Any]) -> threading.Thread:
        """Queue ``WaveStarted`` for each wave some rank starts, in order, to ``inputs``."""
        thread = threading.Thread(target=self._watch, args=(inputs,), name="dp-waves",
                                  daemon=True)
        thread.start()
        return thread

    def _watch(self, inputs: queue.SimpleQueue[Any]) -> None:
        try:
            self._watch_waves(inputs)
        except Exception as exc:  # noqa: BLE001 - the store is gone, or a bug: fail loudly
            if self._closed:
                return
            logger.error("the data-parallel wave watcher failed: %s", exc)
            inputs.put(Stop(f"the data-parallel wave watcher failed (the ranks' store is "
                            f"unreachable): {type(exc).__name__}: {exc}", failed=True))

    def _watch_waves(self, inputs: queue.SimpleQueue[Any]) -> None:
        from torch.distributed import DistStoreError, TCPStore

        # A connection of its own: the busy loop uses the other one meanwhile.
        store = TCPStore("127.0.0.1", self.port, self.size, False,
                         timeout=datetime.timedelta(seconds=_WAVE_WAIT_S))
        wave = 0
        while not self._closed:
            try:
                store.wait([_wave_key(wave)], datetime.timedelta(seconds=_WAVE_WAIT_S))
            except DistStoreError:  # the wait timed out (a long idle spell): wait again
                continue
            inputs.put(WaveStarted(wave))
            wave += 1

    def close(self) -> None:
        self._closed = True


class LockstepEngineCoreProc(EngineCoreProc):
    """``EngineCoreProc`` whose busy loop steps in waves with the other DP ranks."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, handshake: zmq.Socket) -> None:
        super().__init__(core, ctx, handshake)
        parallel = core.config.parallel
        start = time.perf_counter()
        self.group = DPGroup(parallel.data_parallel_rank, parallel.data_parallel_size,
                             parallel.data_parallel_port)
        logger.info("start-up: joined the %d data-parallel ranks in lockstep (rank %d) in "
                    "%.2f s", parallel.data_parallel_size, parallel.data_parallel_rank,
                    time.perf_counter() - start)
        self.empty_steps = 0  # steps this rank took with no work of its own
        # Experts split across the ranks (worker/layers/moe_ep): every step reaches the workers,
        # which replay decode graphs only when every rank does, at the same size.
        self._expert_parallel = parallel.enable_expert_parallel
        if self._expert_parallel:
            core.before_forward = self._agree_forward

    def _agree_forward(self, sched: Any) -> None:
        sched.dp_graph_batch = self.group.agree_graph_batch(graph_batch_proposal(sched))

    def run(self) -> int:
        self.group.watch_waves(self._inputs)
        try:
            return super().run()
        finally:
            self.group.close()

    def _busy_loop(self) -> Stop:
        core = self.core
        inputs = self._inputs
        group = self.group
        wave = 0
        in_wave = False
        stop: Stop | None = None
        checked = time.monotonic()
        while True:
            if not in_wave:
                try:
                    item = inputs.get(timeout=HEALTH_CHECK_INTERVAL_S)
                except queue.Empty:
                    core.executor.check_health()  # idle: the way to notice a dead worker
                    continue
                if isinstance(item, WaveStarted):
                    in_wave = item.wave == wave  # (an older wave's news: already over)
                elif (stop := self._handle(item)) is not None:
                    if group.wave_started(wave):
                        # A peer began a wave this rank has not joined: it waits in the
                        # all-reduce, so leave together.
                        group.agree(False, True)
                    return stop
                if not in_wave and core.has_unfinished_requests():
                    group.start_wave(wave)
                    in_wave = True
                if not in_wave:
                    continue
            while stop is None:
                try:
                    item = inputs.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(item, WaveStarted):
                    stop = self._handle(item)
            has_work = core.has_unfinished_requests()
            any_work, stopping = group.agree(has_work, stop is not None)
            if stopping:
                # Every rank leaves here together, whichever was asked to stop.
                return stop or Stop("a data-parallel peer rank stopped")
            if not any_work:
                in_wave = False
                wave += 1
                self._report_idle()
                continue
            if has_work:
                launched = core.forwards
                self._publish(core.step())
                if self._expert_parallel and core.forwards == launched:
                    core.empty_forward()  # (nothing was scheduled: waiting on a grammar, say)
            else:
                self.empty_steps += 1
                if self._expert_parallel:
                    # Experts across ranks: the workers join this step's MoE exchange.
                    core.empty_forward()
                # An empty step never reaches the workers: look at them as the idle loop does.
                elif (now := time.monotonic()) - checked >= HEALTH_CHECK_INTERVAL_S:
                    checked = now
                    core.executor.check_health()
            self._steps += 1

    def _report_idle(self) -> None:
        """As the plain busy loop going idle: every frontend hears the gauges (KV usage no
        longer that of the last busy step), one of them the counters left unsent."""
        stats = self._with_unsent(self.core.scheduler.make_stats(0))
        now = time.monotonic()
        self._outputs.put(Broadcast(
            CoreOutputs(OutputBatch(timestamp=now, scheduler_stats=stats.gauges(),
                                    engine_index=self._engine_index)),
            counted=CoreOutputs(OutputBatch(timestamp=now, scheduler_stats=stats,
                                            engine_index=self._engine_index))))
