"""gpt-oss's harmony channels as reasoning and content (``--reasoning-parser gpt_oss``).

The ``analysis`` channel's bodies are the reasoning; ``final`` and ``commentary`` bodies
without a recipient (preambles) are the content. A message addressed to a tool
(``to=functions.NAME``) is handed on inside the content as one canonical harmony message
(``harmony.call_header`` + body + ``<|call|>`` when the model wrote its terminator), which the
``openai`` tool parser turns into a call. Text outside any message header (a model that does
not speak harmony) is content.

One left-to-right scanner serves the whole output and the stream; a stream holds back only
what may still be a marker, so the joined deltas equal the whole parse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tidal.engine_core.reasoning_formats import REASONING_FORMATS
from tidal.frontend.reasoning import harmony
from tidal.frontend.reasoning.base import ScanningReasoningParser
from tidal.frontend.reasoning.text_stream import Stripper


@dataclass(slots=True)
class _HarmonyScan:
    text: str = ""
    pos: int = 0  # text before this is decided
    state: str = "between"  # between | header | body | plain
    header_at: int = 0  # where the message being read began (its <|start|>, if any)
    kind: str = "content"  # the body's destination: reasoning | content | call
    reasoning: Stripper = field(default_factory=Stripper)
    content: Stripper = field(default_factory=Stripper)


class GptOssReasoningParser(ScanningReasoningParser):
    name = REASONING_FORMATS["gpt_oss"].name
    needs_special_tokens = True

    def _new_scan(self, text: str) -> _HarmonyScan:
        return _HarmonyScan(text=text)

    def _scan(self, st: _HarmonyScan, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []

        def emit(kind: str, text: str) -> None:
            if text:
                out, stripper = ((reasoning, st.reasoning) if kind == "reasoning"
                                 else (content, st.content))
                out.append(stripper.feed(text))

        text = st.text
        while True:
            if st.state == "between":
                rest = text[st.pos:]
                st.header_at = st.pos
                opens = harmony.leading_recipient(text, final) if st.pos == 0 else False
                if opens is None:
                    break
                if opens:
                    st.state = "header"
                elif rest.startswith(harmony.START):
                    st.pos += len(harmony.START)
                    st.state = "header"
                elif rest.startswith(harmony.CHANNEL):
                    st.state = "header"
                elif not rest or (not final and any(m.startswith(rest)
                                                    for m in harmony.HEADER_STARTS)):
                    break  # nothing more, or it may still become a header
                else:
                    st.state = "plain"
            if st.state == "plain":
                i, _ = harmony.find_first(text, harmony.HEADER_STARTS, st.pos)
                if i < 0:
                    stop = len(text) if final else \
                        len(text) - harmony.held_back(text, st.pos, harmony.HEADER_STARTS)
                    emit("content", text[st.pos:stop])
                    st.pos = stop
                    break
                emit("content", text[st.pos:i])
                st.pos = i
                st.state = "between"
                continue
            if st.state == "header":
                j = text.find(harmony.MESSAGE, st.pos)
                if j < 0:
                    if final:  # a header never finished: keep it, as it came, as content
                        emit("content", text[st.header_at:])
                        st.pos = len(text)
                    break
                channel, recipient = harmony.parse_header(text[st.pos:j])
                st.pos = j + len(harmony.MESSAGE)
                if recipient is not None:
                    st.kind = "call"
                    emit("content", harmony.call_header(recipient))
                else:
                    st.kind = "reasoning" if channel == "analysis" else "content"
                st.state = "body"
            # body
            i, marker = harmony.find_first(text, harmony.BODY_ENDS, st.pos)
            if i < 0:
                stop = len(text) if final else \
                    len(text) - harmony.held_back(text, st.pos, harmony.BODY_ENDS)
                emit(st.kind, text[st.pos:stop])
                st.pos = stop
                break
            emit(st.kind, text[st.pos:i])
            if st.kind == "call" and marker != harmony.START:
                emit("content", harmony.CALL)
            st.pos = i if marker == harmony.START else i + len(marker)
            st.state = "between"
        return "".join(reasoning), "".join(content)
