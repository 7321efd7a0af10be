"""The EngineCore process: an ``EngineCore`` behind ZeroMQ sockets, serving one or more frontends.

Threads
  * main: the busy loop. Between two steps it takes decoded inputs from a queue, then schedules,
    executes and updates once, and hands the outputs (Python objects) to the output thread. With
    nothing to run it blocks on that queue, waking once a second only to ask the executor whether
    its workers are alive: an idle engine uses no CPU to speak of.
  * input: owns the handshake socket and one DEALER per frontend; decodes every message off the
    busy loop's critical path and queues it.
  * output: owns one PUSH per frontend; encodes and sends outputs, and a ``Heartbeat`` to any
    frontend that got nothing for ``HEARTBEAT_INTERVAL_S``.

Sockets
  The engine binds one ROUTER, the handshake socket, at its listen address. A frontend binds its
  own ROUTER (input) and PULL (output), connects a DEALER to the handshake socket and sends
  ``Hello`` with those two addresses. The engine connects a DEALER (identity = the engine id) to
  the frontend's ROUTER and sends ``EngineRegister`` on it (until then the ROUTER cannot route to
  the engine), connects a PUSH to the frontend's PULL, and answers ``Ready`` with its identity,
  the frontend's client index and the resolved ``EngineConfig``. Every frontend has its own pair
  of connections, so each receives only its own outputs; request ids are namespaced by client
  index inside the engine, so two frontends may use the same ids.

Failure
  Any exception from the executor (a worker died) or the busy loop is fatal: the engine sends
  ``EngineDead(reason)`` to every frontend, shuts the executor down and exits with code 1.
  SIGTERM (and SIGINT when run alone) shut down gracefully: frontends get ``EngineDead`` too, exit
  code 0. A frontend that says ``Goodbye`` or whose connection drops is forgotten and its requests
  are aborted; the engine keeps serving the others. A stall is not a death: an engine that was
  paused (SIGSTOP, a long GC or compile) resumes with every frontend and request it had, since
  connections are watched by TCP keepalive (the kernel answers for a stopped process) and the
  deadlines it keeps on its frontends move by the time it was not running. Heartbeats carry
  the count of finished steps, so a frontend tells a slow engine from a stuck one. A message
  that fails to decode is logged and dropped (a request whose id can still be read fails
  alone). A spawned engine exits when its parent process dies (the parent's multiprocessing
  sentinel).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import secrets
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import msgspec
import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from tidal.engine_core import envs, stack_dump
from tidal.engine_core.config import EngineConfig
from tidal.engine_core.core import EngineCore
from tidal.engine_core.executor import Executor
from tidal.engine_core.gc_control import GcPauses, freeze_startup_objects
from tidal.engine_core.protocol import (
    PROTOCOL_VERSION,
    AbortRequests,
    AddRequests,
    ControlRequest,
    ControlResponse,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineMessage,
    EngineRegister,
    FinishReason,
    FrontendMessage,
    Goodbye,
    HandshakeFailed,
    HandshakeMessage,
    Heartbeat,
    Hello,
    OutputBatch,
    Ready,
    SchedulerStats,
)
from tidal.engine_core.serial import Decoder, Encoder, SerialDecodeError
from tidal.engine_core.sockets import NOBLOCK, bind, recv_frames, send_frames, tune_socket

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
# A data-parallel rank tells every frontend its load at most this often while busy.
LOAD_REPORT_INTERVAL_S = 0.05
HEALTH_CHECK_INTERVAL_S = 1.0
# A spawned engine that failed to start waits this long for its frontend's HELLO, to answer it
# with the error instead of leaving the frontend to read only an exit code.
_STARTUP_FAILURE_GRACE_S = 3.0
# At exit, how long closing sockets may take to deliver the last messages (EngineDead).
_LINGER_MS = 500
# How long a frontend that said HELLO may take until the engine's connection to it is up.
_CONNECT_BACK_S = 30.0
# A wait that overran by more than _PAUSE_S means this process was paused (SIGSTOP, a debugger,
# a starved host); the deadlines it keeps on its peers are extended by the pause. Waits that
# serve deadlines last at most _PAUSE_TICK_S, so a pause is measured, not guessed.
_PAUSE_S = 1.0
_PAUSE_TICK_S = 1.0

EXIT_OK = 0
EXIT_FAILED = 1


def engine_request_id(client_index: int, request_id: str) -> str:
    """The id a frontend's request has inside the engine: unique across frontends."""
    return f"c{client_index}:{request_id}"


