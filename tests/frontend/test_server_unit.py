"""The server's edges against a scripted fake engine (no model, milliseconds): errors after a
stream began, engine failures and unexpected exceptions (nothing internal leaks), client
disconnects, the drain-timeout abort, a dead engine, and the waiting-queue estimate."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tidal.engine_core.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    RunnerConfig,
    SchedulerConfig,
)
from tidal.engine_core.model_arch import ArchSpec
from tidal.frontend.async_llm import EngineDeadError, EngineUnavailableError
from tidal.frontend.output_processor import OutputCollector
from tidal.frontend.outputs import CompletionOutput, RequestOutput
from tidal.frontend.server.admission import Admission, AdmissionBoard
from tidal.frontend.server.app import _drain, _watch_engine, build_app, create_state
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.state import ServerSettings


def _config(max_num_seqs: int = 2) -> EngineConfig:
    arch = ArchSpec(architecture="LlamaForCausalLM", family="llama", hidden_size=8,
                    intermediate_size=16, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
                    vocab_size=128, max_position_embeddings=64)
    return EngineConfig(
        model=ModelConfig(path="fake", format="hf", load_format="dummy", tokenizer="fake",
                          served_model_name="fake", dtype="float32", arch=arch,
                          max_model_len=64),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
        parallel=ParallelConfig(),
        runner=RunnerConfig(device="cpu"),
    )


class FakeTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "explode" in text:
            raise RuntimeError("tokenizer crashed in /work/main/secret/file.py")
        return [ord(c) % 128 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def __len__(self) -> int:
        return 128


class _Ready:
    """A scripted output, handed over the way the output processor hands a request state."""

    def __init__(self, out: RequestOutput) -> None:
        self.out = out

    def take_output(self) -> RequestOutput:
        return self.out


class FakeEngine:
    """Scripted by the prompt: "fail" fails after one output, "hang" never finishes, anything
    else yields three one-character outputs."""

    def __init__(self) -> None:
        self.config = _config()
        self.cancelled: list[str] = []
        self.abort_observers: list[Any] = []  # told (engine 0, n) of what is aborted
        self.started = asyncio.Event()
        self.is_dead = False
        self.unavailable = False  # a standalone engine-core gone for now
        self.stalled_s = 0.0  # what seconds_without_progress says
        self.dead_error: BaseException | None = None
        self._tok = FakeTokenizer()
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def get_tokenizer(self) -> Any:
        return self._tok

    def add_stat_observer(self, fn: Any) -> None:
        pass

    def add_abort_observer(self, fn: Any) -> None:
        self.abort_observers.append(fn)

    async def check_health(self) -> None:
        if self.is_dead:
            raise EngineDeadError("gone")
        if self.unavailable:
            raise EngineUnavailableError("gone for now")

    def seconds_without_progress(self) -> float:
        return self.stalled_s

    async def tokenize(self, text: str) -> list[int]:
        return self._tok.encode(text)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool = True,
                                  chat_template: str | None = None,
                                  continue_final_message: bool = False) -> list[int]:
        return self._tok.encode(" ".join(m["content"] for m in messages))

    async def add_request(self, request_id: str, ids: list[int], params: Any, *,
                          collector: OutputCollector, **kw: Any) -> OutputCollector:
        await self.check_health()
        self._tasks[request_id] = asyncio.create_task(self._script(request_id, ids, collector))
        return collector

    async def _script(self, request_id: str, ids: list[int], collector: OutputCollector) -> None:
        text = self._tok.decode(ids)
        for i in range(3):
            self.started.set()
            if "hang" in text and i == 1:
                await asyncio.sleep(3600)
            if "fail" in text and i == 1:
                out = CompletionOutput(index=0, text="", token_ids=[], finish_reason="error",
                                       error="sampling failed in /work/main/worker/sampler.py")
                collector.notify(_Ready(RequestOutput(request_id, None, ids, [out], True)))
                return
            done = i == 2
            collector.notify(_Ready(RequestOutput(request_id, None, ids, [CompletionOutput(
                index=0, text="x", token_ids=[5], finish_reason="length" if done else None)],
                finished=done)))
            await asyncio.sleep(0)

    def abort_quietly(self, request_ids: list[str]) -> None:
        n = 0
        for rid in request_ids:
            task = self._tasks.pop(rid, None)
            if task is not None and not task.done():
                task.cancel()
                self.cancelled.append(rid)
                n += 1
        for fn in self.abort_observers if n else ():
            fn(0, n)  # as AsyncLLM does (one engine)

    def shutdown(self) -> None:
        pass


def _serve(engine: FakeEngine, **settings: Any):
    state = create_state(engine, ServerSettings(**settings))  # type: ignore[arg-type]
    server = TestServer(build_app(state), handler_cancellation=True)
    return state, TestClient(server)


def _run(coro):
    return asyncio.run(coro)


def _sse(body: str) -> list[str]:
    return [line[6:] for line in body.splitlines() if line.startswith("data: ")]


def test_error_after_stream_began_is_an_sse_chunk():
    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            resp = await client.post("/v1/completions", json={"prompt": "fail", "stream": True})
            return resp.status, await resp.text()

    status, body = _run(go())
    events = _sse(body)
    assert status == 200
    assert json.loads(events[0])["choices"][0]["text"] == "x"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_failed" and error["type"] == "server_error"
    assert "/work/" not in error["message"] and "<path>" in error["message"]
    assert events[-1] == "[DONE]"


def test_engine_failure_and_unexpected_errors_leak_nothing():
    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            failed = await client.post("/v1/completions", json={"prompt": "fail"})
            crashed = await client.post("/v1/completions", json={"prompt": "explode"})
            return (failed.status, await failed.json()), (crashed.status, await crashed.json())

    (s1, failed), (s2, crashed) = _run(go())
    assert s1 == 500 and "/work/" not in failed["error"]["message"]
    assert s2 == 500 and crashed["error"]["code"] == "internal_error"
    assert "tokenizer" not in crashed["error"]["message"]
    assert "secret" not in json.dumps(crashed)


def test_client_disconnect_cancels_the_request():
    engine = FakeEngine()

    async def go():
        state, client = _serve(engine)
        async with client:
            task = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hang"}))
            await asyncio.wait_for(engine.started.wait(), 5)
            await asyncio.sleep(0.05)
            task.cancel()  # the client hangs up
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if engine.cancelled:
                    break
                await asyncio.sleep(0.02)
            return state.admission.num_in_flight

    in_flight = _run(go())
    assert len(engine.cancelled) == 1
    assert in_flight == 0


def test_drain_timeout_aborts_open_streams():
    engine = FakeEngine()

    async def go():
        state, client = _serve(engine)
        async with client:
            async def stream():
                resp = await client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hang"}], "stream": True})
                return await resp.text()

            task = asyncio.create_task(stream())
            await asyncio.wait_for(engine.started.wait(), 5)
            state.admission.draining = True
            health = await client.get("/health")
            refused = await client.post("/v1/completions", json={"prompt": "hi"})
            await _drain(state, 0.1, asyncio.Event())
            return health.status, refused.status, await refused.json(), await task

    health, refused, body, text = _run(go())
    assert health == 503 and refused == 503
    assert body["error"]["code"] == "server_draining"
    events = _sse(text)
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    assert events[-1] == "[DONE]"


def test_dead_engine_answers_503():
    engine = FakeEngine()
    engine.is_dead = True

    async def go():
        state, client = _serve(engine)
        async with client:
            health = await client.get("/health")
            resp = await client.post("/v1/completions", json={"prompt": "hi"})
            return health.status, resp.status, await resp.json()

    health, status, body = _run(go())
    assert health == 503 and status == 503 and body["error"]["code"] == "engine_dead"


def test_stalled_or_unreachable_engine_answers_503_until_it_is_back():
    """A stall turns /health to 503 engine_stalled, requests are still taken; an engine-core
    that is gone for now answers 503 engine_unavailable to /health and to new requests (a
    stream too: before its 200) without stopping the server; both clear once the engine is
    back."""
    engine = FakeEngine()

    async def go():
        state, client = _serve(engine, engine_stall_timeout=2.0)
        stop = asyncio.Event()
        watchdog = asyncio.create_task(_watch_engine(state, stop))

        async def health() -> tuple[int, str | None]:
            resp = await client.get("/health")
            return resp.status, None if resp.status == 200 else (await resp.json())["error"]["code"]

        async def post(**body: Any) -> tuple[int, str]:
            resp = await client.post("/v1/completions", json={"prompt": "hi", **body})
            return resp.status, await resp.text()

        async with client:
            seen = [await health()]
            engine.stalled_s = 2.5
            seen += [await health(), await post()]
            engine.stalled_s = 0.0
            seen.append(await health())
            engine.unavailable = True
            await asyncio.sleep(0.7)  # the watchdog polls every 0.5 s
            seen += [await health(), await post(), await post(stream=True)]
            engine.unavailable = False
            seen += [await health(), await post()]
            await asyncio.sleep(0.7)
        watchdog.cancel()
        return seen, stop.is_set(), state.admission.engine_dead

    seen, stopped, dead = _run(go())
    assert seen[0] == (200, None)
    assert seen[1] == (503, "engine_stalled") and seen[2][0] == 200  # stalled, still served
    assert seen[3] == (200, None)
    assert seen[4] == (503, "engine_unavailable")
    for status, body in seen[5:7]:
        assert status == 503 and json.loads(body)["error"]["code"] == "engine_unavailable"
    assert seen[7] == (200, None) and seen[8][0] == 200
    assert not stopped and not dead


def test_unknown_fields_are_ignored():
    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            resp = await client.post("/v1/completions", json={
                "prompt": "hi", "some_future_field": {"x": 1}, "service_tier": "auto"})
            return resp.status, await resp.json()

    status, body = _run(go())
    assert status == 200 and body["choices"][0]["text"] == "xxx"


def test_waiting_estimate_and_429():
    adm = Admission(max_num_seqs=2, max_queued=1)
    a = adm.admit(1)
    b = adm.admit(1)
    assert adm.waiting_estimate() == 0  # two slots, two requests: none waits
    c = adm.admit(1)  # the estimate is 0; one more fits in a queue of 1
    assert adm.waiting_estimate() == 1
    with pytest.raises(APIError) as err:
        adm.admit(1)
    assert err.value.status == 429 and err.value.code == "queue_full"
    adm.started(a, 1)
    adm.started(b, 1)
    assert adm.waiting_estimate() == 1  # a and b run; c waits
    adm.engine_waiting = 3
    assert adm.waiting_estimate() == 3  # the engine knows better
    for t in (a, b, c):
        adm.release(t)
    assert adm.num_in_flight == 0 and adm.waiting_estimate() == 0
    adm.admit(5)  # a lone request is never refused


def test_the_queue_bound_holds_across_api_server_processes():
    """Two API servers (two Admissions on one shared board) refuse as one server would: each
    counts what the other has admitted."""
    import multiprocessing

    memory = AdmissionBoard.allocate(2, multiprocessing.get_context("spawn"))
    a = Admission(max_num_seqs=1, max_queued=1, board=AdmissionBoard.attach(memory, 0))
    b = Admission(max_num_seqs=1, max_queued=1, board=AdmissionBoard.attach(memory, 1))
    first = a.admit(1)  # runs
    second = b.admit(1)  # waits (one slot): the queue holds one
    assert a.waiting_estimate() == b.waiting_estimate() == 1
    with pytest.raises(APIError) as err:
        a.admit(1)
    assert err.value.status == 429
    b.engine_waiting = 5  # the engine's report, seen by both
    assert a.waiting_estimate() == 5
    b.engine_waiting = 0
    a.release(first)
    b.started(second, 1)
    assert b.waiting_estimate() == 0
    b.release(second)
    assert AdmissionBoard.attach(memory, 0).totals() == (0, 0)


def test_drain_abort_ends_a_stream_whose_consumer_is_behind():
    """The engine keeps producing and the consumer reads slower than it: the abort must still
    end the stream (and stop the request in the engine), not wait behind the news."""
    from tidal.frontend.server.generation import Generation

    engine = FakeEngine()

    async def endless(request_id: str, ids: list[int], collector: OutputCollector) -> None:
        while True:
            collector.notify(_Ready(RequestOutput(request_id, None, ids, [CompletionOutput(
                index=0, text="x", token_ids=[5])])))
            await asyncio.sleep(0.001)

    engine._script = endless  # type: ignore[method-assign]

    async def go():
        adm = Admission(max_num_seqs=4, max_queued=None)
        gen = Generation(engine, adm, adm.admit(1), "cmpl-x", [[1, 2]], None)  # type: ignore
        reads = 0
        async for _ in gen.stream():
            reads += 1
            if reads == 3:
                gen.abort()
            await asyncio.sleep(0.01)  # behind: several notifications per read
            assert reads < 10, "the abort did not end the stream"
        return reads, gen.aborted

    reads, aborted = _run(asyncio.wait_for(go(), 10))
    assert aborted and reads <= 4
    assert engine.cancelled == ["cmpl-x-0"]
