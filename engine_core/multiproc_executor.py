"""The multiprocess executor: one worker process per rank on this host.

Start-up. The executor creates the broadcast ring (shared memory, one writer, one reader per
rank) and spawns the workers (``tidal.worker.worker_proc.worker_main``), each with a duplex
``Pipe``. Rank 0 serves the torch.distributed rendezvous store on a free loopback port (port 0:
the kernel picks it, so engines never collide) and reports the port on its pipe; the executor
passes it to the other ranks. Each rank then joins the process groups, loads its shard, creates
its own reply ring and sends back its handle (`WorkerReady`). Start-up messages are msgspec
bytes on the pipe (``send_bytes``): nothing is pickled.

Steps. ``execute_model`` encodes the scheduler output once and enqueues it on the broadcast
ring: every rank reads the same bytes. Only the output rank (first tensor-parallel rank of the
last pipeline stage) replies; control requests (KV sizing, compile counts) are answered by
every rank. With ``non_block`` the call returns at once and ``result()`` collects the reply
later: the EngineCore keeps up to ``max_concurrent_batches`` steps in flight (the pipeline
depth). With async scheduling the output rank replies to step N only once it has launched step
N+1, so its GPU never idles through a round trip to the EngineCore; ``result()`` of the newest
step sends `FlushStep` for the held reply when no next step is coming.

Failure. A thread waits on the workers' process sentinels; the first worker to exit while the
executor is not shutting down marks the executor failed. Every wait on a reply wakes at least
every ``_POLL_S`` to check that mark, and the reply ring itself notices a dead output rank, so
a dead rank surfaces as `WorkerDiedError` (naming rank, pid, exit code and the worker's last
error, if it sent one) within a fraction of a second, from ``execute_model``, ``result()`` or
``check_health``. The EngineCore then fails its requests and calls `shutdown`, which closes the
ring (idle workers exit 0), then terminates and finally kills whatever is left (a rank stuck in
a collective with a dead peer never returns by itself). Workers watch the executor too: the
pipe is their death pipe (EOF: the EngineCore is gone), and the ring reports a dead writer.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import numpy as np

from tidal.engine_core import envs
from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import CompileStats, GetCompileStats
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput
from tidal.engine_core.serial import Decoder, Encoder
from tidal.worker.shm_broadcast import (
    RingClosed,
    RingError,
    RingHandle,
    RingReaderDied,
    RingWriterDied,
    ShmRingReader,
    ShmRingWriter,
    unlink_ring,
)
from tidal.worker.worker_proc import (
    Done,
    ExecuteModel,
    Failed,
    FinishSample,
    FlushStep,
    GetNumBlocks,
    InitKVCache,
    NumBlocks,
    Profile,
    ProfileSummary,
    StartupFailed,
    StartupMessage,
    StepResult,
    StoreAddress,
    WorkerArgs,
    WorkerReady,
    WorkerReply,
    WorkerRequest,
    spin_seconds,
    worker_main,
)

logger = logging.getLogger(__name__)

# Broadcast ring: a scheduler output is a few KB for decode steps; a big prefill batch can take
# the overflow path (order is kept). 8 slots bound how far the executor runs ahead of a rank.
BROADCAST_SLOT_BYTES = 1 << 20
BROADCAST_SLOTS = 8
# How often a wait for a reply wakes to look for dead ranks (the ring's own liveness check
# covers the rank being waited on).
_POLL_S = 0.1
# Shutdown: time for workers to leave by themselves once the ring is closed, then after SIGTERM.
_EXIT_GRACE_S = 5.0
_TERM_GRACE_S = 2.0


# How long a worker's failure waits to see whether a peer killed by a signal caused it (a
# collective that lost its peer fails at once; the death reaches the watcher a moment later).
_PEER_DEATH_GRACE_S = 0.5


class WorkerError(RuntimeError):
    """A worker failed: it raised (and said why) or its process died."""


class WorkerDiedError(WorkerError):
    """A worker process exited while the engine was running."""


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: BaseProcess
    conn: Connection
    pid: int = 0
    reply: ShmRingReader | None = None
    reply_handle: RingHandle | None = None
    last_error: str | None = None  # what the worker reported before it died, if anything

    def describe(self) -> str:
        return f"worker rank {self.rank} (pid {self.pid or self.proc.pid})"


class _PendingStep:
    __slots__ = ("_executor", "_seq")

    def __init__(self, executor: MultiprocExecutor, seq: int) -> None:
        self._executor = executor
        self._seq = seq

    def result(self) -> ModelRunnerOutput:
        return self._executor._collect_step(self._seq)


class MultiprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        par = config.parallel
        self.config = config
        self.world_size = par.world_size
        self.tp_size = par.tensor_parallel_size
        self.pp_size = par.pipeline_parallel_size
        self.max_concurrent_batches = config.max_concurrent_batches
        self.output_rank = par.output_rank
        self._encoder = Encoder()
        self._decoder: Decoder[WorkerReply] = Decoder(WorkerReply)
        self._ranks: list[_Rank] = []
        self._ring: ShmRingWriter | None = None
        self._closing = False
        self._closed = False
        self._failure: WorkerError | None = None
        self._dead: list[_Rank] = []
        self._lock = threading.Lock()
        self._sent = 0  # model steps broadcast so far
        self._received = 0  # model step replies read so far
        # The output rank holds each step's reply until the next step is launched (async
        # scheduling keeps one step queued ahead): ``_flushed`` is ``_sent`` as of the last
        # `FlushStep`, which asks for a held reply when no newer step is coming.
        self._defer = config.scheduler.async_scheduling
        self._flushed = 0
        self._results: dict[int, ModelRunnerOutput] = {}
        start = time.perf_counter()
        atexit.register(self.shutdown)
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._monitor = threading.Thread(target=self._watch_workers, name="worker-monitor",
                                         daemon=True)
        self._monitor.start()
        logger.info("%d worker process(es) ready in %.2f s (tp=%d, pp=%d)", self.world_size,
                    time.perf_counter() - start, self.tp_size, self.pp_size)

    # --- start-up -----------------------------------------------------------------------------

    def _start_workers(self) -> None:
        cfg = self.config
        self._ring = ShmRingWriter.create(self.world_size, BROADCAST_SLOT_BYTES, BROADCAST_SLOTS)
        ctx = multiprocessing.get_context("spawn")
        env = {}
        if envs.gloo_socket_ifname() is None:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # one host: gloo's CPU groups stay on loopback
        for rank in range(self.world_size):
            args = WorkerArgs(config=cfg, rank=rank, local_rank=rank, store_host="127.0.0.1",
                              ring=self._ring.handle, env=env,
                              defer_step_replies=self._defer)
            parent, child = ctx.Pipe(duplex=True)
            # Daemonic: multiprocessing terminates it if this process exits without shutdown().
            proc = ctx.Process(target=worker_main, args=(msgspec.msgpack.encode(args), child),
                               name=f"TidalWorker-{rank}", daemon=True)
            proc.start()
            child.close()  # only the worker holds that end: its EOF is the death signal
            self._ranks.append(_Rank(rank, proc, parent, pid=proc.pid or 0))
        first = self._startup_message(self._ranks[0])
        if not isinstance(first, StoreAddress):
            raise WorkerError(f"{self._ranks[0].describe()}: unexpected start-up message "
                              f"{type(first).__name__}")
        for r in self._ranks[1:]:
            r.conn.send_bytes(msgspec.msgpack.encode(first))
        spin = spin_seconds(cfg)
        for r in self._ranks:
            msg = self._startup_message(r)
            if not isinstance(msg, WorkerReady) or msg.reply is None:
                raise WorkerError(f"{r.describe()}: unexpected start-up message "
                                  f"{type(msg).__name__}")
            r.pid = msg.pid
            r.reply_handle = msg.reply
            r.reply = ShmRingReader.attach(msg.reply, 0, f"executor<-rank{r.rank}", spin_s=spin)

    def _startup_message(self, r: _Rank) -> StartupMessage:
        """The next start-up message of ``r``, watching every worker: one that dies first (a
        rank that cannot load its shard, say) fails the start-up at once, with its reason."""
        sentinels = {x.proc.sentinel: x for x in self._ranks}
        while True:
            ready = multiprocessing.connection.wait([r.conn, *sentinels])
            if r.conn in ready:
                try:
                    msg = msgspec.msgpack.decode(r.conn.recv_bytes(), type=StartupMessage)
                except EOFError:
                    msg = None
                if isinstance(msg, StartupFailed):
                    raise WorkerError(f"{r.describe()} failed to start: {msg.error}")
                if msg is not None:
                    return msg
            for s in ready:
                if s in sentinels:
                    dead = sentinels[s]
                    dead.proc.join(1.0)
                    reason = self._startup_error(dead)
                    raise WorkerDiedError(f"{dead.describe()} exited during start-up with code "
                                          f"{dead.proc.exitcode}" + (f": {reason}" if reason
                                                                     else ""))

    @staticmethod
    def _startup_error(r: _Rank) -> str | None:
        try:
            while r.conn.poll(0):
                msg = msgspec.msgpack.decode(r.conn.recv_bytes(), type=StartupMessage)
                if isinstance(msg, StartupFailed):
                    return msg.error
        except (EOFError, OSError, msgspec.DecodeError):
            pass
        return None

    # --- the Executor interface ---------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        self._broadcast(GetNumBlocks())
        counts = [self._expect(r, NumBlocks).num_blocks for r in self._ranks]
        logger.info("KV blocks per rank: %s; using %d", counts, min(counts))
        return min(counts)

    def init_kv_cache(self, num_blocks: int) -> None:
        self._broadcast(InitKVCache(num_blocks))
        for r in self._ranks:
            self._expect(r, Done)

    def execute_model(self, so: SchedulerOutput, non_block: bool = False,
                      defer_sample: bool = False) -> Any:
        self._broadcast(ExecuteModel(so, defer_sample))
        self._sent += 1
        pending = _PendingStep(self, self._sent - 1)
        return pending if non_block else pending.result()

    @property
    def supports_deferred_sample(self) -> bool:
        """Grammar masks filled while the step runs, sent on the ring behind it
        (`FinishSample`): the ranks compute the logits, then wait for them. Not with pipeline
        stages (the last stage samples on tensors the others send it)."""
        return self.pp_size == 1

    def finish_sample(self, pending: _PendingStep, grammar_req_ids: list[str],
                      grammar_bitmask: np.ndarray | None) -> None:
        """Sample the step ``execute_model(..., defer_sample=True)`` launched, on every rank
        (its reply comes as any step's)."""
        self._broadcast(FinishSample(grammar_req_ids, grammar_bitmask))

    def grammar_buffer(self, rows: int) -> np.ndarray:
        """Host memory for the next ``finish_sample``'s masks (they travel on the ring)."""
        return np.empty((rows, (self.config.model.vocab_size + 31) // 32), dtype=np.int32)

    def check_health(self) -> None:
        self._raise_if_failed()
        for r in self._ranks:
            if not r.proc.is_alive():
                self._mark_dead([r])
        self._raise_if_failed()

    def compile_stats(self) -> CompileStats:
        """Triton JIT compiles of every rank, summed."""
        self._broadcast(GetCompileStats())
        total = CompileStats(ready=True)
        for r in self._ranks:
            total = total.merge(self._expect(r, CompileStats))
        return total

    def profile(self, start: bool, trace_dir: str = "") -> list[ProfileSummary]:
        """Start or stop the torch profiler on every rank (tools); stopping returns each rank's
        summary."""
        self._broadcast(Profile(start, trace_dir))
        if start:
            for r in self._ranks:
                self._expect(r, Done)
            return []
        return [self._expect(r, ProfileSummary) for r in self._ranks]

    @property
    def worker_pids(self) -> list[int]:
        return [r.pid for r in self._ranks]

    # --- messages -----------------------------------------------------------------------------

    def _broadcast(self, msg: WorkerRequest) -> None:
        self._raise_if_failed()
        if self._ring is None:
            raise WorkerError("the executor is shut down")
        frames = self._encoder.encode(msg)
        while True:
            try:
                # Bounded waits: a full ring (a rank far behind, or stuck in a collective with a
                # dead peer) must not hide a failure from us.
                self._ring.enqueue(frames, timeout=_POLL_S)
                return
            except TimeoutError:
                self._raise_if_failed()
            except RingReaderDied as exc:
                self._fail_from_ring(exc)

    def _collect_step(self, seq: int) -> ModelRunnerOutput:
        out = self._results.pop(seq, None)
        if out is None and self._defer and seq == self._sent - 1 and self._flushed < self._sent:
            # The newest step: its reply is held until a next step that is not coming yet.
            self._broadcast(FlushStep())
            self._flushed = self._sent
        while out is None:
            if seq < self._received:
                raise WorkerError(f"step {seq} was already collected")
            reply = self._next_reply(self._ranks[self.output_rank])
            if not isinstance(reply, StepResult):
                raise WorkerError(f"{self._ranks[self.output_rank].describe()}: expected a step "
                                  f"result, got {type(reply).__name__}")
            if self._received == seq:
                out = reply.output
            else:
                self._results[self._received] = reply.output
            self._received += 1
        return out

    def _expect(self, r: _Rank, kind: type) -> Any:
        reply = self._next_reply(r)
        while isinstance(reply, StepResult) and r.rank == self.output_rank:
            # A step launched before this request answered first: keep it for its collector.
            self._results[self._received] = reply.output
            self._received += 1
            reply = self._next_reply(r)
        if not isinstance(reply, kind):
            raise WorkerError(f"{r.describe()}: expected {kind.__name__}, got "
                              f"{type(reply).__name__}")
        return reply

    def _next_reply(self, r: _Rank) -> WorkerReply:
        assert r.reply is not None
        while True:
            self._raise_if_failed()
            try:
                # copy=True: decoded arrays (logprobs) must outlive the ring slot.
                frames = r.reply.dequeue(timeout=_POLL_S, copy=True)
            except TimeoutError:
                continue
            except (RingWriterDied, RingClosed) as exc:
                r.proc.join(1.0)  # the worker is exiting: give it a moment to report its code
                self._mark_dead([r])
                self._raise_if_failed()
                raise WorkerDiedError(f"{r.describe()}: {exc}") from exc  # (not reached)
            reply = self._decoder.decode(frames)
            if isinstance(reply, Failed):
                r.last_error = reply.error
                # A peer killed by a signal fails the collectives of every survivor, often
                # before the watcher has seen that death: the killed peer, the cause, is what
                # to report. (A peer that exits with an error of its own failed alongside.)
                killed = self._peers_killed(r)
                if killed:
                    self._mark_dead(killed)
                else:
                    # This rank's own error is the one to report, also when the watcher, during
                    # the grace, saw a peer exit that failed alongside it.
                    with self._lock:
                        self._failure = WorkerError(f"{r.describe()} failed: {reply.error}")
                self._raise_if_failed()
            return reply

    def _peers_killed(self, failed: _Rank) -> list[_Rank]:
        """The other ranks whose processes end by a signal within a short grace."""
        sentinels = {x.proc.sentinel: x for x in self._ranks if x is not failed}
        if not sentinels:
            return []
        ready = multiprocessing.connection.wait(list(sentinels), timeout=_PEER_DEATH_GRACE_S)
        killed = []
        for s in ready:
            peer = sentinels[s]
            peer.proc.join(0.5)  # its sentinel fires a moment before its exit code can be read
            if peer.proc.exitcode is not None and peer.proc.exitcode < 0:
                killed.append(peer)
        return killed

    # --- failure ------------------------------------------------------------------------------

    def _watch_workers(self) -> None:
        sentinels = {r.proc.sentinel: r for r in self._ranks}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        self._mark_dead([sentinels[s] for s in ready])

    def _mark_dead(self, ranks: list[_Rank]) -> None:
        with self._lock:
            new = [r for r in ranks if r not in self._dead]
            self._dead.extend(new)
        for r in new:
            r.proc.join(0.5)  # its sentinel fires a moment before its exit code can be read
            logger.error("%s died (exit code %s)", r.describe(), r.proc.exitcode)
        if new:
            r = new[0]
            self._set_failure(WorkerDiedError(
                f"{r.describe()} died with exit code {r.proc.exitcode}"))

    def _set_failure(self, err: WorkerError) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = err

    def _raise_if_failed(self) -> None:
        err = self._failure
        if err is None:
            return
        # Add what the dead ranks said before dying (read here: rings are single-threaded).
        if isinstance(err, WorkerDiedError):
            for r in list(self._dead):
                if r.last_error is None:
                    r.last_error = self._last_words(r)
            said = [f"{r.describe()}: {r.last_error}" for r in self._dead if r.last_error]
            if said:
                err = WorkerDiedError(f"{err}; {'; '.join(said)}")
        raise err

    def _last_words(self, r: _Rank) -> str | None:
        if r.reply is None:
            return None
        try:
            while True:
                reply = self._decoder.decode(r.reply.dequeue(timeout=0, copy=True))
                if isinstance(reply, Failed):
                    return reply.error
        except (TimeoutError, RingError, ValueError):
            return None

    def _fail_from_ring(self, exc: RingReaderDied) -> None:
        dead = [r for r in self._ranks if not r.proc.is_alive()]
        for r in dead:
            r.proc.join(0.5)
        self._mark_dead(dead or list(self._ranks))
        self._raise_if_failed()

    # --- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._closing = True
        atexit.unregister(self.shutdown)
        ring, self._ring = self._ring, None
        if ring is not None:
            # Closing the ring is the shutdown request: a worker exits (status 0) once it has
            # read everything before it.
            ring.close()
        procs = [r.proc for r in self._ranks]
        grace = 0.5 if self._failure is not None else _EXIT_GRACE_S
        _join_all(procs, grace)
        alive = [p for p in procs if p.is_alive()]
        if alive:
            logger.warning("terminating %d worker(s) that did not exit: %s", len(alive),
                           [p.pid for p in alive])
            for p in alive:
                p.terminate()
            _join_all(alive, _TERM_GRACE_S)
        for p in procs:
            if p.is_alive():
                logger.warning("killing worker pid %s", p.pid)
                p.kill()
                p.join(5.0)
        for r in self._ranks:
            if r.reply is not None:
                r.reply.close()
                r.reply = None
            if r.reply_handle is not None:
                unlink_ring(r.reply_handle)  # the segment of a worker that could not close it
            r.conn.close()
        codes = {r.rank: r.proc.exitcode for r in self._ranks}
        logger.info("workers stopped (exit codes by rank: %s)", codes)


def _join_all(procs: list[BaseProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
