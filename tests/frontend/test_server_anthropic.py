"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the
official ``anthropic`` client.

A scripted engine produces the model text (thinking, text and tool calls a random-weight model
would never write), so the translation both ways is checked exactly: history blocks to the chat
template's messages, parsed output to content blocks, streamed events to the same message, and
the errors in Anthropic's envelope. The real SmolLM2 (the shared server) then answers as chat
completions answers the same conversation (the ``openai`` client as the reference), streamed
and whole; and a tiny random-weight model shows tool_choice any / tool enforced by the grammar.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from server_harness import API_KEY, generation_server
from test_server_unit import FakeEngine, _Ready

from tidal.engine_core.config import EngineArgs
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.frontend.server.app import build_app, create_state
from tidal.frontend.server.state import STATE_KEY, ServerSettings

ARGS = {"city": "Zürich", "note": 'say "hi" </tool_call>', "days": [1, 2]}
CALLS = ("\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": ARGS})
         + "\n</tool_call>\n<tool_call>\n"
         + json.dumps({"name": "get_time", "arguments": {"tz": "CET"}}) + "\n</tool_call>")
# The last user message picks the script: (model text, finish_reason, stop_reason).
SCRIPTS: dict[str, tuple[str, str, int | str | None]] = {
    "weather": ("<think>\nThe user wants the weather.\n</think>\n\nChecking." + CALLS, "stop",
                None),
    "plain": ("<think>easy</think>The answer is 4.", "stop", 2),
    "between": ("Checking." + CALLS + "\nBoth asked.", "stop", None),
    "stopped": ("Counting 1, 2", "stop", ", 3"),
    "long": ("a b c d", "length", None),
    "fail": ("x", "error", None),
}
TOOLS = [{"name": "get_weather", "description": "Weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
         {"name": "get_time", "input_schema": {"type": "object"}}]
PARSING = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
           "enable_auto_tool_choice": True}


class ScriptedEngine(FakeEngine):
    """Answers with the script its last message names, in 5-character pieces (they split the
    tags and the JSON); records what reached the chat template and the sampling params."""

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[dict[str, Any]] = []
        self.params: list[Any] = []

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool = True,
                                  chat_template: str | None = None,
                                  continue_final_message: bool = False,
                                  tools: list[dict[str, Any]] | None = None,
                                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
        self.rendered.append({"messages": messages, "tools": tools, "kwargs": template_kwargs,
                              "continue": continue_final_message,
                              "add_generation_prompt": add_generation_prompt})
        return self._tok.encode(messages[-1]["content"])

    async def add_request(self, request_id: str, ids: list[int], params: Any, **kw: Any) -> Any:
        self.params.append(params)
        return await super().add_request(request_id, ids, params, **kw)

    async def _script(self, request_id: str, ids: list[int], collector: Any) -> None:
        text, finish, stop = SCRIPTS[self._tok.decode(ids)]
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        for i, piece in enumerate(pieces):
            done = i == len(pieces) - 1
            out = CompletionOutput(index=0, text=piece, token_ids=[5],
                                   finish_reason=finish if done else None,
                                   stop_reason=stop if done else None)
            if done and finish == "error":
                out.error = "the sampler failed"
            collector.notify(_Ready(RequestOutput(request_id, None, ids, [out], finished=done)))
            await asyncio.sleep(0)


def _run(engine: FakeEngine, body: Any, **settings: Any) -> Any:
    async def go():
        state = create_state(engine, ServerSettings(api_key=API_KEY, **settings))
        async with TestClient(TestServer(build_app(state))) as client:
            api = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key=API_KEY,
                                           max_retries=0)
            try:
                return await body(api, client)
            finally:
                await api.close()

    return asyncio.run(go())


def _ask(key: str, **kw: Any) -> dict[str, Any]:
    return {"model": "fake", "max_tokens": 16, "messages": [{"role": "user", "content": key}],
            **kw}


