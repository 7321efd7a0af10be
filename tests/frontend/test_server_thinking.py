"""Reasoning with a grammar and a thinking budget through ``tidal serve --reasoning-parser
qwen3`` and the official ``openai`` client: a tiny random-weight Qwen3 with the real Qwen3
tokenizer and chat template. The weights decide nothing that is checked: a logit bias opens
the thinking, the budget ends it, the grammar shapes the answer; ``reasoning_content`` must
hold the thinking, ``content`` JSON that validates, streamed == whole. Then the 400s."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from server_harness import API_KEY, shared_server

from tidal.frontend.server.errors import APIError
from tidal.frontend.server.openai_protocol import ChatCompletionRequest, decode_request
from tidal.frontend.server.sampling import chat_params, chat_thinking_budget, with_thinking_budget

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
THINK, END_THINK = 151667, 151668  # <think>, </think> in the Qwen3 vocabulary


def _request(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return decode_request(json.dumps(body).encode(), ChatCompletionRequest)


def test_budget_fields_and_their_400s():
    req = _request(max_thinking_tokens=7)
    assert chat_thinking_budget(req, "qwen3") == (7, "max_thinking_tokens")
    params = with_thinking_budget(chat_params(req, _limits()), 7, "max_thinking_tokens",
                                  "qwen3")
    assert params.thinking_token_budget == 7
    for fields, parser in [({"thinking_token_budget": -1}, None), ({}, None)]:
        assert chat_thinking_budget(_request(**fields), parser)[0] in (None, -1)
        assert with_thinking_budget(chat_params(_request(**fields), _limits()), -1,
                                    "thinking_token_budget", parser).thinking_token_budget \
            is None
    for fields, parser, param in [
            ({"thinking_token_budget": 5}, None, "thinking_token_budget"),  # no parser
            ({"max_thinking_tokens": 5}, None, "max_thinking_tokens"),
            ({"thinking_token_budget": -3}, "qwen3", "thinking_token_budget"),
            ({"thinking_token_budget": 4, "max_thinking_tokens": 5}, "qwen3",
             "max_thinking_tokens")]:
        with pytest.raises(APIError) as err:
            chat_thinking_budget(_request(**fields), parser)
        assert err.value.status == 400 and err.value.param == param


def _limits():
    from tidal.frontend.server.sampling import ServerLimits

    return ServerLimits()


@pytest.fixture(scope="module")
def server(qwen3_tokenizer, tmp_path_factory):
    import reference

    path = reference.make_tiny_qwen3_with_tokenizer(
        qwen3_tokenizer, tmp_path_factory.mktemp("tiny-qwen3-serve"))
    return shared_server([str(path), "--reasoning-parser", "qwen3", "--max-model-len", "512",
                          "--kv-cache-memory-bytes", str(32 << 20), "--cpu-threads", "1"])


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


@pytest.mark.slow
def test_thinking_then_a_valid_answer(server):
    budget = 6
    kw = dict(messages=[{"role": "user", "content": "Answer in JSON"}], max_tokens=120,
              seed=3, temperature=1.0, response_format=FORMAT, logit_bias={str(THINK): 100},
              extra_body={"thinking_token_budget": budget})

    async def body(api, model):
        whole = await api.chat.completions.create(model=model, **kw)
        reasoning, content = [], []
        async for chunk in await api.chat.completions.create(model=model, stream=True, **kw):
            if chunk.choices:
                d = chunk.choices[0].delta
                reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
                content.append(d.content or "")
        # Thinking off in the template: the prompt ends the thinking, the bias cannot open it.
        off = await api.chat.completions.create(
            model=model, **{**kw, "extra_body": {"chat_template_kwargs": {
                "enable_thinking": False}, "thinking_token_budget": budget}})
        unknown = None
        try:
            await api.completions.create(model=model, prompt="x", max_tokens=2,
                                         extra_body={"thinking_token_budget": 3})
        except openai.BadRequestError as exc:
            unknown = exc.body
        return whole, ("".join(reasoning), "".join(content)), off, unknown

    whole, streamed, off, unknown = _run(server, body)
    msg = whole.choices[0].message
    reasoning = msg.model_extra.get("reasoning_content")
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert whole.choices[0].finish_reason == "stop"
    # <think>, at most `budget` tokens of thinking, the forced "\n</think>\n\n", the answer.
    answer_tokens = whole.usage.completion_tokens - 1 - budget - 3
    assert 1 <= answer_tokens < 60
    assert streamed == (reasoning or "", msg.content)
    jsonschema.validate(json.loads(off.choices[0].message.content), SCHEMA)
    assert off.choices[0].message.model_extra.get("reasoning_content") is None
    assert unknown["param"] == "thinking_token_budget"
