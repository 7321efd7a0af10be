"""The HTTP server's guard against connections that cost a file descriptor and do no work.

An API server process keeps one file descriptor per open connection; with the soft open-file
limit most systems start processes with (1,024), a thousand sockets that send half a request
header and stop were enough to make ``accept`` fail and the server answer nobody. So:

* ``raise_fd_limit``: at start-up the soft ``RLIMIT_NOFILE`` goes up to the hard limit (a warning
  if even that is low).
* ``--max-connections`` (per API server process; default from the open-file limit, see
  ``default_max_connections``): when every slot is taken, a new connection first **evicts the
  connection that has been idle the longest** (one with no request in progress: a half-sent
  header, or an idle keep-alive connection); only if every connection is busy with a request
  is the newcomer refused, at once, with a 503 in OpenAI's envelope (``too_many_connections``,
  ``Retry-After: 1``, ``Connection: close``: the ``openai`` client retries it with backoff).
  Requests in progress, streams included, are never cut to make room, and idle sockets never
  lock out a client that has a request to send.
* ``--header-timeout``: a connection must deliver a complete request header within that many
  seconds of opening, or of the first byte of its next request on a kept-alive connection; else
  it is closed (with a 408 if part of a header came). ``--body-timeout``: the body must arrive
  within that many seconds of its header; else the request is answered 408 and the connection
  closed. ``--keep-alive-timeout``: an idle kept-alive connection is closed after that long
  (longer than load balancers' usual idle timeouts, 60 s, so a proxy never reuses a connection
  the server is closing). None of these runs while a request is being handled: a long stream
  is never cut.
* Malformed requests that aiohttp rejects before routing (a header field over 8,190 bytes, too
  many headers, garbage on the request line) are answered in OpenAI's envelope, never echoing
  what was sent: 431 for header size (the status that names the part to shrink; clients do not
  retry it), 400 otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from aiohttp import web
from aiohttp.http_exceptions import BadStatusLine, HttpProcessingError, LineTooLong
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse
from aiohttp.web_server import Server

from tidal.frontend.server.errors import APIError, internal_error
from tidal.frontend.server.state import ServerSettings

logger = logging.getLogger(__name__)

# File descriptors kept free of connections: ZMQ sockets, the engine's pipes, model and
# tokenizer files, log files, and the short-lived ones of refused connections.
FD_RESERVE_MIN = 256
# The default connection bound stops here even with a huge open-file limit: each open
# connection holds a few tens of KiB (parser, buffers, a task).
DEFAULT_MAX_CONNECTIONS_CAP = 65536
# Below this hard limit the server cannot hold many clients; say so at start-up.
LOW_FD_LIMIT = 4096
# aiohttp's limits on one header field / the request line, and on the number of fields.
MAX_HEADER_FIELD_BYTES = 8190
MAX_HEADER_FIELDS = 128
# A refused connection is held at most this long to let its client read the 503.
_REFUSAL_LINGER_S = 1.0

OnError = Callable[[int], None]


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns the soft limit now in force.
    Children started afterwards inherit it."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        # The kernel caps RLIMIT_NOFILE at fs.nr_open; "unlimited" cannot be set.
        target = _nr_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft,
                           target, exc)
        else:
            logger.info("raised the open-file soft limit (RLIMIT_NOFILE) from %d to the hard "
                        "limit %d", soft, target)
            soft = target
    if soft == resource.RLIM_INFINITY:
        soft = _nr_open()
    if soft < LOW_FD_LIMIT:
        logger.warning("the open-file limit is %d: this server can hold at most about %d "
                       "connections per process; raise the hard limit (ulimit -Hn, "
                       "LimitNOFILE= in systemd, --ulimit nofile= in Docker)", soft,
                       default_max_connections(soft))
    return soft


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open", encoding="ascii") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20


def default_max_connections(fd_limit: int) -> int:
    """Connections one API server process may hold: its open-file limit less a reserve
    (an eighth, at least ``FD_RESERVE_MIN``), at most ``DEFAULT_MAX_CONNECTIONS_CAP``."""
    reserve = max(FD_RESERVE_MIN, fd_limit // 8)
    return max(1, min(DEFAULT_MAX_CONNECTIONS_CAP, fd_limit - reserve))


@dataclass(slots=True, frozen=True)
class ConnectionLimits:
    max_connections: int
    header_timeout: float  # seconds
    body_timeout: float  # seconds
    keep_alive_timeout: float  # seconds

    @property
    def refusal_burst(self) -> int:
        """Refused connections answered at a time; beyond it they are reset at once, so a
        flood cannot pin descriptors while it waits for its 503."""
        return max(16, self.max_connections // 16)


class BodyTimeoutError(APIError, TimeoutError):
    """Set on a request body that did not arrive in time: the handler reading it answers 408,
    and aiohttp, which drains unread bodies after a response, stops at it quietly (it is a
    ``TimeoutError``) and closes the connection."""

    def __init__(self, seconds: float) -> None:
        super().__init__(408, f"the request body did not arrive within {seconds:g} s of its "
                         "header (--body-timeout); send it faster, or in smaller requests",
                         code="body_timeout", headers={"Connection": "close"})


def _raw_response(err: APIError) -> bytes:
    """``err`` as a whole HTTP/1.1 response that closes the connection, for a socket that
    has no request object to answer through."""
    body = err.body()
    head = [f"HTTP/1.1 {err.status} {_REASONS.get(err.status, 'Error')}",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            "Connection: close", *(f"{k}: {v}" for k, v in (err.headers or {}).items()
                                   if k.lower() != "connection")]
    return ("\r\n".join(head) + "\r\n\r\n").encode("ascii") + body


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


def protocol_error(status: int, exc: BaseException | None) -> APIError:
    """What a request that aiohttp rejected before routing gets. Never repeats what the
    client sent (aiohttp's own messages quote the offending header)."""
    if status >= 500:
        return internal_error(None)
    if isinstance(exc, LineTooLong):
        return APIError(431, f"a request header field or the request line is longer than "
                        f"{MAX_HEADER_FIELD_BYTES} bytes; send smaller headers (large values "
                        "belong in the JSON body)", code="header_too_large")
    message = exc.message if isinstance(exc, HttpProcessingError) else ""
    if "Too many headers" in message:
        return APIError(431, f"the request has more than {MAX_HEADER_FIELDS} header fields",
                        code="header_too_large")
    if isinstance(exc, BadStatusLine):
        hint = ("TLS was sent to a plain-HTTP port: use http://, not https://"
                if "HTTPS" in message else "the request line is not valid HTTP/1.x")
        return APIError(400, hint, code="bad_http_request")
    kind = type(exc).__name__ if exc is not None else "malformed request"
    return APIError(400, f"the HTTP request is malformed ({kind}); the server could not parse "
                    "it", code="bad_http_request")


class GuardedHandler(RequestHandler):
    """aiohttp's per-connection protocol plus the header and body deadlines, and the
    bookkeeping the connection bound needs (is a request in progress?)."""

    __slots__ = ("_guard", "_header_timer", "_body_timer", "_body", "_parsed", "_finished",
                 "_header_bytes", "_counted")

    def __init__(self, manager: GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._body: StreamReader | None = None  # the latest request's body, until complete
        self._parsed = 0  # request headers completed
        self._finished = 0  # responses finished
        self._header_bytes = 0  # bytes of a header still incomplete
        self._counted = True  # holds a slot of the bound (taken by the factory)

    @property
    def is_idle(self) -> bool:
        """No request is queued or being handled on this connection."""
        return self._parsed == self._finished and self.transport is not None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()
        self._guard.became_idle(self)

    def data_received(self, data: bytes) -> None:
        in_body = self._body is not None and not self._body.is_eof()
        if data and not in_body and self.is_idle:
            self._header_bytes += len(data)
            if self._header_timer is None:
                self._arm_header_timer()  # the first byte of the next request on this connection
        before = self._request_count
        super().data_received(data)
        if self._request_count == before:
            return
        # One or more request headers completed (a pipelined body must end before the next
        # header starts, so only the latest can still be waiting for its body).
        self._parsed += self._request_count - before
        self._header_bytes = 0
        self._cancel_header_timer()
        body = self._messages[-1][1] if self._messages else None
        if body is not None and not body.is_eof():
            self._watch_body(body)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_header_timer()
        self._cancel_body_timer()
        self._body = None
        if self._counted:
            self._counted = False
            self._guard.connection_closed(self)
        super().connection_lost(exc)

    async def finish_response(self, request: BaseRequest, resp: StreamResponse,
                              start_time: float | None) -> tuple[StreamResponse, bool]:
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._finished += 1
            if self.is_idle:
                self._guard.became_idle(self)

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None, message: str | None = None,
                     ) -> StreamResponse:
        err = protocol_error(status, exc)
        if err.status >= 500:
            logger.error("error handling a request from %s", request.remote, exc_info=exc)
        else:
            # Bad input from a client is no server fault; it is counted in /metrics.
            logger.debug("rejected a malformed HTTP request from %s: %s (%s)", request.remote,
                         err.code, type(exc).__name__)
        if request.writer.output_size > 0:
            # aiohttp's own contract: once bytes went out, no second response can follow.
            raise ConnectionError("the response began before the error; closing")
        self._guard.report_error(err.status)
        resp = err.response()
        resp.force_close()
        return resp

    def evict(self) -> None:
        """Close this idle connection to make room for a new one."""
        logger.debug("closing an idle connection from %s to make room", self.peername)
        self.force_close()

    # --- deadlines ---------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self._loop.call_later(self._guard.limits.header_timeout,
                                                   self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        transport = self.transport
        if transport is None or not self.is_idle:
            # A request is in progress (its header completed meanwhile, or a pipelined one
            # started during a response): never cut it; keep-alive rules apply after it.
            return
        self._guard.header_timeouts += 1
        if self._header_bytes:
            err = APIError(408, f"the request header did not arrive within "
                           f"{self._guard.limits.header_timeout:g} s (--header-timeout)",
                           code="header_timeout")
            self._guard.report_error(408)
            transport.write(_raw_response(err))
        logger.debug("closing a connection from %s: no complete request header in %g s",
                     self.peername, self._guard.limits.header_timeout)
        self.force_close()

    def _watch_body(self, body: StreamReader) -> None:
        self._cancel_body_timer()
        self._body = body
        self._body_timer = self._loop.call_later(self._guard.limits.body_timeout,
                                                 self._on_body_timeout, body)
        body.on_eof(self._cancel_body_timer)

    def _cancel_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _on_body_timeout(self, body: StreamReader) -> None:
        self._body_timer = None
        if body.is_eof():
            return
        self._guard.body_timeouts += 1
        logger.debug("request body from %s not complete in %g s", self.peername,
                     self._guard.limits.body_timeout)
        body.set_exception(BodyTimeoutError(self._guard.limits.body_timeout))


class _Refusal(asyncio.Protocol):
    """A connection over the bound while every slot is busy: answered 503 at once, then
    closed when its client has read it (or after a second)."""

    __slots__ = ("_server", "_reset", "_transport", "_timer")

    def __init__(self, server: GuardedServer, reset: bool) -> None:
        self._server = server
        self._reset = reset
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        server.num_refusing += 1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are not registered as asyncio.Transport: no isinstance check)
        transport = cast(asyncio.Transport, transport)
        if self._reset:
            transport.abort()
            return
        self._transport = transport
        transport.write(self._server.refusal_bytes)
        if transport.can_write_eof():
            transport.write_eof()
        # Closing with the client's request unread would send a reset that can destroy the
        # 503 before the client reads it; wait for its close instead, briefly.
        self._timer = asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the transport closes itself

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        self._server.num_refusing -= 1