def _blocks(message: Any) -> list[dict[str, Any]]:
    """A message's content without the (random) tool_use ids."""
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if b.type == "tool_use":
            assert b.id.startswith("toolu_")
            del d["id"]
        out.append(d)
    return out


async def _events(client: TestClient, payload: dict[str, Any]) -> list[tuple[str, dict]]:
    """The raw stream as (event name, data) pairs."""
    resp = await client.post("/v1/messages", json=dict(payload, stream=True),
                             headers={"x-api-key": API_KEY})
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = []
    for frame in (await resp.text()).split("\n\n"):
        if frame:
            name, data = frame.split("\n")
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


def test_thinking_text_and_tool_use_whole_and_streamed():
    async def body(api, client):
        kw = _ask("weather", tools=TOOLS, thinking={"type": "adaptive"})
        whole = await api.messages.create(**kw)
        async with api.messages.stream(**kw) as stream:
            streamed = await stream.get_final_message()
        return whole, streamed, await _events(client, kw)

    whole, streamed, events = _run(ScriptedEngine(), body, **PARSING)
    assert _blocks(whole) == [
        {"type": "thinking", "thinking": "The user wants the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "name": "get_weather", "input": ARGS},
        {"type": "tool_use", "name": "get_time", "input": {"tz": "CET"}}]
    assert whole.stop_reason == "tool_use" and whole.stop_sequence is None
    assert whole.id.startswith("msg_") and whole.role == "assistant"
    # The client's own accumulation of the events equals the whole message.
    assert _blocks(streamed) == _blocks(whole)
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("tool_use",
                                                                   whole.usage.output_tokens)
    assert streamed.usage.input_tokens == whole.usage.input_tokens > 0
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"] and names.count("ping") == 1
    assert [data["content_block"]["type"] for name, data in events
            if name == "content_block_start"] == ["thinking", "text", "tool_use", "tool_use"]
    # Each block: start, deltas of its own kind only, stop; indexes in order.
    kinds = {"thinking": "thinking_delta", "text": "text_delta", "tool_use": "input_json_delta"}
    open_index, open_kind = None, None
    for name, data in events:
        assert data["type"] == name
        if name == "content_block_start":
            assert open_index is None
            open_index, open_kind = data["index"], data["content_block"]["type"]
        elif name == "content_block_delta":
            assert data["index"] == open_index and data["delta"]["type"] == kinds[open_kind]
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_history_blocks_reach_the_chat_template():
    engine = ScriptedEngine()
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather in"},
                                     {"type": "text", "text": "Zürich?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "dropped", "signature": "s"},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": ARGS}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}]},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no data",
             "is_error": True, "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "plain"}]},
    ]

    async def body(api, client):
        out = await api.messages.create(
            model="fake", max_tokens=8, messages=messages, tools=TOOLS,
            system=[{"type": "text", "text": "Be brief."}], tool_choice={"type": "none"},
            thinking={"type": "disabled"}, metadata={"user_id": "u1"}, stop_sequences=["##"],
            extra_body={"temperature": 0.5, "top_k": 7, "top_p": 0.9})
        prefilled = await api.messages.create(
            model="fake", max_tokens=8, messages=[{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "plain"}])
        return out, prefilled

    out, prefilled = _run(engine, body, **PARSING)
    # tool_choice none: no call parsing; thinking not asked for: reasoning is left out.
    assert _blocks(out) == [{"type": "text", "text": "The answer is 4."}]
    assert out.stop_reason == "end_turn"
    seen = engine.rendered[0]
    assert seen["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather in\nZürich?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "content": "sunny", "name": "get_weather", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: no data", "name": "get_weather",
         "tool_call_id": "toolu_1"},
        {"role": "user", "content": "plain"}]
    assert seen["tools"] == [
        {"type": "function", "function": {"name": t["name"], **(
            {"description": t["description"]} if "description" in t else {}),
            "parameters": t["input_schema"]}} for t in TOOLS]
    assert seen["kwargs"] == {"enable_thinking": False} and not seen["continue"]
    params = engine.params[0]
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.stop) == (
        8, 0.5, 7, 0.9, ["##"])
    # A last assistant message is a prefill that the model continues.
    last = engine.rendered[1]
    assert last["continue"] and not last["add_generation_prompt"]
    assert last["messages"][-1] == {"role": "assistant", "content": "plain"}
    # thinking was not asked for: the reasoning parser's part is left out here too.
    assert [(b.type, b.text) for b in prefilled.content] == [("text", "The answer is 4.")]


