"""OpenAI's Responses API: ``POST /v1/responses`` (whole, streamed as typed SSE events, or in
the background), ``GET`` and ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A request is turned into chat terms (``responses_input``) and runs through the chat machinery:
the chat template, the sampling bounds, tools and the server's tool / reasoning parsers,
structured outputs. ``previous_response_id`` continues a stored conversation
(``response_store``: in memory, bounded, per API server process); ``store: false`` keeps none.
``background: true`` answers at once and generates in a task of this process
(``response_background``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from tidal.frontend.outputs import CompletionOutput
from tidal.frontend.reasoning import DeltaMessage
from tidal.frontend.server.admission import Ticket
from tidal.frontend.server.chat_parsing import (
    OutputParse,
    ParsedMessage,
    check_tools,
    new_output_parse,
    reads_special_tokens,
    server_parsers,
    template_kwargs,
    with_reasoning_effort,
)
from tidal.frontend.server.common import check_prompt, json_response, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.grammar_checks import parse_checked, parse_sampling
from tidal.frontend.server.logprobs import chat_logprob_entries
from tidal.frontend.server.openai_protocol import ChatLogprobEntry, decode_request, encode
from tidal.frontend.server.prompts import check_context
from tidal.frontend.server.responses_input import (
    chat_request,
    check_metadata,
    check_reasoning,
    input_items,
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
    InputItemList,
    MessageItem,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from tidal.frontend.server.response_background import REPLAY_SLICE, EventLog
from tidal.frontend.server.response_peers import (
    PeerStreamLost,
    find_response,
    forget_response,
)
from tidal.frontend.server.response_store import CONTINUABLE
from tidal.frontend.server.responses_truncation import MODES as TRUNCATION_MODES
from tidal.frontend.server.responses_truncation import truncate
from tidal.frontend.server.serving_chat import reads_reasoning_effort, render_chat
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
    items: list[dict[str, Any]]  # the request's input items, for GET .../input_items
    # include: ["message.output_text.logprobs"]: every generated token's, and how many
    # alternatives each (None: not asked for).
    logprobs: list[ChatLogprobEntry] | None = None
    top_logprobs: int = 0
    tokens_as_ids: bool = False  # the server's --return-tokens-as-token-ids
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None


async def create_response(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req = decode_request(await read_body(request, state), ResponsesRequest,
                         RESPONSES_UNSUPPORTED)
    model, lora = await state.resolve_model(req.model)
    state.require_task("generate", "/v1/responses")
    if req.background and not req.store:
        raise bad_request("a background response must be stored (store: true): it is read "
                          "back with GET /v1/responses/{id}", "store")
    if req.background and state.responses.max_entries == 0:
        raise bad_request("background responses need the response store, which this server "
                          "runs without (--max-stored-responses 0)", "background")
    check_reasoning(req.reasoning)
    if req.truncation is not None and req.truncation not in TRUNCATION_MODES:
        raise bad_request(f"truncation must be \"auto\" or \"disabled\", got "
                          f"{str(req.truncation)[:20]!r}", "truncation")
    metadata = check_metadata(req.metadata)
    tools, echo_tools = tools_of(req)
    cfg = state.settings
    with rename_params():
        chat = chat_request(req, tools)
        parsers = server_parsers(cfg.reasoning_parser, cfg.tool_call_parser,
                                 cfg.enable_auto_tool_choice, cfg.tool_parser_plugin)
        chat_tools = await parse_checked(chat, check_tools, chat, parsers)
        kwargs = with_reasoning_effort(template_kwargs(chat), (req.reasoning or {}).get(
            "effort"), "reasoning.effort", lambda: reads_reasoning_effort(state))
        # tool_choice "required" / named (or strict tools): the grammar enforces the calls.
        enforced = chat_tools.enforced
        params = await parse_sampling(state, chat, chat_params, chat, state.limits,
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
        if stored.status not in CONTINUABLE:
            raise APIError(400, f"previous response {req.previous_response_id[:_ID_CHARS]!r} "
                           f"is {stored.status}; only a completed or incomplete response can "
                           "be continued", param="previous_response_id")
        history = stored.messages
    conversation = history + input_messages(req.input, bool(history))
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) \
        + conversation
    state.admission.check_available()
    if req.background:
        state.background.check_room()
    with rename_params():
        ids = await render_chat(state, messages, True, cfg.chat_template, False,
                                chat_tools.tools, kwargs)
        if req.truncation == "auto":
            messages, ids, dropped = await truncate(
                messages, ids, lambda m: render_chat(state, m, True, cfg.chat_template, False,
                                                     chat_tools.tools, kwargs),
                params.max_tokens, state.max_model_len)
            if dropped:
                logger.debug("truncation auto: %d oldest messages left out (%d tokens now)",
                             dropped, len(ids))
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
        reasoning=req.reasoning, metadata=metadata, store=req.store, user=req.user,
        truncation=req.truncation or "disabled", background=req.background,
        top_logprobs=req.top_logprobs)
    run = _Run(obj, conversation, new_output_parse(parsers, chat_tools.parse, True,
                                                   req.parallel_tool_calls, enforced), len(ids),
               input_items(req.input), [] if chat.logprobs else None, req.top_logprobs or 0,
               cfg.return_tokens_as_token_ids)
    ticket = state.admission.admit(1)
    gen = Generation(state.engine, state.admission, ticket, response_id, [ids], params,
                     lora_request=lora)
    if req.background:
        obj.status = "queued"
        body = encode(obj)
        if not state.responses.put(obj.id, [], body, run.items, "queued"):
            _done(state, gen, run, ticket)
            raise bad_request(f"the request's input ({len(body)} bytes and more) is larger "
                              "than this server's response store takes "
                              "(--max-stored-response-bytes); a background response must be "
                              "stored", "input")
        log = EventLog() if req.stream else None
        state.background.start(obj.id, _in_background(state, gen, run, ticket, log),
                               gen.abort, lambda: _fail(state, run, "cancelled", None), log)
        # In /load the task counts it until it ends; this handler's own count stops here.
        board = state.admission.board if cfg.enable_server_load_tracking else None
        if board is not None:
            board.add_load(-1)
        try:
            if log is None:
                return web.Response(body=body, content_type="application/json")
            # The stream reads the response's event log: a client that goes away leaves the
            # response generating, and GET ?stream=true&starting_after=N picks it up again.
            return await _replay(request, log.follow(-1), -1, obj.id)
        finally:
            if board is not None:
                board.add_load(1)  # (given back as the route's count ends with the handler)
    try:
        if req.stream:
            return await _stream(request, state, gen, run)
        return await _whole(state, gen, run)
    finally:
        _done(state, gen, run, ticket)


def _done(state: ServerState, gen: Generation, run: _Run, ticket: Ticket) -> None:
    gen.close()
    state.release(ticket)
    if run.parse is not None and run.parse.failures:
        state.metrics.tool_parse_failed(run.parse.failures)


async def _in_background(state: ServerState, gen: Generation, run: _Run, ticket: Ticket,
                         log: EventLog | None) -> None:
    """A background response's generation: the stored response follows it (and with
    ``log``, its stream events are written there). Counted in ``/load`` while it runs."""
    obj = run.obj
    board = state.admission.board if state.settings.enable_server_load_tracking else None
    if board is not None:
        board.add_load(1)

    def started() -> None:
        obj.status = "in_progress"
        _store(state, run, [], encode(obj))

    try:
        if log is None:
            await _whole(state, gen, run, started)
        else:
            await _produce(state, gen, run, log.send, started)
            if obj.status == "failed":  # (reported in the stream; stored for GET)
                _fail(state, run, "failed", obj.error)
    except asyncio.CancelledError:
        _fail(state, run, "cancelled", None)
        raise
    except Exception as exc:  # noqa: BLE001 - the stored response says what failed
        err = exc if isinstance(exc, APIError) else from_exception(exc, obj.id)
        state.metrics.error(err.status)
        info = err.info()  # a server error's message without file paths
        _fail(state, run, "failed", ResponseError(code=err.code or "server_error",
                                                  message=info.message))
    finally:
        if log is not None:
            if not log.done:
                # Stopped before its final events (the server going down): its readers
                # still learn how it ended.
                log.payloads.append(msgspec.json.encode({
                    "type": "response.failed", "sequence_number": len(log.payloads),
                    "response": msgspec.Raw(encode(obj))}))
            log.close()
        if board is not None:
            board.add_load(-1)
        _done(state, gen, run, ticket)


def _fail(state: ServerState, run: _Run, status: str, error: ResponseError | None) -> None:
    obj = run.obj
    obj.status, obj.error = status, error
    _store(state, run, [], encode(obj))


def _store(state: ServerState, run: _Run, messages: list[dict[str, Any]], body: bytes) -> None:
    """Store the response as it stands (not a background one deleted while it winds down)."""
    obj = run.obj
    if not (obj.background and state.background.is_deleted(obj.id)):
        state.responses.put(obj.id, messages, body, run.items, obj.status)


async def get_response(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    rid = request.match_info["response_id"]
    if request.query.get("stream", "false").lower() not in ("false", "0"):
        raw = request.query.get("starting_after")
        if raw is not None and not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
            raise bad_request(f"starting_after must be an event's sequence_number (an integer "
                              f">= 0), got {raw[:20]!r}", "starting_after")
        after = -1 if raw is None else int(raw)
        log = state.background.log_of(rid)
        if log is not None:
            _check_after(after, log.done, len(log.payloads))
            return await _replay(request, log.follow(after), after, rid)
        # Another API server process may keep it (--api-server-count > 1).
        peers = state.response_peers
        found = await peers.find_events(rid, after) if peers is not None else None
        if found is None:
            raise bad_request(f"response {rid[:_ID_CHARS]!r} has no stream to replay: only a "
                              "response created with background and stream can be streamed "
                              "again, while it runs and for a while after; GET it whole",
                              "stream", code="unsupported_field")
        address, first = found
        _check_after(after, first.done, first.total)
        assert peers is not None
        return await _replay(request, peers.follow_events(address, rid, after, first),
                             after, rid)
    stored = await find_response(state.responses, state.response_peers, rid)
    if stored is None:
        raise _not_found(rid)
    return web.Response(body=stored.body, content_type="application/json")


async def delete_response(request: web.Request) -> web.Response:
    state = get_state(request)
    rid = request.match_info["response_id"]
    # A deleted response does not go on generating, nor is its stream kept for replay.
    await state.background.cancel(rid, delete=True)
    if not await forget_response(state.responses, state.response_peers, rid):
        raise _not_found(rid)
    return json_response(DeletedResponse(id=rid))


async def list_input_items(request: web.Request) -> web.Response:
    """The input items of a stored response, a page at a time (``after``, ``limit`` 1-100,
    default 20, ``order`` ``desc`` by default, as OpenAI's)."""
    state = get_state(request)
    rid = request.match_info["response_id"]
    query = request.query
    if any(key.startswith("include") for key in query):
        raise bad_request("no extra input item data is available; omit include", "include",
                          code="unsupported_field")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f"order must be asc or desc, got {order[:20]!r}", "order")
    raw_limit = query.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be an integer from 1 to 100, got {raw_limit[:20]!r}",
                          "limit")
    stored = await find_response(state.responses, state.response_peers, rid)
    if stored is None:
        raise _not_found(rid)
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    start = 0
    after = query.get("after")
    if after is not None:
        start = next((i + 1 for i, item in enumerate(items) if item.get("id") == after), -1)
        if start < 0:
            raise bad_request(f"no input item with id {after[:_ID_CHARS]!r} in response "
                              f"{rid[:_ID_CHARS]!r}", "after")
    page = items[start:start + limit]
    return json_response(InputItemList(data=page, first_id=page[0]["id"] if page else None,
                                       last_id=page[-1]["id"] if page else None,
                                       has_more=start + limit < len(items)))


