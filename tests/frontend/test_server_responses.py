"""OpenAI's Responses API (/v1/responses) through the official ``openai`` client: a scripted
engine produces the model text (reasoning and tool calls a random-weight model cannot be made
to emit), so the items, the stream events, the conversation store and the errors are checked
exactly; then the real SmolLM2 answers on the shared server (streamed == whole; a JSON schema
holds)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from server_harness import API_KEY, generation_server
from test_server_unit import FakeEngine, _Ready

from tidal.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from tidal.frontend.server.app import build_app, create_state
from tidal.frontend.server.chat_parsing import new_output_parse, server_parsers
from tidal.frontend.server.response_store import ResponseStore
from tidal.frontend.server.responses_output import ResponseEvents, output_items
from tidal.frontend.server.responses_protocol import FunctionCallItem
from tidal.frontend.server.state import STATE_KEY, ServerSettings

CALL_ARGS = {"city": "Zürich", "note": 'say "hi" </tool_call>', "days": [1, 2]}
SCRIPTS = {
    "weather": ("<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n"
                + json.dumps({"name": "get_weather", "arguments": CALL_ARGS})
                + "\n</tool_call>\n<tool_call>\n"
                + json.dumps({"name": "get_time", "arguments": {"tz": "CET"}})
                + "\n</tool_call>"),
    "plain": "<think>easy</think>The answer is 4.",
    "thanks": "It is sunny in Zürich.",
    "long": "cut off here",
    # What the grammar of a named / required tool_choice makes the model write.
    "named": '{"city": "Paris"}',
    "required": '[{"name": "get_time", "parameters": {"tz": "CET"}}, '
                '{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    "mixed": ('<think>hm</think>Checking.\n<tool_call>{"name": "get_time", "arguments": {}}'
              '</tool_call>\nDone.'),
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
          "strict": None},
         {"type": "function", "name": "get_time", "parameters": {"type": "object"},
          "strict": None}]
PARSING = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes",
           "enable_auto_tool_choice": True}


class ScriptedEngine(FakeEngine):
    """Answers with the script named by the last message's content, in 5-character pieces
    (they split tags and JSON strings); "long" ends by max_tokens. Records what reached the
    chat template."""

    def __init__(self) -> None:
        super().__init__()
        self.rendered: list[dict[str, Any]] = []
        self.params: list[Any] = []
        self._want_logprobs: dict[str, int | None] = {}

    async def add_request(self, request_id: str, ids: list[int], params: Any, **kw: Any) -> Any:
        self.params.append(params)
        self._want_logprobs[request_id] = params.logprobs
        return await super().add_request(request_id, ids, params, **kw)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool = True,
                                  chat_template: str | None = None,
                                  continue_final_message: bool = False,
                                  tools: list[dict[str, Any]] | None = None,
                                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
        self.rendered.append({"messages": messages, "tools": tools, "kwargs": template_kwargs})
        return self._tok.encode(messages[-1]["content"])

    async def _script(self, request_id: str, ids: list[int], collector: Any) -> None:
        key = self._tok.decode(ids)
        if key not in SCRIPTS:
            return await super()._script(request_id, ids, collector)
        text = SCRIPTS[key]
        pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
        top = self._want_logprobs.get(request_id)
        for i, piece in enumerate(pieces):
            done = i == len(pieces) - 1
            reason = ("length" if key == "long" else "stop") if done else None
            # With logprobs: the piece is "token" 5 at rank 1, then the top alternatives.
            lp = None if top is None else [{5: Logprob(-0.25 * i, 1, piece), **{
                6 + k: Logprob(-1.0 - k, 2 + k, f"alt{k}") for k in range(top)}}]
            collector.notify(_Ready(RequestOutput(request_id, None, ids, [CompletionOutput(
                index=0, text=piece, token_ids=[5], finish_reason=reason, logprobs=lp)],
                finished=done)))
            await asyncio.sleep(0)


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


async def _streamed(api: openai.AsyncOpenAI, **kw: Any) -> tuple[list[Any], Any]:
    """The stream's events (checked for order and numbering) and its final response."""
    events = [e async for e in await api.responses.create(stream=True, **kw)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events, events[-1].response


def _items(response: Any) -> list[tuple[Any, ...]]:
    """The output without its generated ids."""
    out = []
    for item in response.output:
        if item.type == "message":
            out.append(("message", item.status, [p.text for p in item.content]))
        elif item.type == "function_call":
            out.append(("function_call", item.status, item.name, item.arguments))
        else:
            out.append(("reasoning", item.status, [p.text for p in item.content or []]))
    return out


def _joined(events: list[Any]) -> dict[str, Any]:
    """What the deltas add up to, per output index, as a client reading them would see."""
    texts: dict[int, str] = {}
    for e in events:
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta",
                      "response.function_call_arguments.delta"):
            texts[e.output_index] = texts.get(e.output_index, "") + e.delta
    return texts


