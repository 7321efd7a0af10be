"""Clients for an EngineCore in another process: one this frontend spawns, or one it reaches by
address (a standalone ``engine-core``, possibly shared with other frontends).

``EngineConnection`` holds the sockets and does the handshake (see ``tidal.engine_core.core_proc``
for the engine's side): this frontend binds a ROUTER (requests go out on it, addressed to the
engine's identity) and a PULL (its outputs come in on it), then sends ``Hello`` to the engine's
handshake socket and waits for ``Ready``, watching the spawned process meanwhile so a start-up
crash raises ``EngineStartupError`` with the engine's error at once, never a hang.

Death of the engine is noticed through the process sentinel (spawned), an ``EngineDead`` message
(the engine failed or shut down), a ROUTER that can no longer route to it, or, for an engine
reached by address, ``heartbeat_timeout_s`` without any message (it heartbeats while idle).
All of them raise ``EngineDeadError``: for good with a spawned engine; with one reached by
address, ``MPAsyncClient`` reconnects when an EngineCore answers there again (its errors
meanwhile are ``EngineUnavailableError``). A stall is not a death: an engine on this host
whose process is stopped (SIGSTOP) is waited for, and a watchdog that ran late (this process
was not running) gives the engine that time back.

``MPAsyncClient`` serves ``AsyncLLM``: socket reads run as event-loop reader callbacks (no task
or future per message); ``MPSyncClient`` serves the offline ``LLM``.

A spawned engine uses the ``spawn`` start method, so a script that starts one must guard its
entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import math
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import psutil
import zmq

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import ControlCall, ControlResult
from tidal.engine_core.core_proc import run_engine_core
from tidal.engine_core.protocol import (
    AbortRequests,
    AddRequests,
    ControlRequest,
    ControlResponse,
    CoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineMessage,
    EngineRegister,
    FrontendMessage,
    Goodbye,
    HandshakeFailed,
    HandshakeMessage,
    Heartbeat,
    Hello,
    OutputBatch,
    Ready,
)
from tidal.engine_core.serial import Decoder, Encoder, SerialDecodeError
from tidal.engine_core.sockets import (
    NOBLOCK,
    bind,
    is_loopback,
    normalize_address,
    recv_frames,
    send_frames,
    tcp_host,
    tune_socket,
)
from tidal.frontend.async_llm import EngineDeadError, EngineUnavailableError

logger = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0  # six missed heartbeats (every 0.5 s while idle): under 5 s
DEFAULT_CONNECT_TIMEOUT_S = 30.0
_REGISTER_TIMEOUT_S = 10.0
_SHUTDOWN_TIMEOUT_S = 10.0
# After the engine process exits, how long to wait for the last message it sent (EngineDead
# carries the reason; the exit code alone says little).
_LAST_WORDS_S = 0.2
_MAX_BATCH = 64  # messages handled per reader callback before yielding to the loop
_HANDSHAKE_POLL_S = 0.05  # how often a reconnecting handshake looks for the engine's answer
# Reconnecting: each handshake waits this long for an answer, then a pause before the next one
# (a fresh one: a HELLO queued for an engine that was going away may never be read).
_RECONNECT_ATTEMPT_S = 5.0
_RECONNECT_PAUSE_S = 0.5
_RECONNECT_WARN_S = 60.0  # how often "still no engine" is logged
# A watchdog that runs this much later than due means this process was not running (stopped,
# or its event loop blocked): the engine is given that time back instead of the blame.
_PAUSE_S = 1.0


class EngineStartupError(RuntimeError):
    """The EngineCore could not start (or could not be reached); the message says why."""


class ControlCallError(RuntimeError):
    """The engine raised while running a control call."""


class EngineConnection:
    """One frontend's sockets to one EngineCore, and the spawned process if it owns it.

    Not thread-safe: use it from one thread (the event loop's, for ``MPAsyncClient``).
    """

    def __init__(self, address: str, *, proc: BaseProcess | None = None,
                 tmpdir: str | None = None, client_host: str | None = None,
                 heartbeat_timeout_s: float | None = DEFAULT_HEARTBEAT_TIMEOUT_S) -> None:
        self.address = normalize_address(address)
        self.proc = proc
        self._tmpdir = tmpdir
        # A spawned engine's death is seen exactly through its sentinel; only a remote one needs
        # the heartbeat deadline.
        self.heartbeat_timeout_s = None if proc is not None else heartbeat_timeout_s
        self.config: EngineConfig | None = None
        self.engine_identity = b""
        self.client_index = -1
        self.engine_pid = 0
        self._ready_wall_time = 0.0
        self.last_seen = time.monotonic()
        self.closed = False
        self._encoder = Encoder()
        self._decoder: Decoder[EngineMessage] = Decoder(EngineMessage)
        self.ctx = zmq.Context()
        try:
            self.router = self.ctx.socket(zmq.ROUTER)
            tune_socket(self.router)
            # Sending to an engine that is not connected raises instead of dropping silently.
            self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self.pull = self.ctx.socket(zmq.PULL)
            tune_socket(self.pull)
            base = self._local_endpoint_base(client_host)
            self.input_address = bind(self.router, base("input"))
            self.output_address = bind(self.pull, base("output"))
            self._handshake = self.ctx.socket(zmq.DEALER)
            self._handshake.setsockopt(zmq.LINGER, 0)
            self._handshake.connect(self.address)
            hello = Hello(self.input_address, self.output_address, os.getpid())
            self._handshake.send(self._encoder.encode(hello)[0])
        except BaseException:
            self.close()
            raise

    # --- start-up ------------------------------------------------------------------------------

    @classmethod
    def spawn(cls, config: EngineConfig, *, listen: str | None = None,
              target: Callable[[bytes, str], None] = run_engine_core,
              **kwargs: Any) -> EngineConnection:
        """Start an EngineCore process for ``config`` and send it HELLO; call ``wait_ready``
        next (the caller may do other start-up work in between, e.g. load the tokenizer).

        ``listen``: the engine's handshake address; by default ``ipc://`` in a fresh temporary
        directory. Give a ``tcp://`` address to let other frontends connect to this engine too.
        ``target``: the process's entry point (an importable function taking the encoded config
        and the listen address, like ``run_engine_core``, which it should end up calling).
        """
        proc, address, tmpdir = start_engine_process(config, listen, target)
        try:
            conn = cls(address, proc=proc, tmpdir=tmpdir, **kwargs)
        except BaseException:
            stop_process(proc, 0.0)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        # Non-daemon (it may start worker processes), so multiprocessing would join it at exit;
        # stop it first instead (atexit runs this before multiprocessing's own handler).
        atexit.register(conn.close)
        return conn

    @classmethod
    def connect(cls, address: str, **kwargs: Any) -> EngineConnection:
        """Send HELLO to a running EngineCore at ``address``; call ``wait_ready`` next."""
        return cls(address, **kwargs)

    def _local_endpoint_base(self, client_host: str | None) -> Callable[[str], str]:
        """Where this frontend binds its two sockets: ipc next to an ipc engine; TCP on loopback
        for a loopback engine, else on ``client_host`` or the interface that routes to it."""
        host = tcp_host(self.address)
        if host is None:
            if self._tmpdir is None:
                self._tmpdir = tempfile.mkdtemp(prefix="tidal-frontend-")
            tmpdir = self._tmpdir
            return lambda name: f"ipc://{tmpdir}/{name}.sock"
        if client_host is None:
            client_host = "127.0.0.1" if is_loopback(host) else _route_to(host)
        return lambda name: f"tcp://{client_host}:*"

    @property
    def handshake_socket(self) -> zmq.Socket:
        """What to poll for the engine's answer to HELLO, to wait on several engines at once
        (``wait_ready`` reads it; closed once the handshake is done)."""
        return self._handshake

    def wait_ready(self, timeout_s: float | None = None) -> EngineConfig:
        """Finish the handshake; returns the engine's resolved config.

        Raises ``EngineStartupError`` if the engine reports a start-up failure, its process
        exits, or (``timeout_s``; default: none for a spawned engine, 30 s otherwise;
        ``math.inf``: none) nothing answers.
        """
        if timeout_s is None and self.proc is None:
            timeout_s = DEFAULT_CONNECT_TIMEOUT_S
        try:
            ready = self._await_ready(timeout_s)
            self._await_register(ready)
        except BaseException:
            self.close()
            raise
        return self._finish_handshake(ready)

    async def wait_ready_async(self, timeout_s: float) -> EngineConfig:
        """``wait_ready`` for an event loop (polls, never blocks it): reconnecting to an
        engine reached by address. Raises ``EngineStartupError`` as ``wait_ready`` does."""
        assert self.proc is None, "a spawned engine's handshake is waited for with wait_ready"
        deadline = time.monotonic() + timeout_s
        decoder: Decoder[HandshakeMessage] = Decoder(HandshakeMessage)
        register: Decoder[EngineRegister] = Decoder(EngineRegister)
        try:
            while (ready := self._handshake_reply(decoder)) is None:
                if time.monotonic() >= deadline:
                    raise EngineStartupError(f"no EngineCore answered at {self.address} within "
                                             f"{timeout_s:.0f} s")
                await asyncio.sleep(_HANDSHAKE_POLL_S)
            deadline = time.monotonic() + _REGISTER_TIMEOUT_S
            while not self._registered(ready, register):
                if time.monotonic() >= deadline:
                    raise EngineStartupError(f"the EngineCore at {self.address} answered the "
                                             f"handshake but never connected to "
                                             f"{self.input_address}")
                await asyncio.sleep(_HANDSHAKE_POLL_S)
        except BaseException:
            self.close()
            raise
        return self._finish_handshake(ready)

    def _finish_handshake(self, ready: Ready) -> EngineConfig:
        self._handshake.close(linger=0)
        self.config = ready.config
        self.engine_identity = ready.engine_identity
        self.client_index = ready.client_index
        self.engine_pid = ready.engine_pid
        self._ready_wall_time = time.time()
        if self.heartbeat_timeout_s is not None:
            # Never stricter than a few of the engine's own heartbeat periods.
            self.heartbeat_timeout_s = max(self.heartbeat_timeout_s,
                                           4 * ready.heartbeat_interval_s)
        self.last_seen = time.monotonic()
        logger.info("connected to the EngineCore at %s (pid %d) as frontend %d", self.address,
                    ready.engine_pid, ready.client_index)
        return ready.config

    def _await_ready(self, timeout_s: float | None) -> Ready:
        decoder: Decoder[HandshakeMessage] = Decoder(HandshakeMessage)
        poller = zmq.Poller()
        poller.register(self._handshake, zmq.POLLIN)
        if self.proc is not None:
            poller.register(self.proc.sentinel, zmq.POLLIN)
        deadline = None if timeout_s is None or math.isinf(timeout_s) \
            else time.monotonic() + timeout_s
        while True:
            wait_ms = None if deadline is None else max(0, (deadline - time.monotonic()) * 1000)
            events = dict(poller.poll(wait_ms))
            if self._handshake in events:
                if (ready := self._handshake_reply(decoder)) is not None:
                    return ready
                continue
            if self.proc is not None and self.proc.sentinel in events:
                # Its error may still be on the way (sent just before it exited).
                if self._handshake.poll(_LAST_WORDS_S * 1000 * 5):
                    continue
                self.proc.join(1)
                raise EngineStartupError(
                    f"the EngineCore process exited with code {self.proc.exitcode} during "
                    "start-up (its log above says why)")
            if deadline is not None and time.monotonic() >= deadline:
                raise EngineStartupError(f"no EngineCore answered at {self.address} within "
                                         f"{timeout_s:.0f} s")

    def _handshake_reply(self, decoder: Decoder[HandshakeMessage]) -> Ready | None:
        """The engine's ``Ready`` if its answer is waiting (None if not); raises
        ``EngineStartupError`` for a refusal or an answer that does not decode."""
        while self._handshake.poll(0):
            try:
                msg = decoder.decode(self._handshake.recv_multipart())
            except SerialDecodeError as exc:
                raise EngineStartupError(f"bad handshake from {self.address}: {exc}") from exc
            if isinstance(msg, Ready):
                return msg
            if isinstance(msg, HandshakeFailed):
                if self.proc is not None:
                    self.proc.join(_SHUTDOWN_TIMEOUT_S)  # it exits by itself; let it
                raise EngineStartupError(f"the EngineCore failed to start: {msg.error}")
        return None

    def _registered(self, ready: Ready, decoder: Decoder[EngineRegister]) -> bool:
        """Whether the engine's ``EngineRegister`` arrived (reads what waits, never blocks)."""
        while self.router.poll(0):
            identity, *frames = self.router.recv_multipart()
            try:
                msg = decoder.decode(frames)
            except SerialDecodeError:
                continue
            if identity == ready.engine_identity and msg.engine_identity == identity:
                return True
        return False

    def _await_register(self, ready: Ready) -> None:
        """Wait until the engine's DEALER is connected to our ROUTER (before that, requests sent
        to it could not be routed)."""
        decoder: Decoder[EngineRegister] = Decoder(EngineRegister)
        deadline = time.monotonic() + _REGISTER_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.router.poll(remaining * 1000):
                break
            if self._registered(ready, decoder):
                return
        raise EngineStartupError(f"the EngineCore at {self.address} answered the handshake but "
                                 f"never connected to {self.input_address}")

    # --- traffic -------------------------------------------------------------------------------

    def send(self, msg: FrontendMessage) -> None:
        try:
            send_frames(self.router, [self.engine_identity, *self._encoder.encode(msg)], NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.ENOTSOCK):
                raise EngineDeadError(f"engine dead: the EngineCore at {self.address} is no "
                                      "longer connected") from exc
            raise

    def recv_nowait(self) -> EngineMessage | None:
        """The next message from the engine, or None if none is waiting. Undecodable messages
        are logged and skipped."""
        while True:
            try:
                frames = recv_frames(self.pull, NOBLOCK, copy=False)
            except zmq.Again:
                return None
            self.last_seen = time.monotonic()
            try:
                return self._decoder.decode(frames)
            except SerialDecodeError as exc:
                logger.warning("dropped an undecodable message from the engine: %s", exc)

    def has_pending(self) -> bool:
        return bool(self.pull.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def heartbeat_expired(self) -> bool:
        """No message for longer than the heartbeat timeout, and the engine is not merely
        stopped: a stopped engine on this host (SIGSTOP, a debugger) is given a fresh deadline
        each time this is asked, so it has the whole timeout to speak once it runs again."""
        if (self.heartbeat_timeout_s is None
                or time.monotonic() - self.last_seen <= self.heartbeat_timeout_s
                or self.has_pending()):
            return False
        if self.engine_stopped():
            self.last_seen = time.monotonic()
            return False
        return True

    def engine_stopped(self) -> bool:
        """Whether the engine's process is on this host and stopped (not dead, not running).
        Only asked of an engine reached through ipc or loopback, whose pid is one of ours."""
        if not self.engine_pid or not (self.proc is not None or self.is_local):
            return False
        try:
            engine = psutil.Process(self.engine_pid)
            # A pid reused since the handshake is another process: not our engine.
            return (engine.create_time() <= self._ready_wall_time
                    and engine.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP))
        except psutil.Error:
            return False

    @property
    def is_local(self) -> bool:
        """Whether the engine runs on this host (ipc, or TCP through loopback)."""
        host = tcp_host(self.address)
        return host is None or is_loopback(host)

    def exit_error(self) -> EngineDeadError:
        """The error for a spawned engine process that exited."""
        assert self.proc is not None
        self.proc.join(0.5)
        return EngineDeadError(f"engine dead: the EngineCore process (pid {self.proc.pid}) "
                               f"exited with code {self.proc.exitcode}")

    def heartbeat_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine dead: no message from the EngineCore at {self.address} "
                               f"for {self.heartbeat_timeout_s:.1f} s")

    def close(self) -> None:
        """Say goodbye (the engine aborts this frontend's requests), close the sockets, and stop
        a spawned engine (SIGTERM, then SIGKILL after a grace period)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if self.engine_identity:
            # Also to a spawned engine about to get SIGTERM: it then has no farewell to
            # deliver to this (closed) frontend and exits without waiting on it.
            try:
                self.send(Goodbye())
            except (EngineDeadError, zmq.ZMQError):
                pass
            # Give the goodbye a moment to leave; the engine may be gone, so never wait long.
            self.router.setsockopt(zmq.LINGER, 200)
        for name in ("_handshake", "pull", "router"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        self.ctx.term()
        if self.proc is not None:
            stop_process(self.proc, _SHUTDOWN_TIMEOUT_S)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


def start_engine_process(config: EngineConfig, listen: str | None = None,
                         target: Callable[[bytes, str], None] = run_engine_core,
                         ) -> tuple[BaseProcess, str, str]:
    """Start an EngineCore process (``spawn``) listening at ``listen``, by default ``ipc://``
    in a fresh temporary directory; returns the process, its address and that directory (the
    caller removes it)."""
    tmpdir = tempfile.mkdtemp(prefix="tidal-")
    address = listen or f"ipc://{tmpdir}/engine.sock"
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=target, args=(msgspec.msgpack.encode(config), address),
                       name="EngineCore", daemon=False)
    try:
        proc.start()
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        raise
    return proc, address, tmpdir


def stop_process(proc: BaseProcess, grace_s: float) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; returns once the process is gone."""
    if proc.is_alive():
        proc.terminate()
        proc.join(grace_s)
    if proc.is_alive():
        logger.warning("the %s process (pid %s) did not stop in %.0f s; killing it", proc.name,
                       proc.pid, grace_s)
        proc.kill()
    proc.join()


