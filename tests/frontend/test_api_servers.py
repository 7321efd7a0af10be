"""``tidal serve --api-server-count 2``: two API server processes over one EngineCore behave as
one server: concurrent streams through both match their non-streamed twins, ``/metrics`` is one
view (frontend counters summed, engine counters counted once), stored responses chain, read
and delete from either process, SIGTERM (to the whole process
group) drains every process and exits 0 with no child left, and killing one API server ends the
whole server with exit code 1."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import psutil
import pytest

from server_harness import SMALL_ENGINE, ServerProcess, require_smollm2

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

PROMPTS = [f"Write one sentence about the number {i}." for i in range(8)]


def _children(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _api_servers(server: ServerProcess) -> list[psutil.Process]:
    """The API server processes: the supervisor's children that hold the listening port."""
    out = []
    for child in psutil.Process(server.pid).children():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
                   for c in child.net_connections("tcp")):
                out.append(child)
        except psutil.Error:
            pass
    return out


def _wait_api_servers(server: ServerProcess, n: int, timeout: float = 90.0
                      ) -> list[psutil.Process]:
    """The API server processes once ``n`` of them listen (``/health`` answers as soon as the
    first one does: each warms up on its own and takes connections once it listens)."""
    deadline = time.monotonic() + timeout
    while len(api := _api_servers(server)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(api) == n, f"expected {n} API server processes listening, got {api}"
    return api


def client_for(server: ServerProcess) -> openai.AsyncOpenAI:
    """A client of its own: its first request opens a new connection, which the kernel gives
    to either API server."""
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def _metric(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (labels ignored)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _gone(procs: list[psutil.Process], timeout: float = 15.0) -> bool:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not alive


async def _metrics(client: openai.AsyncOpenAI) -> str:
    resp = await client._client.get(str(client.base_url).removesuffix("/v1/") + "/metrics")
    return resp.text


def test_two_api_servers_act_as_one():
    require_smollm2()
    server = ServerProcess([*SMALL_ENGINE, "--api-server-count", "2"], api_key=None,
                           new_session=True).start()
    try:
        _wait_api_servers(server, 2)
        children = _children(server.pid)
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused")

        async def one(prompt: str, stream: bool) -> tuple[str, int, str | None]:
            common = dict(model="", prompt=prompt, max_tokens=24, temperature=0.0,
                          extra_body={"ignore_eos": True})
            if not stream:
                r = await client.completions.create(**common)
                return r.choices[0].text, r.usage.completion_tokens, r.choices[0].finish_reason
            text, usage, finish = [], 0, None
            async for chunk in await client.completions.create(
                    **common, stream=True, stream_options={"include_usage": True}):
                if chunk.choices:
                    text.append(chunk.choices[0].text)
                    finish = chunk.choices[0].finish_reason or finish
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
            return "".join(text), usage, finish

        async def main():
            before = await _metrics(client)
            # Each request on its own connection, so both processes take some.
            results = await asyncio.gather(*(one(p, s) for p in PROMPTS for s in (False, True)))
            views = [await _metrics(client) for _ in range(6)]
            await client.close()
            return before, results, views

        before, results, views = asyncio.run(main())
        for k in range(len(PROMPTS)):
            whole, streamed = results[2 * k], results[2 * k + 1]
            assert streamed == whole, f"prompt {k}: streamed {streamed} vs whole {whole}"
            assert whole[0] and whole[1:] == (24, "length")
        generated = sum(r[1] for r in results)
        # Whichever process answers /metrics shows the same totals: frontend counters summed
        # over both, the engine's tokens counted once (not once per frontend).
        for text in views:
            assert _metric(text, "tidal:request_success_total") - \
                _metric(before, "tidal:request_success_total") == len(results)
            assert _metric(text, "tidal:generation_tokens_total") - \
                _metric(before, "tidal:generation_tokens_total") == generated
            assert _metric(text, "tidal:time_to_first_token_seconds_count") - \
                _metric(before, "tidal:time_to_first_token_seconds_count") == len(results)
            running = [line for line in text.splitlines()
                       if line.startswith("tidal:num_requests_running")]
            assert len(running) == 1 and "pid=" not in running[0]
            # Prompt tokens counted by each frontend (summed) and looked up by the engine
            # (counted once) agree; per-request phases are summed over both.
            prompt = _metric(text, "tidal:prompt_tokens_total") - \
                _metric(before, "tidal:prompt_tokens_total")
            assert prompt > 0 and prompt == _metric(text, "tidal:prefix_cache_queries_total") \
                - _metric(before, "tidal:prefix_cache_queries_total")
            assert _metric(text, "tidal:request_queue_time_seconds_count") - \
                _metric(before, "tidal:request_queue_time_seconds_count") == len(results)
            assert len([line for line in text.splitlines()
                        if line.startswith("tidal:cache_config_info")]) == 1

        # Stored responses: follow-ups on fresh connections (either process may take each)
        # chain from one stored response; GET and DELETE reach it from either.
        async def chain():
            c = client_for(server)
            try:
                first = await c.responses.create(model="", input="Say hi.", max_output_tokens=8,
                                                 temperature=0.0)
            finally:
                await c.close()
            ids = []
            for k in range(8):
                c = client_for(server)
                try:
                    r = await c.responses.create(model="", input=f"And {k}?",
                                                 previous_response_id=first.id,
                                                 max_output_tokens=4, temperature=0.0)
                    got = await c.responses.retrieve(first.id)
                finally:
                    await c.close()
                assert r.status in ("completed", "incomplete") and got.id == first.id
                ids.append(r.id)
            c = client_for(server)
            try:
                await c.responses.delete(first.id)
            finally:
                await c.close()
            for _ in range(4):
                c = client_for(server)
                try:
                    with pytest.raises(openai.NotFoundError):
                        await c.responses.retrieve(first.id)
                finally:
                    await c.close()
            return ids

        assert len(set(asyncio.run(chain()))) == 8

        # A background response: polled, listed and cancelled from fresh connections (the
        # cancel reaches the process that runs it, whichever process takes it).
        async def background():
            async def call(fn):
                c = client_for(server)
                try:
                    return await fn(c)
                finally:
                    await c.close()

            queued = await call(lambda c: c.responses.create(
                model="", input="Write a very long story about the sea.", temperature=0.0,
                max_output_tokens=512, background=True))
            polled = [await call(lambda c: c.responses.retrieve(queued.id)) for _ in range(3)]
            items = await call(lambda c: c.responses.input_items.list(queued.id))
            cancelled = await call(lambda c: c.responses.cancel(queued.id))
            after = [await call(lambda c: c.responses.retrieve(queued.id)) for _ in range(4)]
            return queued, polled, items, cancelled, after

        queued, polled, items, cancelled, after = asyncio.run(background())
        assert queued.status == "queued" and queued.background
        assert all(p.id == queued.id for p in polled) and items.data[0].content[0].text.startswith(
            "Write a very long story")
        # (512 tokens take the CPU several seconds: the cancel comes first.)
        assert cancelled.status == "cancelled", cancelled.status
        assert {a.status for a in after} == {"cancelled"}

        # A background stream replayed from fresh connections: the process that takes each
        # GET ?stream=true follows the events from the one that keeps them.
        async def replay():
            c = client_for(server)
            try:
                stream = await c.responses.create(
                    model="", input="Name three colors.", temperature=0.0,
                    max_output_tokens=24, background=True, stream=True)
                whole = [event async for event in stream]
            finally:
                await c.close()
            rid = whole[0].response.id
            replays = []
            for _ in range(6):
                c = client_for(server)
                try:
                    again = await c.responses.retrieve(rid, stream=True, starting_after=2)
                    replays.append([event async for event in again])
                finally:
                    await c.close()
            return whole, replays

        whole, replays = asyncio.run(replay())
        assert whole[-1].type == "response.completed"
        want = [(e.type, e.sequence_number) for e in whole[3:]]
        for events in replays:
            assert [(e.type, e.sequence_number) for e in events] == want

        # SIGTERM to the server's whole process group (as Ctrl-C or ``timeout`` send it)
        # drains both API servers once while a request runs: it completes; exit code 0.
        async def drain():
            c = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused")
            try:
                task = asyncio.create_task(c.completions.create(
                    model="", prompt="Count from one to fifty:", max_tokens=48, temperature=0.0,
                    extra_body={"ignore_eos": True}))
                await asyncio.sleep(0.5)
                os.killpg(server.pid, signal.SIGTERM)
                return await task
            finally:
                await c.close()

        done = asyncio.run(drain())
        assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 48
        assert server.proc.wait(60) == 0
        assert _gone(children), f"left behind: {[p for p in children if p.is_running()]}"
    finally:
        server.stop()


def test_killing_one_api_server_stops_the_whole_server():
    require_smollm2()
    server = ServerProcess(["--distributed-executor-backend", "noop", "--num-kv-blocks", "256",
                            "--max-model-len", "256", "--api-server-count", "2"],
                           api_key=None).start()
    try:
        victim = _wait_api_servers(server, 2)[0]
        children = _children(server.pid)
        start = time.monotonic()
        victim.kill()
        assert server.proc.wait(60) == 1
        log = server.log_tail(80)
        assert re.search(r"APIServer-\d \(pid \d+\) exited with code -9", log), log
        assert time.monotonic() - start < 30
        assert _gone(children), f"left behind: {[p for p in children if p.is_running()]}"
    finally:
        server.stop()