def test_tool_calls_and_reasoning_whole_and_streamed():
    async def body(api, client):
        kw = {"model": "fake", "input": "weather", "tools": TOOLS}
        return await api.responses.create(**kw), await _streamed(api, **kw)

    whole, (events, final) = _run(ScriptedEngine(), body, **PARSING)
    assert whole.status == "completed" and whole.object == "response"
    assert whole.id.startswith("resp_")
    assert _items(whole) == [
        ("reasoning", "completed", ["The user wants the weather."]),
        ("function_call", "completed", "get_weather", json.dumps(CALL_ARGS, ensure_ascii=False)),
        ("function_call", "completed", "get_time", json.dumps({"tz": "CET"}))]
    calls = [i for i in whole.output if i.type == "function_call"]
    assert all(c.call_id and c.id.startswith("fc_") for c in calls)
    assert json.loads(calls[0].arguments) == CALL_ARGS
    assert whole.usage.output_tokens == len(range(0, len(SCRIPTS["weather"]), 5))
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
    assert [t.name for t in whole.tools] == ["get_weather", "get_time"]
    # Streamed: the same items, and the deltas add up to them.
    assert final.status == "completed" and _items(final) == _items(whole)
    joined = _joined(events)
    assert joined == {0: "The user wants the weather.", 1: calls[0].arguments,
                      2: calls[1].arguments}
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.completed"
    assert kinds.count("response.output_item.added") == kinds.count(
        "response.output_item.done") == 3
    assert kinds.count("response.function_call_arguments.done") == 2


def test_text_around_a_call_and_one_call_only():
    """Text before and after a call is one message, whole and streamed alike;
    parallel_tool_calls false keeps the first call."""
    async def body(api, client):
        kw = {"model": "fake", "input": "mixed", "tools": TOOLS}
        one = await api.responses.create(model="fake", input="weather", tools=TOOLS,
                                         parallel_tool_calls=False)
        return await api.responses.create(**kw), await _streamed(api, **kw), one

    whole, (events, final), one = _run(ScriptedEngine(), body, **PARSING)
    assert _items(whole) == _items(final) == [
        ("reasoning", "completed", ["hm"]),
        ("message", "completed", ["Checking.\n\nDone."]),
        ("function_call", "completed", "get_time", "{}")]
    assert _joined(events)[1] == "Checking.\n\nDone."
    assert [i.name for i in one.output if i.type == "function_call"] == ["get_weather"]
    assert one.parallel_tool_calls is False


@pytest.mark.parametrize("key, choice, calls", [
    ("named", {"type": "function", "name": "get_weather"}, [("get_weather", {"city": "Paris"})]),
    ("required", "required", [("get_time", {"tz": "CET"}), ("get_weather", {"city": "Oslo"})]),
])
def test_required_and_named_tool_choice_are_enforced(key, choice, calls):
    """The grammar of chat's enforced tool_choice reaches the engine (no tool parser needed),
    and what it makes the model write comes back as function_call items, whole and
    streamed."""
    engine = ScriptedEngine()

    async def body(api, client):
        kw = {"model": "fake", "input": key, "tools": TOOLS, "tool_choice": choice}
        return await api.responses.create(**kw), await _streamed(api, **kw)

    whole, (events, final) = _run(engine, body)
    got = [(i.name, json.loads(i.arguments)) for i in whole.output]
    assert got == calls and _items(final) == _items(whole)
    assert all(i.type == "function_call" and i.call_id for i in whole.output)
    assert (whole.tool_choice if key == "required" else whole.tool_choice.name) == \
        (choice if key == "required" else "get_weather")
    spec = engine.params[0].structured_outputs
    assert spec is not None and spec == engine.params[1].structured_outputs
    schema = spec.json if isinstance(spec.json, dict) else json.loads(spec.json)
    if key == "named":
        assert schema == TOOLS[0]["parameters"]
    else:
        assert schema["type"] == "array" and schema["minItems"] == 1


def test_raw_http_edges():
    """Unknown stored ids are a 404, a deep or oversized body the usual envelope."""
    async def body(api, client):
        got = await client.get("/v1/responses/resp_nope")
        gone = await client.delete("/v1/responses/resp_nope")
        deep = await client.post("/v1/responses",
                                 data=b'{"input": ' + b"[" * 1000 + b"]" * 1000 + b"}")
        big = await client.post("/v1/responses", data=b'{"input": "' + b"x" * 5000 + b'"}')
        return [(r.status, (await r.json())["error"]) for r in (got, gone, deep, big)]

    from tidal.frontend.server.sampling import ServerLimits

    (got, gone, deep, big) = _run(ScriptedEngine(), body,
                                  limits=ServerLimits(max_body_bytes=4096))
    assert got[0] == gone[0] == 404 and got[1]["param"] == "response_id"
    assert deep[0] == 400 and deep[1]["code"] == "invalid_json"
    assert big[0] == 413


