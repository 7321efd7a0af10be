"""Errors in OpenAI's envelope: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client sees goes through ``APIError``; anything else is logged here with its
traceback and reaches the client as a generic 500 that names the request id to look up in the
log. Messages of server-side errors (5xx) are scrubbed of file paths as a second line of defence.
"""

from __future__ import annotations

import logging
import re

import msgspec
from aiohttp import web

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.\-]+){2,}[/\\]?")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorEnvelope(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """A failure to report to the client with ``status``; ``message`` says what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500
                          else "invalid_request_error")

    def info(self) -> ErrorInfo:
        message = scrub(self.message) if self.status >= 500 else self.message
        return ErrorInfo(message=message, type=self.type, param=self.param, code=self.code)

    def body(self) -> bytes:
        return msgspec.json.encode(ErrorEnvelope(self.info()))

    def response(self) -> web.Response:
        return web.Response(status=self.status, body=self.body(),
                            content_type="application/json", headers=self.headers)


def scrub(message: str) -> str:
    """``message`` without file paths (they say nothing useful to a client)."""
    return _PATH.sub("<path>", message)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def internal_error(request_id: str | None) -> APIError:
    where = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"the server failed to handle this request{where}; the server log "
                    "has the details", code="internal_error")


def engine_unavailable() -> APIError:
    """A frontend of a standalone engine-core that is gone for now (it reconnects)."""
    return APIError(503, "the engine is unreachable (it stopped or restarts); this server "
                    "reconnects when it is back: retry shortly or against another replica",
                    code="engine_unavailable", headers={"Retry-After": "1"})


def engine_stalled(seconds: float) -> APIError:
    """Requests wait and the engine has finished no step for ``seconds``."""
    return APIError(503, f"the engine has made no progress for {seconds:.0f} s (stalled: "
                    "paused, or stuck in a step); requests in flight continue if it resumes",
                    code="engine_stalled")


def from_exception(exc: BaseException, request_id: str | None = None) -> APIError:
    """Map an exception from validation or the engine to what the client sees."""
    from tidal.frontend.async_llm import (
        EngineDeadError,
        EngineUnavailableError,
        RequestFailedError,
    )

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineUnavailableError):
        return engine_unavailable()
    if isinstance(exc, EngineDeadError):
        return APIError(503, "the engine has stopped and this server can no longer generate; "
                        "retry against a healthy replica", code="engine_dead")
    if isinstance(exc, RequestFailedError):
        logger.warning("request %s failed in the engine: %s", request_id, exc)
        return APIError(500, f"the engine failed this request: {exc}", code="request_failed")
    if isinstance(exc, ValueError):
        # SamplingParamError and RequestValidationError carry the offending field.
        return bad_request(scrub(str(exc)), getattr(exc, "param", None))
    logger.error("unexpected error in request %s", request_id, exc_info=exc)
    return internal_error(request_id)
