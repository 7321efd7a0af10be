"""A worker outside the EngineCore's process: the messages executors and workers exchange, the
code that turns one message into one reply (`WorkerProc`, shared by the multiprocess executor's
processes and the Ray executor's actors), and the worker process's main loop (`worker_main`).

Messages are msgspec structs in two tagged unions (`WorkerRequest` in, `WorkerReply` out),
encoded with ``engine_core.serial`` (numpy arrays travel as separate frames), never pickled.

Worker process life (multiprocess executor; spawned, one per rank):

1. start-up, over a ``Pipe`` to the executor (``send_bytes``/``recv_bytes`` of msgspec
   messages): rank 0 serves the rendezvous store on a free port and reports it
   (`StoreAddress`); the executor passes it to the other ranks; every rank joins the process
   groups, loads its shard of the model, creates its reply ring and answers `WorkerReady` (or
   `StartupFailed`);
2. the same pipe then becomes the *death pipe*: a thread blocks reading it, and when the
   executor's end closes without a shutdown (the EngineCore process died, even by ``kill -9``)
   the worker exits at once with status 1;
3. the loop: dequeue the next request from the broadcast ring (blocking, no CPU burnt while
   idle), decode, run, and write the reply, if any, to this worker's own reply ring. Only the
   output rank replies to a model step (with ``defer_step_replies``, a step later: after
   launching the next one, or on `FlushStep`); every rank replies to control requests. Any
   exception is reported as `Failed` and ends the process with status 1: the executor treats
   it as fatal.
   The ring closing (the executor shutting down) ends it with status 0.

The process stays in its parent's session and process group (no ``setsid``), so a terminal's
Ctrl-C or a group kill reaches it too; SIGINT itself is ignored (the EngineCore shuts workers
down in order).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import CompileStats, GetCompileStats
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput
from tidal.engine_core.serial import Decoder, Encoder
from tidal.worker.shm_broadcast import (
    RingClosed,
    RingHandle,
    RingWriterDied,
    ShmRingReader,
    ShmRingWriter,
    unlink_ring,
)

logger = logging.getLogger(__name__)

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)

# Reply rings: replies are small (one step's sampled tokens, logprobs); a bigger one takes the
# ring's overflow path. At most max_concurrent_batches replies are ever waiting.
REPLY_SLOT_BYTES = 256 << 10
REPLY_SLOTS = 4
# How long a blocked ring endpoint spins before it sleeps. The CPU value is the ring's default
# (a 2-core box cannot afford more). On GPUs a decode step takes a few ms, and a wake-up from
# sleep costs ~0.1 ms per endpoint per step (several % of a TP decode step); spinning through a
# step's length costs a host core per waiting process only while requests run: an idle engine
# still sleeps after 20 ms.
SPIN_S_CPU = 5e-4
SPIN_S_GPU = 2e-2


def spin_seconds(config: EngineConfig) -> float:
    return SPIN_S_GPU if config.runner.device == "cuda" else SPIN_S_CPU


# --- executor -> workers -------------------------------------------------------------------


class ExecuteModel(msgspec.Struct, tag="step", **_WIRE):
    so: SchedulerOutput
    # A step that samples stops after its logits until `FinishSample` brings the grammar
    # masks the EngineCore fills meanwhile (no pipeline stages).
    defer_sample: bool = False


class FinishSample(msgspec.Struct, tag="sample", **_WIRE):
    """Sample the step launched with ``defer_sample`` under these masks (every rank samples;
    a no-op for a step that had nothing to sample)."""

    grammar_req_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None


class GetNumBlocks(msgspec.Struct, tag="blocks", **_WIRE):
    """Every rank answers `NumBlocks`; the executor takes the smallest."""


class InitKVCache(msgspec.Struct, tag="kv", **_WIRE):
    num_blocks: int


class Profile(msgspec.Struct, tag="profile", **_WIRE):
    """Start (``start``) or stop the torch profiler on every rank; stopping answers a
    `ProfileSummary` and, if ``trace_dir`` is set, writes rank-named Chrome traces there."""

    start: bool
    trace_dir: str = ""


class FlushStep(msgspec.Struct, tag="flush", **_WIRE):
    """Reply now with the held output of the last step (see ``WorkerArgs.defer_step_replies``):
    the executor wants it and has no newer step to send."""


# `GetCompileStats` (the control call's own struct): every rank answers `CompileStats`.
WorkerRequest = (ExecuteModel | FinishSample | GetNumBlocks | InitKVCache | Profile | FlushStep
                 | GetCompileStats)


# --- workers -> executor -------------------------------------------------------------------


class StepResult(msgspec.Struct, tag="out", **_WIRE):
    output: ModelRunnerOutput


class NumBlocks(msgspec.Struct, tag="blocks", **_WIRE):
    num_blocks: int


class Done(msgspec.Struct, tag="ok", **_WIRE):
    pass


class ProfileSummary(msgspec.Struct, tag="profile", **_WIRE):
    rank: int
    device_us: float = 0.0  # total time of device kernels
    comm_us: float = 0.0  # of which collective-communication kernels (NCCL, gloo)
    cpu_comm_us: float = 0.0  # host time inside torch.distributed calls
    top: list[tuple[str, float, int]] = []  # (kernel, total us, calls), most expensive first


class Failed(msgspec.Struct, tag="failed", **_WIRE):
    error: str


WorkerReply = StepResult | NumBlocks | Done | ProfileSummary | Failed | CompileStats


# --- start-up (pipe) -----------------------------------------------------------------------


class WorkerArgs(msgspec.Struct, **_WIRE):
    config: EngineConfig
    rank: int
    local_rank: int
    store_host: str  # where rank 0 serves the rendezvous store
    ring: RingHandle | None = None  # the broadcast ring (multiprocess executor only)
    # The output rank answers step N only after it has launched step N+1 (or on `FlushStep`).
    # Waiting for step N's tokens before reading the next request would leave the GPU idle
    # for a whole round trip through the EngineCore every step (0.3 ms of a 2.9 ms TP=2
    # decode step, measured): with async scheduling step N+1 is already on the ring by then.
    defer_step_replies: bool = False
    # Set before anything touches a device (Ray: which GPUs this actor sees).
    env: dict[str, str] = {}


class StoreAddress(msgspec.Struct, tag="store", **_WIRE):
    port: int


class WorkerReady(msgspec.Struct, tag="ready", **_WIRE):
    pid: int
    reply: RingHandle | None = None


class StartupFailed(msgspec.Struct, tag="failed", **_WIRE):
    error: str


StartupMessage = StoreAddress | WorkerReady | StartupFailed


def format_exception(exc: BaseException) -> str:
    """The exception and where it was raised, short enough for a log line of the engine."""
    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    where = "; ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames)
    return f"{type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


# --- the worker ----------------------------------------------------------------------------


def _is_sample_later(out: Any) -> bool:
    from tidal.worker.model_runner import SampleLater

    return isinstance(out, SampleLater)


def _step_result(out: Any) -> StepResult:
    """The reply for a step's output (a ``ModelRunnerOutput``, or a pending one whose
    ``get_output()`` waits for the device)."""
    get = getattr(out, "get_output", None)
    return StepResult(get() if get is not None else out)


class WorkerProc:
    """One rank's worker and what it does with each request. Used by the worker process loop
    below and by the Ray actor; knows nothing of how messages arrive."""

    def __init__(self, args: WorkerArgs, port: int, store: Any = None) -> None:
        import torch

        from tidal.worker.distributed.hetero_groups import gpu_index, is_mixed, stage_config
        from tidal.worker.distributed.parallel_state import init_distributed
        from tidal.worker.worker import Worker

        self.args = args
        # (--pp-devices: this rank's stage device in place of the engine's)
        config = stage_config(args.config, args.rank)
        mixed = is_mixed(config)
        local_rank = gpu_index(config, args.rank) if mixed else args.local_rank
        self.rank = args.rank
        if config.runner.device == "cpu" and config.runner.cpu_threads is not None:
            torch.set_num_threads(config.runner.cpu_threads)  # before gloo and the model start
        device = (torch.device("cuda", local_rank) if config.runner.device == "cuda"
                  else torch.device("cpu"))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        start = time.perf_counter()
        par = config.parallel
        self.store = store  # rank 0 serves it: keep it alive with the process group
        tp, pp = init_distributed(rank=args.rank, tp_size=par.tensor_parallel_size,
                                  pp_size=par.pipeline_parallel_size, host=args.store_host,
                                  port=port, device=device, store=store,
                                  kernels=config.runner.kernels,
                                  cpu_collectives=par.cpu_collectives, mixed=mixed,
                                  tp_devices=par.tp_devices)
        logger.info("rank %d: process groups ready in %.2f s", self.rank,
                    time.perf_counter() - start)
        self.worker = Worker(config, args.rank, local_rank, tp, pp)
        self.worker.load_model()
        self._profiler: Any = None
        self._held: Any = None  # the last step's output, not yet sent (defer_step_replies)
        self._later: Any = None  # a step waiting for `FinishSample` (every rank)

    @property
    def is_output_rank(self) -> bool:
        return self.worker.is_output_rank

    def handle(self, msg: WorkerRequest) -> WorkerReply | None:
        match msg:
            case ExecuteModel(so=so, defer_sample=defer):
                out = self.worker.execute_model(so, defer_sample=defer)
                if defer and _is_sample_later(out):
                    # Sampled on `FinishSample`; the step before is due now (this one runs).
                    self._later = out
                    held, self._held = self._held, None
                    return None if held is None else _step_result(held)
                return self._deliver(out)
            case FinishSample(grammar_req_ids=ids, grammar_bitmask=mask):
                later, self._later = self._later, None
                if later is None:
                    return None
                out = self.worker.finish_sample(later, ids, mask)
                return self._deliver(out) if self.is_output_rank else None
            case FlushStep():
                held, self._held = self._held, None
                if held is not None:
                    return _step_result(held)
                # The executor waits for an answer from the output rank: say there is none.
                return Done() if self.is_output_rank else None
            case GetNumBlocks():
                return NumBlocks(int(self.worker.determine_num_blocks()))
            case InitKVCache(num_blocks=n):
                self.worker.init_kv_cache(n)  # allocates, captures graphs and warms up
                return Done()
            case GetCompileStats():
                return self.worker.compile_stats()
            case Profile(start=True):
                self._start_profile()
                return Done()
            case Profile(start=False, trace_dir=trace_dir):
                return self._stop_profile(trace_dir)
        raise TypeError(f"unexpected request {type(msg).__name__}")

    def _deliver(self, out: Any) -> WorkerReply | None:
        """The reply for a step's output now, or (``defer_step_replies``) the step before's,
        holding this one."""
        if out is None:
            return None
        if not self.args.defer_step_replies:
            return _step_result(out)
        held, self._held = self._held, out
        return None if held is None else _step_result(held)

    def _start_profile(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()

    def _stop_profile(self, trace_dir: str) -> ProfileSummary:
        import torch

        prof, self._profiler = self._profiler, None
        if prof is None:
            return ProfileSummary(self.rank)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, f"trace_rank{self.rank}.json"))
        summary = ProfileSummary(self.rank)
        kernels: list[tuple[str, float, int]] = []
        for ev in prof.key_averages():
            dev_us = float(getattr(ev, "self_device_time_total", 0.0) or 0.0)
            name = ev.key
            lname = name.lower()
            if dev_us > 0:
                kernels.append((name[:120], dev_us, int(ev.count)))
                summary.device_us += dev_us
                if "nccl" in lname or "allreduce" in lname or "all_reduce" in lname:
                    summary.comm_us += dev_us
            elif lname.startswith(("c10d::", "nccl:", "gloo:")):
                summary.cpu_comm_us += float(ev.self_cpu_time_total)
        kernels.sort(key=lambda k: -k[1])
        summary.top = kernels[:15]
        return summary

    def shutdown(self) -> None:
        from tidal.worker.distributed.parallel_state import destroy_distributed

        self.worker.shutdown()
        destroy_distributed(self.worker.tp, self.worker.pp)


# --- the worker process --------------------------------------------------------------------


def _setup_logging(rank: int) -> None:
    from tidal.engine_core import envs, stack_dump

    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s %(levelname)s Worker{rank}[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    stack_dump.install()


class _DeathPipe:
    """Watches the executor's end of the start-up pipe: EOF without a shutdown under way means
    the EngineCore process is gone, and this worker must not outlive it. Before leaving it
    removes the shared-memory segments nobody else will (``orphans``: this worker's reply ring,
    and on rank 0 the dead executor's broadcast ring)."""

    def __init__(self, conn: Connection, orphans: list[RingHandle]) -> None:
        self.conn = conn
        self.orphans = orphans
        self.stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._watch, name="death-pipe", daemon=True).start()

    def _watch(self) -> None:
        try:
            while True:
                self.conn.recv_bytes()  # nothing is sent after start-up; only EOF matters
        except (EOFError, OSError):
            pass
        if self.stopping.is_set():
            return
        logger.error("the EngineCore process is gone; worker exiting")
        for handle in self.orphans:
            try:
                unlink_ring(handle)
            except OSError:
                pass
        os._exit(1)


