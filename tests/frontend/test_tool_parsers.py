"""Each tool-call parser on its own format: single and parallel calls, text around them, and
malformed output (kept as content, counted, never raised)."""

from __future__ import annotations

import json

import pytest

from tidal.frontend.tool_parsers import (
    ToolParser,
    get_tool_parser,
    load_tool_parser_plugin,
    register_tool_parser,
    tool_parser_names,
)
from tidal.frontend.tool_parsers.base import Piece, ScanState


def parse(name: str, text: str) -> tuple[str | None, list[tuple[str, object]], int]:
    parser = get_tool_parser(name)()
    content, calls = parser.extract_tool_calls(text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls], parser.failures


def test_hermes_parallel_calls_and_text():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
            '"Paris", "note": "a </tool_call> in a string"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls, failures = parse("hermes", text)
    assert content == "Let me check."
    assert calls == [("get_weather", {"city": "Paris", "note": "a </tool_call> in a string"}),
                     ("get_time", {})]
    assert failures == 0


def test_hermes_unclosed_last_call_counts_and_plain_text_is_content():
    content, calls, _ = parse("hermes", '<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}')
    assert content is None and calls == [("f", {"x": [1, 2]})]
    assert parse("hermes", "  just an answer \n") == ("just an answer", [], 0)


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # a brace short
    '<tool_call>{"arguments": {}}</tool_call>',  # no name
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    "<tool_call>not json</tool_call>",
    "<tool_call>",
])
def test_hermes_malformed_call_falls_back_to_content(text):
    content, calls, failures = parse("hermes", text)
    assert calls == [] and failures == 1
    assert content == text.strip()


def test_hermes_keeps_good_calls_next_to_a_bad_one():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": </tool_call>')
    content, calls, failures = parse("hermes", text)
    assert calls == [("a", {})] and failures == 1
    assert content == '<tool_call>{"name": "b", "arguments": </tool_call>'


def test_llama3_json_calls_with_and_without_python_tag():
    text = ('{"name": "search", "parameters": {"q": "tidal \\"engine\\""}}; '
            '{"name": "calc", "parameters": {"expr": "1+1"}}')
    assert parse("llama3_json", text) == (
        None, [("search", {"q": 'tidal "engine"'}), ("calc", {"expr": "1+1"})], 0)
    tagged = '<|python_tag|>{"name": "f", "arguments": {"a": null}}'
    assert parse("llama3_json", tagged) == (None, [("f", {"a": None})], 0)
    assert parse("llama3_json", "The answer is {x}.") == ("The answer is {x}.", [], 0)


def test_llama3_json_malformed():
    content, calls, failures = parse("llama3_json", '{"name": "f", "parameters": {"a": 1')
    assert calls == [] and failures == 1 and content == '{"name": "f", "parameters": {"a": 1'
    content, calls, failures = parse("llama3_json", '{"answer": 42}')  # JSON, but no call
    assert (content, calls, failures) == ('{"answer": 42}', [], 1)


def test_mistral_calls_list():
    text = ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "[x]"}}, '
            '{"name": "g", "arguments": {"b": {"c": []}}}]')
    assert parse("mistral", text) == ("Sure.", [("f", {"a": "[x]"}), ("g", {"b": {"c": []}})],
                                      0)
    content, calls, failures = parse("mistral", "[TOOL_CALLS] oops")
    assert (content, calls, failures) == ("[TOOL_CALLS] oops", [], 1)
    content, calls, failures = parse("mistral", '[TOOL_CALLS] [{"name": "f"}, {"x": 1}]')
    assert calls == [] and failures == 1  # one bad entry: the whole list stays text


def test_pythonic_calls():
    text = '[get_weather(city="San Francisco", units=\'c\'), m.ping(n=[1, {"k": None}], ok=True)]'
    assert parse("pythonic", text) == (None, [
        ("get_weather", {"city": "San Francisco", "units": "c"}),
        ("m.ping", {"n": [1, {"k": None}], "ok": True})], 0)
    assert parse("pythonic", "No calls needed.") == ("No calls needed.", [], 0)


@pytest.mark.parametrize("text", ["[f(1)]", "[f(a=x)]", "[f(a=1)", "[1, 2]", "[f(a={1, 2})]",
                                  "[f(**k)]", "[" * 200 + "]" * 200])
def test_pythonic_malformed(text):
    content, calls, failures = parse("pythonic", text)
    assert calls == [] and failures == 1 and content == text


def test_streaming_emits_whole_calls_with_ids_and_indices():
    parser = get_tool_parser("hermes")()
    text = ('<tool_call>{"name": "a", "arguments": {"x": "}"}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    deltas = []
    for ch in text:
        msg = parser.extract_tool_calls_streaming(ch)
        if msg is not None:
            deltas.extend(msg.tool_calls)
            assert msg.content is None
    assert parser.finish_streaming() is None
    assert [(d.index, d.name, d.arguments, d.type) for d in deltas] == [
        (0, "a", '{"x": "}"}', "function"), (1, "b", "{}", "function")]
    assert deltas[0].id and deltas[0].id != deltas[1].id


class _EchoParser(ToolParser):
    """A plugin's parser: the whole output is one call of ``echo``."""

    name = "echo_all"

    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        if not final:
            return []
        raw, st.pos = st.text[st.pos:], len(st.text)
        return [self._section(raw, [c for c in [self._call(raw)] if c is not None])]

    @staticmethod
    def _call(raw: str):
        from tidal.frontend.tool_parsers.base import make_call
        return make_call("echo", {"text": raw})


def test_registry_and_plugin_file(tmp_path):
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(tool_parser_names())
    register_tool_parser("echo_all", _EchoParser)
    assert parse("echo_all", "hi") == (None, [("echo", {"text": "hi"})], 0)
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from tidal.frontend.tool_parsers import register_tool_parser\n"
        "from tidal.frontend.tool_parsers.marked import HermesToolParser\n"
        "class Tagged(HermesToolParser):\n"
        "    name = 'tagged'\n"
        "    marker = '<call>'\n"
        "    end_marker = '</call>'\n"
        "register_tool_parser('tagged', Tagged)\n")
    load_tool_parser_plugin(str(plugin))
    assert parse("tagged", '<call>{"name": "f", "arguments": {}}</call>') == (
        None, [("f", {})], 0)
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("nope")
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="failed to load"):
        load_tool_parser_plugin(str(bad))
    with pytest.raises(ValueError, match="not a Python file"):
        load_tool_parser_plugin(str(tmp_path / "missing.py"))
