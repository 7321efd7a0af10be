"""``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions`` (vLLM's extension).

Each prompt runs the search of ``tidal.frontend.beam_search`` (all prompts' beams batched per
step). The beam width is ``best_of`` (completions) or else ``n``; the ``n`` best sequences come
back, best first: choice ``k`` of prompt ``i`` has index ``i * n + k``. ``length_penalty`` and
``early_stopping`` (``true``, ``false`` or ``"never"``; unset is ``"never"``) steer the search,
``temperature`` scales the distribution beams are scored under. The answer is whole: ``stream``
is a 400, as are the sampling fields a search does not use (``top_p``, ``stop``, penalties, ...),
named in ``param``, rather than being ignored.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgspec
from aiohttp import web

from tidal.engine_core.sampling_params import SamplingParamError
from tidal.frontend.beam_search import AsyncBeamSearchRun, BeamSearch, BeamSearchParams
from tidal.frontend.server.common import check_prompt, json_response, new_id
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.logprobs import (
    chat_logprob_entries,
    extend_completion_logprobs,
    tokens_as_ids,
)
from tidal.frontend.server.openai_protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    make_usage,
)
from tidal.frontend.server.prompts import (
    check_context,
    split_prompts,
    tokenize_prompts,
    truncate_prompts,
    truncated,
)
from tidal.frontend.server.state import ServerState

logger = logging.getLogger(__name__)

_INT64_MAX = (1 << 63) - 1

# Fields a beam search reads (or that change nothing it returns); any other field set to more
# than its default or no-op value is a 400.
_COMMON = frozenset({
    "model", "n", "temperature", "seed", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "spaces_between_special_tokens", "stream", "echo", "user",
    "cache_salt", "use_beam_search", "length_penalty", "early_stopping",
    "return_tokens_as_token_ids", "truncate_prompt_tokens", "truncation_side",
})
_COMPLETION = _COMMON | {"prompt", "max_tokens", "best_of", "logprobs", "add_special_tokens"}
_CHAT = _COMMON | {"messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
                   "add_generation_prompt", "continue_final_message"}
# Values of unused fields that ask for nothing.
_NO_OP: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "presence_penalty": (0.0,),
    "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "stop": ([],),
    "stop_token_ids": ([],), "logit_bias": ({},), "suffix": ("",),
}


async def create_beam_completion(state: ServerState, req: CompletionRequest,
                                 model: str) -> web.Response:
    limits = state.limits
    _reject_unused(req, _COMPLETION)
    if req.logprobs is not None:
        _range("logprobs", req.logprobs, 0, limits.max_logprobs)
        if req.echo:
            raise bad_request("echo with logprobs (the prompt's log-probabilities) is not "
                              "supported with use_beam_search", "echo")
    if req.max_tokens is not None:
        _range("max_tokens", req.max_tokens, 1, _INT64_MAX)
    width, width_param = (req.n, "n") if req.best_of is None else (req.best_of, "best_of")
    params = _params(state, req, width, width_param, req.max_tokens, "max_tokens", req.logprobs)
    raw = split_prompts(req.prompt, "prompt", limits.max_prompts)
    state.admission.check_available()
    prompts = truncate_prompts(
        await tokenize_prompts(state, raw, "prompt", req.add_special_tokens), req,
        state.max_model_len)
    for p in prompts:
        check_context(len(p.token_ids), req.max_tokens, state.max_model_len)
        check_prompt(state, p.token_ids, params.step_params(), "prompt")

    request_id = new_id("cmpl")
    searches = [_search(state, p.token_ids, params) for p in prompts]
    aborted = await _run(state, request_id, searches, req.cache_salt)
    tokenizer = state.tokenizer
    as_ids = _as_ids(state, req)
    choices = []
    completion_tokens = 0
    for i, (prompt, search) in enumerate(zip(prompts, searches)):
        echo = ""
        if req.echo:
            echo = prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)
        for k, seq in enumerate(search.sequences(tokenizer)[:req.n]):
            logprobs = None
            if req.logprobs is not None and seq.logprobs is not None:
                logprobs = CompletionLogprobs()
                extend_completion_logprobs(logprobs, seq.logprobs, seq.output_token_ids, 0,
                                           as_ids)
            completion_tokens += len(seq.output_token_ids)
            choices.append(CompletionChoice(
                index=i * req.n + k, text=echo + (seq.output_text or ""), logprobs=logprobs,
                finish_reason=_finish(seq.finish_reason, aborted), stop_reason=seq.stop_reason))
    usage = make_usage(sum(len(p.token_ids) for p in prompts), completion_tokens,
                       sum(s.num_cached_tokens for s in searches),
                       state.settings.enable_prompt_tokens_details)
    return json_response(CompletionResponse(id=request_id, created=int(time.time()), model=model,
                                            choices=choices, usage=usage))


async def create_beam_chat(state: ServerState, req: ChatCompletionRequest,
                           model: str) -> web.Response:
    # Imported here: serving_chat dispatches to this module.
    from tidal.frontend.server.serving_chat import (
        ROLE,
        check_generation_prompt,
        messages_to_dicts,
        render_chat,
    )

    limits = state.limits
    _reject_unused(req, _CHAT)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
        _range("top_logprobs", req.top_logprobs, 0, limits.max_logprobs)
    top_n = (req.top_logprobs or 0) if req.logprobs else None
    budget = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if budget == "max_completion_tokens" else \
        req.max_tokens
    if max_tokens is not None:
        _range(budget, max_tokens, 1, _INT64_MAX)
    params = _params(state, req, req.n, "n", max_tokens, budget, top_n)
    check_generation_prompt(req.add_generation_prompt, req.continue_final_message)
    messages = messages_to_dicts(req.messages)
    state.admission.check_available()
    ids = truncated(await render_chat(state, messages, req.add_generation_prompt,
                                      state.settings.chat_template,
                                      req.continue_final_message), req, state.max_model_len)
    check_context(len(ids), max_tokens, state.max_model_len, budget, "messages")
    check_prompt(state, ids, params.step_params(), "messages")
    echo = messages[-1]["content"] if req.echo and messages[-1]["role"] == ROLE else ""

    request_id = new_id("chatcmpl")
    search = _search(state, ids, params)
    aborted = await _run(state, request_id, [search], req.cache_salt)
    as_ids = _as_ids(state, req)
    choices = []
    completion_tokens = 0
    for k, seq in enumerate(search.sequences(state.tokenizer)[:req.n]):
        logprobs = None
        if top_n is not None and seq.logprobs is not None:
            logprobs = ChatLogprobs(content=chat_logprob_entries(
                seq.logprobs, seq.output_token_ids, top_n, as_ids))
        completion_tokens += len(seq.output_token_ids)
        choices.append(ChatChoice(
            index=k, message=ChatResponseMessage(role=ROLE, content=echo + (seq.output_text or "")),
            logprobs=logprobs, finish_reason=_finish(seq.finish_reason, aborted),
            stop_reason=seq.stop_reason))
    usage = make_usage(len(ids), completion_tokens, search.num_cached_tokens,
                       state.settings.enable_prompt_tokens_details)
    return json_response(ChatCompletionResponse(id=request_id, created=int(time.time()),
                                                model=model, choices=choices, usage=usage))


def _params(state: ServerState, req: CompletionRequest | ChatCompletionRequest, width: int,
            width_param: str, max_tokens: int | None, budget_param: str,
            logprobs: int | None) -> BeamSearchParams:
    limits = state.limits
    if req.stream:
        raise bad_request("stream is not supported with use_beam_search: the beams are only "
                          "known at the end; send stream=false", "stream")
    # Each beam asks the engine for 2 * width candidates per step.
    max_width = min(limits.max_n, state.engine.config.runner.max_logprobs // 2)
    _range(width_param, width, 1, max_width)
    if not 1 <= req.n <= width:
        raise bad_request(f"n must be in [1, {width}] (the beam width, {width_param}) with "
                          f"use_beam_search, got {req.n}", "n")
    temperature = 0.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or not 0.0 <= temperature <= limits.max_temperature:
        raise bad_request(f"temperature must be in [0, {limits.max_temperature}], got "
                          f"{req.temperature}", "temperature")
    early: Any = "never" if req.early_stopping is None else req.early_stopping
    if early not in (True, False, "never"):
        raise bad_request(f"early_stopping must be true, false or \"never\", got {early!r}"[:200],
                          "early_stopping")
    try:
        return BeamSearchParams(
            beam_width=width,
            # Unset: until the context is full (each search stops at its prompt's limit).
            max_tokens=state.max_model_len if max_tokens is None else max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=temperature,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            early_stopping=early,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens is not False,
        )
    except SamplingParamError as exc:
        param = {"beam_width": width_param, "max_tokens": budget_param}.get(exc.param, exc.param)
        raise bad_request(str(exc).replace(exc.param, param, 1), param) from None


def _search(state: ServerState, token_ids: list[int], params: BeamSearchParams) -> BeamSearch:
    model = state.engine.config.model
    return BeamSearch(token_ids, params, model.eos_token_ids, model.max_model_len)


async def _run(state: ServerState, request_id: str, searches: list[BeamSearch],
               cache_salt: str | None) -> bool:
    """Run the searches under one admission ticket; True if the drain timeout aborted them."""
    weight = sum(s.params.beam_width for s in searches)
    ticket = state.admission.admit(weight)
    run = AsyncBeamSearchRun(state.engine, request_id, searches, cache_salt)
    ticket.abort = run.abort
    started = False

    def on_step() -> None:
        nonlocal started
        if not started:
            started = True
            state.admission.started(ticket, weight)

    try:
        await run.run(on_step)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, request_id) from None
    finally:
        run.close()  # (what still runs is aborted in the engine, and counted there)
        state.release(ticket)
    return run.aborted


def _finish(reason: str | None, aborted: bool) -> str:
    return reason or ("abort" if aborted else "length")


def _as_ids(state: ServerState, req: CompletionRequest | ChatCompletionRequest) -> bool:
    return tokens_as_ids(req.return_tokens_as_token_ids, state.settings.return_tokens_as_token_ids)


def _reject_unused(req: msgspec.Struct, allowed: frozenset[str]) -> None:
    for f in msgspec.structs.fields(req):
        if f.name in allowed:
            continue
        value = getattr(req, f.name)
        if value is None or value in _NO_OP.get(f.name, ()):
            continue
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = None
        if value == default:
            continue
        raise bad_request(f"{f.encode_name} is not supported with use_beam_search",
                          f.encode_name, code="unsupported_field")


def _range(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise bad_request(f"{name} must be in [{low}, {high}], got {value}", name)