def test_text_with_reasoning_and_stream_helper():
    """The client's own stream helper (it checks the events' consistency) accepts the stream;
    ``output_text`` joins the message."""
    async def body(api, client):
        whole = await api.responses.create(model="fake", input="plain")
        async with api.responses.stream(model="fake", input="plain") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        return whole, deltas, final

    whole, deltas, final = _run(ScriptedEngine(), body, reasoning_parser="qwen3")
    assert whole.output_text == "The answer is 4." == "".join(deltas) == final.output_text
    assert _items(whole) == _items(final) == [
        ("reasoning", "completed", ["easy"]),
        ("message", "completed", ["The answer is 4."])]


def test_previous_response_id_continues_the_conversation():
    engine = ScriptedEngine()

    async def body(api, client):
        first = await api.responses.create(model="fake", input="weather", tools=TOOLS,
                                           instructions="Be brief.")
        call = next(i for i in first.output if i.type == "function_call")
        second = await api.responses.create(
            model="fake", previous_response_id=first.id, tools=TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "thanks"}])
        got = await api.responses.retrieve(first.id)
        deleted = await client.delete(f"/v1/responses/{first.id}")
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(first.id)
        return first, call, second, got, await deleted.json()

    first, call, second, got, deleted = _run(engine, body, **PARSING)
    assert second.output_text == SCRIPTS["thanks"]
    assert second.previous_response_id == first.id
    assert got.id == first.id and _items(got) == _items(first)
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    # The follow-up saw the first turn (without its instructions, as OpenAI does), the
    # assistant's calls, and the call's output.
    seen = engine.rendered[1]["messages"]
    assert [m["role"] for m in seen] == ["user", "assistant", "tool"]
    assert seen[0]["content"] == "weather"
    assert [c["function"]["name"] for c in seen[1]["tool_calls"]] == ["get_weather", "get_time"]
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == CALL_ARGS
    assert seen[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "thanks"}
    assert engine.rendered[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert engine.rendered[0]["tools"][0]["function"]["name"] == "get_weather"


def test_input_items_reach_the_template():
    engine = ScriptedEngine()
    items = [{"role": "developer", "content": "Answer in English."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "What is the weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"},
             {"type": "function_call_output", "call_id": "c2",
              "output": [{"type": "input_text", "text": "noon"}]},
             {"role": "user", "content": "plain"}]

    async def body(api, client):
        return await api.responses.create(model="fake", input=items, tools=TOOLS,
                                          tool_choice="none", extra_body={
                                              "chat_template_kwargs": {"enable_thinking": False}})

    out = _run(engine, body, **PARSING)
    assert out.output_text == "The answer is 4."
    seen = engine.rendered[0]["messages"]
    assert [m["role"] for m in seen] == ["developer", "user", "assistant", "tool", "tool", "user"]
    assert seen[2]["content"] == "Let me see."
    assert [c["id"] for c in seen[2]["tool_calls"]] == ["c1", "c2"]
    assert seen[3]["content"] == "rain" and seen[4]["content"] == "noon"
    assert engine.rendered[0]["kwargs"] == {"enable_thinking": False}


def test_output_logprobs_whole_and_streamed():
    engine = ScriptedEngine()
    include = ["message.output_text.logprobs"]

    async def body(api, client):
        kw = dict(model="fake", input="plain", include=include, top_logprobs=2)
        whole = await api.responses.create(**kw)
        assert whole.top_logprobs == 2
        events, final = await _streamed(api, **kw)
        plain = await api.responses.create(model="fake", input="plain")
        return whole, events, final, plain

    whole, events, final, plain = _run(engine, body, **PARSING)
    pieces = [SCRIPTS["plain"][i:i + 5] for i in range(0, len(SCRIPTS["plain"]), 5)]
    assert engine.params[0].logprobs == 2 and engine.params[2].logprobs is None
    for resp in (whole, final):
        (message,) = [i for i in resp.output if i.type == "message"]
        lps = message.content[0].logprobs
        # Every generated token's, the reasoning's included, each with its top 2 by rank
        # (the sampled token, rank 1 here, among them).
        assert [lp.token for lp in lps] == pieces
        assert [lp.logprob for lp in lps] == [-0.25 * i for i in range(len(pieces))]
        assert all([t.token for t in lp.top_logprobs] == [lp.token, "alt0"] for lp in lps)
        assert lps[0].bytes == list(pieces[0].encode())
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == pieces
    # Each answer delta carries the tokens since the one before (those of the reasoning
    # with the first): all of them, in order.
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [lp.token for e in deltas for lp in e.logprobs] == pieces
    assert deltas[0].logprobs[0].token == pieces[0] and len(deltas[-1].logprobs) == 1
    assert plain.output[-1].content[0].logprobs == []


def test_input_items_are_listed_back_a_page_at_a_time():
    items = [{"role": "developer", "content": "Answer in English."},
             {"type": "message", "role": "user", "id": "msg_mine",
              "content": [{"type": "input_text", "text": "What is the weather?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"role": "assistant", "content": "Let me see."},
             {"type": "function_call", "call_id": "c1", "name": "get_weather",
              "arguments": "{\"city\": \"Paris\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "rain"},
             {"role": "user", "content": "thanks"}]

    async def body(api, client):
        resp = await api.responses.create(model="fake", input=items, tools=TOOLS,
                                          tool_choice="none")
        every = [i async for i in api.responses.input_items.list(resp.id, limit=2)]
        first = await api.responses.input_items.list(resp.id, limit=3, order="asc")
        rest = await api.responses.input_items.list(resp.id, order="asc",
                                                    after=first.data[-1].id)
        one = await api.responses.create(model="fake", input="thanks")
        single = await api.responses.input_items.list(one.id)
        errors = []
        for query in ("limit=0", "limit=x", "order=up", "after=msg_nope",
                      "include=message.input_image.image_url"):
            r = await client.get(f"/v1/responses/{resp.id}/input_items?{query}")
            errors.append((r.status, (await r.json())["error"]["param"]))
        with pytest.raises(openai.NotFoundError):
            await api.responses.input_items.list("resp_nope")
        return every, first, rest, single, errors

    every, first, rest, single, errors = _run(ScriptedEngine(), body, **PARSING)
    # Newest first by default, across pages of two.
    assert [i.type for i in every] == ["message", "function_call_output", "function_call",
                                       "message", "reasoning", "message", "message"]
    assert first.has_more and not rest.has_more
    asc = first.data + rest.data
    assert [i.id for i in asc] == [i.id for i in reversed(every)]
    assert len({i.id for i in asc}) == len(items)
    assert asc[1].id == "msg_mine" and asc[2].id == "rs_1"
    assert asc[0].role == "developer" and asc[0].content[0].text == "Answer in English."
    assert asc[3].role == "assistant" and asc[3].content[0].type == "output_text"
    assert asc[4].call_id == "c1" and asc[5].output == "rain"
    assert all(i.status == "completed" for i in asc)
    (msg,) = single.data
    assert msg.type == "message" and msg.role == "user" and msg.content[0].text == "thanks"
    assert errors == [(400, "limit"), (400, "limit"), (400, "order"), (400, "after"),
                      (400, "include")]


async def _until(api: openai.AsyncOpenAI, rid: str, *statuses: str) -> Any:
    for _ in range(500):
        got = await api.responses.retrieve(rid)
        if got.status in statuses:
            return got
        await asyncio.sleep(0.01)
    raise AssertionError(f"{rid} stayed {got.status}")


def test_background_response_is_polled_until_done_and_can_be_continued():
    engine = ScriptedEngine()

    async def body(api, client):
        state = client.server.app[STATE_KEY]
        queued = await api.responses.create(model="fake", input="weather", tools=TOOLS,
                                            background=True)
        done = await _until(api, queued.id, "completed")
        assert len(state.background) == 0 and state.admission.num_in_flight == 0
        call = next(i for i in done.output if i.type == "function_call")
        follow = await api.responses.create(
            model="fake", previous_response_id=queued.id, tools=TOOLS, background=True,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "thanks"}])
        follow = await _until(api, follow.id, "completed")
        again = await api.responses.cancel(queued.id)  # over already: returned as it is
        items = await api.responses.input_items.list(follow.id)
        failed = await api.responses.create(model="fake", input="fail", background=True)
        return queued, done, follow, again, items, await _until(api, failed.id, "failed")

    queued, done, follow, again, items, failed = _run(engine, body, **PARSING)
    assert queued.status == "queued" and queued.background and queued.output == []
    assert done.background and [i.type for i in done.output] == [
        "reasoning", "function_call", "function_call"]
    assert done.usage.output_tokens > 0
    assert follow.output_text == SCRIPTS["thanks"]
    assert again.status == "completed" and again.id == done.id
    assert [i.type for i in items.data] == ["function_call_output"]
    assert failed.error.code and "/work" not in failed.error.message


def test_background_response_is_cancelled():
    engine = ScriptedEngine()

    async def body(api, client):
        state = client.server.app[STATE_KEY]
        queued = await api.responses.create(model="fake", input="hang", background=True)
        running = await _until(api, queued.id, "in_progress")
        cancelled = await api.responses.cancel(queued.id)
        stored = await api.responses.retrieve(queued.id)
        twice = await api.responses.cancel(queued.id)
        with pytest.raises(openai.BadRequestError) as follow:
            await api.responses.create(model="fake", input="x",
                                       previous_response_id=queued.id)
        plain = await api.responses.create(model="fake", input="thanks")
        with pytest.raises(openai.BadRequestError) as not_background:
            await api.responses.cancel(plain.id)
        with pytest.raises(openai.NotFoundError):
            await api.responses.cancel("resp_nope")
        return (running, cancelled, stored, twice, follow.value, not_background.value,
                len(state.background), state.admission.num_in_flight)

    (running, cancelled, stored, twice, follow, not_background, left,
     in_flight) = _run(engine, body)
    assert running.status == "in_progress"
    assert cancelled.status == stored.status == twice.status == "cancelled"
    assert engine.cancelled  # the generation was aborted in the engine
    assert left == 0 and in_flight == 0
    assert "cancelled" in follow.body["message"]
    assert not_background.body["param"] == "response_id"


def test_background_stream_is_replayed_and_outlives_its_client():
    engine = ScriptedEngine()

    async def body(api, client):
        kw = dict(model="fake", input="weather", tools=TOOLS, background=True)
        events = [e async for e in await api.responses.create(stream=True, **kw)]
        rid = events[0].response.id
        whole = await api.responses.retrieve(rid)
        again = [e async for e in await api.responses.retrieve(rid, stream=True)]
        tail = [e async for e in await api.responses.retrieve(rid, stream=True,
                                                              starting_after=5)]
        plain = await api.responses.create(model="fake", input="thanks")
        bad = []
        for url in (f"/v1/responses/{plain.id}?stream=true",
                    f"/v1/responses/{rid}?stream=true&starting_after=x",
                    f"/v1/responses/{rid}?stream=true&starting_after=1_0",
                    f"/v1/responses/{rid}?stream=true&starting_after={len(events)}"):
            r = await client.get(url)
            bad.append((r.status, (await r.json())["error"]["param"]))
        # A client that goes away mid-stream leaves the response generating.
        hang = await api.responses.create(model="fake", input="hang", background=True,
                                          stream=True)
        first = []
        async for e in hang:
            first.append(e)
            if len(first) == 3:
                break
        await hang.close()
        hid = first[0].response.id
        running = await api.responses.retrieve(hid)
        await api.responses.cancel(hid)
        resumed = [e async for e in await api.responses.retrieve(hid, stream=True,
                                                                 starting_after=2)]
        await api.responses.delete(rid)  # nor is its stream replayed
        r = await client.get(f"/v1/responses/{rid}?stream=true")
        bad.append((r.status, (await r.json())["error"]["param"]))
        return events, whole, again, tail, bad, first, running, resumed

    events, whole, again, tail, bad, first, running, resumed = _run(engine, body, **PARSING)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[0].response.status == "queued"
    assert events[1].type == "response.in_progress"
    assert events[1].response.status == "in_progress"
    assert events[-1].response.background and _items(events[-1].response) == _items(whole)
    assert whole.status == "completed"
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    assert [e.model_dump() for e in tail] == [e.model_dump() for e in events[6:]]
    assert bad == [(400, "stream"), (400, "starting_after"), (400, "starting_after"),
                   (400, "starting_after"), (400, "stream")]
    assert running.status == "in_progress"
    assert [e.sequence_number for e in resumed] == list(range(3, 3 + len(resumed)))
    assert resumed[-1].type == "response.failed"
    assert resumed[-1].response.status == "cancelled"


def test_background_responses_count_in_load_until_they_end():
    engine = ScriptedEngine()

    async def load(client) -> int:
        return (await (await client.get("/load")).json())["server_load"]

    async def body(api, client):
        seen = [await load(client)]
        bg = await api.responses.create(model="fake", input="hang", background=True)
        seen.append(await load(client))  # its POST answered: the task counts it
        stream = await api.responses.create(model="fake", input="hang", background=True,
                                            stream=True)
        first = None
        async for event in stream:
            first = event
            break
        seen.append(await load(client))  # two running, one read by its POST: still two
        await stream.close()
        await api.responses.cancel(bg.id)
        await api.responses.cancel(first.response.id)
        seen.append(await load(client))
        return seen

    assert _run(engine, body, enable_server_load_tracking=True) == [0, 1, 2, 0]


def test_background_responses_are_bounded_and_deleting_one_stops_it():
    engine = ScriptedEngine()

    async def body(api, client):
        state = client.server.app[STATE_KEY]
        first = await api.responses.create(model="fake", input="hang", background=True)
        with pytest.raises(openai.RateLimitError) as full:
            await api.responses.create(model="fake", input="hang", background=True)
        await _until(api, first.id, "in_progress")
        await api.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(first.id)
        left = len(state.background), state.admission.num_in_flight
        # Room again once it is gone.
        second = await api.responses.create(model="fake", input="thanks", background=True)
        return full.value, left, await _until(api, second.id, "completed")

    full, left, second = _run(engine, body, max_stored_responses=2)
    assert full.body["code"] == "too_many_background_responses"
    assert left == (0, 0) and engine.cancelled
    assert second.output_text == SCRIPTS["thanks"]

    async def no_store(api, client):
        with pytest.raises(openai.BadRequestError) as err:
            await api.responses.create(model="fake", input="x", background=True)
        return err.value.body

    assert _run(ScriptedEngine(), no_store, max_stored_responses=0)["param"] == "background"


def test_max_output_tokens_is_incomplete_and_store_false_keeps_nothing():
    async def body(api, client):
        whole = await api.responses.create(model="fake", input="long", store=False,
                                           max_output_tokens=8)
        events, final = await _streamed(api, model="fake", input="long", store=False)
        with pytest.raises(openai.BadRequestError) as err:
            await api.responses.create(model="fake", input="x", previous_response_id=whole.id)
        return whole, events, final, err.value

    whole, events, final, err = _run(ScriptedEngine(), body)
    for r in (whole, final):
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert _items(r) == [("message", "incomplete", [SCRIPTS["long"]])]
    assert events[-1].type == "response.incomplete"
    assert whole.max_output_tokens == 8 and whole.store is False
    assert err.status_code == 400 and err.body["param"] == "previous_response_id"
    assert err.body["code"] == "previous_response_not_found"


def test_error_mid_stream_ends_with_response_failed():
    async def body(api, client):
        return [e async for e in await api.responses.create(model="fake", input="fail",
                                                            stream=True)]

    events = _run(ScriptedEngine(), body)
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1].response.status == "failed" and "/work" not in events[-2].message


def test_drain_timeout_cancels_open_responses():
    """A response the drain timeout aborts ends as "cancelled" (streamed: response.failed
    after its items close), with what it had produced, and is not stored."""
    engine = ScriptedEngine()

    async def body(api, client):
        state = client.server.app[STATE_KEY]

        async def streamed():
            return [e async for e in await api.responses.create(model="fake", input="hang",
                                                                stream=True)]

        tasks = [asyncio.create_task(streamed()),
                 asyncio.create_task(api.responses.create(model="fake", input="hang"))]
        for _ in range(200):
            if len(engine.params) == 2:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert state.admission.abort_all() == 2
        events, whole = await asyncio.gather(*tasks)
        return events, whole, len(state.responses)

    events, whole, stored = _run(engine, body)
    assert [e.type for e in events[-2:]] == ["response.output_item.done", "response.failed"]
    for r in (events[-1].response, whole):
        assert r.status == "cancelled" and _items(r) == [("message", "incomplete", ["x"])]
    assert stored == 0


@pytest.mark.parametrize("kw, param, says", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "built-in"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "text only"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments", "JSON object"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "robot"),
    # Chat completions' fields change the result there: never silently ignored here.
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json", "chat completions field"),
    ({"extra_body": {"ignore_eos": True}}, "ignore_eos", "chat completions field"),
    ({"extra_body": {"max_completion_tokens": 5}}, "max_completion_tokens", "chat completions field"),
    ({"extra_body": {"thinking_token_budget": 3}}, "thinking_token_budget", "chat/completions only"),
    ({"extra_body": {"bad_words": ["x"]}}, "bad_words", "bad_words"),
    ({"input": []}, "input", "required"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort", "reasoning"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "summar"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format.schema", "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
     "text.format.schema"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "yaml"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                          "strict": "yes"}}}, "text.format.strict", "text.format.strict must"),
    ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity", "verbosity"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice.name",
     "nope"),
    ({"tool_choice": "required", "tools": TOOLS, "text": {"format": {"type": "json_object"}}},
     "tool_choice", "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"temperature": 1e9}, "temperature", "temperature"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "only function tools"),
    ({"tools": TOOLS}, "tools", "--enable-auto-tool-choice"),
    ({"metadata": {"k": "v" * 600}}, "metadata.k", "512"),
    ({"background": True, "store": False}, "store", "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]", "not available"),
    ({"top_logprobs": 3}, "top_logprobs", "include"),
    ({"top_logprobs": 99, "include": ["message.output_text.logprobs"]}, "top_logprobs",
     "top_logprobs"),
    ({"extra_body": {"seed": 3}}, "seed", "chat/completions"),
    ({"extra_body": {"chat_template_kwargs": {"tools": []}}}, "chat_template_kwargs", "tools"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id", "not found"),
    ({"truncation": "middle"}, "truncation", "auto"),
])
def test_what_is_not_available_is_a_400(kw, param, says):
    async def body(api, client):
        with pytest.raises(openai.BadRequestError) as err:
            await api.responses.create(**{"model": "fake", "input": "plain", **kw})
        return err.value.body

    error = _run(ScriptedEngine(), body)
    assert error["param"] == param and says in error["message"], error