async def cancel_response(request: web.Request) -> web.Response:
    """End a background response early (status ``cancelled``); one already over is returned
    as it is."""
    state = get_state(request)
    rid = request.match_info["response_id"]
    peers = state.response_peers
    if await state.background.cancel(rid):
        stored = state.responses.get(rid)
    else:
        stored = state.responses.get(rid)
        if stored is None and peers is not None:
            # The peer that runs it cancels it; else one may hold it, over.
            stored = await peers.cancel(rid) or await peers.get(rid)
    if stored is None:
        raise _not_found(rid)
    if not msgspec.json.decode(stored.body, type=_Background).background:
        raise bad_request(f"response {rid[:_ID_CHARS]!r} was not created in the background; "
                          "only background responses can be cancelled", "response_id")
    return web.Response(body=stored.body, content_type="application/json")


class _Background(msgspec.Struct):
    background: bool = False


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no response with id {rid[:_ID_CHARS]!r} is stored on this server",
                    param="response_id", code="not_found")


# --- whole ---------------------------------------------------------------------------------------


async def _whole(state: ServerState, gen: Generation, run: _Run,
                 started: Callable[[], None] | None = None) -> web.Response:
    """``started``: called with the first tokens."""
    try:
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                if started is not None:
                    started()
                    started = None
                for _, out in batch:
                    for c in out.outputs:
                        _apply(run, c)
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, run.obj.id) from None
    text = "".join(run.text)
    parsed = run.parse.whole(text) if run.parse is not None else ParsedMessage(None, text)
    status = _status(run, gen)
    items = _with_logprobs(run, output_items(parsed, "completed" if status == "completed"
                                             else "incomplete"))
    body = _finish(state, gen, run, status, items,
                   await _count_tokens(state, parsed.reasoning))
    return web.Response(body=body, content_type="application/json")


