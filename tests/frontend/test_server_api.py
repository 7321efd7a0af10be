"""The OpenAI-compatible server's API through the official ``openai`` client (a real
``tidal serve`` process on SmolLM2): completions and chat, whole and streamed, n, logprobs, stop
strings, usage, prompt forms, tokenize/detokenize, models, metrics."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import pytest

from server_harness import API_KEY, generation_server

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    return generation_server()


def run(coro):
    return asyncio.run(coro)


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                              timeout=120)


def post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {API_KEY}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def get_text(server, path: str) -> str:
    with urllib.request.urlopen(server.url + path, timeout=30) as resp:
        return resp.read().decode()


def test_models_health_version(server):
    async def go():
        async with client(server) as c:
            models = await c.models.list()
            return [m.id for m in models.data], models.data[0]

    ids, card = run(go())
    assert ids == ["SmolLM2-135M-Instruct"]
    assert card.model_extra.get("max_model_len") == 1024
    assert server.health() == 200
    assert "version" in json.loads(get_text(server, "/version"))


SAMPLED = dict(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, n=2, logprobs=2)


def test_completion_stream_equals_whole(server):
    async def go():
        async with client(server) as c:
            whole = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                               **SAMPLED)
            stream = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                stream=True,
                                                stream_options={"include_usage": True},
                                                **SAMPLED)
            chunks = [chunk async for chunk in stream]
            return whole, chunks

    whole, chunks = run(go())
    assert len(whole.choices) == 2
    texts = {0: "", 1: ""}
    tokens: dict[int, list[str]] = {0: [], 1: []}
    finish = {}
    for chunk in chunks[:-1]:
        assert chunk.object == "text_completion"
        for ch in chunk.choices:
            texts[ch.index] += ch.text
            tokens[ch.index] += ch.logprobs.tokens
            if ch.finish_reason is not None:
                finish[ch.index] = ch.finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    for ch in whole.choices:
        assert texts[ch.index] == ch.text
        assert tokens[ch.index] == ch.logprobs.tokens
        assert finish[ch.index] == ch.finish_reason
        assert len(ch.logprobs.token_logprobs) == len(ch.logprobs.tokens)
        assert all(len(top) <= 3 for top in ch.logprobs.top_logprobs)
    n_tokens = sum(len(ch.logprobs.tokens) for ch in whole.choices)
    assert whole.usage.completion_tokens == n_tokens
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    expected_prompt = post(server, "/tokenize", {"prompt": PROMPT})["count"]
    assert whole.usage.prompt_tokens == expected_prompt
    assert whole.usage.total_tokens == expected_prompt + n_tokens


def test_chat_stream_equals_whole(server):
    messages = [{"role": "user", "content": "Name three colours."}]
    params = dict(temperature=0.8, seed=7, max_tokens=10, n=2, logprobs=True, top_logprobs=2)

    async def go():
        async with client(server) as c:
            whole = await c.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                    messages=messages, **params)
            stream = await c.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                     messages=messages, stream=True,
                                                     stream_options={"include_usage": True},
                                                     **params)
            return whole, [chunk async for chunk in stream]

    whole, chunks = run(go())
    first_roles = {}
    texts = {0: "", 1: ""}
    lp_tokens: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for ch in chunk.choices:
            first_roles.setdefault(ch.index, ch.delta.role)
            texts[ch.index] += ch.delta.content or ""
            if ch.logprobs is not None and ch.logprobs.content:
                lp_tokens[ch.index] += [e.token for e in ch.logprobs.content]
    assert first_roles == {0: "assistant", 1: "assistant"}
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    for ch in whole.choices:
        assert ch.message.role == "assistant"
        assert texts[ch.index] == ch.message.content
        assert lp_tokens[ch.index] == [e.token for e in ch.logprobs.content]
        for entry in ch.logprobs.content:
            assert len(entry.top_logprobs) == 2
            assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    prompt_ids = post(server, "/tokenize", {"messages": messages})["count"]
    assert whole.usage.prompt_tokens == prompt_ids
    assert whole.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in whole.choices)


def test_stop_string_and_finish_reasons(server):
    async def go():
        async with client(server) as c:
            stopped = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                 max_tokens=12, temperature=0, stop=["."])
            streamed = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                  max_tokens=12, temperature=0, stop=["."],
                                                  stream=True)
            text = "".join([ch.choices[0].text async for ch in streamed if ch.choices])
            length = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                                max_tokens=3, temperature=0)
            return stopped, text, length

    stopped, streamed_text, length = run(go())
    choice = stopped.choices[0]
    assert choice.text == " Paris" and streamed_text == " Paris"
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == "."
    assert length.choices[0].finish_reason == "length"
    assert length.usage.completion_tokens == 3


def test_prompt_forms_and_echo(server):
    ids = post(server, "/tokenize", {"prompt": PROMPT})["tokens"]

    async def go():
        async with client(server) as c:
            kw = dict(model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0)
            text = await c.completions.create(prompt=PROMPT, **kw)
            as_ids = await c.completions.create(prompt=ids, **kw)
            batch = await c.completions.create(prompt=[PROMPT, "Once upon a time"], n=2, **kw)
            id_batch = await c.completions.create(prompt=[ids, ids[:3]], **kw)
            echo = await c.completions.create(prompt=PROMPT, echo=True, logprobs=1, **kw)
            return text, as_ids, batch, id_batch, echo

    text, as_ids, batch, id_batch, echo = run(go())
    assert as_ids.choices[0].text == text.choices[0].text
    assert sorted(ch.index for ch in batch.choices) == [0, 1, 2, 3]
    by_index = {ch.index: ch.text for ch in batch.choices}
    assert by_index[0] == by_index[1] == text.choices[0].text  # greedy: n samples agree
    assert batch.usage.completion_tokens == 16
    assert [ch.index for ch in id_batch.choices] == [0, 1]
    assert id_batch.usage.prompt_tokens == len(ids) + 3
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == PROMPT + text.choices[0].text
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 4
    assert "".join(lp.tokens) == echo.choices[0].text
    assert lp.text_offset[len(ids)] == len(PROMPT)


def test_sampling_extensions(server):
    """vLLM's extra parameters reach the engine: logit_bias forces a token, min_tokens with
    ignore_eos fixes the length, a seeded sample repeats."""
    forced = post(server, "/tokenize", {"prompt": " yes", "add_special_tokens": False})
    token = forced["tokens"][0]

    async def go():
        async with client(server) as c:
            kw = dict(model="SmolLM2-135M-Instruct", prompt=PROMPT)
            biased = await c.completions.create(max_tokens=4, temperature=0,
                                                logit_bias={str(token): 100}, **kw)
            fixed = await c.completions.create(
                max_tokens=6, temperature=0.7, seed=3,
                extra_body={"min_tokens": 6, "ignore_eos": True, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.2}, presence_penalty=0.5,
                frequency_penalty=0.5, **kw)
            again = await c.completions.create(
                max_tokens=6, temperature=0.7, seed=3,
                extra_body={"min_tokens": 6, "ignore_eos": True, "top_k": 20, "min_p": 0.05,
                            "repetition_penalty": 1.2}, presence_penalty=0.5,
                frequency_penalty=0.5, **kw)
            stop_id = await c.completions.create(max_tokens=8, temperature=0,
                                                 logit_bias={str(token): 100},
                                                 extra_body={"stop_token_ids": [token]}, **kw)
            return biased, fixed, again, stop_id

    biased, fixed, again, stop_id = run(go())
    assert biased.choices[0].text == " yes" * 4
    assert fixed.usage.completion_tokens == 6
    assert fixed.choices[0].text == again.choices[0].text
    assert stop_id.choices[0].finish_reason == "stop"
    assert stop_id.choices[0].model_extra.get("stop_reason") == token


def test_tokenize_detokenize(server):
    tok = post(server, "/tokenize", {"prompt": "Hello, world!"})
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    assert post(server, "/detokenize", {"tokens": tok["tokens"]})["prompt"] == "Hello, world!"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert chat["count"] > tok["count"]


def metric_values(server) -> dict[str, float]:
    values = {}
    for line in get_text(server, "/metrics").splitlines():
        if line.startswith("tidal:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


MODEL_LABEL = 'engine="0",model_name="SmolLM2-135M-Instruct"'  # (labels print sorted)


def test_metrics(server):
    async def go():
        async with client(server) as c:
            await c.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=3, temperature=0)

    run(go())
    values = metric_values(server)
    model = MODEL_LABEL
    assert values[f"tidal:prompt_tokens_total{{{model}}}"] > 0
    assert values[f"tidal:generation_tokens_total{{{model}}}"] >= 3
    length = 'engine="0",finished_reason="length",model_name="SmolLM2-135M-Instruct"'
    assert values[f"tidal:request_success_total{{{length}}}"] >= 1
    assert values[f"tidal:time_to_first_token_seconds_count{{{model}}}"] >= 1
    assert values[f"tidal:e2e_request_latency_seconds_count{{{model}}}"] >= 1
    assert values[f"tidal:inter_token_latency_seconds_count{{{model}}}"] >= 2
    assert f"tidal:kv_cache_usage_perc{{{model}}}" in values
    assert f"tidal:num_requests_waiting{{{model}}}" in values
    assert f"tidal:num_preemptions_total{{{model}}}" in values


def test_prefix_cache_usage_salt_and_counters(server):
    # A prompt no other test sends (token ids), long enough for several 16-token blocks.
    ids = [1000 + (i * 37) % 5000 for i in range(83)]
    hits_name = f"tidal:prefix_cache_hits_total{{{MODEL_LABEL}}}"
    queries_name = f"tidal:prefix_cache_queries_total{{{MODEL_LABEL}}}"
    before = metric_values(server)

    async def go():
        async with client(server) as c:
            async def cached(**extra) -> int:
                out = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=ids,
                                                 max_tokens=2, temperature=0, **extra)
                assert out.usage.prompt_tokens == len(ids)
                return out.usage.prompt_tokens_details.cached_tokens

            first = await cached()
            second = await cached()
            salted = await cached(extra_body={"cache_salt": "tenant-b"})
            salted_again = await cached(extra_body={"cache_salt": "tenant-b"})
            chat = dict(model="SmolLM2-135M-Instruct", max_tokens=2, temperature=0,
                        messages=[{"role": "user", "content": "Tell me about tides. " * 12}])
            await c.chat.completions.create(**chat)
            stream = await c.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **chat)
            usage = [chunk.usage async for chunk in stream if chunk.usage is not None]
            return first, second, salted, salted_again, usage

    first, second, salted, salted_again, usage = run(go())
    assert first == 0
    # Whole blocks only, and the last prompt token is always computed.
    assert second == 80 and second % 16 == 0
    assert salted == 0  # another salt shares nothing, even for the same prompt
    assert salted_again == 80
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens > 0
    after = metric_values(server)
    assert after[queries_name] - before.get(queries_name, 0) >= 4 * len(ids)
    assert after[hits_name] - before.get(hits_name, 0) >= 160 + \
        usage[0].prompt_tokens_details.cached_tokens
