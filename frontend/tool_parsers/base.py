"""The tool parser interface and the scanner every format shares.

A format splits an output, left to right, into text and call sections (``_scan``). A whole
output is scanned at once; a stream is scanned as it arrives and only sections no later text
can change are emitted (a section that may still be a call waits until it closes), so the joined
``tool_calls`` and ``content`` deltas always equal the whole-output answer. A call section that
does not parse is kept as content and counted in ``failures``: a malformed call never fails the
request.
"""

from __future__ import annotations

import json
import logging
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tidal.frontend.reasoning.base import DeltaMessage, DeltaToolCall
from tidal.frontend.reasoning.text_stream import Stripper, partial_suffix
from tidal.frontend.tool_parsers.scanning import BracketScan

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{secrets.token_hex(12)}")
    type: str = "function"


# What a scan yields: content text, or the calls of one parsed call section.
Piece = str | list[ToolCall]


@dataclass(slots=True)
class ScanState:
    text: str = ""
    pos: int = 0  # text before this has been emitted
    mode: str = "text"  # free for each format's own states
    num_calls: int = 0
    content: Stripper = field(default_factory=Stripper)
    scan: BracketScan | None = None  # the value being read, kept between pieces of a stream

    def bracket_end(self, start: int, python: bool = False) -> int | None:
        """Where the bracketed value opening at ``text[start]`` ends (None: not yet)."""
        if self.scan is None or self.scan.start != start:
            self.scan = BracketScan(start, python)
        return self.scan.advance(self.text)

    def text_until(self, marker: str, final: bool, pieces: list[Piece]) -> int | None:
        """Emit the plain text before the next ``marker`` into ``pieces``; returns the
        marker's index, or None when none is there yet (then text that may be the start of a
        marker is held back, unless ``final``)."""
        text = self.text
        i = text.find(marker, self.pos)
        if i < 0:
            stop = len(text)
            if not final:
                stop -= partial_suffix(text[self.pos:], marker)
            if stop > self.pos:
                pieces.append(text[self.pos:stop])
                self.pos = stop
            return None
        if i > self.pos:
            pieces.append(text[self.pos:i])
        return i


def make_call(name: Any, arguments: Any) -> ToolCall | None:
    """A call from decoded JSON: a non-empty string name and an object of arguments (a JSON
    string holding one is accepted too); None if it is not one."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def call_from_object(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    args = next((obj[k] for k in args_keys if k in obj), None)
    return make_call(obj.get("name"), args)


class ToolParser(ABC):
    """One instance per output stream (one choice of one request). Subclasses set ``name``,
    implement ``_scan`` and register with ``tidal.frontend.tool_parsers.register_tool_parser``."""

    name: ClassVar[str]
    # Its markers are special tokens (``[TOOL_CALLS]``, ``<|python_tag|>``, harmony's): a
    # request that does not set skip_special_tokens keeps them in the text for the parser.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.failures = 0  # call sections that did not parse (kept as content)
        self.num_calls_found = 0  # by either path
        self._stream = ScanState()

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content is None when calls were found and no
        other text was."""
        st = ScanState(text=text)
        content: list[str] = []
        calls: list[ToolCall] = []
        for piece in self._scan(st, final=True):
            if isinstance(piece, str):
                content.append(st.content.feed(piece))
            else:
                calls.extend(piece)
        self.num_calls_found += len(calls)
        text_out = "".join(content)
        return (text_out or None) if calls else text_out, calls

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        """The news of one more piece of the stream: content and whole calls (each call is one
        delta with its index, id, type, name and complete arguments)."""
        st = self._stream
        st.text += delta_text
        return self._deltas(st, self._scan(st, final=False))

    def finish_streaming(self) -> DeltaMessage | None:
        return self._deltas(self._stream, self._scan(self._stream, final=True))

    def _deltas(self, st: ScanState, pieces: list[Piece]) -> DeltaMessage | None:
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        for piece in pieces:
            if isinstance(piece, str):
                content.append(st.content.feed(piece))
                continue
            for call in piece:
                calls.append(DeltaToolCall(index=st.num_calls, id=call.id, type=call.type,
                                           name=call.name, arguments=call.arguments))
                st.num_calls += 1
                self.num_calls_found += 1
        text = "".join(content)
        if not text and not calls:
            return None
        return DeltaMessage(content=text or None, tool_calls=calls)

    def _section(self, raw: str, calls: list[ToolCall] | None) -> Piece:
        """A call section: its calls, or (it did not parse) its text as content."""
        if not calls:
            self.failures += 1
            logger.debug("%s: a tool call of %d characters did not parse; kept as content",
                         self.name, len(raw))
            return raw
        return calls

    @abstractmethod
    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        """Pieces of ``st.text`` from ``st.pos`` on, advancing ``st.pos`` past what they cover.
        Unless ``final`` (the text is whole), stop before anything more text could change."""