# --- queue items between the threads -------------------------------------------------------------


@dataclass(slots=True)
class _ClientGone:
    index: int
    reason: str


@dataclass(slots=True)
class Stop:
    """Ends the busy loop (public: the lockstep loop in dp_lockstep.py queues and returns it)."""

    reason: str
    failed: bool = False


@dataclass(slots=True)
class _AddClient:
    index: int
    output_address: str


@dataclass(slots=True)
class _RemoveClient:
    index: int


@dataclass(slots=True)
class Broadcast:
    """A message for every frontend (public: the lockstep loop sends its idle stats so)."""

    message: EngineMessage
    # What one frontend (the lowest index) gets instead, e.g. stats with counters.
    counted: EngineMessage | None = None


_STOP_OUTPUT = object()


@dataclass(slots=True, eq=False)
class _Frontend:
    """The input thread's view of one connected frontend."""

    index: int
    dealer: zmq.Socket
    monitor: zmq.Socket
    pid: int
    # Until the DEALER has connected: a frontend that vanished right after its HELLO would
    # otherwise be retried (and heartbeated) forever.
    connect_deadline: float | None


@dataclass(slots=True, eq=False)
class _Push:
    """The output thread's view of one connected frontend."""

    sock: zmq.Socket
    last_sent: float = field(default_factory=time.monotonic)


# --- the process -------------------------------------------------------------------------------