def _apply(run: _Run, c: CompletionOutput) -> list[ChatLogprobEntry]:
    """Take one output; returns its tokens' log-probability entries (none unless asked)."""
    run.text.append(c.text)
    run.num_tokens += len(c.token_ids)
    if c.finish_reason is not None:
        run.finish_reason = c.finish_reason
    if run.logprobs is None or c.logprobs is None:
        return []
    entries = chat_logprob_entries(c.logprobs, c.token_ids, run.top_logprobs,
                                   run.tokens_as_ids)
    run.logprobs.extend(entries)
    return entries


def _with_logprobs(run: _Run, items: list[OutputItem]) -> list[OutputItem]:
    """The answer's text part carries every generated token's log-probability (reasoning
    and call tokens included, as chat completions gives them); an output of calls alone has
    no text part to carry them."""
    if run.logprobs is not None:
        for item in items:
            if isinstance(item, MessageItem):
                for part in item.content:
                    part.logprobs = run.logprobs
    return items


def _status(run: _Run, gen: Generation) -> str:
    if run.finish_reason == "abort" or (gen.aborted and run.finish_reason is None):
        return "cancelled"  # the drain timeout (or the engine) ended it early
    return "incomplete" if run.finish_reason == "length" else "completed"


def _finish(state: ServerState, gen: Generation, run: _Run, status: str,
            items: list[OutputItem], reasoning_tokens: int) -> bytes:
    """The final response object, stored unless ``store: false`` or it did not complete (a
    background response is stored however it ended, for its GET)."""
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
    if obj.store and status in CONTINUABLE:
        turn = history_message(items)
        _store(state, run, run.conversation + ([turn] if turn else []), body)
    elif obj.background:
        _store(state, run, [], body)
    return body


