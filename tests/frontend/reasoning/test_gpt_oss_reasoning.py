"""The ``gpt_oss`` reasoning parser on harmony outputs, whole and streamed (random splits are
fuzzed in tests/frontend/test_parser_stream_fuzz.py)."""

from __future__ import annotations

import pytest

from tidal.frontend.reasoning import get_reasoning_parser

CALL = '<|start|>assistant<|channel|>commentary to=functions.f<|message|>{"a": 1}<|call|>'


def _streamed(text: str, size: int) -> tuple[str, str]:
    parser = get_reasoning_parser("gpt_oss")()
    reasoning, content = [], []
    msgs = [parser.extract_delta(text[i:i + size]) for i in range(0, len(text), size)]
    for msg in [*msgs, parser.finish()]:
        if msg is not None:
            reasoning.append(msg.reasoning_content or "")
            content.append(msg.content or "")
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("text,expected", [
    # analysis, then the final answer (its <|return|> stopped generation: not in the text)
    ("<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final"
     "<|message|>It is 4.", ("Add them.", "It is 4.")),
    ("<|channel|>final<|message|>Just this.<|return|>", (None, "Just this.")),
    # cut inside the reasoning: all of it is reasoning
    ("<|channel|>analysis<|message|>Still think", ("Still think", None)),
    # a preamble is content; a tool call goes on to the tool parser in one spelling, whether
    # the recipient came before or after the channel, with <|constrain|>json or not
    ("<|channel|>analysis<|message|>Need f.<|end|><|start|>assistant<|channel|>commentary"
     "<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.f "
     '<|constrain|>json<|message|>{"a": 1}<|call|>', ("Need f.", "Checking." + CALL)),
    (' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>', (None, CALL)),
    # not harmony at all: content as it came
    ("plain words <|end", (None, "plain words <|end")),
    ("<|channel|>final no message", (None, "<|channel|>final no message")),
])
def test_gpt_oss_channels(text, expected):
    assert get_reasoning_parser("gpt_oss")().extract(text) == expected
    for size in (1, 2, 5, 11):
        assert _streamed(text, size) == tuple(x or "" for x in expected)


def test_stream_holds_back_only_possible_markers():
    parser = get_reasoning_parser("gpt_oss")()
    assert parser.extract_delta("<|chan") is None  # may be a header
    msg = parser.extract_delta("nel|>analysis<|message|>abc<|e")
    assert msg is not None and msg.reasoning_content == "abc"  # "<|e" may be <|end|>
    msg = parser.extract_delta("xtra")
    assert msg is not None and msg.reasoning_content == "<|extra"