def worker_main(args_bytes: bytes, conn: Connection) -> None:
    """Entry point of a worker process (a ``multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = msgspec.msgpack.decode(args_bytes, type=WorkerArgs)
    _setup_logging(args.rank)
    for key, value in args.env.items():
        os.environ[key] = value
    encode = msgspec.msgpack.encode
    try:
        from tidal.engine_core.plugins import load_general_plugins

        load_general_plugins()  # a plugin's model family must be known here too
        store = None
        if args.rank == 0:
            from tidal.worker.distributed.parallel_state import serve_store

            store = serve_store(args.store_host)
            port = int(store.port)
            conn.send_bytes(encode(StoreAddress(port)))
        else:
            msg = msgspec.msgpack.decode(conn.recv_bytes(), type=StartupMessage)
            if not isinstance(msg, StoreAddress):
                raise RuntimeError(f"expected the store address, got {type(msg).__name__}")
            port = msg.port
        proc = WorkerProc(args, port, store)
        if args.ring is None:
            raise RuntimeError("a worker process needs the broadcast ring's handle")
        spin = spin_seconds(args.config)
        reply = ShmRingWriter.create(1, REPLY_SLOT_BYTES, REPLY_SLOTS)
        reader = ShmRingReader.attach(args.ring, args.rank, f"worker-rank{args.rank}", spin_s=spin)
        conn.send_bytes(encode(WorkerReady(os.getpid(), reply.handle)))
    except BaseException as exc:  # noqa: BLE001 - reported to the executor, then exit 1
        logger.exception("rank %d: start-up failed", args.rank)
        try:
            conn.send_bytes(encode(StartupFailed(format_exception(exc))))
        except OSError:
            pass
        os._exit(1)
    death = _DeathPipe(conn, [reply.handle] + ([args.ring] if args.rank == 0 else []))
    death.start()
    code = _serve(proc, reader, reply, args)
    death.stopping.set()
    if code == 0:
        try:
            proc.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway
            logger.exception("rank %d: shutdown failed", args.rank)
            code = 1
    reader.close()
    reply.close()
    logging.shutdown()
    # os._exit: no interpreter teardown (CUDA/NCCL destructors can hang once a peer is gone).
    os._exit(code)


def _serve(proc: WorkerProc, reader: ShmRingReader, reply: ShmRingWriter,
           args: WorkerArgs) -> int:
    """The request loop; returns the exit status."""
    decoder: Decoder[WorkerRequest] = Decoder(WorkerRequest)
    encoder = Encoder()
    rank = proc.rank
    while True:
        try:
            frames = reader.dequeue()
        except RingClosed:
            logger.info("rank %d: the executor closed the ring; exiting", rank)
            return 0
        except RingWriterDied as exc:
            logger.error("rank %d: %s; exiting", rank, exc)
            if rank == 0 and args.ring is not None:
                unlink_ring(args.ring)  # its writer cannot any more
            return 1
        try:
            msg = decoder.decode(frames)
            del frames  # views into the ring slot: released by the next dequeue
            out = proc.handle(msg)
            if out is not None:
                reply.enqueue(encoder.encode(out))
        except Exception as exc:  # noqa: BLE001 - fatal for the engine: report, then exit 1
            logger.exception("rank %d: request failed", rank)
            try:
                reply.enqueue(encoder.encode(Failed(format_exception(exc))), timeout=1.0)
            except Exception:  # noqa: BLE001 - the executor may be gone
                pass
            return 1