async def _count_tokens(state: ServerState, text: str | None) -> int:
    """Tokens of the reasoning text: the parsers split text, not tokens, so the reasoning is
    encoded again to size it (off the event loop when long)."""
    return len(await state.engine.tokenize(text)) if text else 0


# --- streamed ------------------------------------------------------------------------------------


Send = Callable[[list[bytes], bool], Awaitable[None]]


async def _stream(request: web.Request, state: ServerState, gen: Generation,
                  run: _Run) -> web.StreamResponse:
    writer = SSEWriter(request)
    try:
        await writer.start()
        await _produce(state, gen, run, _sse_sender(writer))
    except DISCONNECTS:
        logger.debug("client of %s went away mid-stream", run.obj.id)
    return writer.response


def _check_after(after: int, done: bool, total: int) -> None:
    if done and after >= total:
        raise bad_request(f"starting_after {after} is past the stream's last event "
                          f"({total - 1})", "starting_after")


async def _replay(request: web.Request, events: AsyncIterator[tuple[list[bytes], bool]],
                  after: int, response_id: str) -> web.StreamResponse:
    """A background response's stream from its event log (``EventLog.follow``, or a peer's:
    ``ResponsePeers.follow_events``), after the reader's event number."""
    writer = SSEWriter(request)
    send = _sse_sender(writer)
    try:
        await writer.start()
        seq = after + 1  # the next event's number
        try:
            async for payloads, last in events:
                for k in range(0, max(len(payloads), 1), REPLAY_SLICE):
                    await send(payloads[k:k + REPLAY_SLICE], last and k + REPLAY_SLICE
                               >= len(payloads))
                seq += len(payloads)
        except PeerStreamLost as exc:
            # The API server process that runs it stopped answering (or dropped the log):
            # the reader learns the stream ended early, and may GET the response whole.
            logger.warning("background stream of %s lost: %s", response_id, exc)
            await send([msgspec.json.encode({
                "type": "error", "code": "stream_unavailable", "param": None,
                "message": "the API server process that runs this response stopped sending "
                           "its events; GET the response whole, or stream it again",
                "sequence_number": seq})], True)
    except DISCONNECTS:
        logger.debug("client of background %s went away mid-stream", response_id)
    return writer.response


