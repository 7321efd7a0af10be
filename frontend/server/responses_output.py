"""A response's output items, whole or as the Responses API's stream events.

Whole: the parsed output (chat_parsing's ``ParsedMessage``) becomes a reasoning item (with
``--reasoning-parser``), a message with one ``output_text`` part, then one ``function_call``
item per call. Streamed: ``ResponseEvents`` turns the parsers' deltas into ``output_item`` /
``content_part`` / ``output_text`` / ``function_call_arguments`` events, opening each item on
its first news, and closes them all at the end; the items it built are the final response's
output. Both forms carry the same items in the same order: a message holding only whitespace
next to calls is left out (the whitespace around a call's tags is not an answer), and calls
that come before any answer text are held until the message opens or the output ends (text
after a call still belongs to the message, which comes before the calls).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tidal.frontend.reasoning import DeltaMessage
from tidal.frontend.reasoning.base import DeltaToolCall
from tidal.frontend.server.chat_parsing import ParsedMessage
from tidal.frontend.server.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    OutputItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(parsed: ParsedMessage, status: str) -> list[OutputItem]:
    items: list[OutputItem] = []
    content = parsed.content or ""
    if parsed.reasoning:
        # Reasoning followed by an answer or calls ended; only the last item can be cut.
        ended = bool(content or parsed.calls)
        items.append(ReasoningItem(id=item_id("rs"), status="completed" if ended else status,
                                   content=[ReasoningText(text=parsed.reasoning)]))
    if content.strip() or (content and not parsed.calls):
        items.append(MessageItem(id=item_id("msg"), status=status,
                                 content=[OutputText(text=content)]))
    items.extend(FunctionCallItem(id=item_id("fc"), call_id=c.id, name=c.name,
                                  arguments=c.arguments, status=status) for c in parsed.calls)
    return items


def history_message(items: list[OutputItem]) -> dict[str, Any] | None:
    """The output as the assistant's turn of a stored conversation (reasoning left out, as
    chat templates leave out earlier reasoning)."""
    text = "".join(p.text for i in items if isinstance(i, MessageItem) for p in i.content)
    calls = []
    for i in items:
        if isinstance(i, FunctionCallItem):
            try:
                args: Any = msgspec.json.decode(i.arguments)
            except msgspec.DecodeError:
                args = i.arguments  # kept as the model wrote it
            calls.append({"id": i.call_id, "type": "function",
                          "function": {"name": i.name, "arguments": args}})
    if not text and not calls:
        return None
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return msg


@dataclass(slots=True)
class _Open:
    index: int  # output_index
    item: OutputItem
    parts: list[str] = field(default_factory=list)  # text or arguments so far


class ResponseEvents:
    """The stream's events, each encoded with its ``sequence_number``."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[OutputItem] = []  # every item opened, by output_index
        self._reasoning: _Open | None = None
        self._message: _Open | None = None
        self._calls: dict[int, _Open] = {}  # parser's call index -> its item
        self._open: list[_Open] = []
        self._blank: list[str] = []  # whitespace held until the message proves to exist
        # Calls seen before any answer text: held until the message opens or the output ends,
        # so the message (whose text may come after the calls) keeps its place before them.
        self._held: list[DeltaToolCall] = []
        # Every generated token's log-probability (include: message.output_text.logprobs):
        # on the answer's output_text.done event and its final part, set before ``finish``.
        self.logprobs: list[Any] | None = None
        # Those not yet sent: each answer delta carries the tokens since the one before (the
        # parsers' pieces are not cut at token boundaries: a token whose text is reasoning,
        # held back or a call goes with the next answer delta).
        self.pending_logprobs: list[Any] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return msgspec.json.encode(body)

    def feed(self, msg: DeltaMessage | None, out: list[bytes]) -> None:
        if msg is None:
            return
        if msg.reasoning_content:
            self._reason(msg.reasoning_content, out)
        if msg.content:
            self._text(msg.content, out)
        for d in msg.tool_calls:
            if self._message is None:
                self._held.append(d)
            else:
                self._call(d, out)

    def finish(self, status: str, out: list[bytes]) -> list[OutputItem]:
        """Close every open item (a held blank answer becomes the message if nothing else was
        said); returns the output, in order."""
        if self._blank and not self._held and self._message is None:
            text, self._blank = "".join(self._blank), []
            self._text(text, out, force=True)
        if self.pending_logprobs and self._message is not None:
            # Tokens after the answer's last text (an end-of-sequence token): an empty delta
            # carries them, so the deltas' log-probabilities add up to the whole answer's.
            self._text("", out, force=True)
        self._release(out)
        for o in self._open:
            self._close(o, status, out)
        self._open.clear()
        return self.items

    # --- items -----------------------------------------------------------------------------

    def _add(self, item: OutputItem, out: list[bytes]) -> _Open:
        o = _Open(len(self.items), item)
        self.items.append(item)
        self._open.append(o)
        out.append(self.event("response.output_item.added", output_index=o.index, item=item))
        return o

    def _reason(self, text: str, out: list[bytes]) -> None:
        o = self._reasoning
        if o is None:
            item = ReasoningItem(id=item_id("rs"), status="in_progress", content=[])
            o = self._reasoning = self._add(item, out)
            out.append(self.event("response.content_part.added", item_id=item.id,
                                  output_index=o.index, content_index=0,
                                  part=ReasoningText(text="")))
        o.parts.append(text)
        out.append(self.event("response.reasoning_text.delta", item_id=o.item.id,
                              output_index=o.index, content_index=0, delta=text))

    def _end_reasoning(self, out: list[bytes]) -> None:
        if self._reasoning is not None:
            self._close(self._reasoning, "completed", out)
            self._open.remove(self._reasoning)
            self._reasoning = None

    def _text(self, text: str, out: list[bytes], force: bool = False) -> None:
        o = self._message
        if o is None:
            if not text.strip() and not force:
                self._blank.append(text)
                return
            text, self._blank = "".join(self._blank) + text, []
            self._end_reasoning(out)
            item = MessageItem(id=item_id("msg"), status="in_progress", content=[])
            o = self._message = self._add(item, out)
            out.append(self.event("response.content_part.added", item_id=item.id,
                                  output_index=o.index, content_index=0,
                                  part=OutputText(text="")))
        o.parts.append(text)
        sent, self.pending_logprobs = self.pending_logprobs, []
        out.append(self.event("response.output_text.delta", item_id=o.item.id,
                              output_index=o.index, content_index=0, delta=text,
                              logprobs=sent))
        self._release(out)

    def _release(self, out: list[bytes]) -> None:
        held, self._held = self._held, []
        for d in held:
            self._call(d, out)

    def _call(self, d: DeltaToolCall, out: list[bytes]) -> None:
        o = self._calls.get(d.index)
        if o is None:
            self._end_reasoning(out)
            item = FunctionCallItem(id=item_id("fc"), call_id=d.id or item_id("call"),
                                    name=d.name or "", arguments="", status="in_progress")
            o = self._calls[d.index] = self._add(item, out)
        elif d.name:
            assert isinstance(o.item, FunctionCallItem)
            o.item.name += d.name
        if d.arguments:
            o.parts.append(d.arguments)
            out.append(self.event("response.function_call_arguments.delta", item_id=o.item.id,
                                  output_index=o.index, delta=d.arguments))

    def _close(self, o: _Open, status: str, out: list[bytes]) -> None:
        text = "".join(o.parts)
        item = o.item
        if isinstance(item, FunctionCallItem):
            item.arguments = text
            out.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                  output_index=o.index, name=item.name, arguments=text))
        elif isinstance(item, MessageItem):
            part = OutputText(text=text, logprobs=self.logprobs or [])
            item.content = [part]
            out.append(self.event("response.output_text.done", item_id=item.id,
                                  output_index=o.index, content_index=0, text=text,
                                  logprobs=part.logprobs))
            out.append(self.event("response.content_part.done", item_id=item.id,
                                  output_index=o.index, content_index=0, part=part))
        else:
            rpart = ReasoningText(text=text)
            item.content = [rpart]
            out.append(self.event("response.reasoning_text.done", item_id=item.id,
                                  output_index=o.index, content_index=0, text=text))
            out.append(self.event("response.content_part.done", item_id=item.id,
                                  output_index=o.index, content_index=0, part=rpart))
        item.status = status
        out.append(self.event("response.output_item.done", output_index=o.index, item=item))
