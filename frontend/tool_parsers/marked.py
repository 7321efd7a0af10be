"""Formats whose calls follow a marker in the text: Hermes / Qwen ``<tool_call>{json}
</tool_call>`` and Mistral ``[TOOL_CALLS] [{json}, ...]``."""

from __future__ import annotations

import json
from abc import abstractmethod

from tidal.frontend.tool_parsers.base import (
    Piece,
    ScanState,
    ToolCall,
    ToolParser,
    call_from_object,
)


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i].isspace():
        i += 1
    return i


class MarkedToolParser(ToolParser):
    """Text, then ``marker`` and a call section, then text again, any number of times."""

    marker = ""

    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        text = st.text
        while True:
            if st.mode == "text":
                i = st.text_until(self.marker, final, pieces)
                if i is None:
                    return pieces
                st.pos = i
                st.mode = "call"
            end = self._section_end(st, st.pos + len(self.marker))
            if end is None:
                if not final:
                    return pieces
                end = len(text)
            pieces.append(self._section(text[st.pos:end],
                                        self._parse(text[st.pos + len(self.marker):end])))
            st.pos = end
            st.mode = "text"

    @abstractmethod
    def _section_end(self, st: ScanState, body: int) -> int | None:
        """Index just past the call section whose body starts at ``body``; None: not closed."""

    @abstractmethod
    def _parse(self, body: str) -> list[ToolCall] | None:
        """The calls in a section's body; None: it does not parse."""


class HermesToolParser(MarkedToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one call per tag pair
    (Hermes 2/3, Qwen 2.5/3). A tag inside a JSON string does not end the call; an unclosed
    last call (cut by the stop token) still counts if its JSON is whole."""

    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def _section_end(self, st: ScanState, body: int) -> int | None:
        text = st.text
        b = _skip_ws(text, body)
        if b >= len(text):
            return None
        j: int | None = b
        if text[b] == "{":
            j = st.bracket_end(b)
            if j is None:
                return None
        k = text.find(self.end_marker, j)
        return None if k < 0 else k + len(self.end_marker)

    def _parse(self, body: str) -> list[ToolCall] | None:
        if body.endswith(self.end_marker):
            body = body[:-len(self.end_marker)]
        try:
            call = call_from_object(json.loads(body))
        except (ValueError, RecursionError):
            return None
        return None if call is None else [call]


class MistralToolParser(MarkedToolParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral's pre-v11 format; a
    single object is taken too). Serve with ``skip_special_tokens: false`` where
    ``[TOOL_CALLS]`` is a special token, or it never reaches the text."""

    name = "mistral"
    needs_special_tokens = True
    marker = "[TOOL_CALLS]"

    def _section_end(self, st: ScanState, body: int) -> int | None:
        text = st.text
        b = _skip_ws(text, body)
        if b >= len(text):
            return None
        if text[b] not in "[{":
            return b  # not a call list: the marker alone is the (failed) section
        return st.bracket_end(b)

    def _parse(self, body: str) -> list[ToolCall] | None:
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):
            return None
        items = value if isinstance(value, list) else [value]
        calls = [call_from_object(v) for v in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]
