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

from tidal.frontend.harmony_render import HarmonyRenderError, harmony_prompt_ids, uses_harmony
from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.frontend.reasoning import DeltaMessage
from tidal.frontend.server.chat_parsing import (
    OutputParse,
    check_tools,
    new_output_parse,
    reads_special_tokens,
    server_parsers,
    template_kwargs,
    template_tool_calls,
    with_reasoning_effort,
)
from tidal.frontend.server.common import check_prompt, json_response, new_id, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.grammar_checks import parse_checked, parse_sampling
from tidal.frontend.server.kv_transfer_params import check_request_params, with_answer
from tidal.frontend.server.logprobs import chat_logprob_entries, prompt_logprobs, tokens_as_ids
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
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    PromptLogprobs,
    ResponseToolCall,
    Usage,
    decode_request,
    encode,
    make_usage,
)
from tidal.frontend.server.prompts import check_context, truncated
from tidal.frontend.server.sampling import (
    chat_params,
    chat_thinking_budget,
    with_thinking_budget,
)
from tidal.frontend.server.serving_beam import create_beam_chat
from tidal.frontend.server.sse import DISCONNECTS, SSEWriter
from tidal.frontend.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

ROLE = "assistant"
MAX_MESSAGES = 1024
# What chat templates know; anything else would be rendered (or dropped) by guesswork.
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(slots=True)
class _Choice:
    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[ChatLogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    parse: OutputParse | None = None  # reasoning / tool-call parsers of this choice


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
        if m.role not in ROLES:
            raise bad_request(f"unknown message role {m.role[:40]!r}; use one of "
                              f"{', '.join(sorted(ROLES))}", f"{param}[{i}].role")
        if m.function_call is not None:
            raise bad_request("the legacy function_call is not supported; use tool_calls",
                              f"{param}[{i}].function_call")
        if m.tool_calls and m.role != ROLE:
            raise bad_request("only assistant messages carry tool_calls",
                              f"{param}[{i}].tool_calls")
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
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = template_tool_calls(m.tool_calls, f"{param}[{i}].tool_calls")
        out.append(d)
    return out


def check_generation_prompt(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """The two ways to end a chat prompt exclude each other (as in vLLM)."""
    if add_generation_prompt and continue_final_message:
        raise bad_request("continue_final_message needs add_generation_prompt: false (the "
                          "prompt either opens a new assistant message or continues the last "
                          "one)", "continue_final_message")


def reads_reasoning_effort(state: ServerState) -> bool:
    """Whether chats on this server are rendered by something that reads the template variable
    ``reasoning_effort``: the harmony renderer (gpt-oss without a template of its own), or a
    chat template (``--chat-template``, else the tokenizer's) that mentions it."""
    cfg = state.settings
    tokenizer = state.tokenizer
    if cfg.chat_template is None and uses_harmony(tokenizer, cfg.reasoning_parser,
                                                  cfg.tool_call_parser):
        return True
    template = cfg.chat_template or getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and "reasoning_effort" in t for t in texts)


async def render_chat(state: ServerState, messages: list[dict[str, Any]],
                      add_generation_prompt: bool, chat_template: str | None,
                      continue_final_message: bool = False,
                      tools: list[dict[str, Any]] | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of ``messages`` through the chat template; template failures are a 400.
    ``tools`` and ``template_kwargs`` (chat_template_kwargs) reach the template as variables."""
    cfg = state.settings
    tokenizer = state.tokenizer
    if chat_template is None and uses_harmony(tokenizer, cfg.reasoning_parser,
                                              cfg.tool_call_parser):
        try:  # a gpt-oss tokenizer without its template: harmony_render.py
            return await asyncio.to_thread(harmony_prompt_ids, tokenizer, messages, tools,
                                           add_generation_prompt, continue_final_message,
                                           template_kwargs)
        except HarmonyRenderError as exc:
            raise bad_request(str(exc), exc.param) from None
    extra: dict[str, Any] = {}
    if tools:
        extra["tools"] = tools
    if template_kwargs:
        extra["template_kwargs"] = template_kwargs
    try:
        return await state.engine.apply_chat_template(
            messages, add_generation_prompt, chat_template,
            continue_final_message=continue_final_message, **extra)
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
    model, lora = await state.resolve_model(req.model)
    state.require_task("generate", "/v1/chat/completions")
    cfg = state.settings
    parsers = server_parsers(cfg.reasoning_parser, cfg.tool_call_parser,
                             cfg.enable_auto_tool_choice, cfg.tool_parser_plugin)
    tools = await parse_checked(req, check_tools, req, parsers)
    kwargs = with_reasoning_effort(template_kwargs(req), req.reasoning_effort,
                                   "reasoning_effort", lambda: reads_reasoning_effort(state))
    thinking = chat_thinking_budget(req, cfg.reasoning_parser)
    if req.use_beam_search:
        if req.kv_transfer_params is not None:
            raise bad_request("kv_transfer_params with use_beam_search is not supported",
                              "kv_transfer_params")
        if tools.tools or kwargs or parsers.reasoning is not None:
            raise bad_request("use_beam_search does not take tools, chat_template_kwargs or "
                              "reasoning_effort, "
                              "nor run on a server with --reasoning-parser, yet",
                              "use_beam_search")
        if lora is not None:
            raise bad_request("use_beam_search with a LoRA adapter is not supported yet",
                              "use_beam_search")
        return await create_beam_chat(state, req, model)
    params = await parse_sampling(state, req, chat_params, req, state.limits,
                                  tools.enforced.spec if tools.enforced is not None else None,
                                  reads_special_tokens(parsers, tools))
    params = with_thinking_budget(params, *thinking, cfg.reasoning_parser)
    check_generation_prompt(req.add_generation_prompt, req.continue_final_message)
    kv_params = check_request_params(state, req.kv_transfer_params, params.n, 1)
    messages = messages_to_dicts(req.messages)
    state.admission.check_available()
    ids = truncated(await render_chat(state, messages, req.add_generation_prompt,
                                      state.settings.chat_template,
                                      req.continue_final_message, tools.tools, kwargs),
                    req, state.max_model_len)
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
                     req.cache_salt, lora_request=lora, kv_transfer_params=kv_params)
    choices = [_Choice(i, parse=new_output_parse(parsers, tools.parse, req.include_reasoning,
                                                 req.parallel_tool_calls, tools.enforced))
               for i in range(params.n)]
    view = _View(want_logprobs=req.logprobs, top_n=req.top_logprobs or 0,
                 as_ids=tokens_as_ids(req.return_tokens_as_token_ids,
                                      state.settings.return_tokens_as_token_ids),
                 prompt_ids=ids, prompt_top_n=req.prompt_logprobs,
                 details=state.settings.enable_prompt_tokens_details)
    try:
        if req.stream:
            return await _stream(request, state, req, gen, choices, view, model, request_id,
                                 echo)
        return await _whole(gen, choices, view, model, request_id, echo)
    finally:
        gen.close()
        state.release(ticket)
        failures = sum(c.parse.failures for c in choices if c.parse is not None)
        if failures:
            state.metrics.tool_parse_failed(failures)


@dataclass(slots=True, frozen=True)
class _View:
    """How the request asked to see its outputs."""

    want_logprobs: bool
    top_n: int  # top_logprobs
    as_ids: bool  # tokens as "token_id:<id>"
    prompt_ids: list[int]
    prompt_top_n: int | None  # prompt_logprobs
    details: bool  # usage.prompt_tokens_details


def _apply(choices: list[_Choice], c: CompletionOutput,
           view: _View) -> list[ChatLogprobEntry] | None:
    choice = choices[c.index]
    choice.text.append(c.text)
    choice.num_tokens += len(c.token_ids)
    entries = None
    if view.want_logprobs and c.logprobs is not None:
        entries = chat_logprob_entries(c.logprobs, c.token_ids, view.top_n, view.as_ids)
        choice.logprobs.extend(entries)
    if c.finish_reason is not None:
        choice.finish_reason = c.finish_reason
        choice.stop_reason = c.stop_reason
    return entries


def _usage(choices: list[_Choice], view: _View, gen: Generation) -> Usage:
    return make_usage(len(view.prompt_ids), sum(c.num_tokens for c in choices),
                      gen.num_cached_tokens, view.details)


async def _whole(gen: Generation, choices: list[_Choice], view: _View, model: str,
                 request_id: str, echo: str) -> web.Response:
    prompt_lp = None
    try:
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                for _, out in batch:
                    if out.prompt_logprobs is not None:
                        prompt_lp = out.prompt_logprobs
                    for c in out.outputs:
                        _apply(choices, c, view)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, request_id) from None
    if gen.aborted:
        for c in choices:
            c.finish_reason = c.finish_reason or "abort"
    shown: PromptLogprobs | None = None
    if view.prompt_top_n is not None:
        shown = prompt_logprobs(prompt_lp, view.prompt_ids, view.prompt_top_n)
    body = ChatCompletionResponse(
        id=request_id, created=int(time.time()), model=model, usage=_usage(choices, view, gen),
        choices=[ChatChoice(
            index=c.index,
            message=message,
            logprobs=ChatLogprobs(content=c.logprobs) if view.want_logprobs else None,
            finish_reason=_finish_reason(c), stop_reason=c.stop_reason)
            # The message first: its parse decides the finish reason.
            for c, message in [(c, _message(c, echo)) for c in choices]],
        prompt_logprobs=shown,
    )
    return json_response(with_answer(gen, body))


def _message(c: _Choice, echo: str) -> ChatResponseMessage:
    if c.parse is None:
        return ChatResponseMessage(role=ROLE, content=echo + "".join(c.text))
    parsed = c.parse.whole("".join(c.text))
    content = echo + (parsed.content or "") if echo else parsed.content
    calls = [ResponseToolCall(id=t.id, function=FunctionCall(t.name, t.arguments), type=t.type)
             for t in parsed.calls]
    return ChatResponseMessage(role=ROLE, content=content,
                               reasoning_content=parsed.reasoning, tool_calls=calls or None)


def _finish_reason(c: _Choice) -> str | None:
    """"tool_calls" when an output that stopped by itself held calls (one cut by max_tokens
    keeps "length": calls may have been lost)."""
    if c.finish_reason == "stop" and c.parse is not None and c.parse.tools is not None \
            and c.parse.tools.num_calls_found > 0:
        return "tool_calls"
    return c.finish_reason


def _delta(msg: DeltaMessage | None) -> ChatDelta:
    if msg is None:
        return ChatDelta()
    calls = [DeltaToolCall(index=d.index, id=d.id, type=d.type,
                           function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
             for d in msg.tool_calls]
    return ChatDelta(content=msg.content, reasoning_content=msg.reasoning_content,
                     tool_calls=calls or None)


async def _stream(request: web.Request, state: ServerState, req: ChatCompletionRequest,
                  gen: Generation, choices: list[_Choice], view: _View, model: str,
                  request_id: str, echo: str) -> web.StreamResponse:
    writer = SSEWriter(request)
    created = int(time.time())
    opts = req.stream_options
    continuous = opts is not None and opts.continuous_usage_stats

    def chunk(item: ChatChunkChoice | None, usage: Usage | None = None) -> bytes:
        if continuous and item is not None:
            # Usage so far of this chunk's choice, as vLLM's continuous_usage_stats reports it.
            usage = make_usage(len(view.prompt_ids), choices[item.index].num_tokens, 0)
        return encode(ChatCompletionChunk(id=request_id, created=created, model=model,
                                          choices=[] if item is None else [item], usage=usage))

    try:
        await writer.start()
        await writer.send_many([chunk(ChatChunkChoice(c.index, ChatDelta(role=ROLE,
                                                                          content=echo)))
                                for c in choices])
        tail: list[bytes] = []  # what leaves with the end of the stream, in its one write
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                payloads: list[bytes] = []
                for _, out in batch:
                    _chunks(payloads, chunk, choices, out, view)
                if all(c.finish_reason is not None for c in choices):
                    tail = payloads  # the last news: the stream ends right after it
                elif payloads:
                    await writer.send_many(payloads)
        if gen.aborted:
            for c in choices:
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    held = c.parse.delta("", True) if c.parse is not None else None
                    tail.append(chunk(ChatChunkChoice(c.index, _delta(held),
                                                      finish_reason="abort")))
        if opts is not None and opts.final_usage:
            tail.append(chunk(None, _usage(choices, view, gen)))
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
            view: _View) -> None:
    """Fold ``out`` into the choices and append its SSE chunks (one per choice with news)."""
    for c in out.outputs:
        entries = _apply(choices, c, view)
        choice = choices[c.index]
        if choice.parse is not None:
            # Parsers hold back what may still change, so a piece of text can bring no news.
            delta = _delta(choice.parse.delta(c.text, c.finish_reason is not None))
        else:
            delta = ChatDelta(content=c.text) if c.text else ChatDelta()
        if delta == ChatDelta() and not entries and c.finish_reason is None:
            continue
        payloads.append(chunk(ChatChunkChoice(
            index=c.index,
            delta=delta,
            logprobs=ChatLogprobs(content=entries) if view.want_logprobs else None,
            finish_reason=_finish_reason(choice) if c.finish_reason is not None else None,
            stop_reason=c.stop_reason,
        )))
