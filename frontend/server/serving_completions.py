"""``POST /v1/completions``: text completion, whole or streamed (SSE).

Each prompt of the request runs as one engine request with ``n`` samples; choice ``k`` of prompt
``i`` has index ``i * n + k``, as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field

from aiohttp import web

from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.detokenizer import decode_token
from tidal.frontend.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tidal.frontend.server.common import check_prompt, json_response, new_id, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.grammar_checks import parse_sampling
from tidal.frontend.server.kv_transfer_params import check_request_params, with_answer
from tidal.frontend.server.logprobs import (
    extend_completion_logprobs,
    extend_prompt_logprobs,
    prompt_logprobs,
    tokens_as_ids,
)
from tidal.frontend.server.openai_protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    PromptLogprobs,
    Usage,
    decode_request,
    encode,
    make_usage,
)
from tidal.frontend.server.prompts import (
    Prompt,
    check_context,
    split_prompts,
    tokenize_prompts,
    truncate_prompts,
)
from tidal.frontend.server.sampling import completion_params
from tidal.frontend.server.serving_beam import create_beam_completion
from tidal.frontend.server.sse import DISCONNECTS, SSEWriter
from tidal.frontend.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: CompletionLogprobs | None = None
    offset: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    started: bool = False


class _Completion:
    """Folds the delta outputs of every prompt into choices; each ``apply`` returns the chunk
    pieces that are new."""

    def __init__(self, state: ServerState, req: CompletionRequest, prompts: list[Prompt],
                 params: SamplingParams) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.n = params.n
        self.want_logprobs = req.logprobs is not None
        self.as_ids = tokens_as_ids(req.return_tokens_as_token_ids,
                                    state.settings.return_tokens_as_token_ids)
        self.choices = [_Choice(i) for i in range(len(prompts) * self.n)]
        self._prompt_lp: dict[int, list[PositionLogprobs | None]] = {}

    def apply(self, prompt_index: int, out: RequestOutput) -> list[CompletionChoice]:
        if out.prompt_logprobs is not None:
            self._prompt_lp[prompt_index] = out.prompt_logprobs
        return [self._apply_one(prompt_index, c) for c in out.outputs]

    def _apply_one(self, prompt_index: int, c: CompletionOutput) -> CompletionChoice:
        choice = self.choices[prompt_index * self.n + c.index]
        chunk_lp = CompletionLogprobs() if self.want_logprobs else None
        text = c.text
        if not choice.started:
            choice.started = True
            if self.want_logprobs:
                choice.logprobs = CompletionLogprobs()
            if self.req.echo:
                prompt = self.prompts[prompt_index]
                prefix = self._prompt_text(prompt)
                text = prefix + text
                if chunk_lp is not None:
                    first = decode_token(self.state.tokenizer, prompt.token_ids[0])
                    choice.offset = extend_prompt_logprobs(
                        chunk_lp, self._prompt_lp.get(prompt_index, []), prompt.token_ids, first,
                        self.as_ids, self.req.logprobs)
        if chunk_lp is not None and c.logprobs is not None:
            choice.offset = extend_completion_logprobs(chunk_lp, c.logprobs, c.token_ids,
                                                       choice.offset, self.as_ids)
        if chunk_lp is not None and choice.logprobs is not None:
            _merge(choice.logprobs, chunk_lp)
        choice.text.append(text)
        choice.num_tokens += len(c.token_ids)
        if c.finish_reason is not None:
            choice.finish_reason = c.finish_reason
            choice.stop_reason = c.stop_reason
        return CompletionChoice(index=choice.index, text=text, logprobs=chunk_lp,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.state.tokenizer.decode(prompt.token_ids)

    def abort_open(self) -> list[CompletionChoice]:
        """Finish every open choice with ``abort`` (the drain timeout ended the request)."""
        out = []
        for choice in self.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                out.append(CompletionChoice(index=choice.index, text="",
                                            finish_reason="abort"))
        return out

    @property
    def num_open(self) -> int:
        return sum(1 for c in self.choices if c.finish_reason is None)

    def usage(self, cached_tokens: int) -> Usage:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        return make_usage(prompt, sum(c.num_tokens for c in self.choices), cached_tokens,
                          self.state.settings.enable_prompt_tokens_details)

    def choice_usage(self, index: int) -> Usage:
        """Usage so far of one choice (continuous usage stats, per chunk, as vLLM reports it)."""
        prompt = len(self.prompts[index // self.n].token_ids)
        return make_usage(prompt, self.choices[index].num_tokens, 0)

    def prompt_logprobs(self, index: int) -> PromptLogprobs | None:
        """``prompt_logprobs`` of choice ``index`` (its prompt's), when the request asked."""
        top_n = self.req.prompt_logprobs
        if top_n is None:
            return None
        i = index // self.n
        return prompt_logprobs(self._prompt_lp.get(i), self.prompts[i].token_ids, top_n)


def _merge(into: CompletionLogprobs, part: CompletionLogprobs) -> None:
    into.tokens.extend(part.tokens)
    into.token_logprobs.extend(part.token_logprobs)
    into.top_logprobs.extend(part.top_logprobs)
    into.text_offset.extend(part.text_offset)


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req = decode_request(await read_body(request, state), CompletionRequest)
    model, lora = await state.resolve_model(req.model)
    state.require_task("generate", "/v1/completions")
    if req.use_beam_search:
        if req.kv_transfer_params is not None:
            raise bad_request("kv_transfer_params with use_beam_search is not supported",
                              "kv_transfer_params")
        if lora is not None:
            raise bad_request("use_beam_search with a LoRA adapter is not supported yet",
                              "use_beam_search")
        return await create_beam_completion(state, req, model)
    params = await parse_sampling(state, req, completion_params, req, state.limits)
    raw = split_prompts(req.prompt, "prompt", state.limits.max_prompts)
    state.admission.check_available()
    kv_params = check_request_params(state, req.kv_transfer_params, params.n, len(raw))
    prompts = truncate_prompts(
        await tokenize_prompts(state, raw, "prompt", req.add_special_tokens), req,
        state.max_model_len)
    for p in prompts:
        check_context(len(p.token_ids), params.max_tokens, state.max_model_len)
        check_prompt(state, p.token_ids, params, "prompt")

    request_id = new_id("cmpl")
    ticket = state.admission.admit(params.n * len(prompts))
    gen = Generation(state.engine, state.admission, ticket, request_id,
                     [p.token_ids for p in prompts], params, req.cache_salt,
                     lora_request=lora, kv_transfer_params=kv_params)
    folded = _Completion(state, req, prompts, params)
    try:
        if req.stream:
            return await _stream(request, state, req, gen, folded, model, request_id)
        return await _whole(state, gen, folded, model, request_id)
    finally:
        gen.close()
        state.release(ticket)


async def _whole(state: ServerState, gen: Generation, folded: _Completion, model: str,
                 request_id: str) -> web.Response:
    try:
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                for index, out in batch:
                    folded.apply(index, out)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, request_id) from None
    if gen.aborted:
        folded.abort_open()
    choices: list[CompletionChoice] = [
        CompletionResponseChoice(index=c.index, text="".join(c.text), logprobs=c.logprobs,
                                 finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                 prompt_logprobs=folded.prompt_logprobs(c.index))
        for c in folded.choices
    ]
    body = CompletionResponse(id=request_id, created=int(time.time()), model=model,
                              choices=choices, usage=folded.usage(gen.num_cached_tokens))
    return json_response(with_answer(gen, body))


