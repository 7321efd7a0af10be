"""Pieces every endpoint handler shares: reading the body within its limit, request ids, JSON
responses, and checking a tokenized prompt the way the engine will."""

from __future__ import annotations

import uuid

from aiohttp import web

from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.validation import validate_request
from tidal.frontend.server.errors import APIError, bad_request
from tidal.frontend.server.openai_protocol import encode
from tidal.frontend.server.state import ServerState


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def read_body(request: web.Request, state: ServerState) -> bytes:
    limit = state.limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(None, limit) from None


def _too_large(size: int | None, limit: int) -> APIError:
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(413, f"the request body is too large{got}; the limit is {limit} bytes: "
                    "send fewer or shorter prompts per request", code="request_too_large")


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(obj), content_type="application/json")


def check_prompt(state: ServerState, token_ids: list[int], params: SamplingParams,
                 prompt_param: str) -> None:
    """Run the engine's own request validation here, so its errors are a 400 before any
    response (or stream) starts."""
    try:
        validate_request(token_ids, params, state.engine.config)
    except ValueError as exc:
        param = getattr(exc, "param", None)
        raise bad_request(str(exc), prompt_param if param == "prompt" else param) from None
