"""Several API server processes over one EngineCore: ``tidal serve --api-server-count N``.

One asyncio process tops out at a few tens of thousands of streamed tokens per second (HTTP
parsing, detokenization, SSE writes are Python), well below what one GPU produces. So the work
of the frontend is spread over processes, the way vLLM does it:

    tidal serve (this module: the supervisor)
     ├─ EngineCore process (spawned, or the ``--engine-address`` one)
     └─ API server 0 .. N-1: each an ``AsyncLLM`` connected to the engine as one of its frontends
        (own tokenizer, own detokenization) plus the aiohttp app, all listening on the same
        host:port with SO_REUSEPORT, so the kernel spreads incoming connections over them.

Acting as one server:
* ``/metrics``: prometheus_client's multiprocess mode over a folder of this server's own (see
  ``metrics``); any process renders the sum, the engine's figures counted once.
* ``--max-queued-requests``: the admission counts of all processes live on one shared
  ``AdmissionBoard``, so the limit holds for the server, not per process.
* ``/health``, ``--api-key``: the same settings in every process.
* ``/v1/responses`` stored for ``previous_response_id``, ``GET`` and ``DELETE``: each process
  keeps those it answered and asks the others over IPC for an id it lacks
  (``response_peers``).
* ``GET /load`` (``--enable-server-load-tracking``): each process counts its requests in its
  row of the ``AdmissionBoard``; any process answers with the sum. ``--max-connections`` and
  the header/body timeouts hold per process.
* SIGTERM / SIGINT go to the supervisor, which passes each on as SIGUSR1: every API server
  drains (503 to new requests, in-flight ones finish, up to ``--shutdown-timeout``) and exits;
  then the engine is stopped; exit code 0. A second signal aborts what still runs. API servers
  ignore SIGTERM and SIGINT themselves, and the engine runs in a process group of its own, so
  a signal sent to the whole process group (Ctrl-C, ``timeout``) reaches them once, through
  here (a second copy would abort; the engine stopping first would fail every stream).
  systemd's default ``KillMode=control-group`` signals every process of the service at once,
  the engine included: use ``KillMode=mixed``.
* An API server or the engine that exits on its own (a crash, ``kill -9``) ends the whole
  server: the others are stopped the same way and the exit code is 1. A dead API server is not
  replaced: the streams it carried are lost either way, and a half-sized server that keeps
  answering hides the failure from whatever supervises it (systemd, Kubernetes), which can
  restart the whole server cleanly. No process outlives the supervisor: each child watches it
  and shuts down if it dies.

Every API server warms its own path with one tiny request before it listens, so the first
request a client sends runs no first-time code.

``--data-parallel-size N`` (also with one API server): N EngineCores instead of one
(``frontend.dp_engines``), started and stopped together; every API server connects to each
rank and routes its requests over them (``frontend.dp_client``); a rank that exits ends the
server as the one engine's exit does, the log naming the rank.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from tidal.engine_core import envs
from tidal.engine_core.config import EngineArgs, EngineConfig
from tidal.frontend.dp_engines import DPEngine
from tidal.frontend.server.response_peers import peer_addresses
from tidal.frontend.server.state import ServerSettings

logger = logging.getLogger(__name__)

MAX_DEFAULT_API_SERVERS = 8
# How long API servers of a standalone engine-core (``--engine-address``) may take to connect,
# warm up and listen. A spawned engine's start-up has no deadline (a large model loads for
# minutes): the supervisor watches that process instead, and its death ends the start.
_API_SERVER_START_S = 300.0
_ENGINE_STOP_S = 30.0
_POLL_S = 0.2


def default_api_server_count(world_size: int = 1, cpus: int | None = None) -> int:
    """Two cores per API server once the EngineCore (its busy loop and socket threads: about
    two cores) and one core per GPU worker are served; at least one, at most
    ``MAX_DEFAULT_API_SERVERS``."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0))
    return max(1, min(MAX_DEFAULT_API_SERVERS, (cpus - 2 - world_size) // 2))


# What an API server drains on (a second one aborts what still runs). Not SIGTERM: API servers
# ignore the signals a process group receives as a whole, and take orders from here only.
_DRAIN = signal.SIGUSR1


@dataclass(slots=True)
class _Child:
    name: str
    proc: BaseProcess
    ready: Any  # multiprocessing.Event


def _stop(child: _Child) -> None:
    """Make an API server drain; one still starting holds no request and is just ended (it
    handles the drain signal only once it listens, which is when it sets ``ready``)."""
    if not child.proc.is_alive() or child.proc.pid is None:
        return
    if not child.ready.is_set():
        child.proc.kill()
        return
    try:
        os.kill(child.proc.pid, _DRAIN)
    except ProcessLookupError:
        pass


def reserve_port(settings: ServerSettings) -> socket.socket:
    """Check that host:port is free (an exclusive bind), then hold it with a SO_REUSEPORT bind
    that does not listen, so the API servers can bind it too. Port 0 picks a free port; the
    settings are updated with the one picked."""
    from tidal.frontend.server.app import ServerStartError, bind_socket

    probe = bind_socket(settings)  # raises ServerStartError if busy
    port = probe.getsockname()[1]
    probe.close()
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((settings.host, port))
    except OSError as exc:
        sock.close()
        raise ServerStartError(f"cannot listen on {settings.host}:{port}: "
                               f"{exc.strerror or exc}") from None
    settings.port = port
    return sock


def run(engine_args: EngineArgs, settings: ServerSettings, count: int,
        engine_address: str | None = None) -> int:
    """Serve with ``count`` API server processes until a stop signal (returns 0 once everything
    drained) or a child's death (returns 1). Raises ``ServerStartError`` if the port is busy,
    ``ConfigError``/``ValueError`` for a bad configuration."""
    from tidal.frontend.dp_engines import start_dp_engines, stop_dp_engines
    from tidal.frontend.mp_client import start_engine_process, stop_process
    from tidal.frontend.server.admission import AdmissionBoard
    from tidal.frontend.server.connections import raise_fd_limit

    raise_fd_limit()  # here once: the API server processes inherit it
    config = engine_args.create_config() if engine_address is None else None
    ctx = multiprocessing.get_context("spawn")
    board = AdmissionBoard.allocate(count, ctx)
    held = reserve_port(settings)
    # A folder of this server's own, wiped at exit (prometheus_client aggregates every file in
    # it, so one left from an earlier run would be counted too). API servers read it from
    # their environment when they import prometheus_client.
    metrics_dir = tempfile.mkdtemp(prefix="tidal-metrics-")
    # The API servers' IPC sockets for stored responses (response_peers.py): mkdtemp's folder
    # is this user's alone.
    peers_dir = tempfile.mkdtemp(prefix="tidal-peers-")
    peers = peer_addresses(peers_dir, count) if count > 1 else None
    env_before = envs.prometheus_multiproc_dir()
    stopping: list[int] = []
    engine: BaseProcess | None = None
    engine_tmp: str | None = None
    dp_engines: list[DPEngine] = []  # --data-parallel-size > 1: the ranks, instead of engine
    servers: list[_Child] = []
    original = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_signal(signum: int, frame: Any) -> None:
        stopping.append(signum)

    for sig in original:
        signal.signal(sig, on_signal)
    try:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        if config is not None and config.parallel.data_parallel_size > 1:
            dp_engines = start_dp_engines(config)
        elif config is not None:
            engine, engine_address, engine_tmp = start_engine_process(config)
        addresses = [e.address for e in dp_engines] if dp_engines else [engine_address]
        assert all(a is not None for a in addresses)
        config_bytes = None if config is None else msgspec.msgpack.encode(config)
        for i in range(count):
            ready = ctx.Event()
            proc = ctx.Process(target=run_api_server, name=f"APIServer-{i}", daemon=False,
                               args=(i, count, settings, addresses, config_bytes,
                                     engine_args.tokenizer, board, ready, peers))
            proc.start()
            servers.append(_Child(proc.name, proc, ready))
        code = _supervise(servers, engine, stopping, settings, dp_engines)
    finally:
        _shut_down(servers, stopping, settings)
        if engine is not None:
            stop_process(engine, _ENGINE_STOP_S)
        stop_dp_engines(dp_engines, _ENGINE_STOP_S)
        held.close()
        for sig, handler in original.items():
            signal.signal(sig, handler)
        if env_before is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        else:
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = env_before
        shutil.rmtree(metrics_dir, ignore_errors=True)
        shutil.rmtree(peers_dir, ignore_errors=True)
        if engine_tmp is not None:
            shutil.rmtree(engine_tmp, ignore_errors=True)
    # (One that never listened was ended on purpose, or its death already set the code.)
    if any(c.proc.exitcode not in (0, None) for c in servers if c.ready.is_set()):
        code = 1
    logger.info("server stopped (exit code %d)", code)
    return code


def _shut_down(servers: list[_Child], stopping: list[int], settings: ServerSettings) -> None:
    """Drain every API server still running (passing on any further signal: it aborts what
    still runs) and wait for them; kill what outlives the drain."""
    seen = len(stopping)
    for child in servers:
        _stop(child)
    deadline = time.monotonic() + settings.shutdown_timeout + 10.0
    while alive := [c for c in servers if c.proc.is_alive()]:
        if time.monotonic() >= deadline:
            for child in alive:
                logger.warning("%s (pid %s) did not stop in time; killing it", child.name,
                               child.proc.pid)
                child.proc.kill()
                child.proc.join()
            return
        if len(stopping) > seen:
            seen = len(stopping)
            for child in alive:
                _stop(child)
        multiprocessing.connection.wait([c.proc.sentinel for c in alive], timeout=_POLL_S)


def _supervise(servers: list[_Child], engine: BaseProcess | None, stopping: list[int],
               settings: ServerSettings, dp_engines: list[DPEngine] | None = None) -> int:
    """Wait for the API servers to listen, then for a signal or a death; returns the exit code
    (after passing a signal on, once every API server has drained and exited). A data-parallel
    rank's death ends the server as the one engine's does."""
    dp_engines = dp_engines or []
    start = time.monotonic()
    pending = {c.name for c in servers}
    forwarded = 0
    while True:
        if len(stopping) > forwarded:
            # Pass each signal on once: the first drains, a second aborts what still runs.
            for child in servers:
                _stop(child)
            if forwarded == 0:
                logger.info("%s received: draining %d API server(s) (up to %.0f s)",
                            signal.Signals(stopping[0]).name, len(servers),
                            settings.shutdown_timeout)
            forwarded = len(stopping)
        if forwarded:
            if not any(c.proc.is_alive() for c in servers):
                return 0
        else:
            if engine is not None and not engine.is_alive():
                logger.error("the EngineCore (pid %s) exited with code %s; stopping the server",
                             engine.pid, engine.exitcode)
                return 1
            if (rank := next((e for e in dp_engines if not e.proc.is_alive()), None)) is not None:
                logger.error("the EngineCore of data-parallel rank %d (pid %s) exited with code "
                             "%s; stopping the server (every rank)", rank.rank, rank.proc.pid,
                             rank.proc.exitcode)
                return 1
            dead = next((c for c in servers if not c.proc.is_alive()), None)
            if dead is not None:
                logger.error("%s (pid %s) exited with code %s; stopping the whole server "
                             "(API servers are not replaced)", dead.name, dead.proc.pid,
                             dead.proc.exitcode)
                return 1
            for child in servers:
                if child.name in pending and child.ready.is_set():
                    pending.discard(child.name)
                    if not pending:
                        logger.info("serving on http://%s:%d with %d API server processes "
                                    "(pids %s)", settings.host, settings.port, len(servers),
                                    ", ".join(str(c.proc.pid) for c in servers))
            if (pending and engine is None and not dp_engines
                    and time.monotonic() - start > _API_SERVER_START_S):
                logger.error("API server(s) %s did not start in %.0f s", sorted(pending),
                             _API_SERVER_START_S)
                return 1
        sentinels = [c.proc.sentinel for c in servers if c.proc.is_alive()]
        if engine is not None and engine.is_alive():
            sentinels.append(engine.sentinel)
        sentinels += [e.proc.sentinel for e in dp_engines if e.proc.is_alive()]
        multiprocessing.connection.wait(sentinels, timeout=_POLL_S)


# --- one API server process -----------------------------------------------------------------------


def run_api_server(index: int, count: int, settings: ServerSettings, engine_addresses: list[str],
                   config_bytes: bytes | None, tokenizer: str | None, board_memory: Any,
                   ready: Any, peer_addresses: list[str] | None = None) -> None:
    """Entry point of API server ``index`` (a ``multiprocessing`` target). Several
    ``engine_addresses``: the data-parallel ranks, each reached by every API server."""
    from tidal.engine_core.core_proc import setup_logging, watch_parent

    setup_logging(f"APIServer-{index}")
    from tidal.engine_core.plugins import load_general_plugins

    load_general_plugins()
    for sig in (signal.SIGINT, signal.SIGTERM):  # the supervisor passes them on as _DRAIN
        signal.signal(sig, signal.SIG_IGN)
    watch_parent(_DRAIN)
    import uvloop

    sys.exit(uvloop.run(_serve_one(index, count, settings, engine_addresses, config_bytes,
                                   tokenizer, board_memory, ready, peer_addresses)))


async def _serve_one(index: int, count: int, settings: ServerSettings, engine_addresses: list[str],
                     config_bytes: bytes | None, tokenizer: str | None, board_memory: Any,
                     ready: Any, peer_addresses: list[str] | None) -> int:
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.dp_client import DPAsyncClient
    from tidal.frontend.mp_client import EngineConnection, EngineStartupError, MPAsyncClient
    from tidal.frontend.server.admission import AdmissionBoard
    from tidal.frontend.server.app import serve
    from tidal.frontend.tokenizer import load_tokenizer

    try:
        if config_bytes is None:  # a standalone engine-core: its config comes with READY
            engine = AsyncLLM.from_address(engine_addresses[0], tokenizer=tokenizer,
                                           timeout_s=settings.engine_connect_timeout,
                                           stream_interval=settings.stream_interval)
        else:
            # HELLO goes out now; the tokenizer loads while the engine starts (the supervisor
            # ends this process if the engine dies, so no deadline of its own here).
            conns: list[EngineConnection] = []
            try:
                for address in engine_addresses:
                    conns.append(EngineConnection.connect(address))
                tok = load_tokenizer(msgspec.msgpack.decode(config_bytes,
                                                            type=EngineConfig).model)
                for conn in conns:
                    conn.wait_ready(timeout_s=math.inf)
            except BaseException:
                for conn in conns:
                    conn.close()
                raise
            clients = [MPAsyncClient(conn) for conn in conns]
            engine = AsyncLLM(clients[0] if len(clients) == 1 else DPAsyncClient(clients), tok,
                              settings.stream_interval)
    except (EngineStartupError, ValueError, OSError) as exc:
        logger.error("API server %d could not connect to the engine: %s", index, exc)
        return 1
    board = AdmissionBoard.attach(board_memory, index)
    return await serve(engine, settings, reuse_port=True, board=board, on_ready=ready.set,
                       label=f"API server {index + 1}/{count}", stop_signals=(_DRAIN,),
                       response_peers=None if not peer_addresses else (index, peer_addresses))
