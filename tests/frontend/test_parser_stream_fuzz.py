"""Streaming equivalence of the reasoning and tool-call parsers, run as the chat server runs
them (``chat_parsing.OutputParse``): seeded random outputs (tool calls with nested, tricky JSON
arguments, several calls, text around them, reasoning blocks, malformed and cut-off calls),
each streamed in random pieces (mid-tag, mid-string, one character at a time), must join to
exactly the whole-output parse; and well-formed calls must come back as generated."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

from tidal.frontend.reasoning import get_reasoning_parser
from tidal.frontend.server.chat_parsing import ChatParsers, OutputParse, new_output_parse
from tidal.frontend.tool_parsers import get_tool_parser

CASES_PER_PARSER = 300  # x 4 tool parsers = 1,200 outputs, each streamed twice
TRICKY = ['"', "\\", "{", "}", "[", "]", "(", ")", "'", ";", "<tool_call>", "</tool_call>",
          "[TOOL_CALLS]", "<|python_tag|>", "</think>", "<think>", "\n", "\t", "é", "漢字",
          "🙂", "\u2028", "\\u0041", "\\n", ",", ":", " ", "null", "x=1"]
WORDS = ["the", "weather", "call", "tool", "ok", "Sure", "result", "<", "<tool", "[TOOL",
         "<|python", "<thi", "</thin", "{", "}", "[", "]", "é", "🙂", "\n", "  ", "'", '"']


def _string(rng: random.Random) -> str:
    return "".join(rng.choice(TRICKY + ["a", "b", "7"]) for _ in range(rng.randint(0, 6)))


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 5)
    if kind == 0:
        return _string(rng)
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.choice([True, False, None])
    if kind == 3:
        return round(rng.uniform(-1e3, 1e3), 3)
    if kind == 4:
        return _string(rng)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_string(rng) or "k": _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _args(rng: random.Random) -> dict[str, Any]:
    # Python keyword names for the pythonic format; JSON formats take any key.
    return {f"{rng.choice(['a', 'loc', 'q', 'n_'])}{i}": _value(rng, 1)
            for i in range(rng.randint(0, 4))}


def _name(rng: random.Random) -> str:
    return rng.choice(["get_weather", "search", "f", "lookup_user", "calc2"])


def _text(rng: random.Random, avoid: tuple[str, ...] = ()) -> str:
    while True:
        s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6)))
        if not any(a in s for a in avoid):
            return s


@dataclass
class Case:
    text: str
    # When the output is well formed: the calls and the content it must parse to.
    calls: list[tuple[str, dict[str, Any]]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _dumps(obj: Any, rng: random.Random) -> str:
    return json.dumps(obj, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, None, 2]))


def _break(s: str, rng: random.Random) -> str:
    """Malformed: cut short, a brace lost, or junk in the middle."""
    kind = rng.randrange(3)
    if kind == 0:
        return s[:rng.randint(0, max(0, len(s) - 1))]
    if kind == 1:
        return s.replace("}", "", 1)
    i = rng.randint(0, len(s))
    return s[:i] + rng.choice(["@@", "{", '"', "]"]) + s[i:]


def gen_hermes(rng: random.Random) -> Case:
    calls = [(_name(rng), _args(rng)) for _ in range(rng.randint(0, 3))]
    good = True
    parts = [_text(rng, ("<tool_call>",))]
    for name, args in calls:
        body = _dumps({"name": name, "arguments": args}, rng)
        if rng.random() < 0.1:
            body, good = _break(body, rng), False
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
        if rng.random() < 0.3:
            parts.append(_text(rng, ("<tool_call>",)))
    if calls and rng.random() < 0.15:  # the stop token cut the last closing tag
        parts[-1] = parts[-1].removesuffix("</tool_call>")
        good = good and parts[-1].startswith("<tool_call>")
    return Case("".join(parts), calls if good else None)


def gen_llama3(rng: random.Random) -> Case:
    if rng.random() < 0.2:
        return Case(_text(rng, ("<|python_tag|>", "{")), [])
    calls = [(_name(rng), _args(rng)) for _ in range(rng.randint(1, 3))]
    good = True
    objs = []
    for name, args in calls:
        obj = _dumps({"name": name, "parameters": args}, rng)
        if rng.random() < 0.1:
            obj, good = _break(obj, rng), False
        objs.append(obj)
    head = rng.choice(["", "<|python_tag|>", " "])
    return Case(head + rng.choice(["; ", ";", "\n"]).join(objs), calls if good else None)


def gen_mistral(rng: random.Random) -> Case:
    calls = [(_name(rng), _args(rng)) for _ in range(rng.randint(0, 3))]
    before = _text(rng, ("[TOOL_CALLS]",))
    if not calls:
        return Case(before, [])
    body = _dumps([{"name": n, "arguments": a} for n, a in calls], rng)
    good = True
    if rng.random() < 0.1:
        body, good = _break(body, rng), False
    after = _text(rng, ("[TOOL_CALLS]",)) if rng.random() < 0.3 else ""
    return Case(f"{before}[TOOL_CALLS] {body}{after}", calls if good else None)


def _py(value: Any) -> str:
    return repr(value)  # Python literals of JSON values (True, None, nested dicts and lists)


def gen_pythonic(rng: random.Random) -> Case:
    if rng.random() < 0.2:
        text = _text(rng)
        return Case(text, [] if not text.lstrip().startswith("[") else None)
    calls = [(_name(rng), _args(rng)) for _ in range(rng.randint(1, 3))]
    src = "[" + ", ".join(f"{n}({', '.join(f'{k}={_py(v)}' for k, v in a.items())})"
                          for n, a in calls) + "]"
    good = True
    if rng.random() < 0.1:
        src, good = _break(src, rng), False
    return Case(src + (" " + _text(rng) if rng.random() < 0.2 else ""), calls if good else None)


GENERATORS = {"hermes": gen_hermes, "llama3_json": gen_llama3, "mistral": gen_mistral,
              "pythonic": gen_pythonic}


def _reasoning_block(rng: random.Random, parser: str) -> tuple[str, str]:
    thought = _text(rng, ("</think>", "<think>"))
    if parser == "deepseek_r1" and rng.random() < 0.5:
        return f"{thought}\n</think>\n\n", thought
    return f"<think>\n{thought}\n</think>\n\n", thought


def _chunks(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    one_char = rng.random() < 0.2
    while i < len(text):
        n = 1 if one_char else rng.choice([1, 1, 2, 3, 5, 8, 13])
        out.append(text[i:i + n])
        i += n
    return out


def _parse(reasoning_name: str | None, tool_name: str) -> OutputParse:
    """The parsers of one choice, as the chat server runs them."""
    parsers = ChatParsers(get_reasoning_parser(reasoning_name) if reasoning_name else None,
                          get_tool_parser(tool_name))
    parse = new_output_parse(parsers, parse_tools=True)
    assert parse is not None
    return parse


def _stream(reasoning_name: str | None, tool_name: str, pieces: list[str], rng: random.Random
            ) -> tuple[str, str, list[tuple[int, str, str]]]:
    return _stream_through(_parse(reasoning_name, tool_name), pieces, rng)


def _stream_through(parse: OutputParse, pieces: list[str], rng: random.Random
                    ) -> tuple[str, str, list[tuple[int, str, str]]]:
    """The stream of ``pieces`` joined: reasoning, content and each call's (index, name,
    arguments), the arguments joined over the deltas of their call."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[tuple[int, str, str]] = []
    # The last piece comes with the finish (as the engine's last output does), or after it.
    steps = [(p, False) for p in pieces] + [("", True)]
    if pieces and rng.random() < 0.5:
        steps = [(p, False) for p in pieces[:-1]] + [(pieces[-1], True)]
    for piece, final in steps:
        msg = parse.delta(piece, final)
        if msg is None:
            continue
        reasoning.append(msg.reasoning_content or "")
        content.append(msg.content or "")
        for d in msg.tool_calls:
            if calls and calls[-1][0] == d.index:  # more arguments of the same call
                assert d.name is None or d.name == calls[-1][1]
                calls[-1] = (d.index, calls[-1][1], calls[-1][2] + (d.arguments or ""))
                continue
            assert d.id and d.type == "function" and d.name
            assert d.index == len(calls)
            calls.append((d.index, d.name, d.arguments or ""))
    return "".join(reasoning), "".join(content), calls


