"""The aiohttp application: routes, the error/auth middleware, and the server's lifecycle.

Lifecycle: serve until SIGTERM/SIGINT, then drain: ``/health`` and new requests answer 503 while
in-flight requests finish, for up to ``--shutdown-timeout`` seconds; what is still running then
is aborted (its clients see ``finish_reason="abort"``), the listener closes, the engine shuts
down, and ``serve`` returns 0. If the engine dies, the server fails in-flight requests, turns
``/health`` to 503, and returns 1.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from tidal.engine_core.gc_control import freeze_startup_objects
from tidal.engine_core.protocol import SchedulerStats
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.output_processor import StepRecord
from tidal.frontend.server.admission import Admission, AdmissionBoard
from tidal.frontend.server.auth import check_api_key
from tidal.frontend.server.common import json_response
from tidal.frontend.server.errors import APIError, internal_error
from tidal.frontend.server.metrics import CONTENT_TYPE, ServerMetrics
from tidal.frontend.server.openai_protocol import ModelCard, ModelList
from tidal.frontend.server.serving_chat import create_chat_completion
from tidal.frontend.server.serving_completions import create_completion
from tidal.frontend.server.serving_embeddings import create_embedding
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
        if state.settings.api_key is not None:
            check_api_key(request, state.settings.api_key.encode("utf-8"))
        return await handler(request)
    except APIError as err:
        state.metrics.error(err.status)
        return err.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        err = _http_error(request, exc)
        state.metrics.error(err.status)
        return err.response()
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - logged with its traceback, hidden from the client
        ref = f"req-{uuid.uuid4().hex[:12]}"
        logger.error("unhandled error in %s %s (%s)", request.method, request.path, ref,
                     exc_info=exc)
        state.metrics.error(500)
        return internal_error(ref).response()


def _http_error(request: web.Request, exc: web.HTTPException) -> APIError:
    if exc.status == 404:
        return APIError(404, f"no such endpoint: {request.method} {request.path[:200]}; see "
                        "GET /v1/models, POST /v1/completions, /v1/chat/completions, "
                        "/v1/embeddings", code="not_found")
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
    try:
        await state.engine.check_health()
    except Exception:  # noqa: BLE001 - any failure means "not healthy"
        state.admission.engine_dead = True
        raise APIError(503, "the engine has stopped; this server cannot take requests",
                       code="engine_dead") from None


async def version(request: web.Request) -> web.Response:
    return json_response({"version": _version()})


async def models(request: web.Request) -> web.Response:
    state = get_state(request)
    card = ModelCard(id=state.model_name, created=state.created,
                     max_model_len=state.max_model_len, root=state.model_name)
    return json_response(ModelList(data=[card]))


async def metrics(request: web.Request) -> web.Response:
    state = get_state(request)
    return web.Response(body=state.metrics.render(),
                        headers={"Content-Type": CONTENT_TYPE})


# --- the app -------------------------------------------------------------------------------------


def create_state(engine: AsyncLLM, settings: ServerSettings,
                 board: AdmissionBoard | None = None) -> ServerState:
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
        metrics=ServerMetrics(model_name),
        model_name=model_name,
        max_model_len=config.model.max_model_len,
        task=config.model.task,
    )

    def observe(stats: SchedulerStats | None, record: StepRecord) -> None:
        if stats is not None:
            state.admission.engine_waiting = stats.num_waiting
        state.metrics.observe_step(stats, record)

    engine.add_stat_observer(observe)
    return state


def build_app(state: ServerState) -> web.Application:
    # The body limit is checked again by the handlers, to answer 413 in the API's envelope.
    app = web.Application(client_max_size=state.limits.max_body_bytes,
                          middlewares=[error_middleware])
    app[STATE_KEY] = state
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", create_completion)
    app.router.add_post("/v1/chat/completions", create_chat_completion)
    app.router.add_post("/v1/embeddings", create_embedding)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
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
                ) -> int:
    """Serve until a stop signal (returns 0 after draining) or the engine's death (returns 1).
    Listens on ``sock`` (from ``bind_socket``) or binds now; shuts the engine down before
    returning. Raises ``ServerStartError`` if it cannot listen.

    ``reuse_port``, ``board``: one of several API server processes (``api_servers``): bind
    the shared port, keep admission counts on the shared board. ``on_ready`` is called once
    the server listens. ``stop_signals``: the first drains, a second aborts what runs."""
    try:
        # Before the metrics observe the engine: the warm-up is no client's request.
        seconds = await warm_up(engine)
    except BaseException:
        if sock is not None:
            sock.close()
        engine.shutdown()
        raise
    logger.info("%s warmed up with one request in %.3f s", label, seconds)
    state = create_state(engine, settings, board)
    app = build_app(state)
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # requests in the engine (non-streaming ones included).
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0,
                           access_log=logger if settings.access_log else None)
    await runner.setup()
    try:
        if sock is None:
            sock = bind_socket(settings, reuse_port)
        freeze_startup_objects()
        await web.SockSite(runner, sock, backlog=_LISTEN_BACKLOG).start()
    except BaseException:
        await runner.cleanup()
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
        await runner.cleanup()
        engine.shutdown()
    logger.info("%s stopped (exit code %d)", label, code)
    return code


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
    # check_health also notices an engine that died while idle (no output loop running).
    while True:
        await asyncio.sleep(_ENGINE_POLL_S)
        try:
            await state.engine.check_health()
        except Exception:  # noqa: BLE001 - any failure means the engine is gone
            state.admission.engine_dead = True
        if state.admission.engine_dead:
            logger.error("the engine died (%s); the server stops",
                         state.engine.dead_error or "health check failed")
            stop.set()
            return
