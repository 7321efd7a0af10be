"""From an API request to engine ``SamplingParams``, with the server's bounds checked first.

The engine's own ceilings (``sampling_params.MAX_*``) hold whatever the deployment; the server
enforces these tighter ones at the edge, before anything is tokenized or queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from tidal.engine_core.sampling_params import (
    OutputKind,
    SamplingParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from tidal.frontend.server.errors import bad_request
from tidal.frontend.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from tidal.frontend.server.structured import structured_params

_INT64_MAX = (1 << 63) - 1


@dataclass(slots=True, frozen=True)
class ServerLimits:
    max_n: int = 16
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 1024
    max_allowed_token_ids: int = 8192
    max_prompts: int = 64  # prompts in one completion / embedding request
    max_body_bytes: int = 4 << 20
    max_temperature: float = 100.0


def completion_params(req: CompletionRequest, limits: ServerLimits) -> SamplingParams:
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of={req.best_of} differs from n={req.n}: best_of is the beam "
                          "width with use_beam_search; without it, only best_of == n", "best_of")
    if req.suffix:
        raise bad_request("suffix is not supported by this server", "suffix")
    if req.logprobs is not None:
        _range("logprobs", req.logprobs, 0, limits.max_logprobs)
    if req.max_tokens is not None:
        _range("max_tokens", req.max_tokens, 1, _INT64_MAX)
    prompt_logprobs = _prompt_logprobs(req, limits)
    if req.echo and req.logprobs is not None:
        # The echoed prompt's logprobs come from the same engine output (the wider of the two
        # asks; each view keeps its own top-N).
        prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    return _build(req, limits, max_tokens=req.max_tokens, logprobs=req.logprobs,
                  prompt_logprobs=prompt_logprobs)


def chat_params(req: ChatCompletionRequest, limits: ServerLimits,
                tool_grammar: StructuredOutputsParams | None = None,
                parsers_read_special_tokens: bool = False) -> SamplingParams:
    """``tool_grammar``: the spec of a required / named tool_choice (chat_parsing.check_tools
    made sure no structured-outputs field competes with it). ``parsers_read_special_tokens``
    (chat_parsing.reads_special_tokens): an unset skip_special_tokens becomes False."""
    if tool_grammar is None and (req.tool_choice == "required"
                                 or isinstance(req.tool_choice, dict)):
        # An endpoint that does not hand over check_tools' grammar must not let the choice
        # pass as free text.
        raise bad_request("tool_choice \"required\" or a named function is not enforced on "
                          "this endpoint yet", "tool_choice", code="unsupported_field")
    logprobs = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        _range("top_logprobs", req.top_logprobs, 0, limits.max_logprobs)
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if name == "max_completion_tokens" else req.max_tokens
    if max_tokens is not None:
        _range(name, max_tokens, 1, _INT64_MAX)
    params = _build(req, limits, max_tokens=max_tokens, logprobs=logprobs,
                    prompt_logprobs=_prompt_logprobs(req, limits), structured=tool_grammar)
    params.reasoning_first = True  # a chat reply: its grammar waits for the reasoning's end
    if req.skip_special_tokens is None and parsers_read_special_tokens:
        params.skip_special_tokens = False
    return params


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest,
                     limits: ServerLimits) -> int | None:
    if req.prompt_logprobs is None:
        return None
    _range("prompt_logprobs", req.prompt_logprobs, 0, limits.max_logprobs)
    if req.stream:
        # Only whole responses carry them (as in vLLM).
        raise bad_request("prompt_logprobs is not available with stream: true", "prompt_logprobs")
    return req.prompt_logprobs


def _build(req: CompletionRequest | ChatCompletionRequest, limits: ServerLimits, *,
           max_tokens: int | None, logprobs: int | None,
           prompt_logprobs: int | None,
           structured: StructuredOutputsParams | None = None) -> SamplingParams:
    _range("n", req.n, 1, limits.max_n)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    allowed = _allowed_token_ids(req.allowed_token_ids, limits)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop strings, got {len(stop)}",
                          "stop")
    for s in stop:
        if not s:
            raise bad_request("stop strings must be non-empty", "stop")
        if len(s) > limits.max_stop_string_chars:
            raise bad_request(f"a stop string has {len(s)} characters; the limit is "
                              f"{limits.max_stop_string_chars}", "stop")
    stop_ids = list(req.stop_token_ids or [])
    if len(stop_ids) > limits.max_stop_token_ids:
        raise bad_request(f"at most {limits.max_stop_token_ids} stop_token_ids, got "
                          f"{len(stop_ids)}", "stop_token_ids")
    for t in stop_ids:
        _range("stop_token_ids", t, 0, _INT64_MAX)
    bias = _logit_bias(req.logit_bias, limits)
    if structured is None:
        structured = structured_params(req)
    if req.seed is not None:
        _range("seed", req.seed, -(1 << 63), _INT64_MAX)
    if req.top_k is not None:
        _range("top_k", req.top_k, -1, 1 << 31)
    _range("min_tokens", req.min_tokens, 0, 1 << 31)
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None and not math.isfinite(value):
            raise bad_request(f"{name} must be a finite number", name)
    if req.temperature is not None and req.temperature > limits.max_temperature:
        raise bad_request(f"temperature must be <= {limits.max_temperature}, got "
                          f"{req.temperature}", "temperature")
    try:
        return SamplingParams(
            n=req.n,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=bias,
            allowed_token_ids=allowed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=stop,
            stop_token_ids=stop_ids,
            include_stop_str_in_output=req.include_stop_str_in_output,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=req.skip_special_tokens is not False,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            output_kind=OutputKind.DELTA,
            structured_outputs=structured,
            logits_processors=req.logits_processors or None,
        )
    except SamplingParamError as exc:
        raise bad_request(str(exc), exc.param) from None


def _logit_bias(raw: dict[str, float] | None, limits: ServerLimits) -> dict[int, float] | None:
    if not raw:
        return None
    if len(raw) > limits.max_logit_bias:
        raise bad_request(f"logit_bias has {len(raw)} entries; the limit is "
                          f"{limits.max_logit_bias}", "logit_bias")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key[:32]!r}",
                              "logit_bias") from None
        if not 0 <= tok <= _INT64_MAX:
            raise bad_request(f"logit_bias token id {tok} is out of range", "logit_bias")
        if not math.isfinite(value):
            raise bad_request("logit_bias values must be finite numbers", "logit_bias")
        bias[tok] = value
    return bias


def _allowed_token_ids(raw: list[int] | None, limits: ServerLimits) -> list[int] | None:
    """The list as given (the vocabulary bound is checked with the engine's own validation)."""
    if raw is None:
        return None
    if not raw:
        raise bad_request("allowed_token_ids must hold at least one token id (leave it out to "
                          "allow every token)", "allowed_token_ids")
    if len(raw) > limits.max_allowed_token_ids:
        raise bad_request(f"allowed_token_ids has {len(raw)} ids; the limit is "
                          f"{limits.max_allowed_token_ids}", "allowed_token_ids")
    low = min(raw)
    if low < 0:
        raise bad_request(f"allowed_token_ids holds {low}; token ids are >= 0",
                          "allowed_token_ids")
    return raw


def _range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}], got {value}", name)


