"""The aiohttp application: routes, the error/auth middleware, and the server's lifecycle.

Lifecycle: serve until SIGTERM/SIGINT, then drain: ``/health`` and new requests answer 503 while
in-flight requests finish, for up to ``--shutdown-timeout`` seconds; what is still running then
is aborted (its clients see ``finish_reason="abort"``), the listener closes, the engine shuts
down, and ``serve`` returns 0. If the engine dies, the server fails in-flight requests, turns
``/health`` to 503, and returns 1; a server of a standalone ``engine-core`` (``--engine-address``)
instead stays up, answering 503 ``engine_unavailable`` until the engine is back at its address.
A stall (requests wait, no engine step finishes for ``--engine-stall-timeout`` s) turns
``/health`` to 503 ``engine_stalled`` until the engine makes progress again.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
from aiohttp import web

from tidal.engine_core.gc_control import freeze_startup_objects
from tidal.engine_core.plugins import PluginError
from tidal.engine_core.protocol import SchedulerStats
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.output_processor import StepRecord
from tidal.frontend.server.admission import Admission, AdmissionBoard
from tidal.frontend.server.anthropic_protocol import error_response as anthropic_error_response
from tidal.frontend.server.auth import PUBLIC_PATHS, check_api_key
from tidal.frontend.server.common import json_response, read_body
from tidal.frontend.server.connections import (
    GuardedAppRunner,
    connection_limits,
    raise_fd_limit,
)
from tidal.frontend.server.errors import (
    APIError,
    engine_stalled,
    engine_unavailable,
    internal_error,
)
from tidal.frontend.server.lora_models import FilesystemResolver, LoRAModels
from tidal.frontend.server.metrics import CONTENT_TYPE, ServerMetrics
from tidal.frontend.server.openai_protocol import ModelCard, ModelList
from tidal.frontend.server.response_background import BackgroundResponses
from tidal.frontend.server.response_peers import ResponsePeers
from tidal.frontend.server.response_store import ResponseStore
from tidal.frontend.server.server_plugins import ServerPlugins
from tidal.frontend.server.serving_chat import create_chat_completion
from tidal.frontend.server.serving_completions import create_completion
from tidal.frontend.server.serving_embeddings import create_embedding
from tidal.frontend.server.serving_responses import (
    cancel_response,
    create_response,
    delete_response,
    get_response,
    list_input_items,
)
from tidal.frontend.server.serving_messages import count_message_tokens, create_message
from tidal.frontend.server.serving_io_processor import io_processor
from tidal.frontend.server.serving_tokenize import detokenize, tokenize
from tidal.frontend.server.state import STATE_KEY, ServerSettings, ServerState, get_state

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

class ServerStartError(RuntimeError):
    """The server could not listen (the message says where and why)."""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Connections the kernel may queue before the server accepts them. Python's default (128)
# overflows under a burst: the dropped SYNs are retried after 1, 3, 7 s, which showed as
# 10-20 s first-token times for 2,000 requests sent at once. Capped by net.core.somaxconn.
_LISTEN_BACKLOG = 4096
# After the drain, how long aborted requests get to send their last chunk.
_ABORT_GRACE_S = 5.0
_ENGINE_POLL_S = 0.5


def _version() -> str:
    try:
        return importlib.metadata.version("tidal")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# --- middleware ----------------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's envelope; unexpected ones are logged, never shown."""
    state = get_state(request)
    try:
        if (state.settings.api_key is not None
                and route_path(request.path, state.settings.root_path) not in PUBLIC_PATHS):
            check_api_key(request, state.settings.api_key.encode("utf-8"))
        return await handler(request)
    except APIError as err:
        state.metrics.error(err.status)
        return _error_response(request, err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = _http_error(request, exc)
        state.metrics.error(err.status)
        return _error_response(request, err)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - logged with its traceback, hidden from the client
        ref = f"req-{uuid.uuid4().hex[:12]}"
        logger.error("unhandled error in %s %s (%s)", request.method, request.path, ref,
                     exc_info=exc)
        state.metrics.error(500)
        return _error_response(request, internal_error(ref))


def _error_response(request: web.Request, err: APIError) -> web.Response:
    """Anthropic's envelope on its API's paths (its clients read only that), OpenAI's
    elsewhere."""
    path = route_path(request.path, get_state(request).settings.root_path)
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic_error_response(err)
    return err.response()


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(404, f"no such endpoint: {request.method} {request.path[:200]}; see "
                        "GET /v1/models, POST /v1/completions, /v1/chat/completions, "
                        "/v1/embeddings, /v1/messages, /v1/responses", code="not_found")
    if exc.status == 405:
        return APIError(405, f"{request.method} is not allowed on {request.path[:200]}",
                        code="method_not_allowed")
    if exc.status == 413:
        return APIError(413, "the request body is too large; send fewer or shorter prompts per "
                        "request", code="request_too_large")
    return APIError(exc.status, exc.reason or "the request failed")


# --- small endpoints -----------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    state = get_state(request)
    await _engine_health(state)
    state.admission.check_available()
    return web.Response(status=200)


async def _engine_health(state: ServerState) -> None:
    """503 unless the engine lives, is reachable, and makes progress on the work it has."""
    from tidal.frontend.async_llm import EngineUnavailableError

    try:
        await state.engine.check_health()
    except EngineUnavailableError:
        state.admission.engine_unavailable = True
        raise engine_unavailable() from None  # a standalone engine-core, gone for now
    except Exception:  # noqa: BLE001 - any other failure means "not healthy", for good
        state.admission.engine_dead = True
        raise APIError(503, "the engine has stopped; this server cannot take requests",
                       code="engine_dead") from None
    state.admission.engine_unavailable = False
    stalled = state.engine.seconds_without_progress()
    if stalled >= state.settings.engine_stall_timeout:
        raise engine_stalled(stalled)


async def version(request: web.Request) -> web.Response:
    return json_response({"version": _version()})


async def models(request: web.Request) -> web.Response:
    state = get_state(request)
    card = ModelCard(id=state.model_name, created=state.created,
                     max_model_len=state.max_model_len, root=state.model_name)
    cards = [card]
    if state.loras is not None:
        cards += [ModelCard(id=name, created=state.created, max_model_len=state.max_model_len,
                            root=lora.lora_path, parent=state.model_name)
                  for name, lora in state.loras.by_name.items()]
    return json_response(ModelList(data=cards))


async def _json_object(request: web.Request, state: ServerState) -> dict:
    raw = await read_body(request, state)
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        raise APIError(400, "the request body is not valid JSON; send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def _loras(state: ServerState) -> LoRAModels:
    if state.loras is None:
        raise APIError(400, "this server runs no LoRA adapters: start it with --enable-lora "
                       "(and TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1 to load them at run time)",
                       code="lora_disabled")
    return state.loras


async def load_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/load_lora_adapter`` {lora_name, lora_path}."""
    state = get_state(request)
    if not state.settings.allow_runtime_lora_updating:
        _runtime_lora_off()
    body = await _json_object(request, state)
    lora = await _loras(state).load(body.get("lora_name"), body.get("lora_path"))
    return web.Response(text=f"Success: LoRA adapter '{lora.lora_name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """vLLM's ``POST /v1/unload_lora_adapter`` {lora_name}."""
    state = get_state(request)
    if not state.settings.allow_runtime_lora_updating:
        _runtime_lora_off()
    body = await _json_object(request, state)
    name = body.get("lora_name")
    await _loras(state).unload(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _runtime_lora_off() -> None:
    raise APIError(404, "loading and unloading LoRA adapters at run time is off; start the "
                   "server with TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora (one API "
                   "server process) to allow it", code="not_found")


async def metrics(request: web.Request) -> web.Response:
    state = get_state(request)
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE})


async def load(request: web.Request) -> web.Response:
    """vLLM's ``GET /load``: generation requests in flight on the whole server (every API
    server process), counted only with ``--enable-server-load-tracking``; 0 without it, as
    vLLM answers."""
    state = get_state(request)
    count = state.admission.board.load_total() if state.settings.enable_server_load_tracking \
        else 0
    return json_response({"server_load": count})


def _count_load(handler: Handler) -> Handler:
    """``handler`` counted in ``/load`` while it runs (a stream until its last chunk)."""

    @functools.wraps(handler)
    async def counted(request: web.Request) -> web.StreamResponse:
        board = get_state(request).admission.board
        board.add_load(1)
        try:
            return await handler(request)
        finally:
            board.add_load(-1)

    return counted


def route_path(path: str, root_path: str) -> str:
    """``path`` without the ``--root-path`` prefix, if it has it."""
    if root_path and path.startswith(root_path) and (len(path) == len(root_path)
                                                      or path[len(root_path)] == "/"):
        return path[len(root_path):] or "/"
    return path


# --- the app -------------------------------------------------------------------------------------


def create_state(engine: AsyncLLM, settings: ServerSettings,
                 board: AdmissionBoard | None = None,
                 plugins: ServerPlugins | None = None) -> ServerState:
    config = engine.config
    model_name = config.model.served_model_name
    max_queued = settings.max_queued_requests
    if max_queued is None:
        max_queued = config.scheduler.max_queued_requests
    state = ServerState(
        engine=engine,
        settings=settings,
        admission=Admission(max_num_seqs=config.scheduler.max_num_seqs, max_queued=max_queued,
                            board=board or AdmissionBoard.private()),
        metrics=ServerMetrics.from_config(config, settings.metrics_prefix),
        model_name=model_name,
        max_model_len=config.model.max_model_len,
        task=config.model.task,
        responses=ResponseStore(settings.max_stored_responses,
                                settings.max_stored_response_bytes),
        # A running background response is never evicted: half the store at most.
        background=BackgroundResponses(max(1, settings.max_stored_responses // 2),
                                       settings.max_stored_response_bytes),
        plugins=plugins or ServerPlugins(),
    )
    if getattr(config, "lora", None) is not None:
        state.loras = LoRAModels(engine, model_name, True,
                                 runtime_updates=settings.allow_runtime_lora_updating,
                                 resolvers=state.plugins.lora_resolvers)

    def observe(stats: SchedulerStats | None, record: StepRecord) -> None:
        if stats is not None:
            state.admission.engine_waiting = stats.num_waiting
        state.metrics.observe_step(stats, record)
        if state.plugins.stat_loggers:
            state.plugins.record(stats, record)

    engine.add_stat_observer(observe)
    engine.add_abort_observer(state.metrics.aborted)
    return state


def build_app(state: ServerState) -> web.Application:
    """The routes, each served at its path and, with ``--root-path /p``, at ``/p`` + its path
    too: behind a proxy that strips the prefix, and for clients that send it (a proxy that
    does not strip it, or a client talking to the server directly with the public URL)."""
    # The body limit is checked again by the handlers, to answer 413 in the API's envelope.
    app = web.Application(client_max_size=state.limits.max_body_bytes,
                          middlewares=[error_middleware])
    app[STATE_KEY] = state
    get_routes: list[tuple[str, Handler]] = [
        ("/health", health), ("/ping", health), ("/version", version), ("/metrics", metrics),
        ("/load", load), ("/v1/models", models),
        ("/v1/responses/{response_id}", get_response),
        ("/v1/responses/{response_id}/input_items", list_input_items)]
    # (path, handler, counted in /load: the generation endpoints, as vLLM counts them)
    post_routes: list[tuple[str, Handler, bool]] = [
        ("/v1/completions", create_completion, True),
        ("/v1/chat/completions", create_chat_completion, True),
        ("/v1/responses", create_response, True),
        ("/v1/responses/{response_id}/cancel", cancel_response, False),
        ("/v1/messages", create_message, True),
        ("/v1/messages/count_tokens", count_message_tokens, False),
        ("/v1/embeddings", create_embedding, True),
        ("/tokenize", tokenize, False), ("/detokenize", detokenize, False),
        ("/v1/load_lora_adapter", load_lora_adapter, False),
        ("/v1/unload_lora_adapter", unload_lora_adapter, False),
        ("/v1/io_processor/{name}", io_processor, True)]
    tracking = state.settings.enable_server_load_tracking
    for prefix in ("", state.settings.root_path) if state.settings.root_path else ("",):
        for path, handler in get_routes:
            app.router.add_get(prefix + path, handler)
        for path, handler, counted in post_routes:
            app.router.add_post(prefix + path, _count_load(handler) if counted and tracking
                                else handler)
        app.router.add_delete(prefix + "/v1/responses/{response_id}", delete_response)
    return app


# --- lifecycle -----------------------------------------------------------------------------------


def bind_socket(settings: ServerSettings, reuse_port: bool = False) -> socket.socket:
    """Take the listening address before the (slow) engine start, so a busy port fails at
    once. ``reuse_port``: one of several API server processes sharing the port."""
    try:
        return socket.create_server((settings.host, settings.port), reuse_port=reuse_port,
                                    family=socket.AF_INET6 if ":" in settings.host
                                    else socket.AF_INET, backlog=_LISTEN_BACKLOG)
    except OSError as exc:
        raise ServerStartError(f"cannot listen on {settings.host}:{settings.port}: "
                               f"{exc.strerror or exc}; pick another --port or stop what uses "
                               "it") from None


async def warm_up(engine: AsyncLLM) -> float:
    """One tiny request through this process's whole path (tokenizer, detokenizer, the engine
    round trip, output processing), so that the first client request runs no first-time
    code. Returns the seconds it took."""
    start = time.perf_counter()
    tok = engine.get_tokenizer()
    ids = list(tok.encode("Hello", add_special_tokens=False)) if tok is not None else [1]
    ids = [t for t in ids if 0 <= t < engine.config.model.vocab_size] or [0]
    rid = f"tidal-warm-up-{os.getpid()}"
    if engine.config.model.task == "embed":
        await engine.encode(ids, rid)
    else:
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                output_kind=OutputKind.DELTA)
        async for _ in engine.generate(ids, params, rid):
            pass
    return time.perf_counter() - start


async def serve(engine: AsyncLLM, settings: ServerSettings, sock: socket.socket | None = None,
                *, reuse_port: bool = False, board: AdmissionBoard | None = None,
                on_ready: Callable[[], None] | None = None, label: str = "server",
                stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT),
                response_peers: tuple[int, list[str]] | None = None) -> int:
    """Serve until a stop signal (returns 0 after draining) or the engine's death (returns 1).
    Listens on ``sock`` (from ``bind_socket``) or binds now; shuts the engine down before
    returning. Raises ``ServerStartError`` if it cannot listen.

    ``reuse_port``, ``board``: one of several API server processes (``api_servers``): bind
    the shared port, keep admission counts on the shared board; ``response_peers`` (this
    process's index, every API server's address): stored responses are looked up at the
    others too (response_peers.py). ``on_ready`` is called once the server listens.
    ``stop_signals``: the first drains, a second aborts what runs."""
    try:
        plugins = _load_plugins(engine, settings)
        # Before the metrics observe the engine: the warm-up is no client's request.
        seconds = await warm_up(engine)
    except BaseException:
        if sock is not None:
            sock.close()
        engine.shutdown()
        raise
    logger.info("%s warmed up with one request in %.3f s", label, seconds)
    engine_parser = engine.config.scheduler.reasoning_parser
    if engine_parser != settings.reasoning_parser:
        # (Only an engine-core started apart can differ.) Its grammars would wait for another
        # end of thinking than the one this server's parser splits the replies at.
        if sock is not None:
            sock.close()
        engine.shutdown()
        raise ServerStartError(
            f"the engine was started with --reasoning-parser {engine_parser} and this server "
            f"with {settings.reasoning_parser}: give both the same one")
    state = create_state(engine, settings, board, plugins)
    if settings.lora_modules:
        try:
            assert state.loras is not None  # (the CLI requires --enable-lora)
            await state.loras.register_startup(list(settings.lora_modules))
        except BaseException as exc:
            if sock is not None:
                sock.close()
            engine.shutdown()
            if isinstance(exc, ValueError):
                raise ServerStartError(str(exc)) from None
            raise
    if response_peers is not None:
        index, addresses = response_peers
        state.response_peers = ResponsePeers(index, addresses, state.responses,
                                             state.background.cancel,
                                             state.background.log_of)
        state.response_peers.start()
    app = build_app(state)
    limits = connection_limits(settings, raise_fd_limit())
    logger.info("%s: at most %d connections (--max-connections), header timeout %g s, body "
                "timeout %g s, keep-alive %g s", label, limits.max_connections,
                limits.header_timeout, limits.body_timeout, limits.keep_alive_timeout)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests in the engine (non-streaming ones included).
    runner = GuardedAppRunner(app, limits, on_error=state.metrics.error,
                              handler_cancellation=True, shutdown_timeout=2.0,
                              access_log=logger if settings.access_log else None)
    await runner.setup()
    try:
        if sock is None:
            sock = bind_socket(settings, reuse_port)
        freeze_startup_objects()
        await web.SockSite(runner, sock, backlog=_LISTEN_BACKLOG).start()
    except BaseException:
        await runner.cleanup()
        if state.response_peers is not None:
            await state.response_peers.close()
        engine.shutdown()
        raise
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    force = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            logger.warning("%s again: aborting in-flight requests now", sig.name)
            force.set()
        else:
            logger.info("%s received: draining (up to %.0f s)", sig.name,
                        settings.shutdown_timeout)
            stop.set()

    for sig in stop_signals:
        loop.add_signal_handler(sig, on_signal, sig)
    watchdog = asyncio.create_task(_watch_engine(state, stop), name="tidal-engine-watchdog")
    logger.info("%s: serving %s on http://%s:%d (max_model_len %d)", label, state.model_name,
                settings.host, settings.port, state.max_model_len)
    if on_ready is not None:
        on_ready()
    try:
        await stop.wait()
        state.admission.draining = True
        code = 1 if state.admission.engine_dead else 0
        timeout = _ABORT_GRACE_S if code else settings.shutdown_timeout
        await _drain(state, timeout, force)
    finally:
        watchdog.cancel()
        for sig in stop_signals:
            loop.remove_signal_handler(sig)
        await state.background.close()
        await runner.cleanup()
        if state.response_peers is not None:
            await state.response_peers.close()
        state.plugins.shutdown()
        engine.shutdown()
    logger.info("%s stopped (exit code %d)", label, code)
    return code