def _sse_sender(writer: SSEWriter) -> Send:
    async def send(payloads: list[bytes], last: bool) -> None:
        data = b"".join(b"event: " + _kind(p) + b"\ndata: " + p + b"\n\n" for p in payloads)
        if last:
            writer.finished = True
            await writer.response.write_eof(data)
        elif data:
            await writer.response.write(data)

    return send


async def _produce(state: ServerState, gen: Generation, run: _Run, send: Send,
                   started: Callable[[], None] | None = None) -> None:
    """The response's stream events, handed to ``send`` as they come (``last`` with the final
    ones: response.completed / incomplete / failed). A failure after the first event is
    reported in the stream; what ``send`` raises (a client gone) goes to the caller.
    ``started``: called between response.created and response.in_progress (a background
    response is created queued)."""
    events = ResponseEvents()
    reasoning: list[str] = []
    try:
        created = events.event("response.created", response=run.obj)
        if started is not None:
            started()
        await send([created, events.event("response.in_progress", response=run.obj)], False)
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                payloads: list[bytes] = []
                for _, out in batch:
                    for c in out.outputs:
                        events.pending_logprobs.extend(_apply(run, c))
                        msg = _delta(run, c.text, c.finish_reason is not None)
                        if msg is not None and msg.reasoning_content:
                            reasoning.append(msg.reasoning_content)
                        events.feed(msg, payloads)
                if payloads:
                    await send(payloads, False)
        tail: list[bytes] = []
        if gen.aborted and run.finish_reason is None and run.parse is not None:
            events.feed(run.parse.delta("", True), tail)
        status = _status(run, gen)
        events.logprobs = run.logprobs  # (on the answer's output_text.done and final item)
        items = events.finish("completed" if status == "completed" else "incomplete", tail)
        body = _finish(state, gen, run, status, items,
                       await _count_tokens(state, "".join(reasoning)))
        final = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed")
        tail.append(events.event(final, response=msgspec.Raw(body)))
        await send(tail, True)
    except (asyncio.CancelledError, *DISCONNECTS):
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is out: report in the stream
        err = from_exception(exc, run.obj.id)
        state.metrics.error(err.status)
        run.obj.status = "failed"
        info = err.info()  # a server error's message without file paths
        run.obj.error = ResponseError(code=err.code or "server_error", message=info.message)
        await send([events.event("error", code=err.code, message=info.message,
                                 param=err.param),
                    events.event("response.failed", response=run.obj)], True)


def _delta(run: _Run, text: str, final: bool) -> DeltaMessage | None:
    if run.parse is not None:
        return run.parse.delta(text, final)
    return DeltaMessage(content=text) if text else None


def _kind(payload: bytes) -> bytes:
    """The event's type (the start of every payload ``ResponseEvents`` encodes)."""
    start = payload.index(b'"type":"') + 8
    return payload[start:payload.index(b'"', start)]
