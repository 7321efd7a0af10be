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
    parse = _parse(reasoning_name, tool_name)
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
            assert d.id and d.type == "function" and d.name
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