def _whole(reasoning_name: str | None, tool_name: str, text: str
           ) -> tuple[str, str, list[tuple[int, str, str]]]:
    parsed = _parse(reasoning_name, tool_name).whole(text)
    return (parsed.reasoning or "", parsed.content or "",
            [(i, c.name, c.arguments) for i, c in enumerate(parsed.calls)])


@pytest.mark.parametrize("tool_name", sorted(GENERATORS))
def test_streamed_deltas_join_to_the_whole_parse(tool_name: str):
    rng = random.Random(f"fuzz-{tool_name}")
    checked_good = 0
    for _ in range(CASES_PER_PARSER):
        case = GENERATORS[tool_name](rng)
        reasoning_name = rng.choice([None, "qwen3", "deepseek_r1"])
        text, thought = case.text, None
        if reasoning_name and rng.random() < 0.8:
            block, thought = _reasoning_block(rng, reasoning_name)
            text = block + text
            if rng.random() < 0.1:  # cut inside the reasoning: no answer at all
                text, thought, case.calls = text[:rng.randint(0, len(block) - 1)], None, None
        whole = _whole(reasoning_name, tool_name, text)
        for _ in range(2):
            streamed = _stream(reasoning_name, tool_name, _chunks(text, rng), rng)
            assert streamed == whole, f"{tool_name}/{reasoning_name}: {text!r}"
        if thought is not None and reasoning_name:
            assert whole[0] == thought.strip()
        if case.calls is not None and (reasoning_name is None or thought is not None
                                       or reasoning_name == "qwen3"):
            got = [(name, json.loads(args)) for _, name, args in whole[2]]
            assert got == case.calls, text
            checked_good += 1
    assert checked_good > CASES_PER_PARSER // 2  # the generator mostly makes valid calls