async def _stream(request: web.Request, state: ServerState, req: CompletionRequest,
                  gen: Generation, folded: _Completion, model: str,
                  request_id: str) -> web.StreamResponse:
    writer = SSEWriter(request)
    created = int(time.time())

    def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
        return encode(CompletionResponse(id=request_id, created=created, model=model,
                                         choices=choices, usage=usage))

    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats

    def one(choice: CompletionChoice) -> bytes:
        return chunk([choice], folded.choice_usage(choice.index) if continuous else None)

    try:
        await writer.start()
        tail: list[bytes] = []  # what leaves with the end of the stream, in its one write
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                payloads = []
                for index, out in batch:
                    for choice in folded.apply(index, out):
                        has_tokens = choice.logprobs is not None and choice.logprobs.tokens
                        if choice.text or has_tokens or choice.finish_reason is not None:
                            payloads.append(one(choice))
                if folded.num_open == 0:
                    tail = payloads  # the last news: the stream ends right after it
                elif payloads:
                    await writer.send_many(payloads)
        if gen.aborted:
            tail.extend(one(choice) for choice in folded.abort_open())
        if opts is not None and opts.final_usage:
            tail.append(chunk([], folded.usage(gen.num_cached_tokens)))
        return await writer.finish(tail)
    except asyncio.CancelledError:
        raise
    except DISCONNECTS:
        logger.debug("client of %s went away mid-stream", request_id)
        return writer.response
    except Exception as exc:  # noqa: BLE001 - the status line is out: report in the stream
        err = from_exception(exc, request_id)
        state.metrics.error(err.status)
        return await writer.fail(err)
