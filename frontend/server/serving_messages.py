"""``POST /v1/messages`` (Anthropic's Messages API) and ``POST /v1/messages/count_tokens``.

A request becomes a chat-completion request (``anthropic_input.to_chat_request``) and goes
through chat's own checks and prompt rendering (chat_parsing, sampling, serving_chat), so both
APIs share one set of bounds, one chat template path and one pair of output parsers. The
output is parsed by the server's reasoning and tool-call parsers, then laid out as Anthropic
content blocks (thinking, text, tool_use), whole or as Anthropic's stream of events. Errors
leave in Anthropic's envelope (the app's middleware picks it by path; a stream that already
began ends with an ``error`` event).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tidal.frontend.reasoning import DeltaMessage
from tidal.frontend.server.anthropic_input import (
    check_stop_sequences,
    checked_tools,
    sampling_params,
    to_chat_request,
)
from tidal.frontend.server.anthropic_protocol import (
    BlockDelta,
    BlockStart,
    BlockStop,
    ContentBlock,
    CountTokensRequest,
    DeltaUsage,
    Event,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    StopInfo,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    ToolUseBlock,
    error_event,
    sse_event,
)
from tidal.frontend.server.chat_parsing import (
    ChatParsers,
    ChatTools,
    OutputParse,
    new_output_parse,
    server_parsers,
    template_kwargs,
    with_reasoning_effort,
)
from tidal.frontend.server.common import check_prompt, json_response, read_body
from tidal.frontend.server.errors import APIError, bad_request, from_exception
from tidal.frontend.server.generation import Generation
from tidal.frontend.server.grammar_checks import parse_checked, parse_sampling
from tidal.frontend.server.openai_protocol import ChatCompletionRequest, decode_request
from tidal.frontend.server.prompts import check_context
from tidal.frontend.server.serving_chat import (
    messages_to_dicts,
    reads_reasoning_effort,
    render_chat,
)
from tidal.frontend.server.sse import DISCONNECTS, SSEWriter
from tidal.frontend.server.state import ServerState, get_state

logger = logging.getLogger(__name__)


async def _render(state: ServerState, chat: ChatCompletionRequest, tools: ChatTools
                  ) -> list[int]:
    kwargs = with_reasoning_effort(template_kwargs(chat), chat.reasoning_effort,
                                   "output_config.effort", lambda: reads_reasoning_effort(state))
    messages = messages_to_dicts(chat.messages)
    return await render_chat(state, messages, chat.add_generation_prompt,
                             state.settings.chat_template, chat.continue_final_message,
                             tools.tools, kwargs)


def _parsers(state: ServerState) -> ChatParsers:
    cfg = state.settings
    return server_parsers(cfg.reasoning_parser, cfg.tool_call_parser,
                          cfg.enable_auto_tool_choice, cfg.tool_parser_plugin)


# --- handlers ------------------------------------------------------------------------------------


async def count_message_tokens(request: web.Request) -> web.Response:
    state = get_state(request)
    req = decode_request(await read_body(request, state), CountTokensRequest)
    await state.resolve_model(req.model)
    state.require_task("generate", "/v1/messages/count_tokens")
    parsers = _parsers(state)
    chat = to_chat_request(req, parsers, for_count=True)
    ids = await _render(state, chat, checked_tools(chat, parsers))
    return json_response(TokenCount(input_tokens=len(ids)))


async def create_message(request: web.Request) -> web.StreamResponse:
    state = get_state(request)
    req = decode_request(await read_body(request, state), MessagesRequest)
    model, lora = await state.resolve_model(req.model)
    state.require_task("generate", "/v1/messages")
    if req.max_tokens is None:
        raise bad_request("is required", "max_tokens")
    check_stop_sequences(req.stop_sequences, state)
    parsers = _parsers(state)
    chat = to_chat_request(req, parsers)
    tools = await parse_checked(chat, checked_tools, chat, parsers)
    params = await parse_sampling(state, chat, sampling_params, chat, state, tools)
    state.admission.check_available()
    ids = await _render(state, chat, tools)
    check_context(len(ids), params.max_tokens, state.max_model_len, "max_tokens", "messages")
    check_prompt(state, ids, params, "messages")

    request_id = f"msg_{uuid.uuid4().hex}"
    ticket = state.admission.admit(1)
    gen = Generation(state.engine, state.admission, ticket, request_id, [ids], params,
                     lora_request=lora)
    out = _Output(parse=new_output_parse(parsers, tools.parse, chat.include_reasoning,
                                         chat.parallel_tool_calls, tools.enforced),
                  prompt_tokens=len(ids))
    try:
        if req.stream:
            return await _stream(request, state, gen, out, model, request_id)
        return await _whole(gen, out, model, request_id)
    finally:
        gen.close()
        state.release(ticket)
        if out.parse is not None and out.parse.failures:
            state.metrics.tool_parse_failed(out.parse.failures)


# --- output --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Output:
    parse: OutputParse | None
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def stop(self) -> StopInfo:
        """Anthropic's stop_reason (and the stop sequence that matched, if one did)."""
        if self.finish_reason == "length":
            return StopInfo("max_tokens")
        tools = self.parse.tools if self.parse is not None else None
        if tools is not None and tools.num_calls_found > 0:
            return StopInfo("tool_use")
        if isinstance(self.stop_reason, str):
            return StopInfo("stop_sequence", self.stop_reason)
        return StopInfo("end_turn")


def _aborted() -> APIError:
    return APIError(503, "the server shut down before this message was finished; retry "
                    "against another replica", code="server_draining")