ENFORCED_CASES = 300  # required arrays and named arguments, each streamed twice


def gen_enforced(rng: random.Random) -> tuple[str | None, Case]:
    """(the named function or None for "required", an output its grammar could give: compact
    or spaced JSON, keys in either order, sometimes cut short by max_tokens or followed by
    junk that no grammar would allow)."""
    if rng.random() < 0.3:
        name, args = _name(rng), _args(rng)
        text = _dumps(args, rng)
        good = rng.random() < 0.85
        if not good:
            text = text[:rng.randint(0, len(text))]
        # A named call is the whole output, cut or not.
        return name, Case(text, [(name, args)] if good else None, {"raw": text})
    calls = [(_name(rng), _args(rng)) for _ in range(rng.randint(1, 3))]
    items = []
    for name, args in calls:
        members = [f'"name": {json.dumps(name)}', f'"parameters": {_dumps(args, rng)}']
        if rng.random() < 0.2:
            members.reverse()
        items.append("{" + rng.choice([", ", ",", ",\n "]).join(members) + "}")
    text = "[" + rng.choice([", ", ","]).join(items) + "]"
    good = True
    kind = rng.random()
    if kind < 0.15:
        text, good = text[:rng.randint(0, len(text) - 1)], False
    elif kind < 0.2:
        text, good = text + rng.choice([" junk", "]", "{}"]), False
    elif kind < 0.25:
        i = rng.randint(0, len(text))
        text, good = text[:i] + rng.choice(["@", "x", '"k": 1, ']) + text[i:], False
    return None, Case(text, calls if good else None)


def test_enforced_tool_calls_stream_like_the_whole_parse():
    """Outputs of tool_choice "required" / a named function: name first, then argument
    fragments, joined == the whole parse (which keeps the arguments as the model wrote
    them)."""
    from tidal.engine_core.sampling_params import StructuredOutputsParams
    from tidal.frontend.tool_parsers.enforced import EnforcedTools

    rng = random.Random("fuzz-enforced")
    checked_good = 0
    for _ in range(ENFORCED_CASES):
        named, case = gen_enforced(rng)
        reasoning_name = rng.choice([None, "qwen3"])
        parsers = ChatParsers(get_reasoning_parser(reasoning_name) if reasoning_name else None)
        enforced = EnforcedTools(named, StructuredOutputsParams(json_object=True))

        def parse() -> OutputParse:
            out = new_output_parse(parsers, True, enforced=enforced)
            assert out is not None
            return out

        text = case.text
        if reasoning_name and rng.random() < 0.5:
            text = _reasoning_block(rng, reasoning_name)[0] + text
        parsed = parse().whole(text)
        whole = (parsed.reasoning or "", parsed.content or "",
                 [(i, c.name, c.arguments) for i, c in enumerate(parsed.calls)])
        for _ in range(2):
            assert _stream_through(parse(), _chunks(text, rng), rng) == whole, text
        if named is not None:  # always one call, its arguments exactly the output (the
            # reasoning parser strips the whitespace around the answer)
            raw = case.extra["raw"]
            assert [(n, a) for _, n, a in whole[2]] == [(named, raw.strip() if reasoning_name
                                                         else raw)]
        if case.calls is not None:
            assert [(n, json.loads(a)) for _, n, a in whole[2]] == case.calls, text
            assert whole[1] == ""
            checked_good += 1
    assert checked_good > ENFORCED_CASES // 2


