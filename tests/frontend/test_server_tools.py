"""Tool calling and reasoning in /v1/chat/completions through the official ``openai`` client:
a scripted engine produces the model text (a random-weight model cannot be made to emit a
call), so the server's parsing, wiring and errors are checked exactly; then the real SmolLM2
answers a chat with tools (nothing breaks, streamed == whole)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from server_harness import API_KEY, generation_server
from test_server_unit import FakeEngine, _Ready

from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.frontend.server.app import build_app, create_state
from tidal.frontend.server.state import ServerSettings

CALL_ARGS = {"city": "Zürich", "note": 'say "hi" {not a brace} </tool_call>', "days": [1, 2]}
SCRIPTS = {
    "weather": ("<think>\nThe user wants the weather.\n</think>\n\nChecking.\n<tool_call>\n"
                + json.dumps({"name": "get_weather", "arguments": CALL_ARGS})
                + "\n</tool_call>\n<tool_call>\n"
                + json.dumps({"name": "get_time", "arguments": {"tz": "CET"}})
                + "\n</tool_call>"),
    "broken": '<think>hm</think><tool_call>{"name": "get_weather", "arguments": {</tool_call>',
    "plain": "<think>easy</think>The answer is 4.",
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


class ScriptedEngine(FakeEngine):
    """Answers the chat whose last message is a key of ``SCRIPTS`` with that text, in small
    pieces (they split tags and JSON strings); records what reached the chat template."""

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[dict[str, Any]] = []

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool = True,
                                  chat_template: str | None = None,
                                  continue_final_message: bool = False,
                                  tools: list[dict[str, Any]] | None = None,
                                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
        self.rendered.append({"messages": messages, "tools": tools, "kwargs": template_kwargs})
        return self._tok.encode(messages[-1]["content"])

    async def _script(self, request_id: str, ids: list[int], collector: Any) -> None:
        text = SCRIPTS[self._tok.decode(ids)]
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        for i, piece in enumerate(pieces):
            done = i == len(pieces) - 1
            collector.notify(_Ready(RequestOutput(request_id, None, ids, [CompletionOutput(
                index=0, text=piece, token_ids=[5], finish_reason="stop" if done else None)],
                finished=done)))
            await asyncio.sleep(0)


PARSING = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
           "enable_auto_tool_choice": True}


def _run(engine: ScriptedEngine, body: Any, **settings: Any) -> Any:
    async def go():
        state = create_state(engine, ServerSettings(**settings))  # type: ignore[arg-type]
        async with TestClient(TestServer(build_app(state))) as client:
            api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x",
                                     max_retries=0)
            try:
                return await body(api, client)
            finally:
                await api.close()

    return asyncio.run(go())


def _ask(key: str, **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": key}], **kw}


async def _streamed(api: openai.AsyncOpenAI, **kw: Any) -> dict[str, Any]:
    """The stream joined as the openai docs show: content, reasoning and per-index calls."""
    content, reasoning, calls, finish = [], [], {}, None
    async for chunk in await api.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            d = ch.delta
            content.append(d.content or "")
            reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return {"content": "".join(content), "reasoning": "".join(reasoning),
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())],
            "finish": finish}


def test_auto_tool_calls_and_reasoning_whole_and_streamed():
    engine = ScriptedEngine()

    async def body(api, client):
        whole = await api.chat.completions.create(**_ask("weather", tools=TOOLS,
                                                         tool_choice="auto"))
        streamed = await _streamed(api, **_ask("weather", tools=TOOLS))
        return whole, streamed

    whole, streamed = _run(engine, body, **PARSING)
    choice = whole.choices[0]
    msg = choice.message
    assert choice.finish_reason == "tool_calls"
    assert msg.content == "Checking."
    assert msg.model_extra["reasoning_content"] == "The user wants the weather."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", CALL_ARGS), ("get_time", {"tz": "CET"})]
    assert all(c.type == "function" and c.id for c in msg.tool_calls)
    assert streamed == {"content": msg.content,
                        "reasoning": msg.model_extra["reasoning_content"],
                        "calls": [(c.function.name, c.function.arguments)
                                  for c in msg.tool_calls],
                        "finish": "tool_calls"}
    # The tools reached the chat template as given.
    assert engine.rendered[0]["tools"] == TOOLS


def test_tool_results_and_template_kwargs_reach_the_template():
    engine = ScriptedEngine()
    messages = [
        {"role": "user", "content": "weather in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "user", "content": "plain"},
    ]

    async def body(api, client):
        return await api.chat.completions.create(
            model="fake", messages=messages, tools=TOOLS, tool_choice="none",
            extra_body={"chat_template_kwargs": {"enable_thinking": False},
                        "include_reasoning": False})

    out = _run(engine, body, **PARSING)
    msg = out.choices[0].message
    # tool_choice "none": no parsing of calls; include_reasoning false drops the reasoning.
    assert msg.content == "The answer is 4." and not msg.tool_calls
    assert (msg.model_extra or {}).get("reasoning_content") is None
    assert out.choices[0].finish_reason == "stop"
    seen = engine.rendered[0]
    assert seen["kwargs"] == {"enable_thinking": False}
    assert seen["messages"][1]["tool_calls"] == [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": CALL_ARGS}}]
    assert seen["messages"][2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_malformed_call_is_content_and_counted():
    async def body(api, client):
        whole = await api.chat.completions.create(**_ask("broken", tools=TOOLS))
        streamed = await _streamed(api, **_ask("broken", tools=TOOLS))
        metrics = await (await client.get("/metrics")).text()
        return whole, streamed, metrics

    whole, streamed, metrics = _run(ScriptedEngine(), body, **PARSING)
    msg = whole.choices[0].message
    assert msg.content == '<tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    assert not msg.tool_calls and whole.choices[0].finish_reason == "stop"
    assert streamed["content"] == msg.content and streamed["calls"] == []
    line = next(ln for ln in metrics.splitlines()
                if ln.startswith("tidal:tool_call_parse_failures_total{"))
    assert float(line.rsplit(" ", 1)[1]) == 2.0


@pytest.mark.parametrize("settings,kw,param,says", [
    (PARSING, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (PARSING, {"tools": TOOLS, "tool_choice": {"type": "function",
                                               "function": {"name": "get_date"}}},
     "tool_choice.function.name", "not one of the tools"),
    (PARSING, {"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tool_call_parser": "pythonic", "enable_auto_tool_choice": True},
     {"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
     "tools[0].function.strict", "hermes"),
    (PARSING, {"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
     "tools[0].type", "not supported"),
    (PARSING, {"extra_body": {"chat_template_kwargs": {"tools": []}}},
     "chat_template_kwargs", "cannot set"),
    (PARSING, {"messages": [
        {"role": "user", "content": "plain"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "user", "content": "plain"}]},
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    (PARSING, {"messages": [{"role": "user", "content": "plain", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "assistant"),
    ({}, {"tools": TOOLS}, "tools", "--enable-auto-tool-choice"),
    ({}, {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
])
def test_what_is_not_available_is_a_400(settings, kw, param, says):
    async def body(api, client):
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(**_ask("plain", **kw))
        return err.value.body

    error = _run(ScriptedEngine(), body, **settings)
    assert error["param"] == param and says in error["message"], error


def test_without_parsers_tool_choice_none_passes_tools_and_text_is_untouched():
    engine = ScriptedEngine()

    async def body(api, client):
        return await api.chat.completions.create(**_ask("plain", tools=TOOLS,
                                                        tool_choice="none"))

    out = _run(engine, body)
    assert out.choices[0].message.content == SCRIPTS["plain"]
    assert engine.rendered[0]["tools"] == TOOLS


@pytest.mark.slow
def test_smollm2_chat_with_tools():
    """The real model with tools, tool_choice auto (the shared server parses hermes) and a
    template argument, through its real chat template: an answer comes back; streamed and
    whole agree."""
    server = generation_server()

    async def go():
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        try:
            models = await api.models.list()
            kw = {"model": models.data[0].id,
                  "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                  "tools": TOOLS, "max_tokens": 24, "temperature": 0,
                  "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
            whole = await api.chat.completions.create(**kw)
            streamed = await _streamed(api, **kw)
            return whole, streamed
        finally:
            await api.close()

    whole, streamed = asyncio.run(go())
    choice = whole.choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert isinstance(choice.message.content, str) or calls
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert streamed["content"] == (choice.message.content or "")
    assert streamed["calls"] == calls and streamed["finish"] == choice.finish_reason


def test_serve_parser_flags(tmp_path):
    from tidal.frontend.cli import _server_settings, build_parser

    def settings(*flags: str) -> ServerSettings:
        return _server_settings(build_parser().parse_args(["serve", *flags]))

    on = settings("--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                  "--tool-call-parser", "pythonic")
    assert (on.reasoning_parser, on.tool_call_parser, on.enable_auto_tool_choice) == (
        "deepseek_r1", "pythonic", True)
    for flags, says in [(["--tool-call-parser", "hermes"], "--enable-auto-tool-choice"),
                        (["--enable-auto-tool-choice"], "--tool-call-parser"),
                        (["--enable-auto-tool-choice", "--tool-call-parser", "nope"],
                         "unknown tool call parser"),
                        (["--reasoning-parser", "nope"], "unknown reasoning parser"),
                        (["--tool-parser-plugin", str(tmp_path / "none.py")], "cannot load")]:
        with pytest.raises(SystemExit, match=says):
            settings(*flags)


def test_parallel_tool_calls_false_keeps_the_first_call():
    async def body(api, client):
        kw = _ask("weather", tools=TOOLS, parallel_tool_calls=False)
        return await api.chat.completions.create(**kw), await _streamed(api, **kw)

    whole, streamed = _run(ScriptedEngine(), body, **PARSING)
    calls = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"]
    assert streamed["calls"] == calls and streamed["finish"] == "tool_calls"


@pytest.mark.parametrize("reasoning, tool_parser, tools, sent, skip", [
    (None, "hermes", True, None, True),  # <tool_call> is plain text
    (None, "mistral", True, None, False),  # [TOOL_CALLS] is a special token: kept for it
    (None, "mistral", False, None, True),  # no tools: nothing to parse
    (None, "mistral", True, True, True),  # the request's own choice wins
    ("gpt_oss", None, False, None, False),  # harmony's channels are special tokens
    ("qwen3", None, False, None, True),
])
def test_special_tokens_are_kept_for_parsers_that_read_them(reasoning, tool_parser, tools,
                                                             sent, skip):
    """As vLLM's parsers adjust the request: a request that does not set skip_special_tokens
    keeps special tokens in its text when the server's parser looks for them."""
    from tidal.frontend.server.chat_parsing import (
        check_tools,
        reads_special_tokens,
        resolve_parsers,
    )
    from tidal.frontend.server.openai_protocol import ChatCompletionRequest
    from tidal.frontend.server.sampling import chat_params
    from tidal.frontend.server.state import ServerLimits

    parsers = resolve_parsers(reasoning, tool_parser, tool_parser is not None)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if tools:
        body["tools"] = TOOLS
    if sent is not None:
        body["skip_special_tokens"] = sent
    req = msgspec.convert(body, ChatCompletionRequest)
    params = chat_params(req, ServerLimits(), None,
                         reads_special_tokens(parsers, check_tools(req, parsers)))
    assert params.skip_special_tokens is skip
