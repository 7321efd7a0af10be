"""OpenAI's Responses API: ``POST /v1/responses`` (whole, or streamed as typed SSE events),
``GET`` and ``DELETE /v1/responses/{id}``.

A request is turned into chat terms (``responses_input``) and runs through the chat machinery:
the chat template, the sampling bounds, tools and the server's tool / reasoning parsers,
structured outputs. ``previous_response_id`` continues a stored conversation
(``response_store``: in memory, bounded, per API server process); ``store: false`` keeps none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tidal.frontend.reasoning import DeltaMessage
from tidal.frontend.server.chat_parsing import (
    OutputParse,
    ParsedMessage,
    check_tools,
    new_output_parse,
    reads_special_tokens,
    server_parsers,
    template_kwargs,
)
from tidal.frontend.server.common import check_prompt, json_response, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.openai_protocol import decode_request, encode
from tidal.frontend.server.prompts import check_context
from tidal.frontend.server.responses_input import (
    chat_request,
    check_metadata,
    check_reasoning,
    input_messages,
    rename_params,
    tools_of,
)
from tidal.frontend.server.responses_output import (
    ResponseEvents,
    history_message,
    item_id,
    output_items,
)
from tidal.frontend.server.responses_protocol import (
    RESPONSES_UNSUPPORTED,
    DeletedResponse,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from tidal.frontend.server.response_peers import find_response, forget_response
from tidal.frontend.server.serving_chat import render_chat
from tidal.frontend.server.sampling import chat_params
from tidal.frontend.server.sse import DISCONNECTS, SSEWriter
from tidal.frontend.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

_ID_CHARS = 200  # ids are echoed in errors: bounded


@dataclass(slots=True)
class _Run:
    """One response in the making."""

    obj: ResponseObject  # its shell: everything but output, status and usage
    conversation: list[dict[str, Any]]  # input turns, for the store
    parse: OutputParse | None
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None


async def create_response(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req = decode_request(await read_body(request, state), ResponsesRequest,
                         RESPONSES_UNSUPPORTED)
    model, lora = await state.resolve_model(req.model)
    state.require_task("generate", "/v1/responses")
    check_reasoning(req.reasoning)
    metadata = check_metadata(req.metadata)
    tools, echo_tools = tools_of(req)
    cfg = state.settings
    with rename_params():
        chat = chat_request(req, tools)
        parsers = server_parsers(cfg.reasoning_parser, cfg.tool_call_parser,
                                 cfg.enable_auto_tool_choice, cfg.tool_parser_plugin)
        chat_tools = check_tools(chat, parsers)
        kwargs = template_kwargs(chat)
        # tool_choice "required" / named (or strict tools): the grammar enforces the calls.
        enforced = chat_tools.enforced
        params = chat_params(chat, state.limits,
                             enforced.spec if enforced is not None else None,
                             reads_special_tokens(parsers, chat_tools))
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = await find_response(state.responses, state.response_peers,
                                     req.previous_response_id)
        if stored is None:
            raise APIError(400, f"previous response with id "
                           f"{req.previous_response_id[:_ID_CHARS]!r} not found (responses are "
                           "kept in this server's memory, a bounded number of them, the least "
                           "recently used evicted first, and only with store: true)",
                           param="previous_response_id",
                           code="previous_response_not_found")
        history = stored.messages
    conversation = history + input_messages(req.input, bool(history))
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
        + conversation
    state.admission.check_available()
    with rename_params():
        ids = await render_chat(state, messages, True, cfg.chat_template, False,
                                chat_tools.tools, kwargs)
        check_context(len(ids), params.max_tokens, state.max_model_len, "max_output_tokens",
                      "input")
        check_prompt(state, ids, params, "input")

    response_id = item_id("resp")
    obj = ResponseObject(
        id=response_id, created_at=int(time.time()), model=model, status="in_progress",
        output=[], tools=echo_tools, tool_choice=req.tool_choice or "auto",
        parallel_tool_calls=req.parallel_tool_calls is not False,
        instructions=req.instructions, previous_response_id=req.previous_response_id,
        max_output_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p,
        text={"format": req.text["format"]} if req.text and req.text.get("format")
        else {"format": {"type": "text"}},
        reasoning=req.reasoning, metadata=metadata, store=req.store, user=req.user)
    run = _Run(obj, conversation, new_output_parse(parsers, chat_tools.parse, True,
                                                   req.parallel_tool_calls, enforced), len(ids))
    ticket = state.admission.admit(1)
    gen = Generation(state.engine, state.admission, ticket, response_id, [ids], params,
                     lora_request=lora)
    try:
        if req.stream:
            return await _stream(request, state, gen, run)
        return await _whole(state, gen, run)
    finally:
        gen.close()
        state.release(ticket)
        if run.parse is not None and run.parse.failures:
            state.metrics.tool_parse_failed(run.parse.failures)


async def get_response(request: web.Request) -> web.Response:
    state = get_state(request)
    rid = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raise bad_request("replaying a stored response as a stream is not supported; GET it "
                          "whole", "stream", code="unsupported_field")
    stored = await find_response(state.responses, state.response_peers, rid)
    if stored is None:
        raise _not_found(rid)
    return web.Response(body=stored.body, content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    state = get_state(request)
    rid = request.match_info["response_id"]
    if not await forget_response(state.responses, state.response_peers, rid):
        raise _not_found(rid)
    return json_response(DeletedResponse(id=rid))


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no response with id {rid[:_ID_CHARS]!r} is stored on this server",
                    param="response_id", code="not_found")


# --- whole ---------------------------------------------------------------------------------------


async def _whole(state: ServerState, gen: Generation, run: _Run) -> web.Response:
    try:
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                for _, out in batch:
                    for c in out.outputs:
                        _apply(run, c.text, len(c.token_ids), c.finish_reason)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, run.obj.id) from None
    text = "".join(run.text)
    parsed = run.parse.whole(text) if run.parse is not None else ParsedMessage(None, text)
    status = _status(run, gen)
    items = output_items(parsed, "completed" if status == "completed" else "incomplete")
    body = _finish(state, gen, run, status, items,
                   await _count_tokens(state, parsed.reasoning))
    return web.Response(body=body, content_type="application/json")


def _apply(run: _Run, text: str, num_tokens: int, finish_reason: str | None) -> None:
    run.text.append(text)
    run.num_tokens += num_tokens
    if finish_reason is not None:
        run.finish_reason = finish_reason


def _status(run: _Run, gen: Generation) -> str:
    if run.finish_reason == "abort" or (gen.aborted and run.finish_reason is None):
        return "cancelled"  # the drain timeout (or the engine) ended it early
    return "incomplete" if run.finish_reason == "length" else "completed"


def _finish(state: ServerState, gen: Generation, run: _Run, status: str,
            items: list[OutputItem], reasoning_tokens: int) -> bytes:
    """The final response object, stored unless ``store: false`` or it did not complete."""
    obj = run.obj
    obj.status = status
    obj.output = items
    obj.completed_at = int(time.time()) if status == "completed" else None
    obj.incomplete_details = IncompleteDetails("max_output_tokens") \
        if status == "incomplete" else None
    obj.usage = ResponseUsage(
        input_tokens=run.prompt_tokens, output_tokens=run.num_tokens,
        total_tokens=run.prompt_tokens + run.num_tokens,
        input_tokens_details=InputTokensDetails(gen.num_cached_tokens),
        output_tokens_details=OutputTokensDetails(min(run.num_tokens, reasoning_tokens)))
    body = encode(obj)
    if obj.store and status in ("completed", "incomplete"):
        turn = history_message(items)
        state.responses.put(obj.id, run.conversation + ([turn] if turn else []), body)
    return body


async def _count_tokens(state: ServerState, text: str | None) -> int:
    """Tokens of the reasoning text: the parsers split text, not tokens, so the reasoning is
    encoded again to size it (off the event loop when long)."""
    return len(await state.engine.tokenize(text)) if text else 0


# --- streamed ------------------------------------------------------------------------------------


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  run: _Run) -> web.StreamResponse:
    writer = SSEWriter(request)
    events = ResponseEvents()
    reasoning: list[str] = []

    async def send(payloads: list[bytes], last: bool = False) -> None:
        data = b"".join(b"event: " + _kind(p) + b"\ndata: " + p + b"\n\n" for p in payloads)
        if last:
            writer.finished = True
            await writer.response.write_eof(data)
        elif data:
            await writer.response.write(data)

    try:
        await writer.start()
        await send([events.event("response.created", response=run.obj),
                    events.event("response.in_progress", response=run.obj)])
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                payloads: list[bytes] = []
                for _, out in batch:
                    for c in out.outputs:
                        _apply(run, c.text, len(c.token_ids), c.finish_reason)
                        msg = _delta(run, c.text, c.finish_reason is not None)
                        if msg is not None and msg.reasoning_content:
                            reasoning.append(msg.reasoning_content)
                        events.feed(msg, payloads)
                if payloads:
                    await send(payloads)
        tail: list[bytes] = []
        if gen.aborted and run.finish_reason is None and run.parse is not None:
            events.feed(run.parse.delta("", True), tail)
        status = _status(run, gen)
        items = events.finish("completed" if status == "completed" else "incomplete", tail)
        body = _finish(state, gen, run, status, items,
                       await _count_tokens(state, "".join(reasoning)))
        final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed")
        tail.append(events.event(final, response=msgspec.Raw(body)))
        await send(tail, last=True)
        return writer.response
    except asyncio.CancelledError:
        raise
    except DISCONNECTS:
        logger.debug("client of %s went away mid-stream", run.obj.id)
        return writer.response
    except Exception as exc:  # noqa: BLE001 - the status line is out: report in the stream
        err = from_exception(exc, run.obj.id)
        state.metrics.error(err.status)
        run.obj.status = "failed"
        info = err.info()  # a server error's message without file paths
        run.obj.error = ResponseError(code=err.code or "server_error", message=info.message)
        try:
            await send([events.event("error", code=err.code, message=info.message,
                                     param=err.param),
                        events.event("response.failed", response=run.obj)], last=True)
        except DISCONNECTS:
            pass
        return writer.response


def _delta(run: _Run, text: str, final: bool) -> DeltaMessage | None:
    if run.parse is not None:
        return run.parse.delta(text, final)
    return DeltaMessage(content=text) if text else None


def _kind(payload: bytes) -> bytes:
    """The event's type (the start of every payload ``ResponseEvents`` encodes)."""
    start = payload.index(b'"type":"') + 8
    return payload[start:payload.index(b'"', start)]