def _load_plugins(engine: AsyncLLM, settings: ServerSettings) -> ServerPlugins:
    """This process's plugins (server_plugins.py); one that fails stops start-up, named."""
    config = engine.config
    if getattr(config, "lora", None) is None and (settings.lora_modules
                                                   or settings.lora_resolver_dir):
        raise ServerStartError("--lora-modules and --lora-resolver-dir need --enable-lora")
    builtin = {}
    if settings.lora_resolver_dir is not None:
        builtin["filesystem"] = FilesystemResolver(settings.lora_resolver_dir)
    try:
        return ServerPlugins.load(config, engine.get_tokenizer(),
                                  log_stats=not settings.disable_log_stats,
                                  lora_resolvers=builtin)
    except PluginError as exc:
        raise ServerStartError(str(exc)) from None


async def _drain(state: ServerState, timeout: float, force: asyncio.Event) -> None:
    admission = state.admission
    if admission.num_in_flight:
        logger.info("waiting for %d in-flight request(s)", admission.num_in_flight)
        forced = asyncio.create_task(force.wait())
        idle = asyncio.create_task(admission.wait_idle(timeout))
        await asyncio.wait({forced, idle}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        idle.cancel()
    if admission.num_in_flight:
        n = admission.abort_all()
        logger.warning("shutdown timeout: aborted %d request(s) still running", n)
        if not await admission.wait_idle(_ABORT_GRACE_S):
            logger.warning("%d request(s) did not end in time; closing their connections",
                           admission.num_in_flight)


async def _watch_engine(state: ServerState, stop: asyncio.Event) -> None:
    """Stop the server when the engine dies. A standalone engine-core that is gone is waited
    for instead (the client reconnects; 503 engine_unavailable meanwhile), and a stall is only
    logged, when it begins and when it ends (``/health`` answers 503 engine_stalled)."""
    from tidal.frontend.async_llm import EngineUnavailableError

    unavailable_since: float | None = None
    stalled_since: float | None = None
    timeout = state.settings.engine_stall_timeout
    # check_health also notices an engine that died while idle (no output loop running).
    while True:
        await asyncio.sleep(_ENGINE_POLL_S)
        try:
            await state.engine.check_health()
        except EngineUnavailableError as exc:
            state.admission.engine_unavailable = True
            if unavailable_since is None:
                unavailable_since = time.monotonic()
                logger.error("the engine is unavailable (%s); answering 503 engine_unavailable "
                             "until it is back", exc)
            continue
        except Exception:  # noqa: BLE001 - any other failure means the engine is gone
            state.admission.engine_dead = True
        if state.admission.engine_dead:
            logger.error("the engine died (%s); the server stops",
                         state.engine.dead_error or "health check failed")
            stop.set()
            return
        if unavailable_since is not None:
            state.admission.engine_unavailable = False
            logger.info("the engine is back after %.1f s", time.monotonic() - unavailable_since)
            unavailable_since = None
        waited = state.engine.seconds_without_progress()
        if stalled_since is None and waited >= timeout:
            stalled_since = time.monotonic() - waited
            logger.warning("the engine is stalled: no step finished for %.0f s while %d "
                           "request(s) wait; /health answers 503 engine_stalled", waited,
                           state.admission.num_in_flight)
        elif stalled_since is not None and waited < timeout:
            logger.warning("the engine made progress again after a stall of %.1f s",
                           time.monotonic() - stalled_since - waited)
            stalled_since = None
