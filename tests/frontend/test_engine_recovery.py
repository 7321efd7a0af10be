"""One standalone ``engine-core`` and two ``tidal serve --engine-address`` frontends, through the
faults an engine meets in production:

* frozen (SIGSTOP, as a long GC or compile looks from outside), for longer than the frontends'
  heartbeat timeout and than the 10 s after which a paused engine used to drop its frontends:
  ``/health`` answers 503 ``engine_stalled`` while requests wait, nothing is failed or
  reconnected, and after SIGCONT the streams in flight complete with their whole outputs and
  ``/health`` is 200 again;
* killed (``kill -9``): both frontends stay up; a stream in flight ends with an error event
  (then ``[DONE]``), a non-streamed request gets a 503, ``/health`` and new requests answer
  503 ``engine_unavailable``; an engine-core started again at the same address is found (a new
  handshake) and both frontends serve as before, with the same outputs.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil
import pytest

from server_harness import SMALL_ENGINE, ServerProcess, free_port, require_smollm2

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
STALL_TIMEOUT_S = 2.0
# Longer than the frontends' heartbeat timeout (3 s) and than the 10 s after which ZMTP
# heartbeats used to drop every connection of an engine that had been paused.
FROZEN_S = 11.0
PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
FROZEN_TOKENS = 24  # enough that every stream is still open when the engine is stopped


class EngineCore:
    """An ``engine-core`` process at a fixed address (so that another can take its place)."""

    def __init__(self, address: str, log_path: Path) -> None:
        self.address = address
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> EngineCore:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tidal.engine_core.cli", "--listen", self.address,
                 *SMALL_ENGINE], stdout=log, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + timeout
        while b"EngineCore serving at" not in self.log_path.read_bytes():
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"engine-core did not start:\n{self.log()}"
            time.sleep(0.2)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass(slots=True)
class Cluster:
    engine: EngineCore
    frontends: list[ServerProcess]
    tmp: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require_smollm2()
    tmp = tmp_path_factory.mktemp("engine-recovery")
    engine = EngineCore(f"tcp://127.0.0.1:{free_port()}", tmp / "engine-1.log").start()
    frontends = [ServerProcess(["--engine-address", engine.address, "--engine-stall-timeout",
                                str(STALL_TIMEOUT_S)], api_key=None) for _ in range(2)]
    errors: list[BaseException] = []

    def start(server: ServerProcess) -> None:
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(f,)) for f in frontends]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = Cluster(engine, frontends, tmp)
    try:
        if errors:
            raise errors[0]
        yield state
    finally:
        for f in frontends:
            f.stop()
        state.engine.stop()


async def _health(session: aiohttp.ClientSession, server: ServerProcess) -> tuple[int, str | None]:
    async with session.get(server.url + "/health") as resp:
        if resp.status == 200:
            return 200, None
        body = await resp.json()
        assert set(body) == {"error"} and body["error"]["type"] == "service_unavailable_error"
        return resp.status, body["error"]["code"]


async def _wait_health(session: aiohttp.ClientSession, servers: list[ServerProcess],
                       want: tuple[int, str | None], timeout: float) -> float:
    """Seconds until every server's ``/health`` answers ``want``."""
    start = time.monotonic()
    while True:
        got = [await _health(session, s) for s in servers]
        if all(g == want for g in got):
            return time.monotonic() - start
        assert time.monotonic() - start < timeout, f"/health: {got}, waiting for {want}"
        await asyncio.sleep(0.1)


def _client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0)


async def _complete(server: ServerProcess, prompt: str, max_tokens: int) -> tuple[str, str]:
    async with _client(server) as c:
        out = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                         temperature=0, extra_body={"ignore_eos": True})
    return out.choices[0].text, out.choices[0].finish_reason


