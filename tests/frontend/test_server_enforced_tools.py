"""Grammar-enforced tool calls through ``tidal serve`` and the official ``openai`` client:
``tool_choice: "required"`` and a named function, streamed and not, n > 1, parallel calls on
and off. A tiny random-weight Llama with SmolLM2's tokenizer and chat template serves them,
with no tool parser flags: whatever the weights, every call must parse and validate against
its tool's schema, because the grammar forces it. Then the 400s of what cannot be enforced,
and ``strict`` tools under tool_choice "auto" on the shared SmolLM2 server (hermes parser).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from server_harness import API_KEY, generation_server, shared_server

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": -100, "maximum": 100},
    "b": {"type": "integer", "minimum": 0, "maximum": 9},
    "exact": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
    "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                      "parameters": WEATHER, "strict": True}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no parameters: takes none
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD,
           "now": {"type": "object", "additionalProperties": False}}
MESSAGES = [
    {"role": "user", "content": "Weather in Paris, and 2 + 3?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": "now", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "12:00"},
]


@pytest.fixture(scope="module")
def server(tiny_smol_path):
    # No --enable-auto-tool-choice: enforced calls need no tool parser.
    return shared_server([str(tiny_smol_path), "--max-model-len", "512",
                          "--kv-cache-memory-bytes", str(64 << 20), "--cpu-threads", "1"])


def _run(server, body) -> Any:
    async def go():
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                                 timeout=120)
        try:
            model = (await api.models.list()).data[0].id
            return await body(api, model)
        finally:
            await api.close()

    return asyncio.run(go())


async def _streamed(api: openai.AsyncOpenAI, **kw: Any) -> dict[int, dict[str, Any]]:
    """choice index -> the stream of that choice joined (calls in delta order)."""
    out: dict[int, dict[str, Any]] = {}
    async for chunk in await api.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            slot = out.setdefault(ch.index, {"content": "", "calls": {}, "finish": None})
            slot["content"] += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                call = slot["calls"].get(tc.index)
                if call is None:  # a call's first delta carries its id, type and name
                    assert tc.id and tc.type == "function" and tc.function.name
                    call = slot["calls"][tc.index] = {"id": tc.id, "name": "",
                                                      "arguments": ""}
                else:
                    assert tc.id is None and not tc.function.name
                call["name"] += tc.function.name or ""
                call["arguments"] += tc.function.arguments or ""
            slot["finish"] = ch.finish_reason or slot["finish"]
    return out


def _check_calls(calls: list[tuple[str, str]], named: str | None, parallel: bool) -> None:
    assert calls
    if named is not None or not parallel:
        assert len(calls) == 1
    for name, arguments in calls:
        assert name == named if named is not None else name in SCHEMAS
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# (tool_choice, parallel_tool_calls, n, stream) of the seeded requests: 32 choices in all.
CASES = [(choice, parallel, n, stream)
         for choice in ("required", "get_weather", "add", "now")
         for parallel, n, stream in ((None, 1, False), (False, 2, False), (None, 1, True),
                                     (False, 2, True))]


@pytest.mark.slow
def test_required_and_named_calls_always_validate(server):
    async def one(api, model, seed, choice, parallel, n, stream):
        kw: dict[str, Any] = dict(
            model=model, messages=MESSAGES, tools=TOOLS, n=n, seed=seed, temperature=1.0,
            max_tokens=200,
            tool_choice=choice if choice == "required" else {
                "type": "function", "function": {"name": choice}})
        if parallel is not None:
            kw["parallel_tool_calls"] = parallel
        if stream:
            joined = await _streamed(api, **kw)
            return [(c["finish"], c["content"] or None,
                     [(t["name"], t["arguments"]) for _, t in sorted(c["calls"].items())])
                    for _, c in sorted(joined.items())]
        resp = await api.chat.completions.create(**kw)
        return [(c.finish_reason, c.message.content,
                 [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []])
                for c in resp.choices]

    async def body(api, model):
        return await asyncio.gather(*(one(api, model, seed, *case)
                                      for seed, case in enumerate(CASES)))

    results = _run(server, body)
    for (choice, parallel, n, _), choices in zip(CASES, results, strict=True):
        assert len(choices) == n
        for finish, content, calls in choices:
            assert finish == "tool_calls" and content is None, (choice, calls)
            _check_calls(calls, None if choice == "required" else choice, parallel is not False)


@pytest.mark.slow
@pytest.mark.parametrize("kw,param,says", [
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
      "extra_body": {"structured_outputs": {"regex": "a+"}}}, "tool_choice",
     "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice.function.name", "not one of the tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "add"}}},
     "tool_choice.type", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
      "tool_choice": "required"}, "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}], "tool_choice": "none"}, "tools[0].function.parameters",
     "JSON object"),
    ({"tools": [TOOLS[1], TOOLS[1]], "tool_choice": "required"}, "tools[1].function.name",
     "two tools"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tools[0].function.strict", "hermes"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"min_tokens": 3}},
     "min_tokens", "structured outputs"),
])
def test_what_cannot_be_enforced_is_a_400(server, kw, param, says):
    async def body(api, model):
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                              **kw)
        return err.value.body

    error = _run(server, body)
    assert error["param"] == param and says in error["message"], error


@pytest.mark.slow
def test_strict_tools_with_auto_on_the_hermes_server():
    """Free text with calls held to their schema (a structural tag): the real SmolLM2, shown
    the Hermes format once, calls the strict tool; whole and streamed agree."""
    server = generation_server()
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather,
                                               "strict": True}}]
    shot = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    messages = [{"role": "system", "content": "To call a tool, answer only with " + shot},
                {"role": "user", "content": "What is the weather in Rome?"},
                {"role": "assistant", "content": shot},
                {"role": "tool", "content": "sunny"},
                {"role": "user", "content": "What is the weather in Paris?"}]

    async def body(api, model):
        kw = dict(model=model, messages=messages, tools=tools, max_tokens=40, temperature=0)
        return await api.chat.completions.create(**kw), await _streamed(api, **kw)

    whole, streamed = _run(server, body)
    choice = whole.choices[0]
    calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
    assert choice.finish_reason == "tool_calls" and calls
    for name, arguments in calls:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), weather)
    (joined,) = streamed.values()
    assert joined["finish"] == "tool_calls" and joined["content"] == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(joined["calls"].items())] == calls