@pytest.mark.parametrize("key,stop_reason,stop_sequence", [
    ("plain", "end_turn", None), ("stopped", "stop_sequence", ", 3"),
    ("long", "max_tokens", None)])
def test_stop_reasons_whole_and_streamed(key, stop_reason, stop_sequence):
    async def body(api, client):
        whole = await api.messages.create(**_ask(key))
        async with api.messages.stream(**_ask(key)) as stream:
            streamed = await stream.get_final_message()
        return whole, streamed

    whole, streamed = _run(ScriptedEngine(), body)
    for message in (whole, streamed):
        assert (message.stop_reason, message.stop_sequence) == (stop_reason, stop_sequence)
        assert message.content[0].text == SCRIPTS[key][0]


def test_text_after_a_call_streams_into_the_one_text_block():
    """Tool calls are held until the output ends, so text after a call still joins the text
    block before them: the stream equals the whole message."""
    async def body(api, client):
        kw = _ask("between", tools=TOOLS)
        whole = await api.messages.create(**kw)
        async with api.messages.stream(**kw) as stream:
            streamed = await stream.get_final_message()
        return whole, streamed

    whole, streamed = _run(ScriptedEngine(), body, **PARSING)
    assert [b["type"] for b in _blocks(whole)] == ["text", "tool_use", "tool_use"]
    assert "Both asked." in whole.content[0].text
    assert _blocks(streamed) == _blocks(whole)


def test_disable_parallel_tool_use_keeps_the_first_call():
    async def body(api, client):
        kw = _ask("weather", tools=TOOLS,
                  tool_choice={"type": "auto", "disable_parallel_tool_use": True})
        whole = await api.messages.create(**kw)
        async with api.messages.stream(**kw) as stream:
            return whole, await stream.get_final_message()

    whole, streamed = _run(ScriptedEngine(), body, **PARSING)
    assert [b.name for b in whole.content if b.type == "tool_use"] == ["get_weather"]
    assert _blocks(streamed) == _blocks(whole) and streamed.stop_reason == "tool_use"


def test_engine_failure_mid_stream_is_an_error_event():
    async def body(api, client):
        with pytest.raises(anthropic.InternalServerError) as whole:
            await api.messages.create(**_ask("fail"))
        events = await _events(client, _ask("fail"))
        with pytest.raises(anthropic.APIStatusError):
            async with api.messages.stream(**_ask("fail")) as stream:
                await stream.get_final_message()
        return whole.value, events

    whole, events = _run(ScriptedEngine(), body)
    assert whole.status_code == 500 and whole.body["error"]["type"] == "api_error"
    assert "sampler failed" in whole.body["error"]["message"]
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["type"] == "error" and events[-1][1]["error"]["type"] == "api_error"


def test_count_tokens_is_the_rendered_prompt():
    engine = ScriptedEngine()

    async def body(api, client):
        count = await api.messages.count_tokens(model="fake", messages=[
            {"role": "user", "content": "weather"}], tools=TOOLS, system="S")
        made = await api.messages.create(**_ask("weather", tools=TOOLS, system="S"))
        return count, made

    count, made = _run(engine, body, **PARSING)
    assert count.input_tokens == made.usage.input_tokens == len(engine._tok.encode("weather"))
    assert engine.rendered[0]["tools"] == engine.rendered[1]["tools"] is not None