def test_harmless_fields_are_accepted():
    async def body(api, client):
        return await api.responses.create(
            model="fake", input="plain", metadata={"team": "a"}, user="u", store=True,
            parallel_tool_calls=False, reasoning={"effort": None}, truncation="disabled",
            text={"format": {"type": "text"}}, temperature=0.5, top_p=0.9,
            extra_body={"service_tier": "auto", "prompt_cache_key": "k"})

    out = _run(ScriptedEngine(), body)
    assert out.output_text == SCRIPTS["plain"] and out.metadata == {"team": "a"}
    assert out.parallel_tool_calls is False and out.temperature == 0.5


def _plain(items: list[Any]) -> list[tuple[Any, ...]]:
    out = []
    for i in items:
        if isinstance(i, FunctionCallItem):
            out.append(("function_call", i.name, i.arguments))
        else:
            out.append((i.type, [p.text for p in i.content]))
    return out


def test_streamed_items_equal_whole_items_at_any_chunking():
    """Whatever the chunk boundaries, the items the stream builds (and the deltas that fill
    them) equal the whole response's, in order and status (here of an output cut short):
    blank text between calls is no message either way, text after a call joins the message
    before it."""
    rng = random.Random(7)
    parsers = server_parsers("qwen3", "hermes", True, None)
    texts = [*SCRIPTS.values(), "  \n", "<think>a</think>\n\n", "<think>a</think> ok ",
             '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\n\nafter',
             'x<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>  ']
    for text in texts:
        cut = output_items(new_output_parse(parsers, True).whole(text), "incomplete")
        whole = _plain(cut)
        for _ in range(40):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1,
                                                                rng.randint(0, 12))))
            pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            parse = new_output_parse(parsers, True)
            events = ResponseEvents()
            out: list[bytes] = []
            for k, piece in enumerate(pieces):
                events.feed(parse.delta(piece, k == len(pieces) - 1), out)
            items = events.finish("incomplete", out)
            assert _plain(items) == whole, (text, pieces)
            assert [i.status for i in items] == [i.status for i in cut], (text, pieces)
            decoded = [json.loads(e) for e in out]
            assert [e["sequence_number"] for e in decoded] == list(range(len(decoded)))
            joined: dict[int, str] = {}
            for e in decoded:
                if e["type"].endswith(".delta"):
                    joined[e["output_index"]] = joined.get(e["output_index"], "") + e["delta"]
            for index, item in enumerate(_plain(items)):
                assert joined.get(index, "") == (item[2] if item[0] == "function_call"
                                                 else "".join(item[1]))


