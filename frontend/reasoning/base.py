"""The reasoning parser interface, and the one implementation ``<think>``-style models share.

A parser instance serves one output stream (one choice of one request): ``extract`` parses a
whole output, ``extract_delta`` / ``finish`` parse it as it arrives. Both run the same
left-to-right scanner, and a stream only emits what no later text can change, so the joined
deltas always equal the whole-output answer (tests/frontend/test_parser_stream_fuzz.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tidal.engine_core.reasoning_formats import REASONING_FORMATS
from tidal.frontend.reasoning.text_stream import Stripper, partial_suffix


@dataclass(slots=True)
class DeltaToolCall:
    """One ``tool_calls`` delta of a stream (OpenAI's shape; unset parts are omitted)."""

    index: int
    id: str | None = None
    type: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True)
class DeltaMessage:
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not self.reasoning_content and not self.content and not self.tool_calls


class ReasoningParser(ABC):
    """Splits an output into (reasoning, content). Subclasses set ``name`` and register with
    ``tidal.frontend.reasoning.register_reasoning_parser``."""

    name: ClassVar[str]
    # Its markers are special tokens: a request that does not set skip_special_tokens keeps
    # them in the text for the parser (as vLLM's parsers adjust the request).
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; None where there is none."""

    @abstractmethod
    def extract_delta(self, delta_text: str) -> DeltaMessage | None:
        """The news of one more piece of this parser's stream (None: nothing yet)."""

    @abstractmethod
    def finish(self) -> DeltaMessage | None:
        """The stream ended: whatever was held back."""


class ScanningReasoningParser(ReasoningParser):
    """A parser built on one left-to-right scanner over a scan state (the text so far and how
    far it is decided): the whole output and the stream both run ``_scan``, so they agree."""

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(tokenizer)
        self._stream = self._new_scan("")

    @abstractmethod
    def _new_scan(self, text: str) -> Any:
        """A scan state at the start of ``text``."""

    @abstractmethod
    def _scan(self, st: Any, final: bool) -> tuple[str, str]:
        """(reasoning, content) decided since the last call; ``final``: the text is whole."""

    def extract(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self._scan(self._new_scan(text), final=True)
        return reasoning or None, content or None

    def extract_delta(self, delta_text: str) -> DeltaMessage | None:
        st = self._stream
        st.text += delta_text
        return self._message(*self._scan(st, final=False))

    def finish(self) -> DeltaMessage | None:
        return self._message(*self._scan(self._stream, final=True))

    @staticmethod
    def _message(reasoning: str, content: str) -> DeltaMessage | None:
        if not reasoning and not content:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, content=content or None)


@dataclass(slots=True)
class _ThinkScan:
    text: str = ""
    pos: int = 0  # text before this is decided
    state: str = "start"  # start | reasoning | content
    reasoning: Stripper = field(default_factory=Stripper)
    content: Stripper = field(default_factory=Stripper)


class ThinkTagParser(ScanningReasoningParser):
    """``<think>reasoning</think>content``. ``implicit_start``: the opening tag may be missing
    (it was in the prompt, as DeepSeek-R1's template does), so text before ``</think>`` is
    reasoning, and an output that never closes it is all reasoning. Without it an output that
    does not open with ``<think>`` is all content (Qwen3 with thinking off); one that opens it
    and is cut short is all reasoning. Both parts are stripped of surrounding whitespace."""

    name = "think"
    start_tag = "<think>"
    end_tag = "</think>"
    implicit_start = False

    def _new_scan(self, text: str) -> _ThinkScan:
        return _ThinkScan(text=text)

    def _scan(self, st: _ThinkScan, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        text = st.text
        if st.state == "start":
            rest = text[st.pos:].lstrip()
            if rest.startswith(self.start_tag):
                st.pos = text.index(self.start_tag, st.pos) + len(self.start_tag)
                st.state = "reasoning"
            elif not final and self.start_tag.startswith(rest):
                return "", ""  # may still become the opening tag
            else:
                st.state = "reasoning" if self.implicit_start else "content"
        if st.state == "reasoning":
            end = text.find(self.end_tag, st.pos)
            if end >= 0:
                reasoning.append(st.reasoning.feed(text[st.pos:end]))
                st.pos = end + len(self.end_tag)
                st.state = "content"
            else:
                stop = len(text) if final else len(text) - partial_suffix(text, self.end_tag)
                reasoning.append(st.reasoning.feed(text[st.pos:stop]))
                st.pos = stop
        if st.state == "content":
            content.append(st.content.feed(text[st.pos:]))
            st.pos = len(text)
        return "".join(reasoning), "".join(content)


# The tags come from the table the EngineCore reads too (its grammar gate and thinking budget
# must end the reasoning exactly where these parsers do).
_QWEN3 = REASONING_FORMATS["qwen3"]
_R1 = REASONING_FORMATS["deepseek_r1"]


class Qwen3ReasoningParser(ThinkTagParser):
    name = _QWEN3.name
    start_tag = _QWEN3.start
    end_tag = _QWEN3.end
    implicit_start = _QWEN3.implicit_start


class DeepSeekR1ReasoningParser(ThinkTagParser):
    name = _R1.name
    start_tag = _R1.start
    end_tag = _R1.end
    implicit_start = _R1.implicit_start
