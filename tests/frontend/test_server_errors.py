"""Bad inputs against a real server: each gets the right status and OpenAI's error envelope,
nothing internal leaks, and the server stays healthy and correct afterwards. Also the 429
queue bound and the ``openai`` client's typed errors."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from server_harness import API_KEY, SMALL_ENGINE, require_smollm2, shared_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
MAX_LEN = 256
BODY_LIMIT = 65536
AUTH = {"Authorization": f"Bearer {API_KEY}"}
JSON = {**AUTH, "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server():
    require_smollm2()
    args = [a if a != "1024" else str(MAX_LEN) for a in SMALL_ENGINE]
    return shared_server(args + ["--max-num-seqs", "2", "--max-queued-requests", "2",
                                 "--max-request-bytes", str(BODY_LIMIT)])


def run(coro):
    return asyncio.run(coro)


async def _request(server, method: str, path: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, server.url + path, data=body,
                             headers=JSON if headers is None else headers) as resp:
            return resp.status, await resp.read()


def _greedy(server) -> str:
    body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6,
                       "temperature": 0}).encode()
    status, raw = run(_request(server, "POST", "/v1/completions", body))
    assert status == 200, raw
    return json.loads(raw)["choices"][0]["text"]


@pytest.fixture(scope="module")
def baseline(server):
    return _greedy(server)


def _completion(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 4, **fields}).encode()


def _chat(**fields) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    body.update(fields)
    return json.dumps(body).encode()


LONG_PROMPT = " ".join(["word"] * (MAX_LEN + 50))

# (id, method, path, body, headers (None: key + JSON), status, param)
CASES = [
    ("malformed-json", "POST", "/v1/completions", b'{"prompt": "Hi",', None, 400, None),
    ("non-object", "POST", "/v1/completions", b'["Hi"]', None, 400, None),
    ("empty-body", "POST", "/v1/completions", b"", None, 400, None),
    ("invalid-utf8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', None, 400, None),
    ("n-wrong-type", "POST", "/v1/completions", _completion(n="two"), None, 400, "n"),
    ("n-bool", "POST", "/v1/completions", _completion(n=True), None, 400, "n"),
    ("n-huge", "POST", "/v1/completions", _completion(n=10**6), None, 400, "n"),
    ("n-chat-huge", "POST", "/v1/chat/completions", _chat(n=10**6), None, 400, "n"),
    ("max-tokens-negative", "POST", "/v1/completions", _completion(max_tokens=-1), None, 400,
     "max_tokens"),
    ("max-completion-tokens-zero", "POST", "/v1/chat/completions",
     _chat(max_completion_tokens=0), None, 400, "max_completion_tokens"),
    ("temperature-negative", "POST", "/v1/completions", _completion(temperature=-0.5), None,
     400, "temperature"),
    ("top-p-zero", "POST", "/v1/completions", _completion(top_p=0), None, 400, "top_p"),
    ("logprobs-21", "POST", "/v1/completions", _completion(logprobs=21), None, 400,
     "logprobs"),
    ("top-logprobs-without-logprobs", "POST", "/v1/chat/completions", _chat(top_logprobs=2),
     None, 400, "top_logprobs"),
    ("too-many-stops", "POST", "/v1/completions", _completion(stop=[f"s{i}" for i in range(40)]),
     None, 400, "stop"),
    ("stop-too-long", "POST", "/v1/completions", _completion(stop=["x" * 1000]), None, 400,
     "stop"),
    ("logit-bias-bad-key", "POST", "/v1/completions", _completion(logit_bias={"abc": 1}),
     None, 400, "logit_bias"),
    ("logit-bias-too-big", "POST", "/v1/completions",
     _completion(logit_bias={str(i): 1 for i in range(2000)}), None, 400, "logit_bias"),
    ("logit-bias-out-of-vocab", "POST", "/v1/completions",
     _completion(logit_bias={"999999": 1}), None, 400, "logit_bias"),
    ("prompt-missing", "POST", "/v1/completions", json.dumps({"model": MODEL}).encode(), None,
     400, "prompt"),
    ("prompt-mixed-types", "POST", "/v1/completions", _completion(prompt=["a", 5]), None, 400,
     "prompt"),
    ("prompt-token-out-of-vocab", "POST", "/v1/completions", _completion(prompt=[1, 10**9]),
     None, 400, "prompt"),
    ("prompt-over-context", "POST", "/v1/completions", _completion(prompt=LONG_PROMPT), None,
     400, "prompt"),
    ("prompt-plus-max-tokens-over-context", "POST", "/v1/completions",
     _completion(max_tokens=MAX_LEN), None, 400, "max_tokens"),
    ("messages-missing", "POST", "/v1/chat/completions",
     json.dumps({"model": MODEL}).encode(), None, 400, "messages"),
    ("messages-wrong-type", "POST", "/v1/chat/completions",
     json.dumps({"model": MODEL, "messages": [{"role": "user", "content": 5}]}).encode(), None,
     400, "messages[0].content"),
    ("image-content", "POST", "/v1/chat/completions",
     _chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None, 400,
     "messages[0].content[0]"),
    ("embeddings-on-generative-model", "POST", "/v1/embeddings",
     json.dumps({"model": MODEL, "input": "hi"}).encode(), None, 400, "model"),
    ("unknown-model", "POST", "/v1/completions", _completion(model="gpt-17"), None, 404,
     "model"),
    ("missing-key", "POST", "/v1/completions", _completion(), {}, 401, None),
    ("wrong-key", "POST", "/v1/completions", _completion(),
     {"Authorization": "Bearer nope"}, 401, None),
    ("oversized-body", "POST", "/v1/completions", _completion(prompt="x" * (BODY_LIMIT + 10)),
     None, 413, None),
    ("unknown-route", "GET", "/v1/nothing", None, None, 404, None),
    ("wrong-method", "GET", "/v1/completions", None, None, 405, None),
    ("detokenize-out-of-vocab", "POST", "/detokenize", json.dumps({"tokens": [-1]}).encode(),
     None, 400, "tokens"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input(server, baseline, case):
    name, method, path, body, headers, status, param = case
    got, raw = run(_request(server, method, path, body, headers))
    assert got == status, raw
    envelope = json.loads(raw)
    error = envelope["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and isinstance(error["type"], str)
    assert error["param"] == param
    assert "Traceback" not in error["message"] and ".py" not in error["message"]
    assert "/work/" not in error["message"] and "site-packages" not in error["message"]
    assert server.health() == 200


def test_context_error_gives_both_numbers(server):
    body = _completion(prompt="Hello there my dear friend", max_tokens=MAX_LEN - 3)
    status, raw = run(_request(server, "POST", "/v1/completions", body))
    assert status == 400
    message = json.loads(raw)["error"]["message"]
    assert str(MAX_LEN) in message and str(MAX_LEN - 3) in message


def test_still_correct_after_bad_inputs(server, baseline):
    for _, method, path, body, headers, _, _ in CASES[:6]:
        run(_request(server, method, path, body, headers))
    assert _greedy(server) == baseline


def test_openai_client_typed_errors(server):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                      max_retries=0) as c:
            with pytest.raises(openai.NotFoundError) as nf:
                await c.completions.create(model="nope", prompt="Hi", max_tokens=2)
            with pytest.raises(openai.BadRequestError) as br:
                await c.completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=10**6)
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="wrong",
                                      max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        return nf.value, br.value

    nf, br = run(go())
    assert br.body["param"] == "n" and nf.body["code"] == "model_not_found"


def test_queue_full_gives_429(server, baseline):
    """--max-num-seqs 2 --max-queued-requests 2: a burst of 10 gets some 429s, the rest
    complete."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async def one():
                async with s.post(server.url + "/v1/completions", headers=JSON,
                                  data=_completion(max_tokens=8, ignore_eos=True)) as resp:
                    return resp.status, await resp.read()

            return await asyncio.gather(*[one() for _ in range(10)])

    results = run(go())
    statuses = sorted(s for s, _ in results)
    assert statuses.count(429) >= 1 and statuses.count(200) >= 2, statuses
    assert set(statuses) <= {200, 429}
    for status, raw in results:
        if status == 429:
            assert json.loads(raw)["error"]["code"] == "queue_full"
    assert server.health() == 200
    assert _greedy(server) == baseline