def test_store_flags_bound_the_servers_store():
    from tidal.frontend.cli import _server_settings, build_parser

    def settings(*flags: str) -> ServerSettings:
        return _server_settings(build_parser().parse_args(["serve", *flags]))

    s = settings("--max-stored-responses", "1", "--max-stored-response-bytes", "100000")
    assert (s.max_stored_responses, s.max_stored_response_bytes) == (1, 100000)
    with pytest.raises(SystemExit, match="max-stored-responses"):
        settings("--max-stored-responses", "-1")

    async def body(api, client):
        first = await api.responses.create(model="fake", input="plain")
        second = await api.responses.create(model="fake", input="plain")
        with pytest.raises(openai.NotFoundError):
            await api.responses.retrieve(first.id)  # evicted: one entry only
        return (await api.responses.retrieve(second.id)).id == second.id

    assert _run(ScriptedEngine(), body, max_stored_responses=1)


def test_response_store_bounds():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    msgs = [{"role": "user", "content": "x"}]
    for rid in ("a", "b"):
        assert store.put(rid, msgs, b"{}")
    assert store.get("a") is not None  # "b" is now the least recently used
    assert store.put("c", msgs, b"{}")
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    before = store.num_bytes
    assert not store.put("huge", msgs, b"x" * 20_000)  # over the bound alone: not kept
    assert store.num_bytes == before
    assert store.put("big", msgs, b"x" * 9_950)  # evicts both others to fit
    assert len(store) == 1 and store.num_bytes <= 10_000
    assert store.delete("big") and store.num_bytes == 0 and not store.delete("big")
    assert not ResponseStore(max_entries=0).put("a", msgs, b"{}")
    # A background response still running is never evicted; a later state of a response
    # that no longer fits drops the earlier one (no stale "in_progress" left behind).
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    assert store.put("run", [], b"{}", status="in_progress")
    for rid in ("d", "e", "f"):
        assert store.put(rid, msgs, b"{}")
    assert store.get("run") is not None and store.get("f") is not None and len(store) == 2
    assert not store.put("run", msgs, b"x" * 20_000, status="completed")
    assert store.get("run") is None


