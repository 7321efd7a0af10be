"""Bodies of OpenAI's Responses API (``/v1/responses``), as msgspec structs.

The request is decoded strictly like the other endpoints'; the polymorphic parts (``input``
items, ``tools``, ``tool_choice``, ``text.format``) stay plain JSON here and are checked item
by item in ``serving_responses`` so each error names the exact field. Output shapes follow
``openai.types.responses`` (what the official client validates).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from tidal.frontend.server.openai_protocol import ChatCompletionRequest
from tidal.frontend.server.unsupported import (
    GENERATION,
    Unsupported,
    _empty,
)


def _nothing(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


_SAMPLING = "this sampling control is not part of the Responses API here; use " \
            "/v1/chat/completions"

# Fields of the Responses API (and vLLM's extensions of it) that would change the result and
# are not implemented: a 400 naming the field unless set to the value that asks for nothing.
RESPONSES_UNSUPPORTED: Mapping[str, Unsupported] = {
    "conversation": Unsupported("conversations are not supported; chain responses with "
                                "previous_response_id"),
    "prompt": Unsupported("prompt templates are not supported; send input"),
    "context_management": Unsupported("context management is not supported", _empty),
    "prompt_cache_retention": Unsupported("the prefix cache keeps what fits in memory; "
                                          "retention cannot be chosen"),
    # vLLM's request extensions: each would change the output.
    "top_k": Unsupported(_SAMPLING),
    "min_p": Unsupported(_SAMPLING),
    "seed": Unsupported(_SAMPLING),
    "stop": Unsupported(_SAMPLING, _empty),
    "repetition_penalty": Unsupported(_SAMPLING),
    "presence_penalty": Unsupported(_SAMPLING),
    "frequency_penalty": Unsupported(_SAMPLING),
    "logit_bias": Unsupported(_SAMPLING, _empty),
    "n": Unsupported("a response has one output; send several requests", lambda v: v in (None, 1)),
    "response_format": Unsupported("the Responses API takes text.format"),
    "structured_outputs": Unsupported("the Responses API takes text.format"),
    "messages": Unsupported("the Responses API takes input"),
    "max_tokens": Unsupported("the Responses API takes max_output_tokens"),
}


# --- request -------------------------------------------------------------------------------------


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[Any] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    store: bool = True
    background: bool = False  # answered at once, generated in a task (response_background)
    include: list[Any] | None = None  # only "message.output_text.logprobs"
    top_logprobs: int | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}
    truncation: str | None = None  # "auto" | "disabled" (None): responses_truncation
    # Known and without effect here (built-in tools are rejected, so their call limit is moot;
    # the rest are identifiers, routing hints, or stream obfuscation that is not done).
    max_tool_calls: int | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None


# Every other field chat completions or completions act on (vLLM's sampling extensions,
# guided_*, ignore_eos, min_tokens, ...) would change the result if it were read: refused
# here rather than ignored (decode_request consults this table for fields the struct lacks).
RESPONSES_UNSUPPORTED = {
    **{name: Unsupported("it is a chat completions field, not part of the Responses API "
                         "here; use /v1/chat/completions", _nothing)
       for name in (f.encode_name for f in msgspec.structs.fields(ChatCompletionRequest))},
    **GENERATION,
    **RESPONSES_UNSUPPORTED,
}


# --- output items --------------------------------------------------------------------------------


class OutputText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "output_text"
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class MessageItem(msgspec.Struct, kw_only=True):
    id: str
    content: list[OutputText]
    status: str
    type: str = "message"
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str
    type: str = "function_call"


class ReasoningItem(msgspec.Struct, kw_only=True):
    id: str
    content: list[ReasoningText]
    status: str
    type: str = "reasoning"
    summary: list[Any] = msgspec.field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


# --- the response --------------------------------------------------------------------------------


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(
        default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: str
    output: list[OutputItem]
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    object: str = "response"
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    store: bool = True
    user: str | None = None
    truncation: str = "disabled"
    background: bool = False
    top_logprobs: int | None = None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None


class InputItemList(msgspec.Struct, kw_only=True):
    """A page of ``GET /v1/responses/{id}/input_items``."""

    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response.deleted"
    deleted: bool = True
