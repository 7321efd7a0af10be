"""The ``<think>`` reasoning parsers, whole and streamed."""

from __future__ import annotations

import pytest

from tidal.frontend.reasoning import (
    ReasoningParser,
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)


def whole(name: str, text: str) -> tuple[str | None, str | None]:
    return get_reasoning_parser(name)().extract(text)


def streamed(name: str, text: str, size: int) -> tuple[str, str]:
    parser = get_reasoning_parser(name)()
    reasoning, content = [], []
    msgs = [parser.extract_delta(text[i:i + size]) for i in range(0, len(text), size)]
    for msg in [*msgs, parser.finish()]:
        if msg is not None:
            reasoning.append(msg.reasoning_content or "")
            content.append(msg.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("name,text,expected", [
    ("qwen3", "<think>\nLet me see.\n</think>\n\nIt is 4.", ("Let me see.", "It is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),  # thinking off: no tags
    ("qwen3", "<think>\nstill thinking when cut", ("still thinking when cut", None)),
    ("qwen3", "<think></think>Answer", (None, "Answer")),
    ("qwen3", "a <think> b", (None, "a <think> b")),  # only a leading tag opens reasoning
    ("deepseek_r1", "<think>why</think>because", ("why", "because")),
    ("deepseek_r1", "why\n</think>\nbecause", ("why", "because")),  # opening tag in the prompt
    ("deepseek_r1", "no end tag", ("no end tag", None)),
])
def test_think_parsers(name, text, expected):
    assert whole(name, text) == expected
    for size in (1, 2, 3, 7):
        assert streamed(name, text, size) == tuple(x or "" for x in expected)


def test_registry():
    assert {"qwen3", "deepseek_r1"} <= set(reasoning_parser_names())

    class Upper(ReasoningParser):
        name = "upper"

        def extract(self, text):
            return None, text.upper()

        def extract_delta(self, delta_text):
            return None

        def finish(self):
            return None

    register_reasoning_parser("upper", Upper)
    assert whole("upper", "hi") == (None, "HI")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")
    with pytest.raises(TypeError):
        register_reasoning_parser("bad", int)  # type: ignore[arg-type]