@pytest.mark.slow
def test_smollm2_responses_streamed_equals_whole_and_json_schema():
    """The real model on the shared server: a greedy answer is the same whole and streamed
    (its deltas join to it), a follow-up through previous_response_id answers, and
    text.format json_schema yields JSON valid under the schema, a named tool_choice a call
    whose arguments are valid under the tool's, and the output's log-probabilities are chat
    completions' for the same conversation."""
    server = generation_server()
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}

    async def go():
        api = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
        try:
            kw = {"model": (await api.models.list()).data[0].id,
                  "input": "Name three colors.", "max_output_tokens": 16, "temperature": 0}
            whole = await api.responses.create(**kw)
            events, final = await _streamed(api, **kw)
            follow = await api.responses.create(**{**kw, "input": "And one more?",
                                                   "previous_response_id": whole.id})
            structured = await api.responses.create(
                **{**kw, "input": "Give a person as JSON.", "max_output_tokens": 40,
                   "text": {"format": {"type": "json_schema", "name": "person",
                                       "schema": schema, "strict": True}}})
            city = {"type": "object", "properties": {"city": {"type": "string",
                                                              "maxLength": 20}},
                    "required": ["city"], "additionalProperties": False}
            named = await api.responses.create(
                **{**kw, "input": "What is the weather in Paris?", "max_output_tokens": 40,
                   "tools": [{"type": "function", "name": "get_weather", "parameters": city,
                              "strict": True}],
                   "tool_choice": {"type": "function", "name": "get_weather"}})
            with_lp = await api.responses.create(
                **kw, include=["message.output_text.logprobs"], top_logprobs=2)
            lp_events, _ = await _streamed(api, **kw, include=["message.output_text.logprobs"],
                                           top_logprobs=2)
            chat = await api.chat.completions.create(
                model=kw["model"], messages=[{"role": "user", "content": kw["input"]}],
                max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
            return (whole, events, final, follow, structured, (named, city),
                    (with_lp, chat, lp_events))
        finally:
            await api.close()

    whole, events, final, follow, structured, (named, city), (with_lp, chat, lp_events) = \
        asyncio.run(go())
    # Log-probabilities as chat completions gives them for the same conversation.
    lps = with_lp.output[-1].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert with_lp.output_text == chat.choices[0].message.content == whole.output_text
    assert [(lp.token, lp.bytes) for lp in lps] == [(c.token, c.bytes) for c in want]
    assert [lp.logprob for lp in lps] == pytest.approx([c.logprob for c in want], abs=1e-4)
    assert [[t.token for t in lp.top_logprobs] for lp in lps] == \
        [[t.token for t in c.top_logprobs] for c in want]
    # Streamed, the answer deltas carry them all, in order.
    streamed = [lp for e in lp_events if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in lps]
    assert whole.output_text and whole.status in ("completed", "incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") \
        == whole.output_text == final.output_text
    assert final.status == whole.status
    assert whole.usage.output_tokens <= 16 and whole.usage.input_tokens > 0
    assert follow.usage.input_tokens > whole.usage.input_tokens + whole.usage.output_tokens
    assert follow.status in ("completed", "incomplete")
    assert structured.status == "completed"
    jsonschema.validate(json.loads(structured.output_text), schema)
    assert named.status == "completed" and [i.type for i in named.output] == ["function_call"]
    assert named.output[0].name == "get_weather"
    jsonschema.validate(json.loads(named.output[0].arguments), city)


class WholeEngine(ScriptedEngine):
    """Renders every message (one token a character), so the prompt grows with the
    conversation; the model's context is 64 tokens (``_config``)."""

    async def apply_chat_template(self, messages: list[dict[str, Any]], *args: Any,
                                  **kwargs: Any) -> list[int]:
        self.rendered.append({"messages": messages})
        return self._tok.encode("|".join(f"{m['role'][0]}:{m['content']}" for m in messages))


def test_truncation_auto_drops_the_oldest_turns():
    """A chained conversation that outgrows the context: with truncation "auto" the oldest
    turn goes (the instructions stay), the response says so and counts the tokens it kept;
    without, the same request is the context 400. The stored conversation stays whole: the
    next follow-up truncates it again. A last turn too long alone is a 400 either way."""
    engine = WholeEngine()

    async def body(api, client):
        common: dict[str, Any] = dict(model="fake", instructions="brief", max_output_tokens=4,
                                      truncation="auto")
        first = await api.responses.create(input="a" * 25, **common)
        second = await api.responses.create(input="b" * 25, previous_response_id=first.id,
                                            **common)
        kept = engine.rendered[-1]["messages"]
        with pytest.raises(openai.BadRequestError) as plain:
            await api.responses.create(**{**common, "truncation": "disabled"}, input="b" * 25,
                                       previous_response_id=first.id)
        before = len(engine.rendered)
        third = await api.responses.create(input="c" * 25, previous_response_id=second.id,
                                           **common)
        kept3 = engine.rendered[-1]["messages"]
        # The first render of the third request is the whole stored conversation.
        whole3 = [m["content"] for m in engine.rendered[before]["messages"]]
        with pytest.raises(openai.BadRequestError) as alone:
            await api.responses.create(input="d" * 70, previous_response_id=second.id,
                                       **common)
        return first, second, kept, plain.value, third, kept3, whole3, alone.value

    first, second, kept, plain, third, kept3, whole3, alone = _run(engine, body)
    assert first.truncation == second.truncation == "auto"
    assert first.usage.input_tokens == len("s:brief|u:" + "a" * 25)
    assert [m["role"] for m in kept] == ["system", "user"] and kept[1]["content"] == "b" * 25
    assert second.usage.input_tokens == len("s:brief|u:" + "b" * 25)
    assert plain.body["code"] == "context_length_exceeded"
    # The third turn: the stored conversation holds all three turns, two of which go.
    assert whole3[0] == "brief" and whole3[1] == "a" * 25 and whole3[-1] == "c" * 25
    assert [m["content"] for m in kept3] == ["brief", "c" * 25]
    assert alone.body["code"] == "context_length_exceeded"
