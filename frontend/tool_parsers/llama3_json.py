"""Llama 3.x JSON tool calls: ``{"name": ..., "parameters": {...}}``, several separated by
``;``, at the start of the output or after ``<|python_tag|>``."""

from __future__ import annotations

import json
from typing import Any

from tidal.frontend.tool_parsers.base import Piece, ScanState, ToolParser, call_from_object

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Calls start where the output opens with ``{`` or at ``<|python_tag|>`` (a special
    token: serve with ``skip_special_tokens: false`` to keep it in the text). Each JSON object
    is one call; text after the last one is content."""

    name = "llama3_json"
    needs_special_tokens = True

    def __init__(self, tokenizer: Any = None, call_begins: tuple[str, ...] = ()) -> None:
        super().__init__(tokenizer)
        # Strict tools under "auto" (strict_tags.py): the grammar holds only calls that open
        # with one of these texts, so another object (``{"parameters": ...``, ``{ "name"``)
        # is not a call but content.
        self.call_begins = call_begins

    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        text = st.text
        while True:
            if st.mode == "text" and st.pos == 0 and not st.content.started:
                rest = text.lstrip()
                if not rest and not final:
                    return pieces
                if rest.startswith("{"):
                    st.pos = len(text) - len(rest)
                    st.mode = "calls"
                else:
                    st.mode = "text_only"
            if st.mode in ("text", "text_only"):
                i = st.text_until(PYTHON_TAG, final, pieces)
                if i is None:
                    return pieces
                st.pos = i + len(PYTHON_TAG)
                st.mode = "calls"
            # "calls": objects separated by ';' and whitespace
            k = st.pos
            while k < len(text) and (text[k].isspace() or text[k] == ";"):
                k += 1
            st.pos = k
            if k >= len(text):
                return pieces
            if text[k] != "{":
                st.mode = "text_only"
                continue
            j = st.bracket_end(k)
            if j is None:
                if not final:
                    return pieces
                j = len(text)
            try:
                call = call_from_object(json.loads(text[k:j]), ("parameters", "arguments"))
            except (ValueError, RecursionError):
                call = None
            if self.call_begins and not text.startswith(self.call_begins, k):
                call = None
            pieces.append(self._section(text[k:j], None if call is None else [call]))
            st.pos = j
