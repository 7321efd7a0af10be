"""vLLM's ``truncate_prompt_tokens`` / ``truncation_side`` on completions and chat (and their
beam searches): the last (or first) k prompt tokens reach the engine, ``-1`` is the context
length, bad values are 400s naming the field; the Responses API keeps its own ``truncation``
and refuses these."""

from __future__ import annotations

from typing import Any

import pytest
from test_server_unit import FakeEngine, _run, _serve

from tidal.frontend.server.prompts import truncated


class Recording(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[int]] = []

    async def add_request(self, request_id: str, ids: list[int], params: Any, **kw: Any) -> Any:
        self.prompts.append(list(ids))
        return await super().add_request(request_id, ids, params, **kw)


def _ids(text: str) -> list[int]:
    return [ord(c) % 128 for c in text]


def test_the_last_or_first_tokens_reach_the_engine():
    engine = Recording()

    async def go():
        state, client = _serve(engine)
        async with client:
            out = []
            for extra in ({"truncate_prompt_tokens": 4},
                          {"truncate_prompt_tokens": 4, "truncation_side": "right"},
                          {"truncate_prompt_tokens": -1}, {}):
                resp = await client.post("/v1/completions", json={
                    "prompt": "abcdefghij", "echo": True, "max_tokens": 3, **extra})
                out.append((resp.status, await resp.json()))
            resp = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "abcdefghij"}], "max_tokens": 3,
                "truncate_prompt_tokens": 5})
            out.append((resp.status, await resp.json()))
            return out

    (left, right, whole, plain, chat) = _run(go())
    assert [s for s, _ in (left, right, whole, plain, chat)] == [200] * 5
    assert engine.prompts[:4] == [_ids("ghij"), _ids("abcd"), _ids("abcdefghij"),
                                  _ids("abcdefghij")]
    assert left[1]["usage"]["prompt_tokens"] == 4
    assert left[1]["choices"][0]["text"].startswith("ghij")  # echo: the prompt it ran
    assert right[1]["choices"][0]["text"].startswith("abcd")
    assert engine.prompts[4] == _ids("fghij") and chat[1]["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize("extra,param", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),  # past the 64-token context
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 4, "truncation_side": "middle"}, "truncation_side"),
])
def test_bad_values_are_400s(extra, param):
    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            out = []
            for path, body in (("/v1/completions", {"prompt": "abc"}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "abc"}]})):
                resp = await client.post(path, json={**body, "max_tokens": 2, **extra})
                out.append((resp.status, (await resp.json())["error"]["param"]))
            return out

    assert _run(go()) == [(400, param), (400, param)]


def test_the_responses_api_refuses_them():
    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            resp = await client.post("/v1/responses", json={
                "input": "abc", "truncate_prompt_tokens": 2})
            return resp.status, (await resp.json())["error"]["param"]

    assert _run(go()) == (400, "truncate_prompt_tokens")


def test_truncated():
    class Req:
        truncate_prompt_tokens: int | None = 3
        truncation_side: str | None = None

    ids = list(range(10))
    assert truncated(ids, Req(), 64) == [7, 8, 9]
    r = Req()
    r.truncation_side = "right"
    assert truncated(ids, r, 64) == [0, 1, 2]
    r.truncate_prompt_tokens = -1
    assert truncated(ids, r, 5) == [0, 1, 2, 3, 4]
    r.truncate_prompt_tokens = None
    assert truncated(ids, r, 5) is ids
