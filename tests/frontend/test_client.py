"""``tidal.frontend.AsyncClient`` against real servers: completions and chat (whole and
streamed deltas), embeddings, models, health, typed errors, timeouts."""

from __future__ import annotations

import asyncio
import socket

import pytest

from server_harness import API_KEY, embedding_server, generation_server
from tidal.frontend import AsyncClient
from tidal.frontend.client import (
    APIConnectionError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    NotFoundError,
)

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def run(coro):
    return asyncio.run(coro)


def test_complete_and_stream_agree():
    server = generation_server()

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            whole = await c.complete("The capital of France is", max_tokens=8, temperature=0.7,
                                     seed=11, n=2)
            stream = c.stream_complete("The capital of France is", max_tokens=8,
                                       temperature=0.7, seed=11, n=2)
            texts = {0: "", 1: ""}
            async for delta in stream:
                texts[delta.index] += delta.text
            return whole, texts, stream.usage

    whole, texts, usage = run(go())
    assert {c.index: c.text for c in whole.choices} == texts
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_and_stream_chat_agree():
    server = generation_server()

    async def go():
        async with AsyncClient(server.base_url, api_key=API_KEY) as c:
            whole = await c.chat(MESSAGES, max_tokens=8, temperature=0)
            deltas = [d async for d in c.stream_chat(MESSAGES, max_tokens=8, temperature=0)]
            return whole, deltas

    whole, deltas = run(go())
    assert deltas[0].role == "assistant"
    assert "".join(d.content for d in deltas) == whole.choices[0].message.content
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason


def test_models_health_and_typed_errors():
    server = generation_server()

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            models = await c.models()
            healthy = await c.health()
            with pytest.raises(BadRequestError) as bad:
                await c.complete("Hi", max_tokens=-1)
            with pytest.raises(NotFoundError):
                await c.complete("Hi", model="not-served", max_tokens=2)
            with pytest.raises(BadRequestError):
                async for _ in c.stream_chat(MESSAGES, n=10**6):
                    pass
        async with AsyncClient(server.url, api_key="wrong") as c:
            with pytest.raises(AuthenticationError) as auth:
                await c.models()
        return models, healthy, bad.value, auth.value

    models, healthy, bad, auth = run(go())
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert healthy
    assert bad.status == 400 and bad.param == "max_tokens" and "max_tokens" in bad.message
    assert auth.status == 401 and auth.code == "invalid_api_key"


def test_embeddings():
    server = embedding_server()

    async def go():
        async with AsyncClient(server.url, api_key=API_KEY) as c:
            return await c.embeddings(["a cat", "a dog"])

    vectors = run(go())
    assert len(vectors) == 2 and len(vectors[0]) == 384
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-5


def test_timeout_and_connection_errors():
    # A listener that never answers: the client must give up after its timeout.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]

        async def go():
            async with AsyncClient(f"http://127.0.0.1:{port}", timeout=0.5) as c:
                with pytest.raises(APITimeoutError):
                    await c.models()
                assert not await c.health()

        run(go())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]

    async def refused():
        async with AsyncClient(f"http://127.0.0.1:{closed_port}", timeout=2) as c:
            with pytest.raises(APIConnectionError):
                await c.complete("Hi", model="m")

    run(refused())