def chat_thinking_budget(req: ChatCompletionRequest,
                         reasoning_parser: str | None) -> tuple[int | None, str]:
    """(the budget asked for, the field that asked): ``thinking_token_budget`` (vLLM's name)
    or its alias ``max_thinking_tokens``; both set must agree. Checked before anything else
    (beam search too), so no path ignores it."""
    budget, param = req.thinking_token_budget, "thinking_token_budget"
    if req.max_thinking_tokens is not None:
        if budget is not None and budget != req.max_thinking_tokens:
            raise bad_request("thinking_token_budget and max_thinking_tokens differ; send one",
                              "max_thinking_tokens")
        budget, param = req.max_thinking_tokens, "max_thinking_tokens"
    with_thinking_budget(SamplingParams(), budget, param, reasoning_parser)
    return budget, param


def with_thinking_budget(params: SamplingParams, budget: int | None, param: str,
                         reasoning_parser: str | None) -> SamplingParams:
    """``params`` with a thinking budget: the engine forces the end of the thinking after
    ``budget`` tokens of it. None or -1 asks for no limit. 400 naming ``param`` when the server
    has no reasoning parser (nothing would tell where the thinking ends) or out of range."""
    if budget is None or (type(budget) is int and budget == -1):
        return params
    if type(budget) is not int:
        raise bad_request(f"{param} must be an integer", param)
    if reasoning_parser is None:
        raise bad_request(f"{param} needs the server started with --reasoning-parser (the "
                          "model's reasoning format tells where the thinking ends)", param)
    try:
        return msgspec.structs.replace(params, thinking_token_budget=budget)
    except SamplingParamError as exc:
        raise bad_request(str(exc).replace("thinking_token_budget", param, 1), param) from None