def _tool_id() -> str:
    return f"toolu_{secrets.token_hex(12)}"


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use input. The parsers emit JSON objects; only a call the
    grammar enforced and max_tokens cut short holds less (stop_reason says "max_tokens")."""
    try:
        value = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


async def _whole(gen: Generation, out: _Output, model: str, request_id: str) -> web.Response:
    try:
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                for _, ro in batch:
                    for c in ro.outputs:
                        out.text.append(c.text)
                        out.num_tokens += len(c.token_ids)
                        if c.finish_reason is not None:
                            out.finish_reason, out.stop_reason = c.finish_reason, c.stop_reason
    except (asyncio.CancelledError, APIError):
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to the client's error envelope
        raise from_exception(exc, request_id) from None
    if gen.aborted:
        raise _aborted()
    text = "".join(out.text)
    blocks: list[ContentBlock] = []
    if out.parse is None:
        if text:
            blocks.append(TextBlock(text))
    else:
        parsed = out.parse.whole(text)
        if parsed.reasoning:
            blocks.append(ThinkingBlock(parsed.reasoning))
        if parsed.content:
            blocks.append(TextBlock(parsed.content))
        blocks.extend(ToolUseBlock(_tool_id(), call.name, _input(call.arguments))
                      for call in parsed.calls)
    stop = out.stop()
    return json_response(Message(id=request_id, model=model, content=blocks,
                                 stop_reason=stop.stop_reason, stop_sequence=stop.stop_sequence,
                                 usage=MessageUsage(out.prompt_tokens, out.num_tokens)))


@dataclass(slots=True)
class _Blocks:
    """Content blocks opened, filled and closed as the parsed output arrives: a new block
    begins whenever the kind of news changes (thinking, text). Tool calls are held until the
    output ends and then stream as one block each, after the text: text a model writes after
    a call then still joins the one text block, so the joined deltas are always the whole
    message's blocks, in its order (the parsers hand over each call only once it is complete,
    so holding them costs little)."""

    index: int = -1
    open: str | None = None  # "thinking", "text"
    pinged: bool = False
    calls: dict[int, list[str]] = field(default_factory=dict)  # parser index -> name, args...

    def feed(self, msg: DeltaMessage, events: list[Event]) -> None:
        if msg.reasoning_content:
            self._ensure("thinking", events)
            events.append(BlockDelta(self.index, ThinkingDelta(msg.reasoning_content)))
        if msg.content:
            self._ensure("text", events)
            events.append(BlockDelta(self.index, TextDelta(msg.content)))
        for call in msg.tool_calls:
            parts = self.calls.setdefault(call.index, [""])
            if call.name is not None:
                parts[0] = call.name
            if call.arguments:
                parts.append(call.arguments)

    def finish(self, events: list[Event]) -> None:
        """Close the open block, then stream the held tool calls."""
        self.close(events)
        for name, *arguments in self.calls.values():
            self._start(ToolUseBlock(_tool_id(), name, {}), "tool", events)
            if arguments:
                events.append(BlockDelta(self.index, InputJsonDelta("".join(arguments))))
            self.close(events)
        self.calls.clear()

    def _ensure(self, kind: str, events: list[Event]) -> None:
        if self.open != kind:
            self.close(events)
            block: ContentBlock = ThinkingBlock("") if kind == "thinking" else TextBlock("")
            self._start(block, kind, events)

    def _start(self, block: ContentBlock, kind: str, events: list[Event]) -> None:
        self.index += 1
        self.open = kind
        events.append(BlockStart(self.index, block))
        if not self.pinged:  # Anthropic's order: the first block's start, then a ping
            self.pinged = True
            events.append(Ping())

    def close(self, events: list[Event]) -> None:
        if self.open is not None:
            events.append(BlockStop(self.index))
            self.open = None


def _encode(events: list[Event]) -> bytes:
    return b"".join(sse_event(e) for e in events)


async def _stream(request: web.Request, state: ServerState, gen: Generation, out: _Output,
                  model: str, request_id: str) -> web.StreamResponse:
    writer = SSEWriter(request)
    blocks = _Blocks()
    start = MessageStart(Message(id=request_id, model=model, content=[], stop_reason=None,
                                 stop_sequence=None,
                                 usage=MessageUsage(out.prompt_tokens, 0)))
    try:
        await writer.start()
        await writer.response.write(sse_event(start))
        events: list[Event] = []
        async with aclosing(gen.stream()) as stream:
            async for batch in stream:
                for _, ro in batch:
                    for c in ro.outputs:
                        out.num_tokens += len(c.token_ids)
                        final = c.finish_reason is not None
                        if final:
                            out.finish_reason, out.stop_reason = c.finish_reason, c.stop_reason
                        if out.parse is not None:
                            msg = out.parse.delta(c.text, final)
                        else:
                            msg = DeltaMessage(content=c.text or None)
                        if msg is not None:
                            blocks.feed(msg, events)
                if events and out.finish_reason is None:
                    await writer.response.write(_encode(events))
                    events = []
        if gen.aborted:
            raise _aborted()
        blocks.finish(events)
        if not blocks.pinged:
            events.append(Ping())
        stop = out.stop()
        events.append(MessageDelta(stop, DeltaUsage(out.prompt_tokens, out.num_tokens)))
        events.append(MessageStop())
        await writer.response.write_eof(_encode(events))
        return writer.response
    except asyncio.CancelledError:
        raise
    except DISCONNECTS:
        logger.debug("client of %s went away mid-stream", request_id)
        return writer.response
    except Exception as exc:  # noqa: BLE001 - the status line is out: report in the stream
        err = from_exception(exc, request_id)
        state.metrics.error(err.status)
        try:
            await writer.response.write_eof(error_event(err))
        except DISCONNECTS:
            pass
        return writer.response