BAD_REQUESTS = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}]}]}, "text only"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                  "input": {}}]}]}, "messages[0].content[0]"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}},
     "output_config.format.schema"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "adaptive"}}, "--reasoning-parser"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 500}, "temperature"),
    ({"max_tokens": 5000}, "context length"),
    ({"tools": TOOLS}, "--enable-auto-tool-choice"),
]


def test_bad_requests_are_400s_in_anthropics_envelope():
    async def body(api, client):
        out = []
        for change, says in BAD_REQUESTS:
            payload = {k: v for k, v in {**_ask("plain"), **change}.items() if v is not None}
            resp = await client.post("/v1/messages", data=json.dumps(payload),
                                     headers={"x-api-key": API_KEY,
                                              "content-type": "application/json"})
            out.append((resp.status, await resp.json(), says))
        with pytest.raises(anthropic.BadRequestError) as err:
            await api.messages.create(**_ask("plain", thinking={"type": "adaptive"}))
        out.append((err.value.status_code, err.value.body, "--reasoning-parser"))
        return out

    for status, error, says in _run(ScriptedEngine(), body):
        assert status == 400 and error["type"] == "error", (says, error)
        assert error["error"]["type"] == "invalid_request_error", error
        assert says in error["error"]["message"], error


def test_thinking_budget_auth_and_error_statuses():
    engine = ScriptedEngine()

    async def body(api, client):
        thought = await api.messages.create(**_ask("plain", thinking={"type": "enabled",
                                                                      "budget_tokens": 5}))
        with pytest.raises(anthropic.BadRequestError) as budget:
            await api.messages.create(**_ask("plain", thinking={"type": "enabled",
                                                                "budget_tokens": 16}))
        bad_key = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="wrong",
                                           max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as auth:
            await bad_key.messages.create(**_ask("plain"))
        await bad_key.close()
        with pytest.raises(anthropic.NotFoundError) as model:
            await api.messages.create(**dict(_ask("plain"), model="claude-x"))
        bearer = await client.post("/v1/messages/count_tokens",
                                   json={"messages": [{"role": "user", "content": "plain"}]},
                                   headers={"Authorization": f"Bearer {API_KEY}"})
        route = await client.post("/v1/messages/nope", json={},
                                  headers={"x-api-key": API_KEY})
        huge = await client.post("/v1/messages", data=b"x" * (5 << 20),
                                 headers={"x-api-key": API_KEY})
        assert huge.status == 413
        assert (await huge.json())["error"]["type"] == "request_too_large"
        # Draining (a 503 elsewhere): Anthropic's retryable 529 overloaded_error.
        client.server.app[STATE_KEY].admission.draining = True
        with pytest.raises(anthropic.APIStatusError) as overloaded:
            await api.messages.create(**_ask("plain"))
        return (thought, budget.value, auth.value, model.value, bearer, route.status,
                await route.json(), overloaded.value)

    thought, budget, auth, model, bearer, route_status, route, overloaded = _run(
        engine, body, **PARSING)
    assert overloaded.status_code == 529
    assert overloaded.body["error"]["type"] == "overloaded_error"
    # The budget reaches the engine, which ends the thinking there; the thinking is shown.
    assert engine.params[0].thinking_token_budget == 5
    assert _blocks(thought) == [{"type": "thinking", "thinking": "easy", "signature": ""},
                                {"type": "text", "text": "The answer is 4."}]
    assert engine.rendered[0]["kwargs"] == {"enable_thinking": True}
    assert "less than max_tokens" in budget.body["error"]["message"]
    assert auth.body["error"]["type"] == "authentication_error"
    assert model.body["error"]["type"] == "not_found_error"
    assert bearer.status == 200
    assert route_status == 404 and route["error"]["type"] == "not_found_error"


