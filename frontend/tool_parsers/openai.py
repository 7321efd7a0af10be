"""gpt-oss harmony tool calls (``--tool-call-parser openai``, vLLM's name): a message whose
header addresses ``to=functions.NAME`` carries the call's JSON arguments as its body, up to
``<|call|>`` (or the end of the output: ``<|call|>`` stops generation). Use it with
``--reasoning-parser gpt_oss``, which takes the analysis and final channels apart and hands
the tool messages on, each with a header of its own (alone, this parser does not see a call
whose header the generation prompt began, `` to=functions.f<|channel|>...`` at the very start
of the output); any other text is content as it stands (frontend/reasoning/harmony.py
describes the format)."""

from __future__ import annotations

import json

from tidal.frontend.reasoning import harmony
from tidal.frontend.tool_parsers.base import Piece, ScanState, ToolCall, ToolParser, make_call

_NAMESPACE = "functions."


def _call(recipient: str, body: str) -> list[ToolCall] | None:
    if not recipient.startswith(_NAMESPACE):
        return None  # a built-in tool (browser, python): not a function call
    body = body.strip()
    try:
        args = json.loads(body) if body else {}
    except (ValueError, RecursionError):
        return None
    call = make_call(recipient[len(_NAMESPACE):], args)
    return None if call is None else [call]


class OpenAIToolParser(ToolParser):
    name = "openai"
    needs_special_tokens = True

    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        text = st.text
        while True:
            if st.mode == "text":
                i, _ = harmony.find_first(text, harmony.HEADER_STARTS, st.pos)
                if i < 0:
                    stop = len(text) if final else \
                        len(text) - harmony.held_back(text, st.pos, harmony.HEADER_STARTS)
                    if stop > st.pos:
                        pieces.append(text[st.pos:stop])
                        st.pos = stop
                    return pieces
                if i > st.pos:
                    pieces.append(text[st.pos:i])
                st.pos = i
                st.mode = "header"
            j = text.find(harmony.MESSAGE, st.pos)
            if j < 0:
                if final:
                    pieces.append(text[st.pos:])
                    st.pos = len(text)
                return pieces
            _, recipient = harmony.parse_header(text[st.pos:j])
            body = j + len(harmony.MESSAGE)
            if recipient is None:  # not a call: the header stays in the content as it is
                pieces.append(text[st.pos:body])
                st.pos = body
                st.mode = "text"
                continue
            k, marker = harmony.find_first(text, harmony.BODY_ENDS, body)
            if k < 0:
                if not final:
                    return pieces
                k, marker = len(text), ""
            end = k if marker == harmony.START else k + len(marker)
            pieces.append(self._section(text[st.pos:end], _call(recipient, text[body:k])))
            st.pos = end
            st.mode = "text"
