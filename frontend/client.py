"""``AsyncClient``: a small asyncio client for tidal's (or any OpenAI-compatible) server.

    async with AsyncClient("http://127.0.0.1:8000", api_key="...") as client:
        reply = await client.chat([{"role": "user", "content": "Hi"}], max_tokens=32)
        print(reply.choices[0].message.content)
        async for delta in client.stream_chat([{"role": "user", "content": "Hi"}]):
            print(delta.content, end="")

Sampling parameters are passed as keyword arguments, exactly as the API names them. Failures
raise typed exceptions (``BadRequestError`` ... ``ServiceUnavailableError``) carrying the
server's message, ``param`` and ``code``; an error sent inside a stream raises the same way.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiohttp
import msgspec
import numpy as np

from tidal.frontend.server.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobEntry,
    CompletionLogprobs,
    CompletionResponse,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    Usage,
)

# --- errors --------------------------------------------------------------------------------------


class TidalClientError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(TidalClientError):
    """The server could not be reached (or the connection broke)."""


class APITimeoutError(APIConnectionError):
    """No answer (or no next stream chunk) within the client's timeout."""


class APIError(TidalClientError):
    """The server answered with an error; ``message`` is the server's own."""

    def __init__(self, status: int | None, message: str, type: str | None = None,
                 param: str | None = None, code: str | None = None) -> None:
        where = f" (param: {param})" if param else ""
        super().__init__(f"{status or 'stream'} {type or 'error'}: {message}{where}")
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


class BadRequestError(APIError):
    pass


class AuthenticationError(APIError):
    pass


class NotFoundError(APIError):
    pass


class RequestTooLargeError(APIError):
    pass


class RateLimitError(APIError):
    pass


class ServerError(APIError):
    pass


class ServiceUnavailableError(ServerError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError, 401: AuthenticationError, 404: NotFoundError,
    413: RequestTooLargeError, 429: RateLimitError, 503: ServiceUnavailableError,
}
_BY_TYPE: dict[str, type[APIError]] = {
    "invalid_request_error": BadRequestError, "authentication_error": AuthenticationError,
    "not_found_error": NotFoundError, "rate_limit_error": RateLimitError,
    "service_unavailable_error": ServiceUnavailableError, "server_error": ServerError,
}


class _ErrorInfo(msgspec.Struct):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: str | int | None = None


class _Envelope(msgspec.Struct):
    error: _ErrorInfo | str | None = None


def _error_from(status: int | None, body: bytes) -> APIError:
    try:
        env = msgspec.json.decode(body, type=_Envelope)
    except msgspec.DecodeError:
        env = _Envelope()
    info = env.error if isinstance(env.error, _ErrorInfo) else _ErrorInfo(
        message=env.error or body[:500].decode("utf-8", "replace") or "no details")
    cls = _BY_STATUS.get(status or 0)
    if cls is None:
        cls = _BY_TYPE.get(info.type or "", ServerError if (status or 500) >= 500 else APIError)
    code = None if info.code is None else str(info.code)
    return cls(status, info.message, info.type, info.param, code)


# --- stream items --------------------------------------------------------------------------------


@dataclass(slots=True)
class CompletionDelta:
    """New text of one choice of a streamed completion."""

    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


@dataclass(slots=True)
class ChatDelta:
    """New content of one choice of a streamed chat completion (``role`` on the first)."""

    index: int
    content: str
    role: str | None = None
    finish_reason: str | None = None
    logprobs: list[ChatLogprobEntry] | None = None


class _DeltaStream:
    """An async iterator of deltas; ``usage`` is set once the stream has ended. Leaving the
    loop early: ``await stream.aclose()`` (or ``async with stream:``) hangs up at once, which
    aborts the request on the server."""

    def __init__(self, source: AsyncIterator[bytes], kind: str) -> None:
        self._source = source
        self._kind = kind
        self.usage: Usage | None = None
        self._pending: list[Any] = []

    def __aiter__(self) -> _DeltaStream:
        return self

    async def __anext__(self) -> Any:
        while not self._pending:
            payload = await self._source.__anext__()
            self._pending.extend(self._parse(payload))
        return self._pending.pop(0)

    def _parse(self, payload: bytes) -> list[Any]:
        if self._kind == "chat":
            chunk = msgspec.json.decode(payload, type=ChatCompletionChunk)
            if chunk.usage is not None:
                self.usage = chunk.usage
            return [ChatDelta(index=c.index, content=c.delta.content or "", role=c.delta.role,
                              finish_reason=c.finish_reason,
                              logprobs=None if c.logprobs is None else c.logprobs.content)
                    for c in chunk.choices]
        chunk = msgspec.json.decode(payload, type=CompletionResponse)
        if chunk.usage is not None:
            self.usage = chunk.usage
        return [CompletionDelta(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                logprobs=c.logprobs) for c in chunk.choices]

    async def aclose(self) -> None:
        await self._source.aclose()  # type: ignore[attr-defined]

    async def __aenter__(self) -> _DeltaStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


# --- the client ----------------------------------------------------------------------------------


class AsyncClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 timeout: float = 600.0, *, model: str | None = None) -> None:
        """``base_url``: the server (with or without ``/v1``). ``timeout``: seconds for a whole
        response, or between two chunks of a stream. ``model``: the default model name (else
        the server's first)."""
        base = base_url.rstrip("/")
        self.root = base[:-3] if base.endswith("/v1") else base
        self.timeout = timeout
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self._headers)
        return self._session

    # --- endpoints -------------------------------------------------------------------------

    async def models(self) -> list[ModelCard]:
        return (await self._get_json("/v1/models", ModelList)).data

    async def health(self) -> bool:
        """True if the server answers /health with 200 (False for 503 or no answer)."""
        try:
            async with self._http().get(self.root + "/health",
                                        timeout=aiohttp.ClientTimeout(total=self.timeout)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def complete(self, prompt: str | list[str] | list[int] | list[list[int]], *,
                       model: str | None = None, **params: Any) -> CompletionResponse:
        body = {"model": await self._model(model), "prompt": prompt, **params, "stream": False}
        return await self._post_json("/v1/completions", body, CompletionResponse)

    def stream_complete(self, prompt: str | list[str] | list[int] | list[list[int]], *,
                        model: str | None = None, **params: Any) -> _DeltaStream:
        """Completion deltas as they are generated; the stream's ``usage`` is set at the end."""
        body = {"prompt": prompt, **params, "stream": True,
                "stream_options": {"include_usage": True}}
        return _DeltaStream(self._sse("/v1/completions", body, model), "completion")

    async def chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                   **params: Any) -> ChatCompletionResponse:
        body = {"model": await self._model(model), "messages": messages, **params,
                "stream": False}
        return await self._post_json("/v1/chat/completions", body, ChatCompletionResponse)

    def stream_chat(self, messages: list[dict[str, Any]], *, model: str | None = None,
                    **params: Any) -> _DeltaStream:
        """Chat deltas as they are generated; the stream's ``usage`` is set at the end."""
        body = {"messages": messages, **params, "stream": True,
                "stream_options": {"include_usage": True}}
        return _DeltaStream(self._sse("/v1/chat/completions", body, model), "chat")

    async def embeddings(self, input: str | list[str] | list[int] | list[list[int]], *,
                         model: str | None = None) -> list[list[float]]:
        """One vector per input, in input order (sent as base64 float32: exact, and small)."""
        body = {"model": await self._model(model), "input": input, "encoding_format": "base64"}
        resp = await self._post_json("/v1/embeddings", body, EmbeddingResponse)
        out = []
        for item in sorted(resp.data, key=lambda d: d.index):
            if isinstance(item.embedding, str):
                vec = np.frombuffer(base64.b64decode(item.embedding), dtype="<f4")
                out.append(vec.astype(np.float64).tolist())
            else:
                out.append(list(item.embedding))
        return out

    # --- plumbing --------------------------------------------------------------------------

    async def _model(self, model: str | None) -> str:
        if model is not None:
            return model
        if self.model is None:
            cards = await self.models()
            if not cards:
                raise NotFoundError(404, "the server lists no model")
            self.model = cards[0].id
        return self.model

    async def _request(self, method: str, path: str, body: Any | None,
                       timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        data = None if body is None else msgspec.json.encode(body)
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            resp = await self._http().request(method, self.root + path, data=data,
                                              headers=headers, timeout=timeout)
        except asyncio.TimeoutError:
            raise APITimeoutError(f"{method} {path}: no response within {self.timeout} s") \
                from None
        except aiohttp.ClientError as exc:
            raise APIConnectionError(f"{method} {path}: cannot reach {self.root}: {exc}") \
                from None
        if resp.status >= 400:
            try:
                raw = await resp.read()
            finally:
                resp.release()
            raise _error_from(resp.status, raw)
        return resp

    async def _read(self, resp: aiohttp.ClientResponse, path: str) -> bytes:
        try:
            return await resp.read()
        except asyncio.TimeoutError:
            raise APITimeoutError(f"{path}: no response within {self.timeout} s") from None
        except aiohttp.ClientError as exc:
            raise APIConnectionError(f"{path}: the connection broke: {exc}") from None
        finally:
            resp.release()

    async def _get_json(self, path: str, cls: type[Any]) -> Any:
        resp = await self._request("GET", path, None, aiohttp.ClientTimeout(total=self.timeout))
        return msgspec.json.decode(await self._read(resp, path), type=cls)

    async def _post_json(self, path: str, body: Any, cls: type[Any]) -> Any:
        resp = await self._request("POST", path, body,
                                   aiohttp.ClientTimeout(total=self.timeout))
        return msgspec.json.decode(await self._read(resp, path), type=cls)

    async def _sse(self, path: str, body: dict[str, Any],
                   model: str | None) -> AsyncIterator[bytes]:
        """The ``data:`` payloads of a stream, until ``[DONE]``; an error chunk raises."""
        body["model"] = await self._model(model)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout,
                                        sock_read=self.timeout)
        resp = await self._request("POST", path, body, timeout)
        try:
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                if payload.startswith(b'{"error"'):
                    raise _error_from(None, payload)
                yield payload
        except asyncio.TimeoutError:
            raise APITimeoutError(f"{path}: no stream chunk within {self.timeout} s") from None
        except aiohttp.ClientError as exc:
            raise APIConnectionError(f"{path}: the stream broke: {exc}") from None
        finally:
            resp.close()  # a stream left early must not be reused: it still has data
