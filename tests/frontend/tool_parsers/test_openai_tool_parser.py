"""The ``openai`` (gpt-oss harmony) tool parser behind the ``gpt_oss`` reasoning parser, as the
chat server runs them (random splits are fuzzed in tests/frontend/test_parser_stream_fuzz.py)."""

from __future__ import annotations

import json

from tidal.frontend.reasoning import get_reasoning_parser
from tidal.frontend.server.chat_parsing import ChatParsers, new_output_parse
from tidal.frontend.tool_parsers import get_tool_parser, tool_parser_names

TURN = ("<|channel|>analysis<|message|>Weather, then time.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Zürich", "note": "a } brace"}<|call|>'
        "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        '{"tz": "CET"}')  # the last <|call|> stopped generation


def _parse():
    parsers = ChatParsers(get_reasoning_parser("gpt_oss"), get_tool_parser("openai"))
    parse = new_output_parse(parsers, parse_tools=True)
    assert parse is not None
    return parse


def test_calls_reasoning_and_content():
    assert "openai" in tool_parser_names()
    parsed = _parse().whole(TURN)
    assert parsed.reasoning == "Weather, then time."
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Zürich", "note": "a } brace"}), ("get_time", {"tz": "CET"})]
    # Streamed token-sized pieces: the same calls, each delta whole.
    parse = _parse()
    deltas = [parse.delta(TURN[i:i + 3], final=i + 3 >= len(TURN))
              for i in range(0, len(TURN), 3)]
    calls = [c for d in deltas if d is not None for c in d.tool_calls]
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (i, c.name, c.arguments) for i, c in enumerate(parsed.calls)]


def test_final_answer_and_failed_calls_stay_content():
    text = ("<|channel|>final<|message|>No tools needed.<|return|>")
    assert _parse().whole(text).content == "No tools needed."
    bad = "<|channel|>commentary to=functions.f<|message|>{not json<|call|>"
    parse = _parse()
    parsed = parse.whole(bad)
    assert parsed.calls == [] and parse.failures == 1
    assert parsed.content == ("<|start|>assistant<|channel|>commentary to=functions.f"
                              "<|message|>{not json<|call|>")
    # A built-in tool (not functions.*) is no function call either.
    browser = "<|channel|>commentary to=browser.search<|message|>{}<|call|>"
    assert _parse().whole(browser).calls == []
