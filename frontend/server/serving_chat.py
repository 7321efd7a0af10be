"""``POST /v1/chat/completions``: messages through the model's chat template, then generation,
whole or streamed (SSE: a first chunk per choice carrying the role, then content deltas)."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.frontend.server.common import check_prompt, json_response, new_id, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.logprobs import chat_logprob_entries
from tidal.frontend.server.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    Usage,
    decode_request,
    encode,
    make_usage,
)
from tidal.frontend.server.prompts import check_context
from tidal.frontend.server.sampling import chat_params
from tidal.frontend.server.sse import DISCONNECTS, SSEWriter
from tidal.frontend.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

ROLE = "assistant"
MAX_MESSAGES = 1024


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatLogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def messages_to_dicts(messages: list[ChatMessage] | None, param: str = "messages"
                      ) -> list[dict[str, Any]]:
    """API messages -> what chat templates take; only text content is supported."""
    if not messages:
        raise bad_request(f"{param} is required and must hold at least one message", param)
    if len(messages) > MAX_MESSAGES:
        raise bad_request(f"{param} has {len(messages)} messages; the limit is {MAX_MESSAGES}",
                          param)
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            texts = []
            for j, part in enumerate(m.content):
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type {part.type[:40]!r} are not "
                                      "supported; this server takes text only",
                                      f"{param}[{i}].content[{j}]")
                texts.append(part.text)
            content: str | None = "\n".join(texts)
        else:
            content = m.content
        d: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


async def render_chat(state: ServerState, messages: list[dict[str, Any]],
                      add_generation_prompt: bool, chat_template: str | None) -> list[int]:
    """Token ids of ``messages`` through the chat template; template failures are a 400."""
    try:
        return await state.engine.apply_chat_template(messages, add_generation_prompt,
                                                      chat_template)
    except ValueError as exc:
        raise bad_request(f"cannot apply the chat template: {exc}", "messages") from None
    except Exception as exc:  # noqa: BLE001 - jinja2 errors: the messages don't fit the template
        if type(exc).__module__.startswith("jinja2"):
            reason = getattr(exc, "message", None) or str(exc)
            raise bad_request(f"the chat template rejected these messages: {reason}",
                              "messages") from None
        raise


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req = decode_request(await read_body(request, state), ChatCompletionRequest)
    model = state.check_model(req.model)
    state.require_task("generate", "/v1/chat/completions")
    params = chat_params(req, state.limits)
    messages = messages_to_dicts(req.messages)
    state.admission.check_available()
    ids = await render_chat(state, messages, req.add_generation_prompt,
                            state.settings.chat_template)
    budget_param = "max_completion_tokens" if req.max_completion_tokens is not None else \
        "max_tokens"
    check_context(len(ids), params.max_tokens, state.max_model_len, budget_param, "messages")
    check_prompt(state, ids, params, "messages")
    echo = ""
    if req.echo and messages[-1]["role"] == ROLE:
        echo = messages[-1]["content"]

    request_id = new_id("chatcmpl")
    ticket = state.admission.admit(params.n)
    gen = Generation(state.engine, state.admission, ticket, request_id, [ids], params,
                     req.cache_salt)
    choices = [_Choice(i) for i in range(params.n)]
    top_n = req.top_logprobs or 0
    try:
        if req.stream:
            return await _stream(request, state, req, gen, choices, len(ids), model,
                                 request_id, echo, top_n)
        return await _whole(gen, choices, len(ids), model, request_id, echo, req.logprobs,
                            top_n)
    finally:
        gen.close()
        num_open = sum(1 for c in choices if c.finish_reason is None)
        state.release(ticket, 0 if gen.failed else num_open)


def _apply(choices: list[_Choice], c: CompletionOutput, want_logprobs: bool,
           top_n: int) -> list[ChatLogprobEntry] | None:
    choice = choices[c.index]
    choice.text.append(c.text)
    choice.num_tokens += len(c.token_ids)
    entries = None
    if want_logprobs and c.logprobs is not None:
        entries = chat_logprob_entries(c.logprobs, c.token_ids, top_n)
        choice.logprobs.extend(entries)
    if c.finish_reason is not None:
        choice.finish_reason = c.finish_reason
        choice.stop_reason = c.stop_reason
    return entries


def _usage(choices: list[_Choice], n_prompt: int, gen: Generation) -> Usage:
    return make_usage(n_prompt, sum(c.num_tokens for c in choices), gen.num_cached_tokens)


async def _whole(gen: Generation, choices: list[_Choice], n_prompt: int, model: str,
                 request_id: str, echo: str, want_logprobs: bool, top_n: int) -> web.Response:
    try:
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                for _, out in batch:
                    for c in out.outputs:
                        _apply(choices, c, want_logprobs, top_n)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, request_id) from None
    if gen.aborted:
        for c in choices:
            c.finish_reason = c.finish_reason or "abort"
    body = ChatCompletionResponse(
        id=request_id, created=int(time.time()), model=model, usage=_usage(choices, n_prompt, gen),
        choices=[ChatChoice(
            index=c.index,
            message=ChatResponseMessage(role=ROLE, content=echo + "".join(c.text)),
            logprobs=ChatLogprobs(content=c.logprobs) if want_logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in choices],
    )
    return json_response(body)


async def _stream(request: web.Request, state: ServerState, req: ChatCompletionRequest,
                  gen: Generation, choices: list[_Choice], n_prompt: int, model: str,
                  request_id: str, echo: str, top_n: int) -> web.StreamResponse:
    writer = SSEWriter(request)
    created = int(time.time())

    def chunk(items: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
        return encode(ChatCompletionChunk(id=request_id, created=created, model=model,
                                          choices=items, usage=usage))

    try:
        await writer.start()
        await writer.send_many([chunk([ChatChunkChoice(c.index, ChatDelta(role=ROLE,
                                                                          content=echo))])
                                for c in choices])
        tail: list[bytes] = []  # what leaves with the end of the stream, in its one write
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                payloads: list[bytes] = []
                for _, out in batch:
                    _chunks(payloads, chunk, choices, out, req.logprobs, top_n)
                if all(c.finish_reason is not None for c in choices):
                    tail = payloads  # the last news: the stream ends right after it
                elif payloads:
                    await writer.send_many(payloads)
        if gen.aborted:
            for c in choices:
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    tail.append(chunk([ChatChunkChoice(c.index, ChatDelta(),
                                                       finish_reason="abort")]))
        if req.stream_options is not None and req.stream_options.include_usage:
            tail.append(chunk([], _usage(choices, n_prompt, gen)))
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


def _chunks(payloads: list[bytes], chunk: Any, choices: list[_Choice], out: RequestOutput,
            want_logprobs: bool, top_n: int) -> None:
    """Fold ``out`` into the choices and append its SSE chunks (one per choice with news)."""
    for c in out.outputs:
        entries = _apply(choices, c, want_logprobs, top_n)
        if not c.text and not entries and c.finish_reason is None:
            continue
        item = ChatChunkChoice(
            index=c.index,
            delta=ChatDelta(content=c.text) if c.text else ChatDelta(),
            logprobs=ChatLogprobs(content=entries) if want_logprobs else None,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        payloads.append(chunk([item]))