class EngineCoreProc:
    """Runs an initialised ``EngineCore`` behind its sockets until shut down or failed."""

    def __init__(self, core: EngineCore, ctx: zmq.Context, handshake: zmq.Socket) -> None:
        self.core = core
        self.ctx = ctx
        self.handshake = handshake  # bound; the input thread owns it once ``run`` starts
        self.identity = b"tidal-engine-" + secrets.token_hex(4).encode()
        self._inputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # engine request id -> (client index, the id that client uses)
        self._owners: dict[str, tuple[int, str]] = {}
        self._wake_address = f"inproc://tidal-wake-{self.identity.decode()}"
        self._next_client = 0
        # Counters of steps whose stats reached no frontend yet (see ``_publish``).
        self._unsent_stats: SchedulerStats | None = None
        # Steps finished, read by the output thread for its heartbeats (an int: written by the
        # busy loop alone, read atomically).
        self._steps = 0
        # Data parallelism: outputs carry this rank (metrics label them), and every frontend
        # hears the rank's load now and then, not only those it sends outputs to: each API
        # server's DP coordinator routes on it (frontend/dp_coordinator.py).
        parallel = core.config.parallel
        self._engine_index = parallel.data_parallel_rank
        self._share_load = parallel.data_parallel_size > 1
        self._load_sent = 0.0
        # Requests received (input thread) and handed to the scheduler (busy loop), each
        # counter written by its thread alone: those that came during a step count as waiting
        # in its load report, or every coordinator reads this rank lighter than it is all
        # through a burst (issue 26).
        self._adds_received = 0
        self._adds_taken = 0

    def request_shutdown(self, reason: str) -> None:
        """Ask the busy loop to stop after the current step. Safe in a signal handler
        (``SimpleQueue.put`` is reentrant)."""
        self._inputs.put(Stop(reason))

    def run(self) -> int:
        """Serve until shut down (returns 0) or failed (returns 1)."""
        wake = self.ctx.socket(zmq.PAIR)
        wake.bind(self._wake_address)
        threads = [
            threading.Thread(target=self._guard, args=(self._input_loop,), name="engine-input",
                             daemon=True),
            threading.Thread(target=self._guard, args=(self._output_loop,), name="engine-output",
                             daemon=True),
        ]
        for t in threads:
            t.start()
        code = EXIT_OK
        farewell = "the EngineCore exited"
        try:
            stop = self._busy_loop()
            if stop.failed:
                code = EXIT_FAILED
                logger.error("EngineCore failed: %s", stop.reason)
                farewell = stop.reason
            else:
                logger.info("EngineCore shutting down: %s", stop.reason)
                farewell = f"the EngineCore shut down ({stop.reason})"
        except Exception as exc:  # noqa: BLE001 - a worker died, or a bug: fatal, reported
            code = EXIT_FAILED
            logger.exception("EngineCore failed")
            farewell = f"{type(exc).__name__}: {exc}"
        finally:
            self._outputs.put(Broadcast(EngineDead(farewell)))
            self._outputs.put(_STOP_OUTPUT)
            wake.send(b"")
            for t in threads:
                t.join(timeout=5)
            wake.close(linger=0)
            try:
                self.core.shutdown()
            except Exception:  # noqa: BLE001 - already exiting; say so and carry on
                logger.exception("executor shutdown failed")
                code = EXIT_FAILED
        return code

    def _guard(self, loop: Any) -> None:
        """A thread that dies takes the engine down with it (never a silent half-engine)."""
        try:
            loop()
        except Exception as exc:  # noqa: BLE001
            logger.exception("%s thread failed", threading.current_thread().name)
            self._inputs.put(Stop(f"the {threading.current_thread().name} thread failed: {exc}",
                                   failed=True))

    # --- main thread: the busy loop ------------------------------------------------------------

    def _busy_loop(self) -> Stop:
        core = self.core
        inputs = self._inputs
        busy = False
        while True:
            if not core.has_unfinished_requests():
                if busy:
                    # Going idle (often by an abort, which produces no output): tell every
                    # frontend, so gauges such as KV usage do not keep their last busy value.
                    busy = False
                    stats = self._with_unsent(core.scheduler.make_stats(0))
                    now = time.monotonic()
                    self._outputs.put(Broadcast(
                        CoreOutputs(OutputBatch(timestamp=now, scheduler_stats=stats.gauges(),
                                                engine_index=self._engine_index)),
                        counted=CoreOutputs(OutputBatch(timestamp=now, scheduler_stats=stats,
                                                        engine_index=self._engine_index))))
                try:
                    item = inputs.get(timeout=HEALTH_CHECK_INTERVAL_S)
                except queue.Empty:
                    # Idle: the only way to notice a worker that died meanwhile.
                    core.executor.check_health()
                    if core.scheduler.has_held_kv:  # KV held for a consumer: sent yet?
                        core.poll_kv_transfers(force=True)
                    continue
                if (stop := self._handle(item)) is not None:
                    return stop
            while True:
                try:
                    item = inputs.get_nowait()
                except queue.Empty:
                    break
                if (stop := self._handle(item)) is not None:
                    return stop
            if core.has_unfinished_requests():
                busy = True
                self._publish(core.step())
                self._steps += 1

    def _handle(self, item: Any) -> Stop | None:
        match item:
            case (int() as client, AddRequests(requests=reqs)):
                self._adds_taken += len(reqs)
                for req in reqs:
                    self._add(client, req)
            case (int() as client, AbortRequests(request_ids=ids)):
                keys = [engine_request_id(client, rid) for rid in ids]
                self.core.abort_requests(keys)
                for key in keys:
                    self._owners.pop(key, None)
            case (int() as client, _Rejected(request_id=rid, error=error)):
                self._reject(client, rid, error)
            case (int() as client, ControlRequest() as req):
                try:
                    resp = ControlResponse(req.call_id, self.core.handle_control(req.call))
                except Exception as exc:  # noqa: BLE001 - the caller gets the error
                    resp = ControlResponse(req.call_id, error=f"{type(exc).__name__}: {exc}")
                self._outputs.put((client, resp))
            case _ClientGone(index=index, reason=reason):
                keys = [k for k, (c, _) in self._owners.items() if c == index]
                self.core.abort_requests(keys)
                for key in keys:
                    del self._owners[key]
                logger.info("frontend %d left (%s); aborted its %d unfinished request(s)",
                            index, reason, len(keys))
                self._outputs.put(_RemoveClient(index))
            case Stop():
                return item
            case _:
                logger.error("ignoring an unexpected input %r", item)
        return None

    def _add(self, client: int, req: EngineCoreRequest) -> None:
        rid = req.request_id
        key = engine_request_id(client, rid)
        req.request_id = key
        req.client_index = client
        try:
            self.core.add_request(req)
        except ValueError as exc:  # invalid or duplicate: fails this request alone
            self._reject(client, rid, str(exc).replace(key, rid))
            return
        self._owners[key] = (client, rid)

    def _reject(self, client: int, request_id: str, error: str) -> None:
        logger.warning("rejected request %s of frontend %d: %s", request_id, client, error)
        out = EngineCoreOutput(request_id, finish_reason=FinishReason.ERROR, error=error)
        batch = OutputBatch(details=[out], timestamp=time.monotonic())
        self._outputs.put((client, CoreOutputs(batch)))

    def _with_unsent(self, stats: SchedulerStats) -> SchedulerStats:
        if self._unsent_stats is not None:
            stats.add_counters(self._unsent_stats)
            self._unsent_stats = None
        return stats

    def _publish(self, outs: EngineCoreOutputs) -> None:
        """One message per frontend with outputs this step. The step's counters (tokens,
        preemptions, prefix-cache lookups) go to exactly one of them, so frontends that add up
        their counters (the API servers of one ``tidal serve``) count each event once; the
        others get the gauges. A step without outputs keeps its counters for the next one."""
        stats = outs.scheduler_stats
        if stats is not None:
            stats = self._with_unsent(stats)
            if self._share_load:
                stats.num_waiting += max(0, self._adds_received - self._adds_taken)
            if self._share_load and outs.timestamp - self._load_sent >= LOAD_REPORT_INTERVAL_S:
                self._load_sent = outs.timestamp
                self._outputs.put(Broadcast(CoreOutputs(OutputBatch(
                    timestamp=outs.timestamp, scheduler_stats=stats.gauges(),
                    engine_index=self._engine_index))))
        if not outs.outputs:
            self._unsent_stats = stats
            return
        owners = self._owners
        groups: dict[int, list[EngineCoreOutput]] = {}
        for out in outs.outputs:
            owner = owners.get(out.request_id)
            if owner is None:
                continue  # its frontend left
            if out.finish_reason is not None:
                del owners[out.request_id]
            client, out.request_id = owner
            group = groups.get(client)
            if group is None:
                groups[client] = [out]
            else:
                group.append(out)
        if not groups:
            self._unsent_stats = stats
            return
        for client, group in groups.items():
            batch = OutputBatch.pack(group, outs.timestamp, stats, self._engine_index)
            self._outputs.put((client, CoreOutputs(batch)))
            if stats is not None:
                stats = stats.gauges()

    # --- input thread ---------------------------------------------------------------------------

    def _input_loop(self) -> None:
        wake = self.ctx.socket(zmq.PAIR)
        wake.connect(self._wake_address)
        poller = zmq.Poller()
        poller.register(self.handshake, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        by_dealer: dict[zmq.Socket, _Frontend] = {}
        by_monitor: dict[zmq.Socket, _Frontend] = {}
        decoder: Decoder[FrontendMessage] = Decoder(FrontendMessage)
        hs_decoder: Decoder[HandshakeMessage] = Decoder(HandshakeMessage)
        encoder = Encoder()

        def drop(fe: _Frontend, reason: str) -> None:
            if by_dealer.pop(fe.dealer, None) is None:
                return  # already dropped
            by_monitor.pop(fe.monitor, None)
            poller.unregister(fe.dealer)
            poller.unregister(fe.monitor)
            fe.dealer.disable_monitor()
            fe.monitor.close(linger=0)
            fe.dealer.close(linger=0)
            self._inputs.put(_ClientGone(fe.index, reason))

        try:
            while True:
                deadlines = [fe.connect_deadline for fe in by_dealer.values()
                             if fe.connect_deadline is not None]
                timeout = None
                if deadlines:
                    # Short waits, so that a pause of this process shows as an overrun.
                    timeout = min(max(0.0, min(deadlines) - time.monotonic()), _PAUSE_TICK_S)
                before = time.monotonic()
                events = poller.poll(None if timeout is None else timeout * 1000)
                now = time.monotonic()
                if timeout is not None and (paused := now - before - timeout) > _PAUSE_S:
                    # This process was not running (stopped, or starved of CPU): the silence
                    # is ours, so the frontends get the time back rather than the blame.
                    for fe in by_dealer.values():
                        if fe.connect_deadline is not None:
                            fe.connect_deadline += paused
                for fe in list(by_dealer.values()):
                    if fe.connect_deadline is not None and now >= fe.connect_deadline:
                        drop(fe, f"never connected back within {_CONNECT_BACK_S:.0f} s")
                for sock, _ in events:
                    if sock is wake:
                        return
                    if sock is self.handshake:
                        fe = self._on_hello(hs_decoder, encoder)
                        if fe is not None:
                            by_dealer[fe.dealer] = fe
                            by_monitor[fe.monitor] = fe
                            poller.register(fe.dealer, zmq.POLLIN)
                            poller.register(fe.monitor, zmq.POLLIN)
                    elif (fe := by_dealer.get(sock)) is not None:
                        if self._on_frontend_input(fe, decoder):
                            drop(fe, "said goodbye")
                    elif (fe := by_monitor.get(sock)) is not None:
                        event = recv_monitor_message(fe.monitor)["event"]
                        if event == zmq.EVENT_CONNECTED:
                            fe.connect_deadline = None
                        elif event == zmq.EVENT_DISCONNECTED:
                            drop(fe, "connection lost")
        finally:
            for fe in list(by_dealer.values()):
                fe.dealer.disable_monitor()
                fe.monitor.close(linger=0)
                fe.dealer.close(linger=0)
            wake.close(linger=0)
            self.handshake.close(linger=0)

    def _on_hello(self, decoder: Decoder[HandshakeMessage], encoder: Encoder) -> _Frontend | None:
        frames = self.handshake.recv_multipart()
        if len(frames) != 2:
            logger.warning("dropped a handshake message of %d frames", len(frames))
            return None
        peer, payload = frames
        try:
            hello = decoder.decode([payload])
        except SerialDecodeError as exc:
            logger.warning("dropped an undecodable handshake message: %s", exc)
            return None
        if not isinstance(hello, Hello):
            logger.warning("dropped an unexpected %s on the handshake socket",
                           type(hello).__name__)
            return None

        def refuse(why: str) -> None:
            logger.warning("refused a frontend (pid %d): %s", hello.pid, why)
            self.handshake.send_multipart([peer, encoder.encode(HandshakeFailed(why))[0]])

        if hello.protocol_version != PROTOCOL_VERSION:
            refuse(f"protocol version {hello.protocol_version} does not match the engine's "
                   f"{PROTOCOL_VERSION}")
            return None
        addresses = (hello.input_address, hello.output_address)
        if not all(a.startswith(("tcp://", "ipc://")) for a in addresses):
            refuse(f"frontend addresses must be tcp:// or ipc://, got {addresses}")
            return None
        index = self._next_client
        self._next_client += 1
        dealer = self.ctx.socket(zmq.DEALER)
        tune_socket(dealer)
        dealer.setsockopt(zmq.IDENTITY, self.identity)
        monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        dealer.connect(hello.input_address)
        dealer.send(encoder.encode(EngineRegister(self.identity))[0])
        # Queued before READY goes out, so the output thread knows the frontend before any of
        # its outputs can exist.
        self._outputs.put(_AddClient(index, hello.output_address))
        ready = Ready(self.identity, index, self.core.config, os.getpid(), HEARTBEAT_INTERVAL_S)
        self.handshake.send_multipart([peer, encoder.encode(ready)[0]])
        logger.info("frontend %d connected (pid %d, input %s, output %s)", index, hello.pid,
                    hello.input_address, hello.output_address)
        return _Frontend(index, dealer, monitor, hello.pid, time.monotonic() + _CONNECT_BACK_S)

    def _on_frontend_input(self, fe: _Frontend, decoder: Decoder[FrontendMessage]) -> bool:
        """Drain one frontend's DEALER; True if it said goodbye."""
        while True:
            try:
                frames = recv_frames(fe.dealer, NOBLOCK)
            except zmq.Again:
                return False
            try:
                msg = decoder.decode(frames)
            except SerialDecodeError as exc:
                good, bad = _salvage_adds(frames[0])
                logger.warning("dropped an undecodable message from frontend %d%s: %s", fe.index,
                               f" (requests {', '.join(r for r, _ in bad)})" if bad else "", exc)
                if good:
                    self._adds_received += len(good)
                    self._inputs.put((fe.index, AddRequests(good)))
                for rid, why in bad:
                    self._inputs.put((fe.index, _Rejected(rid, f"malformed request: {why}")))
                continue
            if isinstance(msg, Goodbye):
                return True
            if isinstance(msg, AddRequests):
                self._adds_received += len(msg.requests)
            self._inputs.put((fe.index, msg))

    # --- output thread --------------------------------------------------------------------------

    def _output_loop(self) -> None:
        encoder = Encoder()
        pushes: dict[int, _Push] = {}
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S

        def send(index: int, frames: list[Any]) -> None:
            push = pushes.get(index)
            if push is None:
                return  # that frontend left
            try:
                send_frames(push.sock, frames, NOBLOCK, copy=False)
            except zmq.Again:  # only with a high-water mark, which is off; never silently
                logger.error("frontend %d is not reading; dropped a message", index)
            push.last_sent = time.monotonic()

        # The start of the previous turn (after its wait): a stop that lands while this thread
        # sends (not while it waits) shows up as time since then that no wait accounts for.
        last_start = time.monotonic()
        try:
            while True:
                before = time.monotonic()
                wait = max(0.0, next_beat - before)
                try:
                    item = self._outputs.get(timeout=wait)
                except queue.Empty:
                    item = None
                now = time.monotonic()
                paused = now - last_start - min(now - before, wait)
                last_start = now
                if paused > _PAUSE_S:
                    # This thread wakes every heartbeat interval, so it is the one to notice.
                    logger.warning("the EngineCore was paused for %.1f s (stopped, a long GC, "
                                   "or starved of CPU); carrying on with every frontend", paused)
                if item is _STOP_OUTPUT:
                    return
                match item:
                    case (int() as index, msg):
                        send(index, encoder.encode(msg))
                    case _AddClient(index=index, output_address=address):
                        sock = self.ctx.socket(zmq.PUSH)
                        tune_socket(sock)
                        sock.connect(address)
                        pushes[index] = _Push(sock)
                    case _RemoveClient(index=index):
                        push = pushes.pop(index, None)
                        if push is not None:
                            push.sock.close(linger=0)
                    case Broadcast(message=msg, counted=counted):
                        frames = encoder.encode(msg)
                        for i, index in enumerate(sorted(pushes)):
                            send(index, encoder.encode(counted) if i == 0 and counted
                                 else frames)
                now = time.monotonic()
                if now >= next_beat:
                    heartbeat = encoder.encode(Heartbeat(self._steps))
                    for index, push in pushes.items():
                        if now - push.last_sent >= HEARTBEAT_INTERVAL_S:
                            send(index, heartbeat)
                    next_beat = now + HEARTBEAT_INTERVAL_S
        finally:
            for push in pushes.values():
                push.sock.close(linger=_LINGER_MS)


@dataclass(slots=True)
class _Rejected:
    """A request the input thread could not decode but whose id it could read."""

    request_id: str
    error: str


def _salvage_adds(payload: bytes) -> tuple[list[EngineCoreRequest], list[tuple[str, str]]]:
    """An ``AddRequests`` that failed to decode, taken apart: the requests that are valid alone,
    and (id, why) of those that are not but whose id can be read, so one malformed request
    fails visibly and alone instead of hanging its caller or taking its batch down."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return [], []
    if not (isinstance(raw, list) and len(raw) >= 2 and raw[0] == "add"
            and isinstance(raw[1], list)):
        return [], []
    good: list[EngineCoreRequest] = []
    bad: list[tuple[str, str]] = []
    for item in raw[1]:
        try:
            good.append(msgspec.convert(item, EngineCoreRequest))
        except (msgspec.ValidationError, ValueError, TypeError) as exc:
            if isinstance(item, list) and item and isinstance(item[0], str):
                bad.append((item[0], str(exc)))
    return good, bad


# --- entry points ------------------------------------------------------------------------------


def serve(config: EngineConfig, listen: str, *, executor: Executor | None = None,
          spawned: bool = False) -> int:
    """Bind the handshake socket at ``listen``, start the EngineCore and serve until shut down.

    Returns the process exit code. Installs SIGTERM (and SIGINT unless ``spawned``) handlers:
    the first signal shuts down gracefully, a second one exits at once.
    """
    start = time.perf_counter()
    signals = [signal.SIGTERM] if spawned else [signal.SIGTERM, signal.SIGINT]
    ctx = zmq.Context()
    handshake = ctx.socket(zmq.ROUTER)
    # No ROUTER_MANDATORY here: an answer to a frontend that already left is dropped instead
    # of raising in the input thread.
    handshake.setsockopt(zmq.LINGER, _LINGER_MS)
    try:
        try:
            address = bind(handshake, listen)
        except zmq.ZMQError as exc:
            logger.error("start-up: cannot listen at %s: %s", listen, exc)
            return EXIT_FAILED
        logger.info("start-up: handshake socket bound at %s in %.2f s", address,
                    time.perf_counter() - start)

        def abort_startup(signum: int, frame: Any) -> None:
            raise SystemExit(128 + signum)

        if threading.current_thread() is not threading.main_thread():
            signals = []  # only the main thread may handle signals
        for sig in signals:
            signal.signal(sig, abort_startup)
        phase = time.perf_counter()
        core: EngineCore | None = None
        try:
            core = EngineCore(config, executor)
            logger.info("start-up: EngineCore initialised in %.2f s (%d KV blocks of %d tokens, "
                        "max_model_len %d)", time.perf_counter() - phase,
                        core.config.cache.num_blocks, core.config.cache.block_size,
                        core.config.model.max_model_len)
            # Here too: a lockstep rank that cannot meet its peers failed to start (reported
            # to the frontend, its workers stopped), never a silent wait.
            if core.config.parallel.data_parallel_lockstep:
                from tidal.engine_core.dp_lockstep import LockstepEngineCoreProc

                proc: EngineCoreProc = LockstepEngineCoreProc(core, ctx, handshake)
            else:
                proc = EngineCoreProc(core, ctx, handshake)
        except Exception as exc:  # noqa: BLE001 - reported to the frontend, then exit 1
            logger.exception("start-up: the EngineCore failed to start")
            if spawned:
                _refuse_pending_hellos(handshake, "".join(
                    traceback.format_exception_only(type(exc), exc)).strip())
            _shut_down_quietly(core)
            handshake.close()
            return EXIT_FAILED
        except BaseException:  # a stop signal during start-up: still stop the workers
            _shut_down_quietly(core)
            raise
        # A long-running process: requests' short-lived objects only for the collector, and
        # its pauses in the stats line.
        freeze_startup_objects()
        core.stats_logger.gc_pauses = GcPauses().install()
        received: list[int] = []

        def on_signal(signum: int, frame: Any) -> None:
            received.append(signum)
            if len(received) > 1:  # a second signal: die of it now
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            proc.request_shutdown(f"received {signal.Signals(signum).name}")

        for sig in signals:
            signal.signal(sig, on_signal)
        logger.info("EngineCore serving at %s (pid %d; %.2f s since the process started)",
                    address, os.getpid(), time.time() - psutil.Process().create_time())
        return proc.run()
    finally:
        # Cleanup must not be cut short by an exception from a handler: a signal now ends the
        # process the default way (the frontend that sends it is not waiting for more).
        for sig in signals:
            signal.signal(sig, signal.SIG_DFL)
        if not handshake.closed:
            handshake.close(linger=0)
        ctx.term()


def _shut_down_quietly(core: EngineCore | None) -> None:
    """Stop a half-started engine's executor (its workers); a failure there is logged only:
    the start-up failure is the one to report."""
    if core is None:
        return
    try:
        core.shutdown()
    except Exception:  # noqa: BLE001
        logger.exception("start-up: stopping the executor after the failure failed too")


def _refuse_pending_hellos(handshake: zmq.Socket, error: str) -> None:
    """Answer the spawning frontend's HELLO (sent as soon as it started us) with the error."""
    decoder: Decoder[HandshakeMessage] = Decoder(HandshakeMessage)
    payload = Encoder().encode(HandshakeFailed(error))[0]
    if not handshake.poll(_STARTUP_FAILURE_GRACE_S * 1000):
        return
    while handshake.poll(0):
        frames = handshake.recv_multipart()
        try:
            if len(frames) == 2 and isinstance(decoder.decode(frames[1:]), Hello):
                handshake.send_multipart([frames[0], payload])
        except (SerialDecodeError, zmq.ZMQError):
            continue


def setup_logging(name: str) -> None:
    """Log lines of an engine process: level from ``TIDAL_LOG_LEVEL``, process name and pid."""
    logging.basicConfig(
        level=envs.log_level(),
        format=f"%(asctime)s %(levelname)s {name}[%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    stack_dump.install()


def watch_parent(stop_signal: signal.Signals = signal.SIGTERM) -> None:
    """A spawned process outlives no parent: when the parent's end of multiprocessing's sentinel
    pipe closes (the parent died, however), shut down as if sent ``stop_signal``."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("the parent process (pid %s) died; shutting down", parent.pid)
        os.kill(os.getpid(), stop_signal)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_engine_core(config_bytes: bytes, listen: str, log_name: str = "EngineCore") -> None:
    """Entry point of an EngineCore process spawned by a frontend (``multiprocessing`` target).

    ``config_bytes`` is the msgpack encoding of the resolved ``EngineConfig``. The process
    leaves its parent's process group and ignores SIGINT: the frontend drains and shuts it down
    (SIGTERM), and it shuts down by itself if the frontend dies. ``log_name`` starts its log
    lines (a data-parallel rank's names the rank).
    """
    setup_logging(log_name)
    # A process group of its own: a signal sent to the frontend's whole group (Ctrl-C,
    # ``timeout``, ``kill -- -PGID``) is the frontend's to handle (it drains its requests, then
    # stops this process). Taking it here too would end every in-flight request at once.
    os.setpgrp()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent()
    from tidal.engine_core.plugins import load_general_plugins

    load_general_plugins()  # before the config: its ArchSpec may name a plugin's family
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)
    sys.exit(serve(config, listen, spawned=True))
