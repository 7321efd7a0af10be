"""Request fields of OpenAI's and vLLM's APIs that this server does not implement.

Each would change the result, so a request that sets one (to anything but its no-op value) is a
400 naming it, never a silent success. Fields the request structs declare are implemented (or
checked where they are used); fields in neither place are ignored with a debug log, as OpenAI's
clients send newer fields freely: ``HARMLESS`` lists the known ones that have no effect on the
result here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from tidal.frontend.server.errors import bad_request


def _unset(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


def _false(value: Any) -> bool:
    return value is None or value is False


def _zero(value: Any) -> bool:
    return value is None or (type(value) is int and value == 0)


def _no_tool_choice(value: Any) -> bool:
    return value is None or value == "none"


def _this_backend(value: Any) -> bool:
    return value is None or value == "auto"


def _text_modality(value: Any) -> bool:
    return value is None or value == ["text"]


def _no_thinking_budget(value: Any) -> bool:
    return value is None or (type(value) is int and value == -1)


@dataclass(slots=True, frozen=True)
class Unsupported:
    reason: str  # completes "<field> is not supported: ..."
    no_op: Callable[[Any], bool] = _unset  # values that ask for nothing


# Chat completions declare tools, tool_choice and chat_template_kwargs (chat_parsing.py);
# these entries answer the other endpoints.
_TOOLS = "tool calling is available in /v1/chat/completions only"
_FUNCTIONS = "the legacy functions API is not supported; use tools in /v1/chat/completions"
_THINKING = ("a thinking budget is taken by /v1/chat/completions only (on a server with "
             "--reasoning-parser)")
_STRUCTURED = ("whitespace patterns are not supported (JSON schema, JSON object, regex, "
               "choice, grammar and structural tags are: response_format, structured_outputs, "
               "guided_*)")

# Completions, chat completions and /tokenize (a chat field in a completion request asks for
# something the endpoint cannot do either).
GENERATION: Mapping[str, Unsupported] = {
    "tools": Unsupported(_TOOLS, _empty),
    "tool_choice": Unsupported(f"{_TOOLS}; only \"none\" is accepted", _no_tool_choice),
    "functions": Unsupported(_FUNCTIONS, _empty),
    "function_call": Unsupported(f"{_FUNCTIONS}; only \"none\" is accepted",
                                 _no_tool_choice),
    # response_format, structured_outputs and guided_json/regex/choice/grammar are request
    # fields (frontend/server/structured.py); these parts of structured outputs are not yet.
    "structural_tag": Unsupported("give a structural tag as response_format {\"type\": "
                                  "\"structural_tag\", ...} or structured_outputs."
                                  "structural_tag"),
    "guided_decoding_backend": Unsupported(
        "only \"auto\" is accepted; pick a grammar backend with structured_outputs.backend",
        _this_backend),
    "guided_whitespace_pattern": Unsupported(_STRUCTURED),
    "logits_processors": Unsupported("custom logits processors are not accepted in requests",
                                     _empty),
    "bad_words": Unsupported("bad_words is not implemented; use logit_bias with -100 for "
                             "the tokens to avoid", _empty),
    "logprob_token_ids": Unsupported("use logprobs / top_logprobs", _empty),
    "truncate_prompt_tokens": Unsupported("prompts are never truncated here; shorten the "
                                          "prompt"),
    "truncation_side": Unsupported("prompts are never truncated here; shorten the prompt"),
    "prompt_embeds": Unsupported("prompt embeddings are not accepted; send text or token ids",
                                 _empty),
    "chat_template": Unsupported("the server's chat template applies (tidal serve "
                                 "--chat-template sets it)"),
    "chat_template_kwargs": Unsupported("chat template arguments are taken by "
                                        "/v1/chat/completions only", _empty),
    "documents": Unsupported("documents for the chat template are not supported", _empty),
    "add_special_tokens": Unsupported("the chat template alone decides the special tokens of a "
                                      "chat prompt", _false),
    "mm_processor_kwargs": Unsupported("this server takes text only", _empty),
    "media_io_kwargs": Unsupported("this server takes text only", _empty),
    "modalities": Unsupported("this server produces text only", _text_modality),
    "audio": Unsupported("this server produces text only"),
    "prediction": Unsupported("predicted outputs are not supported"),
    "web_search_options": Unsupported("web search is not supported"),
    "verbosity": Unsupported("verbosity is not supported"),
    "reasoning_effort": Unsupported("a reasoning effort is taken by /v1/chat/completions "
                                    "(and /v1/responses as reasoning.effort) only"),
    "thinking_token_budget": Unsupported(_THINKING, _no_thinking_budget),
    "max_thinking_tokens": Unsupported(_THINKING, _no_thinking_budget),
    "priority": Unsupported("priority scheduling is not supported; requests run first come, "
                            "first served", _zero),
    # (Declared by completions and chat completions: frontend/server/kv_transfer_params.py.)
    "kv_transfer_params": Unsupported(
        "disaggregated prefill/decode takes /v1/completions and /v1/chat/completions only",
        _empty),
    "ec_transfer_params": Unsupported("disaggregated serving is not supported", _empty),
    "vllm_xargs": Unsupported("request extensions are not supported", _empty),
    "return_token_ids": Unsupported("use logprobs with return_tokens_as_token_ids", _false),
    "return_prompt_text": Unsupported("the prompt text is not returned", _false),
    "watermarking": Unsupported("watermarking is not supported", _false),
    "repetition_detection": Unsupported("repetition detection is not supported"),
}

def _true(value: Any) -> bool:
    return value is None or value is True


def _one_of(*values: str) -> Any:
    return lambda value: value is None or value in values


# /v1/embeddings: vLLM's fields that would change the vectors (the rest of its request is
# declared by EmbeddingRequest, or harmless: request_id, cache_salt).
EMBEDDING: Mapping[str, Unsupported] = {
    "normalize": Unsupported("embeddings here are always normalized to unit length; only "
                             "true is accepted", _true),
    "use_activation": Unsupported("embeddings here are always normalized to unit length; "
                                  "only true is accepted", _true),
    "embed_dtype": Unsupported("embeddings are float32 here; only \"float32\" is accepted",
                               _one_of("float32")),
    "endianness": Unsupported("base64 embeddings are little-endian float32 here; only "
                              "\"native\" or \"little\" is accepted",
                              _one_of("native", "little")),
    "messages": Unsupported("chat-style embedding inputs are not supported; send input",
                            _empty),
    "chat_template": Unsupported("chat-style embedding inputs are not supported; send input"),
    "mm_processor_kwargs": Unsupported("this server takes text only", _empty),
    "priority": Unsupported("priority scheduling is not supported; requests run first come, "
                            "first served", _zero),
}

# Known fields that change nothing this server returns: identifiers and metadata, hints about
# caching or routing, chunking of a stream, and switches for features that are absent here
# (routed-expert data, the render endpoints) or that only chat completions act on
# (``include_reasoning``, ``parallel_tool_calls``: chat_parsing.py reads them there).
HARMLESS: frozenset[str] = frozenset({
    "user", "request_id", "session_id", "metadata", "store", "service_tier",
    "prompt_cache_key", "safety_identifier", "parallel_tool_calls", "include_reasoning",
    "stream_interval", "routed_experts_prompt_start", "return_token_offsets",
    "return_mm_kwargs",
})


def reject_unsupported(raw: Mapping[str, Any], fields: Iterable[str],
                       table: Mapping[str, Unsupported]) -> None:
    """400 for the first of ``fields`` (keys of the request body ``raw``) that ``table`` lists
    and that is set to more than its no-op value."""
    for name in fields:
        entry = table.get(name)
        if entry is not None and not entry.no_op(raw[name]):
            raise bad_request(f"{name} is not supported: {entry.reason}", name,
                              code="unsupported_field")