@pytest.mark.slow
def test_smollm2_answers_as_chat_completions_does():
    """The real model: /v1/messages (whole and streamed) says what /v1/chat/completions says
    to the same conversation, greedily; count_tokens is the prompt chat counted."""
    server = generation_server()
    messages = [{"role": "user", "content": "Name three colors."}]

    async def go():
        api = anthropic.AsyncAnthropic(base_url=server.url, api_key=API_KEY, max_retries=0)
        ref = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        try:
            model = (await ref.models.list()).data[0].id
            chat = await ref.chat.completions.create(
                model=model, messages=[{"role": "system", "content": "Be brief."}, *messages],
                max_tokens=16, temperature=0)
            kw = {"model": model, "system": "Be brief.", "messages": messages,
                  "max_tokens": 16, "extra_body": {"temperature": 0}}
            whole = await api.messages.create(**kw)
            async with api.messages.stream(**kw) as stream:
                streamed = await stream.get_final_message()
            count = await api.messages.count_tokens(model=model, system="Be brief.",
                                                    messages=messages)
            # A stop sequence taken from the answer cuts it there.
            text = whole.content[0].text
            stop = text[len(text) // 2:len(text) // 2 + 3]
            cut = await api.messages.create(**dict(kw, stop_sequences=[stop]))
            return chat, whole, streamed, count, stop, cut
        finally:
            await api.close()
            await ref.close()

    chat, whole, streamed, count, stop, cut = asyncio.run(go())
    text = chat.choices[0].message.content
    assert [(b.type, b.text) for b in whole.content] == [("text", text)]
    assert _blocks(streamed) == _blocks(whole)
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat.choices[0].finish_reason] == streamed.stop_reason
    assert count.input_tokens == whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert stop.strip() and cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[:text.index(stop)]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
          "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny_engine(tiny_smol_path):
    eng = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_smol_path), served_model_name="tiny-smol", num_kv_blocks=128,
        max_num_seqs=4, max_model_len=512, cpu_threads=1, dtype="float32"))
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_tool_choice_and_output_format_are_enforced(tiny_engine):
    """A random-weight model calls the tool, or writes JSON of the schema, because the grammar
    holds it to that."""
    tools = [{"name": "get_weather", "input_schema": SCHEMA},
             {"name": "get_time", "input_schema": {"type": "object", "properties": {
                 "tz": {"enum": ["CET", "UTC"]}}, "required": ["tz"],
                 "additionalProperties": False}}]

    async def body(api, client):
        out = []
        for choice in ({"type": "tool", "name": "get_time"},
                       {"type": "any", "disable_parallel_tool_use": True}):
            kw = {"model": "tiny-smol", "max_tokens": 100, "tools": tools,
                  "tool_choice": choice, "extra_body": {"temperature": 0},
                  "messages": [{"role": "user", "content": "Weather in Paris?"}]}
            whole = await api.messages.create(**kw)
            async with api.messages.stream(**kw) as stream:
                out.append((choice, whole, await stream.get_final_message()))
        kw = {"model": "tiny-smol", "max_tokens": 100, "extra_body": {"temperature": 0},
              "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
              "messages": [{"role": "user", "content": "Weather in Paris?"}]}
        formatted = await api.messages.create(**kw)
        async with api.messages.stream(**kw) as stream:
            return out, formatted, await stream.get_final_message()

    calls, formatted, streamed_format = _run(tiny_engine, body)
    for message in (formatted, streamed_format):
        assert message.stop_reason == "end_turn" and len(message.content) == 1
        jsonschema.validate(json.loads(message.content[0].text), SCHEMA)
    for choice, whole, streamed in calls:
        for message in (whole, streamed):
            uses = [b for b in message.content if b.type == "tool_use"]
            assert message.stop_reason == "tool_use" and len(uses) == 1, message
            schema = next(t["input_schema"] for t in tools if t["name"] == uses[0].name)
            jsonschema.validate(uses[0].input, schema)
            if choice["type"] == "tool":
                assert uses[0].name == "get_time"
