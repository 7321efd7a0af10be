"""The server under load and at its edges: 200 concurrent streams, clients that disconnect
(their KV blocks are freed, seen in /metrics), and SIGTERM draining and aborting."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp
import openai
import psutil
import pytest

from server_harness import (
    API_KEY,
    SMALL_ENGINE,
    ServerProcess,
    free_port,
    generation_server,
    require_smollm2,
)

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def run(coro):
    return asyncio.run(coro)


async def _metrics(session: aiohttp.ClientSession, server) -> dict[str, float]:
    async with session.get(server.url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("tidal:"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            if "finished_reason" in name:
                key += ":" + name.split('finished_reason="')[1].split('"')[0]
            out[key] = float(value)
    return out


async def _stream(session: aiohttp.ClientSession, server, body: dict) -> tuple[list[dict], bool]:
    """POST a streaming completion; returns the parsed chunks and whether [DONE] came."""
    chunks, done = [], False
    async with session.post(server.url + "/v1/completions", headers=HEADERS,
                            data=json.dumps({"model": MODEL, "stream": True, **body})) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunks.append(json.loads(line[6:]))
    return chunks, done


def test_200_concurrent_streams():
    server = generation_server()

    async def go():
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                                      timeout=300) as c:
            async def one(i: int):
                stream = await c.completions.create(
                    # Unseeded: per-request seeds cost a CPU-side noise draw over the whole
                    # vocabulary for each of 200 rows a step (seeds have tests of their own).
                    model=MODEL, prompt=f"Hi {i}", max_tokens=4,
                    temperature=0.5, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True})
                text, finish, usage = "", None, None
                async for chunk in stream:
                    for ch in chunk.choices:
                        text += ch.text
                        finish = ch.finish_reason or finish
                    usage = chunk.usage or usage
                return text, finish, usage

            return await asyncio.gather(*[one(i) for i in range(200)])

    start = time.perf_counter()
    results = run(go())
    elapsed = time.perf_counter() - start
    assert len(results) == 200
    for text, finish, usage in results:
        assert finish == "length"
        assert usage.completion_tokens == 4
    assert elapsed < 240
    assert server.health() == 200


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "non-stream"])
def test_disconnect_frees_kv(streaming):
    """A client that goes away mid-request is aborted in the engine at once: the next request's
    step reports no running request and an empty KV cache."""
    server = generation_server()

    async def go():
        async with aiohttp.ClientSession() as s:
            before = await _metrics(s, server)
            body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 600,
                    "ignore_eos": True, "stream": streaming}
            if streaming:
                async with s.post(server.url + "/v1/completions", headers=HEADERS,
                                  data=json.dumps(body)) as resp:
                    seen = 0
                    async for raw in resp.content:
                        if raw.startswith(b"data: {"):
                            seen += 1
                            if seen == 3:
                                break
                    resp.close()  # hang up mid-stream
            else:
                try:
                    async with s.post(server.url + "/v1/completions", headers=HEADERS,
                                      data=json.dumps(body),
                                      timeout=aiohttp.ClientTimeout(total=1.5)) as resp:
                        await resp.read()
                    pytest.fail("a 600-token completion finished within 1.5 s")
                except TimeoutError:
                    pass  # the client gave up and closed the connection
        gone_at = time.perf_counter()
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", headers=HEADERS,
                              data=json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2,
                                               "temperature": 0})) as resp:
                assert resp.status == 200
                await resp.read()
            after = await _metrics(s, server)
        return before, after, time.perf_counter() - gone_at

    before, after, elapsed = run(go())
    assert after["tidal:num_requests_running"] == 0
    assert after["tidal:kv_cache_usage_perc"] == 0.0
    aborted = after["tidal:request_success_total:abort"] - before.get(
        "tidal:request_success_total:abort", 0.0)
    assert aborted == 1
    assert elapsed < 10


def _children(pid: int) -> list[tuple[psutil.Process, str]]:
    """The server's descendants with their command lines, read now: a process in the middle
    of exiting has already lost its command line, so it cannot be told apart later."""
    out = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            out.append((p, " ".join(p.cmdline())))
        except psutil.NoSuchProcess:
            pass
    return out


def _assert_none_left(children: list[tuple[psutil.Process, str]]) -> None:
    """Every child of the exited server is gone. The one exception allowed a moment's grace is
    multiprocessing's resource tracker: it exits by itself once the server's end of its pipe
    closes, i.e. just after the server does; the engine and its workers must already be gone."""
    def alive(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    lingering = [(p, cmd) for p, cmd in children if alive(p)]
    assert all("resource_tracker" in cmd for _, cmd in lingering), \
        [f"{p.pid} {cmd[:300]}" for p, cmd in lingering]
    _, still = psutil.wait_procs([p for p, _ in lingering], timeout=10)
    assert not [p for p in still if alive(p)], still


def test_sigterm_drains_in_flight_requests():
    require_smollm2()
    server = ServerProcess(SMALL_ENGINE + ["--shutdown-timeout", "60"]).start()
    try:
        children = _children(server.pid)

        async def go():
            async with aiohttp.ClientSession() as s:
                # (Long enough to be under way still 1.3 s in on a fast machine: 16 tokens
                # were done by then once, and the server, drained, had closed its socket.)
                body = {"prompt": "Count slowly:", "max_tokens": 96, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                tasks = [asyncio.create_task(_stream(s, server, body)) for _ in range(6)]
                await asyncio.sleep(1.0)  # streams are under way
                server.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                async with s.get(server.url + "/health") as resp:
                    health = resp.status
                async with s.post(server.url + "/v1/completions", headers=HEADERS,
                                  data=json.dumps({"model": MODEL, "prompt": "Hi",
                                                   "max_tokens": 2})) as resp:
                    refused = resp.status, await resp.json()
                return health, refused, await asyncio.gather(*tasks)

        health, refused, streams = run(go())
        assert health == 503
        assert refused[0] == 503 and refused[1]["error"]["code"] == "server_draining"
        for chunks, done in streams:
            assert done
            finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
            assert finishes[-1] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == 96
        assert server.proc.wait(60) == 0
        _assert_none_left(children)
    finally:
        server.stop()


def test_sigterm_aborts_what_outlives_the_timeout():
    require_smollm2()
    server = ServerProcess(SMALL_ENGINE + ["--shutdown-timeout", "1"]).start()
    try:
        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"prompt": "Tell me everything:", "max_tokens": 500, "ignore_eos": True}
                tasks = [asyncio.create_task(_stream(s, server, body)) for _ in range(3)]
                await asyncio.sleep(1.0)
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        start = time.perf_counter()
        streams = run(go())
        for chunks, done in streams:
            assert done
            assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
            assert 0 < sum(len(c["choices"][0]["text"]) > 0 for c in chunks) < 500
        assert server.proc.wait(30) == 0
        assert time.perf_counter() - start < 30
    finally:
        server.stop()


def test_engine_death_fails_requests_and_exits_nonzero():
    """Kill the EngineCore process mid-stream: the stream ends with an error chunk and [DONE],
    the server exits 1 and leaves no process behind."""
    require_smollm2()
    server = ServerProcess(SMALL_ENGINE).start()
    try:
        children = _children(server.pid)
        engines = [p for p, cmd in children if "spawn_main" in cmd]
        if not engines:
            pytest.skip("this build runs the engine in the server's own process")

        async def go():
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "prompt": "Count:", "max_tokens": 300,
                        "ignore_eos": True, "stream": True}
                async with s.post(server.url + "/v1/completions", headers=HEADERS,
                                  data=json.dumps(body)) as resp:
                    lines = []
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            if len(lines) == 2:
                                for p in engines:
                                    p.kill()
                    return lines

        lines = run(go())
        assert lines[-1] == "[DONE]"
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "engine_dead" and error["type"] == "service_unavailable_error"
        assert server.proc.wait(30) == 1
        time.sleep(0.5)
        _assert_none_left(children)
    finally:
        server.stop()


def test_serve_from_engine_address(tmp_path):
    """``tidal serve --engine-address`` serves from a running ``engine-core``; stopping the
    server leaves the shared engine running."""
    require_smollm2()
    address = f"tcp://127.0.0.1:{free_port()}"
    log = open(tmp_path / "engine.log", "wb")
    engine = subprocess.Popen([sys.executable, "-m", "tidal.engine_core.cli", "--listen", address,
                               *SMALL_ENGINE], stdout=log, stderr=subprocess.STDOUT)
    server = None
    try:
        deadline = time.monotonic() + 120
        while b"serving at" not in (tmp_path / "engine.log").read_bytes():
            assert engine.poll() is None, (tmp_path / "engine.log").read_text()
            assert time.monotonic() < deadline, "engine-core did not start"
            time.sleep(0.25)
        # A frontend whose reasoning parser is not the engine's would split replies at another
        # end of thinking than the engine's grammars wait for: it refuses to start.
        with pytest.raises(RuntimeError, match="give both the same one"):
            ServerProcess(["--engine-address", address, "--reasoning-parser", "qwen3"]).start()
        server = ServerProcess(["--engine-address", address]).start()

        async def go():
            async with openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY,
                                          max_retries=0) as c:
                return await c.completions.create(model=MODEL, prompt="The capital of France is",
                                                  max_tokens=4, temperature=0)

        out = run(go())
        assert out.choices[0].text.strip() and out.usage.completion_tokens == 4
        assert server.stop() == 0
        assert engine.poll() is None  # the engine outlives its frontend
    finally:
        if server is not None:
            server.stop()
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(30)
        except subprocess.TimeoutExpired:
            engine.kill()
        log.close()