def test_frozen_engine_is_stalled_not_dead(cluster):
    servers = cluster.frontends
    engine = psutil.Process(cluster.engine.pid)
    pairs = [(servers[i % 2], p) for i, p in enumerate(PROMPTS)]

    async def stream(server: ServerProcess, prompt: str, first: asyncio.Event
                     ) -> tuple[str, str]:
        text, finish = [], None
        async with _client(server) as c:
            chunks = await c.completions.create(model=MODEL, prompt=prompt,
                                                max_tokens=FROZEN_TOKENS, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
            async for chunk in chunks:
                text.append(chunk.choices[0].text)
                finish = chunk.choices[0].finish_reason or finish
                first.set()
        return "".join(text), finish

    async def main():
        # The twins, at the same time (the same batches as the streams below).
        want = await asyncio.gather(*(_complete(s, p, FROZEN_TOKENS) for s, p in pairs))
        async with aiohttp.ClientSession() as session:
            await _wait_health(session, servers, (200, None), 5)
            firsts = [asyncio.Event() for _ in pairs]
            tasks = [asyncio.create_task(stream(s, p, e)) for (s, p), e in zip(pairs, firsts)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 60)
            engine.suspend()
            stopped = time.monotonic()
            try:
                noticed = await _wait_health(session, servers, (503, "engine_stalled"),
                                             STALL_TIMEOUT_S + 5)
                await asyncio.sleep(FROZEN_S - (time.monotonic() - stopped))
                # Still stalled, not lost: nothing waited on longer than the heartbeat
                # timeout has been given up.
                assert [await _health(session, s) for s in servers] == \
                    [(503, "engine_stalled")] * 2
                assert not any(t.done() for t in tasks)
            finally:
                engine.resume()
            got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            recovered = await _wait_health(session, servers, (200, None), 10)
        return want, got, noticed, recovered

    want, got, noticed, recovered = asyncio.run(main())
    print(f"/health said engine_stalled {noticed:.1f} s after SIGSTOP "
          f"(timeout {STALL_TIMEOUT_S} s); 200 again {recovered:.1f} s after the streams ended")
    assert got == want and all(f == "length" for _, f in got), (got, want)
    assert all(s.proc is not None and s.proc.poll() is None for s in servers)
    assert cluster.engine.proc is not None and cluster.engine.proc.poll() is None
    engine_log = cluster.engine.log()
    assert "left (" not in engine_log, engine_log  # no frontend was dropped
    assert "the EngineCore was paused for" in engine_log
    for s in servers:
        log = s.log_tail(200)
        assert "the engine is stalled" in log and "reconnect" not in log, log


async def _stream_lines(session: aiohttp.ClientSession, server: ServerProcess, prompt: str,
                        first: asyncio.Event) -> tuple[int, list[str]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    async with session.post(server.url + "/v1/completions", json=body) as resp:
        lines = []
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                lines.append(line[len("data: "):])
                first.set()
        return resp.status, lines


async def _post(session: aiohttp.ClientSession, server: ServerProcess, body: dict
                ) -> tuple[int, dict]:
    async with session.post(server.url + "/v1/completions", json=body) as resp:
        return resp.status, await resp.json()


def test_killed_engine_core_is_waited_for_and_reconnected(cluster):
    servers = cluster.frontends

    async def main():
        want = [await _complete(s, PROMPTS[0], 8) for s in servers]
        async with aiohttp.ClientSession() as session:
            first = asyncio.Event()
            streamed = asyncio.create_task(_stream_lines(session, servers[0], PROMPTS[1], first))
            whole = asyncio.create_task(_post(session, servers[1], {
                "model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True}))
            await asyncio.wait_for(first.wait(), 60)
            await asyncio.sleep(0.5)  # the non-streamed request is in the engine too
            assert not whole.done()
            os.kill(cluster.engine.pid, signal.SIGKILL)
            killed = time.monotonic()
            (status, lines), (whole_status, whole_body) = await asyncio.wait_for(
                asyncio.gather(streamed, whole), 60)
            failed = time.monotonic() - killed
            health = [await _health(session, s) for s in servers]
            new_whole = [await _post(session, s, {"model": MODEL, "prompt": "Hi",
                                                  "max_tokens": 4}) for s in servers]
            new_stream = await _post(session, servers[0], {"model": MODEL, "prompt": "Hi",
                                                           "max_tokens": 4, "stream": True})
            alive = [s.proc is not None and s.proc.poll() is None for s in servers]

            cluster.engine.proc.wait(10)
            cluster.engine = EngineCore(cluster.engine.address,
                                        cluster.tmp / "engine-2.log").start()
            restarted = time.monotonic()
            await _wait_health(session, servers, (200, None), 60)
            back = time.monotonic() - restarted
            again = [await _complete(s, PROMPTS[0], 8) for s in servers]
        return (want, status, lines, whole_status, whole_body, failed, health, new_whole,
                new_stream, alive, back, again)

    (want, status, lines, whole_status, whole_body, failed, health, new_whole, new_stream, alive,
     back, again) = asyncio.run(main())
    print(f"in-flight requests failed {failed:.1f} s after kill -9 of the engine-core; both "
          f"frontends served again {back:.1f} s after a new one started")
    assert alive == [True, True]
    # The stream: tokens, then the error event, then [DONE] (the stream had begun: 200).
    assert status == 200 and lines[-1] == "[DONE]" and len(lines) >= 3
    error = json.loads(lines[-2])["error"]
    assert error["code"] == "engine_unavailable" and error["type"] == "service_unavailable_error"
    assert whole_status == 503 and whole_body["error"]["code"] == "engine_unavailable"
    assert failed < 10
    assert health == [(503, "engine_unavailable")] * 2
    for code, body in [*new_whole, new_stream]:
        assert code == 503 and body["error"]["code"] == "engine_unavailable", body
    assert again == want and all(f == "length" for _, f in again)
    for s in servers:
        assert s.proc is not None and s.proc.poll() is None
        log = s.log_tail(200)
        assert "reconnected to the EngineCore at" in log, log