HARMONY_CASES = 300  # gpt-oss outputs, each streamed twice with tools and once without
# Text of harmony bodies: near-markers and JSON-ish characters, never a whole marker.
HARMONY_WORDS = ["the", "plan", "call", "ok", "é", "🙂", "漢字", "\n", "  ", "<", "<|", "<|end",
                 "<|chan", "<|start", "|>", "to=", "{", "}", '"', "final", "analysis", "json"]
_HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>",
                    "<|return|>")


def _harmony_text(rng: random.Random) -> str:
    while True:
        s = "".join(rng.choice(HARMONY_WORDS + [" "]) for _ in range(rng.randint(0, 8)))
        if not any(m in s for m in _HARMONY_MARKERS):
            return s


def gen_harmony(rng: random.Random) -> tuple[str, dict[str, Any] | None]:
    """A gpt-oss turn: analysis, preambles, tool calls (the recipient before or after the
    channel, with or without <|constrain|>json), a final answer; the terminator that stops
    generation (<|call|>, <|return|>) sometimes missing. Returns the text and, when well
    formed, the reasoning, content and calls it must parse to."""
    parts: list[str] = []
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[tuple[str, dict[str, Any]]] = []
    good = True
    kinds = [rng.choice(["analysis", "preamble", "call", "final"])
             for _ in range(rng.randint(1, 5))]
    for i, kind in enumerate(kinds):
        last = i == len(kinds) - 1
        start = "<|start|>assistant" if i or rng.random() < 0.3 else ""
        if kind == "call":
            name, args = _name(rng), _args(rng)
            body = json.dumps(args, ensure_ascii=rng.random() < 0.5)
            if rng.random() < 0.1:
                body, good = body[:rng.randint(0, max(0, len(body) - 1))] + "@", False
            header = rng.choice([
                f"{start}<|channel|>commentary to=functions.{name} <|constrain|>json",
                f"{start} to=functions.{name}<|channel|>commentary json",
                f"{start}<|channel|>commentary to=functions.{name}"])
            end = "" if last and rng.random() < 0.5 else "<|call|>"
            parts.append(f"{header}<|message|>{body}{end}")
            calls.append((name, args))
            continue
        body = _harmony_text(rng)
        channel = {"analysis": "analysis", "preamble": "commentary", "final": "final"}[kind]
        end = "<|end|>" if kind != "final" else rng.choice(["<|return|>", "<|end|>"])
        if last and rng.random() < 0.5:
            end = ""
        parts.append(f"{start}<|channel|>{channel}<|message|>{body}{end}")
        (reasoning if kind == "analysis" else content).append(body)
    text = "".join(parts)
    if rng.random() < 0.1:  # cut anywhere (mid-marker too): only equivalence is checked
        return text[:rng.randint(0, len(text))], None
    if not good:
        return text, None
    return text, {"reasoning": "".join(reasoning).strip(), "content": "".join(content).strip(),
                  "calls": calls}


def test_harmony_streams_like_the_whole_parse():
    """gpt_oss reasoning with and without the openai tool parser: streamed == whole, and a
    well-formed turn parses to what was generated."""
    rng = random.Random("fuzz-harmony")
    checked_good = 0
    for _ in range(HARMONY_CASES):
        text, expected = gen_harmony(rng)
        for tools in (True, False):
            parsers = ChatParsers(get_reasoning_parser("gpt_oss"),
                                  get_tool_parser("openai") if tools else None)

            def parse(parsers: ChatParsers = parsers, tools: bool = tools) -> OutputParse:
                out = new_output_parse(parsers, parse_tools=tools)
                assert out is not None
                return out

            parsed = parse().whole(text)
            whole = (parsed.reasoning or "", parsed.content or "",
                     [(i, c.name, c.arguments) for i, c in enumerate(parsed.calls)])
            for _ in range(2 if tools else 1):
                assert _stream_through(parse(), _chunks(text, rng), rng) == whole, text
            if expected is not None and tools:
                assert whole[0] == expected["reasoning"], text
                assert whole[1] == expected["content"], text
                assert [(n, json.loads(a)) for _, n, a in whole[2]] == expected["calls"], text
                checked_good += 1
    assert checked_good > HARMONY_CASES // 2