def _route_to(host: str) -> str:
    """The local address that routes to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


# --- asyncio -----------------------------------------------------------------------------------


class MPAsyncClient:
    """``AsyncEngineClient`` for an EngineCore in another process.

    Sends are gathered per event-loop turn: requests admitted in one turn (a burst) leave as one
    ``AddRequests`` message, flushed by a callback at the end of the turn; every message keeps
    its order. Reads run as a reader callback on the event loop: it drains the PULL socket and
    hands each step's ``OutputBatch`` to the ``on_outputs`` handler right there (no task or
    queue per message), and resolves control calls. The loop is bound on first use; a new loop
    (e.g. successive ``asyncio.run`` calls) rebinds it.

    ``reconnect`` (an engine reached by address, not one this frontend spawned): losing the
    engine (it shut down or died, or went silent) fails the requests in flight with
    ``EngineUnavailableError`` (an ``EngineDeadError``), as do new ones, until an EngineCore
    answers at the same address again: a fresh handshake, and the client serves again. An
    engine serving another model there is refused (logged; the client keeps trying).

    ``last_progress``: when the engine last showed progress on work (``time.monotonic()``): an
    output, or a heartbeat whose step count moved.
    """

    def __init__(self, conn: EngineConnection, *, reconnect: bool = False,
                 connect_kwargs: dict[str, Any] | None = None) -> None:
        assert conn.config is not None, "finish the handshake first (wait_ready)"
        self.conn = conn
        self.config = conn.config
        self.last_progress = time.monotonic()
        self._reconnect = reconnect and conn.proc is None
        self._connect_kwargs = dict(connect_kwargs or {})
        self._reconnect_task: asyncio.Task[None] | None = None
        self._steps_seen = -1
        self._shut_down = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_outputs: Callable[[OutputBatch], None] | None = None
        self._on_dead: Callable[[EngineDeadError], None] | None = None
        self._calls: dict[int, asyncio.Future[ControlResult]] = {}
        self._call_ids = itertools.count()
        self._watchdog: asyncio.TimerHandle | None = None
        self._watchdog_due = 0.0
        self._dead: EngineDeadError | None = None
        self._outbox: list[FrontendMessage] = []
        self._flush_handle: asyncio.Handle | None = None

    @classmethod
    def spawn(cls, config: EngineConfig, **kwargs: Any) -> MPAsyncClient:
        conn = EngineConnection.spawn(config, **kwargs)
        conn.wait_ready()
        return cls(conn)

    @classmethod
    def connect(cls, address: str, timeout_s: float | None = None, *, reconnect: bool = True,
                **kwargs: Any) -> MPAsyncClient:
        """Connect to a running EngineCore; ``reconnect`` (default) rides out its restarts."""
        conn = EngineConnection.connect(address, **kwargs)
        conn.wait_ready(timeout_s)
        return cls(conn, reconnect=reconnect, connect_kwargs=kwargs)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    def attach(self, on_outputs: Callable[[OutputBatch], None],
               on_dead: Callable[[EngineDeadError], None]) -> None:
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self._attach()

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        self._send(AddRequests(list(reqs)))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(list(request_ids)))

    async def call(self, call: ControlCall) -> ControlResult:
        """Run a control call in the engine; returns ``type(call).result_type``."""
        self._attach()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future[ControlResult] = self._loop.create_future()
        self._calls[call_id] = fut
        try:
            self._send(ControlRequest(call_id, call))
            return await fut
        finally:
            self._calls.pop(call_id, None)

    def shutdown(self) -> None:
        self._shut_down = True
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()  # it closes the connection it was making
            self._reconnect_task = None
        if self._dead is None:
            self._flush()
        self._detach()
        if self._dead is None or isinstance(self._dead, EngineUnavailableError):
            self._dead = EngineDeadError("engine dead: the client was shut down")
        self.conn.close()

    # --- internals -----------------------------------------------------------------------------

    def _send(self, msg: FrontendMessage) -> None:
        self._attach()
        if self._dead is not None:
            raise self._dead
        outbox = self._outbox
        # Consecutive messages of one kind merge, so a burst is one message.
        if outbox and type(msg) is type(outbox[-1]):
            if isinstance(msg, AddRequests):
                outbox[-1].requests.extend(msg.requests)  # type: ignore[union-attr]
                return
            if isinstance(msg, AbortRequests):
                outbox[-1].request_ids.extend(msg.request_ids)  # type: ignore[union-attr]
                return
        outbox.append(msg)
        if self._flush_handle is None:
            if self._loop is None:  # no loop to flush from (a closed client): send now
                self._flush()
            else:
                self._flush_handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_handle = None
        outbox, self._outbox = self._outbox, []
        if self._dead is not None:
            return
        for msg in outbox:
            try:
                self.conn.send(msg)
            except EngineDeadError as exc:
                self._lost(str(exc))
                return
            except Exception as exc:  # noqa: BLE001 - the requests in it would wait forever
                logger.exception("sending to the engine failed")
                self._fail(EngineDeadError(f"engine unreachable: sending failed: {exc}"))
                return

    def _attach(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is self._loop or self.conn.closed and not self._reconnecting():
            return
        self._detach()
        self._loop = loop
        if self._reconnecting():
            if self._reconnect_task is None or self._reconnect_task.done():
                self._reconnect_task = loop.create_task(self._reconnect_loop(),
                                                        name="tidal-engine-reconnect")
            return
        if self._dead is not None:
            return
        self._watch(loop)

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the connection in ``loop`` and watch the engine's life."""
        loop.add_reader(self.conn.pull.getsockopt(zmq.FD), self._on_readable)
        if self.conn.proc is not None:
            loop.add_reader(self.conn.proc.sentinel, self._on_engine_exit)
        elif self.conn.heartbeat_timeout_s is not None:
            self.conn.last_seen = time.monotonic()
            self._schedule_watchdog(loop)
        # The fd is edge-triggered: anything that arrived before we watched it must be read now.
        loop.call_soon(self._on_readable)

    def _schedule_watchdog(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.conn.heartbeat_timeout_s is not None
        period = self.conn.heartbeat_timeout_s / 4
        self._watchdog_due = time.monotonic() + period
        self._watchdog = loop.call_later(period, self._check_heartbeat)

    def _detach(self) -> None:
        loop, self._loop = self._loop, None
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
            self._flush()  # what the old loop had gathered still goes out, in order
        for fut in self._calls.values():
            if not fut.done() and not fut.get_loop().is_closed():
                fut.cancel()
        self._calls.clear()
        if loop is None or loop.is_closed() or self.conn.closed or self._dead is not None:
            return  # a dead client watches nothing (``_fail`` stopped it)
        loop.remove_reader(self.conn.pull.getsockopt(zmq.FD))
        if self.conn.proc is not None:
            loop.remove_reader(self.conn.proc.sentinel)

    def _on_readable(self) -> None:
        if self._loop is None or self.conn.closed:
            return
        for _ in range(_MAX_BATCH):
            if self._dead is not None:
                return
            msg = self.conn.recv_nowait()
            if msg is None:
                return
            self._dispatch(msg)
        self._loop.call_soon(self._on_readable)  # more waiting: let other callbacks run first

    def _dispatch(self, msg: EngineMessage) -> None:
        match msg:
            case CoreOutputs(outputs=outputs):
                self.last_progress = time.monotonic()
                if self._on_outputs is None:
                    return
                try:
                    self._on_outputs(outputs)
                except Exception as exc:  # noqa: BLE001 - a bug in output processing: fatal
                    logger.exception("processing the engine's outputs failed")
                    self._fail(EngineDeadError(f"engine output processing failed: {exc}"))
            case ControlResponse(call_id=call_id):
                fut = self._calls.pop(call_id, None)
                if fut is not None and not fut.done():
                    if msg.error is not None:
                        fut.set_exception(ControlCallError(msg.error))
                    else:
                        fut.set_result(msg.result)
            case Heartbeat(steps=steps):
                if steps != self._steps_seen:
                    if self._steps_seen >= 0:
                        self.last_progress = time.monotonic()
                    self._steps_seen = steps
            case EngineDead(reason=reason):
                self._lost(f"engine dead: {reason}")

    def _on_engine_exit(self) -> None:
        assert self._loop is not None and self.conn.proc is not None
        self._loop.remove_reader(self.conn.proc.sentinel)
        self._loop.call_later(_LAST_WORDS_S, self._engine_exited)

    def _engine_exited(self) -> None:
        self._on_readable()  # what it sent before dying, EngineDead with its reason included
        self._fail(self.conn.exit_error())

    def _check_heartbeat(self) -> None:
        self._watchdog = None
        if self._dead is not None or self._loop is None:
            return
        now = time.monotonic()
        if (late := now - self._watchdog_due) > _PAUSE_S:
            # This process (or its event loop) was not running: the engine's messages may be
            # waiting unread rather than missing, so the engine gets that time back.
            self.conn.last_seen = min(now, self.conn.last_seen + late)
        if self.conn.has_pending():
            self._on_readable()  # the loop was busy; the engine was not silent
            if self._dead is not None:
                return
        elif self.conn.heartbeat_expired():
            self._lost(str(self.conn.heartbeat_error()))
            return
        self._schedule_watchdog(self._loop)

    def _lost(self, why: str) -> None:
        """The engine is gone (it said so, went silent, or can no longer be reached): fatal for
        a client that does not reconnect, for now for one that does."""
        if not self._reconnect or self._shut_down:
            self._fail(EngineDeadError(why))
            return
        self._fail(EngineUnavailableError(why))
        logger.warning("reconnecting to the EngineCore at %s; until it answers, requests fail "
                       "with 503 engine_unavailable", self.conn.address)
        # Goodbye: should this engine only have been paused, it drops our requests on resuming.
        self.conn.close()
        if self._loop is not None and not self._loop.is_closed():
            self._reconnect_task = self._loop.create_task(self._reconnect_loop(),
                                                          name="tidal-engine-reconnect")

    def _reconnecting(self) -> bool:
        return self._reconnect and not self._shut_down and isinstance(self._dead,
                                                                      EngineUnavailableError)

    async def _reconnect_loop(self) -> None:
        """Handshake with whatever answers at the engine's address until one serves the same
        model, then serve through it."""
        address = self.conn.address
        start = time.monotonic()
        next_warning = start + _RECONNECT_WARN_S
        while True:
            try:
                conn = EngineConnection.connect(address, **self._connect_kwargs)
                config = await conn.wait_ready_async(_RECONNECT_ATTEMPT_S)
            except EngineStartupError as exc:
                logger.debug("no EngineCore at %s yet: %s", address, exc)
            except (zmq.ZMQError, OSError) as exc:
                logger.warning("reconnecting to %s failed: %s", address, exc)
            except Exception:  # noqa: BLE001 - a bug; the next attempt may still succeed
                logger.exception("reconnecting to %s failed", address)
            else:
                mismatch = _serving_mismatch(self.config, config)
                if mismatch is None:
                    self._adopt(conn)
                    logger.info("reconnected to the EngineCore at %s (pid %d) as frontend %d "
                                "after %.1f s", address, conn.engine_pid, conn.client_index,
                                time.monotonic() - start)
                    return
                conn.close()
                logger.error("the EngineCore now at %s serves %s; this frontend serves %s: not "
                             "using it", address, *mismatch)
            if time.monotonic() >= next_warning:
                logger.warning("still no usable EngineCore at %s after %.0f s; retrying", address,
                               time.monotonic() - start)
                next_warning = time.monotonic() + _RECONNECT_WARN_S
            await asyncio.sleep(_RECONNECT_PAUSE_S)

    def _adopt(self, conn: EngineConnection) -> None:
        """Serve through a fresh connection (after ``_reconnect_loop``)."""
        self.conn = conn
        self._reconnect_task = None
        self._dead = None
        self._steps_seen = -1
        self.last_progress = time.monotonic()
        if self._loop is not None and not self._loop.is_closed():
            self._watch(self._loop)

    def _fail(self, err: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = err
        if not self.conn.closed:
            logger.error("%s", err)
        self._outbox.clear()
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._loop is not None and not self._loop.is_closed() and not self.conn.closed:
            self._loop.remove_reader(self.conn.pull.getsockopt(zmq.FD))
            if self.conn.proc is not None:
                self._loop.remove_reader(self.conn.proc.sentinel)
        if self._on_dead is not None:
            self._on_dead(err)


def _serving_mismatch(current: EngineConfig, new: EngineConfig) -> tuple[str, str] | None:
    """What differs between the engine a frontend serves from and a new one at its address, as
    far as the frontend's requests care (model, tokenizer, limits); None if nothing."""

    def identity(config: EngineConfig) -> tuple[Any, ...]:
        m = config.model
        return (m.served_model_name, m.tokenizer, m.task, m.max_model_len, m.vocab_size,
                m.eos_token_ids, m.chat_template, config.runner.max_logprobs)

    if identity(current) == identity(new):
        return None
    return (f"{new.model.served_model_name} (max_model_len {new.model.max_model_len})",
            f"{current.model.served_model_name} (max_model_len {current.model.max_model_len})")


# --- blocking (offline LLM) --------------------------------------------------------------------


class MPSyncClient:
    """The ``InprocClient`` interface (``add_request``, ``abort_requests``, ``step``) over an
    EngineCore in another process; ``step`` blocks until the engine sends outputs."""

    def __init__(self, conn: EngineConnection) -> None:
        assert conn.config is not None, "finish the handshake first (wait_ready)"
        self.conn = conn
        self.config = conn.config
        self._poller = zmq.Poller()
        self._poller.register(conn.pull, zmq.POLLIN)
        if conn.proc is not None:
            self._poller.register(conn.proc.sentinel, zmq.POLLIN)
        self._pending: deque[EngineMessage] = deque()
        self._call_ids = itertools.count()
        self._dead: EngineDeadError | None = None

    @classmethod
    def spawn(cls, config: EngineConfig, **kwargs: Any) -> MPSyncClient:
        conn = EngineConnection.spawn(config, **kwargs)
        conn.wait_ready()
        return cls(conn)

    def add_request(self, req: EngineCoreRequest) -> None:
        self._send(AddRequests([req]))

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self._send(AbortRequests(list(request_ids)))

    def step(self) -> OutputBatch:
        """The next batch of outputs (blocks)."""
        while True:
            msg = self._next()
            if isinstance(msg, CoreOutputs):
                return msg.outputs

    def call(self, call: ControlCall) -> ControlResult:
        call_id = next(self._call_ids)
        self._send(ControlRequest(call_id, call))
        skipped: list[EngineMessage] = []
        try:
            while True:
                msg = self._next()
                if isinstance(msg, ControlResponse) and msg.call_id == call_id:
                    if msg.error is not None:
                        raise ControlCallError(msg.error)
                    return msg.result
                skipped.append(msg)  # outputs that arrived meanwhile: keep them for step()
        finally:
            self._pending.extendleft(reversed(skipped))

    def shutdown(self) -> None:
        self.conn.close()

    def _send(self, msg: FrontendMessage) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            self.conn.send(msg)
        except EngineDeadError as exc:
            self._dead = exc
            raise

    def _next(self) -> EngineMessage:
        """The next message that is not a heartbeat; raises EngineDeadError."""
        if self._pending:
            return self._pending.popleft()
        if self._dead is not None:
            raise self._dead
        conn = self.conn
        timeout = conn.heartbeat_timeout_s
        while True:
            msg = conn.recv_nowait()
            if msg is not None:
                if isinstance(msg, Heartbeat):
                    continue
                if isinstance(msg, EngineDead):
                    self._dead = EngineDeadError(f"engine dead: {msg.reason}")
                    raise self._dead
                return msg
            events = dict(self._poller.poll(None if timeout is None else timeout * 250))
            if conn.proc is not None and conn.proc.sentinel in events:
                if conn.pull.poll(_LAST_WORDS_S * 1000):
                    continue
                self._dead = conn.exit_error()
                raise self._dead
            if not events and conn.heartbeat_expired():
                self._dead = conn.heartbeat_error()
                raise self._dead