class GuardedServer(Server):
    """aiohttp's low-level server with a bound on open connections (see the module's doc)."""

    def __init__(self, handler: Any, *, limits: ConnectionLimits,
                 on_error: OnError | None = None, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.limits = limits
        self.on_error = on_error
        self.num_open = 0
        self.num_refusing = 0
        self.num_refused = 0
        self.num_evicted = 0
        self.header_timeouts = 0
        self.body_timeouts = 0
        # Connections that were idle at some point, oldest first; entries that got busy since
        # are skipped (and put back when they are idle again).
        self._idle: OrderedDict[GuardedHandler, None] = OrderedDict()
        err = APIError(503, f"the server holds its limit of {limits.max_connections} "
                       "connections (--max-connections) and each one is busy with a request; "
                       "retry shortly", code="too_many_connections",
                       headers={"Retry-After": "1"})
        self.refusal_bytes = _raw_response(err)

    def __call__(self) -> asyncio.Protocol:  # the protocol factory, one call per accept
        if self.num_open >= self.limits.max_connections and not self._evict_idle():
            self.num_refused += 1
            self.report_error(503)
            if self.num_refused == 1 or self.num_refused % 1000 == 0:
                logger.warning("connection limit reached (%d open, all busy): refused %d "
                               "connection(s) so far", self.num_open, self.num_refused)
            return _Refusal(self, reset=self.num_refusing >= self.limits.refusal_burst)
        # The slot is taken here, not in connection_made: an accept loop may create many
        # protocols before any of them is connected.
        self.num_open += 1
        return GuardedHandler(self, loop=self._loop, **self._kwargs)

    def became_idle(self, handler: GuardedHandler) -> None:
        self._idle[handler] = None
        self._idle.move_to_end(handler)

    def connection_closed(self, handler: GuardedHandler) -> None:
        self.num_open -= 1
        self._idle.pop(handler, None)

    def report_error(self, status: int) -> None:
        if self.on_error is not None:
            self.on_error(status)

    def _evict_idle(self) -> bool:
        while self._idle:
            handler, _ = self._idle.popitem(last=False)
            if handler.is_idle:
                self.num_evicted += 1
                handler.evict()
                return True
        return False


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose server is a ``GuardedServer``."""

    __slots__ = ("_limits", "_on_error")

    def __init__(self, app: web.Application, limits: ConnectionLimits, *,
                 on_error: OnError | None = None, **kwargs: Any) -> None:
        super().__init__(app, keepalive_timeout=limits.keep_alive_timeout, **kwargs)
        self._limits = limits
        self._on_error = on_error

    async def _make_server(self) -> Server:
        # The plain server carries what the app and the runner configured (the app's handler,
        # request factory, handler options); the guarded one takes them over.
        base = await super()._make_server()
        return GuardedServer(base.request_handler, limits=self._limits, on_error=self._on_error,
                             request_factory=base.request_factory,
                             handler_cancellation=base.handler_cancellation,
                             loop=asyncio.get_running_loop(), **base._kwargs)


def connection_limits(settings: ServerSettings, fd_limit: int) -> ConnectionLimits:
    """The limits of one API server process: the settings', the connection bound derived
    from ``fd_limit`` (the open-file limit in force) unless set."""
    max_connections = settings.max_connections
    if max_connections is None:
        max_connections = default_max_connections(fd_limit)
    elif max_connections > fd_limit - FD_RESERVE_MIN:
        logger.warning("--max-connections %d is close to or above the open-file limit %d: "
                       "the server may run out of descriptors before it refuses connections",
                       max_connections, fd_limit)
    return ConnectionLimits(max_connections=max_connections,
                            header_timeout=settings.header_timeout,
                            body_timeout=settings.body_timeout,
                            keep_alive_timeout=settings.keep_alive_timeout)
