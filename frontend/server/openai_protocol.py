"""Request and response bodies of the OpenAI-compatible API, as msgspec structs.

Requests are decoded strictly (wrong types are a 400 naming the field; no silent coercion);
fields this server does not know are ignored, with a debug log, as OpenAI's clients send newer
fields freely, except the result-changing ones of OpenAI's and vLLM's APIs that ``unsupported``
lists: those are a 400 naming the field. Responses are encoded with ``msgspec.json.encode``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from tidal.frontend.server.errors import APIError, bad_request
from tidal.frontend.server.json_depth import check_json_depth
from tidal.frontend.server.unsupported import (
    EMBEDDING,
    GENERATION,
    Unsupported,
    reject_unsupported,
)

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=msgspec.Struct)

# A prompt: text, token ids, or a batch of either (checked further in ``normalize_prompts``).
PromptInput = str | list[str | int | list[int]]


# --- requests ------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    # Unset follows continuous_usage_stats: vLLM defaults it to true, so a stream that asks only
    # for continuous usage still ends with the usage chunk there.
    include_usage: bool | None = None
    continuous_usage_stats: bool = False  # usage so far on every chunk (vLLM)

    @property
    def final_usage(self) -> bool:
        """Whether the stream ends with a chunk of the whole request's usage."""
        return self.continuous_usage_stats if self.include_usage is None else self.include_usage


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as the model produced it


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call of an earlier assistant message (rendered through the chat template)."""

    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # passed to the chat template
    tool_calls: list[MessageToolCall] | None = None  # assistant messages
    # Declared to be rejected (the legacy functions API is not supported), not dropped silently.
    function_call: Any = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: str
    function: FunctionDefinition


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields the completion and chat APIs share (OpenAI's and vLLM's extensions)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # None: True, unless the server's parsers read special tokens (chat_parsing.py)
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    user: str | None = None
    cache_salt: str | None = None
    # Disaggregated prefill/decode (vLLM's extension; frontend/server/kv_transfer_params.py):
    # only on a server with a P2P KV connector (--kv-transfer-config).
    kv_transfer_params: dict[str, Any] | None = None
    # Beam search (vLLM's extension; frontend/server/serving_beam.py).
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str | None = None  # true, false or "never"; unset: "never"
    prompt_logprobs: int | None = None
    # vLLM's: keep the last (truncation_side "left") or first ("right") k prompt tokens; -1:
    # the context length (prompts.truncated).
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    allowed_token_ids: list[int] | None = None
    # Entry-point names of logits processors (group tidal.logits_processors) for this request.
    logits_processors: list[str] | None = None
    return_tokens_as_token_ids: bool | None = None  # None: the server's default
    # Structured outputs: one form per request (frontend/server/structured.py checks them).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: PromptInput | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None
    best_of: int | None = None  # the beam width with use_beam_search; else it must equal n
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Tool calling and template arguments (frontend/server/chat_parsing.py checks them).
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # low | medium | high: the template variable reasoning_effort, where the template reads it
    # (chat_parsing.with_reasoning_effort); elsewhere a 400.
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # false: drop reasoning_content (--reasoning-parser)
    # Most thinking tokens before the engine forces the end of thinking (--reasoning-parser);
    # -1 or null: no limit. max_thinking_tokens is an alias.
    thinking_token_budget: int | None = None
    max_thinking_tokens: int | None = None
    parallel_tool_calls: bool | None = None  # false: at most one parsed call


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: PromptInput | None = None
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # as completions take it (prompts.truncated)
    truncation_side: str | None = None
    add_special_tokens: bool = True  # the tokenizer's (an encoder's [CLS] / [SEP])


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# --- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Only with --enable-prompt-tokens-details (absent otherwise, as in vLLM).
    prompt_tokens_details: PromptTokensDetails | None = None


def make_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
               details: bool = False) -> Usage:
    """``details``: add ``prompt_tokens_details`` (``--enable-prompt-tokens-details``)."""
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens)
                 if details else None)


class PromptLogprob(msgspec.Struct):
    """One entry of ``prompt_logprobs`` (vLLM's shape: token id -> this)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt position (the first has none): token id -> its log-probability, the prompt's own
# token first, then the top-N.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)
    text_offset: list[int] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponseChoice(CompletionChoice):
    """A choice of a whole response (stream chunks carry no prompt log-probabilities)."""

    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    """A whole response, or (``object="text_completion"`` too, as OpenAI does) one stream
    chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: str = "text_completion"
    usage: Usage | None = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobEntry] | None = None


class ResponseToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    object: str = "chat.completion"
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | None = None


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"


class ModelCard(msgspec.Struct):
    id: str
    created: int
    max_model_len: int
    object: str = "model"
    owned_by: str = "tidal"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's shape)


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


# --- decoding ------------------------------------------------------------------------------------

_PATH_IN_ERROR = re.compile(r" - at `\$(.*)`$")
_KNOWN_FIELDS: dict[type, frozenset[str]] = {}
# Fields these requests do not declare but reject when set (see unsupported.py).
_UNSUPPORTED: dict[type, Mapping[str, Unsupported]] = {
    CompletionRequest: GENERATION, ChatCompletionRequest: GENERATION, TokenizeRequest: GENERATION,
    EmbeddingRequest: EMBEDDING,
}


def decode_request(body: bytes, cls: type[T],
                   unsupported: Mapping[str, Unsupported] | None = None) -> T:
    """Decode a JSON request body into ``cls``; every failure is a 400 that says what is wrong
    (and, for a field, names it in ``param``). ``unsupported``: the fields to reject for a
    request type defined elsewhere (default: this module's table for ``cls``)."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not valid UTF-8 (bad byte at offset "
                          f"{exc.start}); send JSON encoded as UTF-8",
                          code="invalid_json") from None
    if not body.strip():
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    check_json_depth(body)  # the decoder recurses per level: a deep body would be a 500
    try:
        raw = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise bad_request(f"the request body is not valid JSON ({exc}); send a JSON object",
                          code="invalid_json") from None
    if not isinstance(raw, dict):
        raise bad_request(f"the request body must be a JSON object, got a JSON "
                          f"{_json_type(raw)}", code="invalid_json")
    known = _KNOWN_FIELDS.get(cls)
    if known is None:
        known = _KNOWN_FIELDS[cls] = frozenset(f.encode_name for f in msgspec.structs.fields(cls))
    unknown = [k for k in raw if k not in known]
    if unknown:
        table = unsupported if unsupported is not None else _UNSUPPORTED.get(cls)
        if table is not None:
            reject_unsupported(raw, unknown, table)
        logger.debug("ignoring unknown request field(s) of %s: %s", cls.__name__,
                     ", ".join(sorted(unknown)[:20]))
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: msgspec.ValidationError) -> APIError:
    text = str(exc)
    match = _PATH_IN_ERROR.search(text)
    param = None
    if match:
        # "$.messages[0].content" -> "messages[0].content"; "$.logit_bias[...]" -> "logit_bias"
        param = match.group(1).lstrip(".").replace("[...]", "") or None
        text = text[: match.start()]
    if text.startswith("Object missing required field"):
        field = text.split("`")[1] if "`" in text else None
        if field is not None:
            param = f"{param}.{field}" if param else field
        return bad_request(f"{param or 'a field'} is required", param)
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{text[0].lower() + text[1:] if text else 'invalid value'}",
                       param)


def _json_type(value: Any) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return "null" if value is None else type(value).__name__


def encode(obj: Any) -> bytes:
    return msgspec.json.encode(obj)
