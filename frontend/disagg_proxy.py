"""``tidal disagg-proxy``: one OpenAI endpoint in front of a prefill and a decode instance.

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to the prefill instance
(``kv_role: kv_producer``) as a whole (non-streamed) request of one token with
``kv_transfer_params: {"do_remote_decode": true}``; its answer's ``kv_transfer_params`` say where
the prompt's KV waits. The original request then goes to the decode instance (``kv_consumer``)
with those params, and the decode instance's answer (streamed or not) is relayed to the client
as it comes. A prefill that returns no params (it could not keep the KV) leaves the decode
instance to compute the prompt itself: slower, same answer. Errors of either instance are
relayed as they are (OpenAI envelopes); an instance that cannot be reached is a 502 envelope.
``/health`` is 200 only while both instances are healthy; ``/v1/models`` is the decode
instance's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from tidal.frontend.server.errors import APIError, bad_request

logger = logging.getLogger(__name__)

PARAM = "kv_transfer_params"
MAX_BODY_BYTES = 4 << 20  # as the API server's default
# Headers passed on to the instances (authentication and request tracing).
_FORWARDED = ("Authorization", "X-Request-Id")
_HEALTH_TIMEOUT_S = 5.0


@dataclass(slots=True, frozen=True)
class ProxyConfig:
    prefill_url: str  # base URL of the prefill instance, e.g. http://127.0.0.1:8100
    decode_url: str
    host: str = "127.0.0.1"
    port: int = 8000
    # Seconds one instance may take for one request (a long decode streams within it).
    request_timeout_s: float = 600.0


class Proxy:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.prefill = config.prefill_url.rstrip("/")
        self.decode = config.decode_url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None
        # Requests whose prefill gave no KV to pull (the decode instance computed the prompt).
        self.prefill_fallbacks = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy is not started"
        return self._session

    async def start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.request_timeout_s)
        # No connection limit of aiohttp's own (100): the instances bound their queues.
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

    async def stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.stop)
        return app

    # --- handlers ------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._disaggregated(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._disaggregated(request, "/v1/chat/completions", chat=True)

    async def _disaggregated(self, request: web.Request, path: str,
                             chat: bool) -> web.StreamResponse:
        body = await _read_json(request)
        if body.get(PARAM) is not None:
            raise bad_request("kv_transfer_params is set by the proxy; send the request "
                              "without it", PARAM)
        headers = {h: request.headers[h] for h in _FORWARDED if h in request.headers}
        params = await self._prefill(path, prefill_body(body, chat), headers)
        if params is None:
            self.prefill_fallbacks += 1
            decode_body = body
        else:
            decode_body = dict(body)
            decode_body[PARAM] = params
        return await self._relay(request, self.decode + path, decode_body, headers, "decode")

    async def _prefill(self, path: str, body: dict[str, Any],
                       headers: dict[str, str]) -> dict[str, Any] | None:
        """The prefill instance's ``kv_transfer_params``; its error is the client's error."""
        try:
            async with self.session.post(self.prefill + path, json=body,
                                         headers=headers) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise _Relayed(resp.status, raw, resp.content_type)
        except aiohttp.ClientError as exc:
            raise _unreachable("prefill", exc) from None
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise APIError(502, "the prefill instance answered with something other than "
                           "JSON", code="bad_gateway") from None
        params = answer.get(PARAM) if isinstance(answer, dict) else None
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            logger.warning("the prefill instance kept no KV for this request (its answer has "
                           "no %s); the decode instance computes the prompt", PARAM)
            return None
        return params

    async def _relay(self, request: web.Request, url: str, body: dict[str, Any],
                     headers: dict[str, str], who: str) -> web.StreamResponse:
        """POST ``body`` to ``url`` and pass the answer on as it arrives (SSE included)."""
        try:
            async with self.session.post(url, json=body, headers=headers) as resp:
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    raw = await resp.read()
                    return web.Response(status=resp.status, body=raw,
                                        content_type=resp.content_type)
                out = web.StreamResponse(status=200, headers={
                    "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except aiohttp.ClientError as exc:
            raise _unreachable(who, exc) from None

    async def health(self, request: web.Request) -> web.Response:
        prefill, decode = await asyncio.gather(self._health_of(self.prefill),
                                               self._health_of(self.decode))
        ok = prefill == decode == 200
        return web.json_response({"prefill": prefill, "decode": decode},
                                 status=200 if ok else 503)

    async def _health_of(self, base: str) -> int:
        try:
            async with self.session.get(base + "/health",
                                        timeout=aiohttp.ClientTimeout(
                                            total=_HEALTH_TIMEOUT_S)) as resp:
                return resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return 0  # unreachable

    async def models(self, request: web.Request) -> web.Response:
        headers = {h: request.headers[h] for h in _FORWARDED if h in request.headers}
        try:
            async with self.session.get(self.decode + "/v1/models", headers=headers) as resp:
                return web.Response(status=resp.status, body=await resp.read(),
                                    content_type=resp.content_type)
        except aiohttp.ClientError as exc:
            raise _unreachable("decode", exc) from None


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill instance's request: the client's, computing one token, whole, with the
    request to keep its KV for a remote decode."""
    out = dict(body)
    for key in ("stream", "stream_options", "min_tokens", "max_tokens", "max_completion_tokens"):
        out.pop(key, None)
    out["max_completion_tokens" if chat else "max_tokens"] = 1
    out["stream"] = False
    out[PARAM] = {"do_remote_decode": True}
    return out


class _Relayed(Exception):
    """An instance's own error answer, passed to the client as it is."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status = status
        self.body = body
        self.content_type = content_type


def _unreachable(who: str, exc: BaseException) -> APIError:
    logger.warning("the %s instance cannot be reached: %s", who, exc)
    return APIError(502, f"the {who} instance cannot be reached ({type(exc).__name__})",
                    code="bad_gateway")


async def _read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes") from None
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except _Relayed as exc:
        return web.Response(status=exc.status, body=exc.body, content_type=exc.content_type)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return APIError(exc.status, exc.reason or "request failed").response()


def add_proxy_args(parser: argparse.ArgumentParser) -> None:
    # (Required: no default to show.)
    parser.add_argument("--prefill", required=True, metavar="URL", default=argparse.SUPPRESS,
                        help="base URL of the prefill instance (tidal serve with kv_role "
                             "kv_producer), e.g. http://127.0.0.1:8100; required, no default")
    parser.add_argument("--decode", required=True, metavar="URL", default=argparse.SUPPRESS,
                        help="base URL of the decode instance (kv_role kv_consumer); "
                             "required, no default")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds one instance may take for one request")


def run_proxy(ns: argparse.Namespace) -> int:
    for name in ("prefill", "decode"):
        url = getattr(ns, name)
        if not url.startswith(("http://", "https://")):
            raise SystemExit(f"tidal disagg-proxy: --{name} must be an http(s) URL, got {url!r}")
    if not 0 < ns.port < 65536:
        raise SystemExit(f"tidal disagg-proxy: --port must be in 1..65535, got {ns.port}")
    if not ns.request_timeout > 0:
        raise SystemExit("tidal disagg-proxy: --request-timeout must be positive")
    config = ProxyConfig(ns.prefill, ns.decode, ns.host, ns.port, ns.request_timeout)
    logger.info("disaggregated proxy on http://%s:%d: prefill %s, decode %s", config.host,
                config.port, config.prefill_url, config.decode_url)
    web.run_app(Proxy(config).app(), host=config.host, port=config.port, print=None)
    return 0
