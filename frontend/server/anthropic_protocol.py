"""Request and response bodies of Anthropic's Messages API (``POST /v1/messages``,
``/v1/messages/count_tokens``), its streaming events and its error envelope, as msgspec structs.

Top-level request fields are decoded strictly, as Anthropic's API does: a field the structs do
not declare is a 400 (``Extra inputs are not permitted`` there). The declared fields that change
nothing here (metadata, routing and caching hints) are accepted and read by nothing; the declared
ones this server cannot honour are rejected by ``anthropic_input`` with a 400 that says why.
Content blocks are read loosely (their extra keys, such as ``cache_control``, ask for nothing)
and each block type is checked where it is converted.
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from tidal.frontend.server.errors import APIError, scrub

# --- requests ------------------------------------------------------------------------------------


class InputBlock(msgspec.Struct, kw_only=True):
    """One content block of a request message or of ``system`` (the fields of every type
    this server reads; ``type`` says which apply)."""

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[InputBlock] | None = None
    is_error: bool | None = None


class InputMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[InputBlock]


class Tool(msgspec.Struct, kw_only=True):
    """A client tool; server tools (web search, bash, ...) carry another ``type``."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or unset
    strict: bool | None = None
    cache_control: Any = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str  # auto | any | tool | none
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: str  # enabled | adaptive | disabled
    budget_tokens: int | None = None
    display: str | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: str  # json_schema
    schema: dict[str, Any] | None = None


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: OutputFormat | None = None  # structured output: the text follows the schema
    effort: str | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``/v1/messages/count_tokens``: what shapes the prompt."""

    model: str | None = None
    messages: list[InputMessage] | None = None
    system: str | list[InputBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Declared to be rejected with a reason (anthropic_input.UNSUPPORTED), not as unknown.
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    # No effect here: caching is automatic, there is one tier and one region.
    cache_control: Any = None
    metadata: Any = None
    service_tier: Any = None
    speed: Any = None
    inference_geo: Any = None
    diagnostics: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    max_tokens: int | None = None  # required (checked by the handler, named in the 400)
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None


# --- responses -----------------------------------------------------------------------------------


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    # Anthropic signs thinking for multi-turn checks; this server has nothing to sign, and
    # thinking blocks sent back in a later request are dropped (as Anthropic drops those of
    # earlier turns).
    signature: str = ""


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


class Message(msgspec.Struct):
    id: str
    model: str
    content: list[ContentBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage
    type: str = "message"
    role: str = "assistant"


class TokenCount(msgspec.Struct):
    input_tokens: int


# --- streaming events (``event: <type>`` then ``data: <the struct>``) ----------------------------


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: Message


class BlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


class BlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class BlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None = None


class DeltaUsage(msgspec.Struct):
    """Cumulative, as Anthropic sends it in ``message_delta``."""

    input_tokens: int
    output_tokens: int


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopInfo
    usage: DeltaUsage


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


Event = MessageStart | BlockStart | Ping | BlockDelta | BlockStop | MessageDelta | MessageStop


def sse_event(event: msgspec.Struct) -> bytes:
    """One server-sent event in Anthropic's framing: its type as the event name."""
    name = type(event).__struct_config__.tag
    return b"event: " + str(name).encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


# --- errors --------------------------------------------------------------------------------------

# Anthropic's error types by status; 503 (draining, engine gone or stalled) goes out as the
# 529 overloaded_error Anthropic's clients know to retry.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_OVERLOADED = 529


class ErrorInfo(msgspec.Struct):
    type: str
    message: str


class ErrorEnvelope(msgspec.Struct, tag="error", tag_field="type"):
    error: ErrorInfo


def error_envelope(err: APIError) -> ErrorEnvelope:
    kind = _ERROR_TYPES.get(err.status, "api_error" if err.status >= 500
                            else "invalid_request_error")
    message = scrub(err.message) if err.status >= 500 else err.message
    if err.param and err.status < 500 and not message.startswith(err.param):
        # Anthropic's envelope has no "param": the message names the field instead.
        message = f"{err.param}: {message}"
    return ErrorEnvelope(ErrorInfo(type=kind, message=message))


def error_response(err: APIError) -> web.Response:
    status = _OVERLOADED if err.status == 503 else err.status
    return web.Response(status=status, body=msgspec.json.encode(error_envelope(err)),
                        content_type="application/json", headers=err.headers)


def error_event(err: APIError) -> bytes:
    return sse_event(error_envelope(err))
