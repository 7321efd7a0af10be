"""Grammar checks off the event loop (``frontend/server/grammar_checks.py``): which requests
carry a grammar, that their parsing runs on a worker thread (the others' stays on the loop), and
that a slow compile leaves the server answering other requests meanwhile, with its own answer
still right and the next request with the same schema not compiled again."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from types import SimpleNamespace
from typing import Any

from test_server_unit import FakeEngine, _run, _serve

from tidal.engine_core.structured_output import spec
from tidal.frontend.server import grammar_checks
from tidal.frontend.server.grammar_checks import carries_grammar, parse_checked


def _req(**kw: Any) -> SimpleNamespace:
    fields = dict(response_format=None, structured_outputs=None, guided_json=None,
                  guided_regex=None, guided_choice=None, guided_grammar=None, tools=None,
                  tool_choice=None)
    fields.update(kw)
    return SimpleNamespace(**fields)


def _tool(strict: bool | None = None) -> SimpleNamespace:
    return SimpleNamespace(function=SimpleNamespace(name="f", strict=strict, parameters={}))


class _SlowCompiles:
    """``spec._validate`` made slow (it sleeps without the GIL, as llguidance compiles) for the
    specs whose text holds ``match`` (every spec: ""); records the specs compiled and the most
    compiles running at once."""

    def __init__(self, monkeypatch, seconds: float, match: str = "") -> None:
        self.seconds, self.match = seconds, match
        self.compiled: list[str] = []
        self.running = self.most = 0
        self._lock = threading.Lock()
        self._real = spec._validate
        monkeypatch.setattr(spec, "_validate", self)

    def __call__(self, params, backend) -> None:
        text = params.json or params.regex or ""
        with self._lock:
            self.compiled.append(text)
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            if self.match in text:
                time.sleep(self.seconds)
        finally:
            with self._lock:
                self.running -= 1
        self._real(params, backend)


def test_which_requests_carry_a_grammar():
    assert not carries_grammar(_req())
    assert not carries_grammar(_req(response_format={"type": "text"}))
    assert carries_grammar(_req(response_format={"type": "json_object"}))
    assert carries_grammar(_req(guided_regex="a+"))
    assert carries_grammar(_req(structured_outputs={"choice": ["a"]}))
    # Tools: only where a grammar holds the calls to their schemas.
    assert not carries_grammar(_req(tools=[_tool()], tool_choice="auto"))
    assert not carries_grammar(_req(tools=[_tool()]))
    assert carries_grammar(_req(tools=[_tool()], tool_choice="required"))
    assert carries_grammar(_req(tools=[_tool()], tool_choice={"type": "function",
                                                              "function": {"name": "f"}}))
    assert carries_grammar(_req(tools=[_tool(), _tool(True)], tool_choice="auto"))
    assert not carries_grammar(_req(tools=[_tool(True)], tool_choice="none"))
    # A completions request has no tools field at all.
    plain = _req()
    del plain.tools, plain.tool_choice
    assert not carries_grammar(plain)


def test_parsing_with_a_grammar_runs_on_a_worker_thread():
    def where(fail: bool = False) -> str:
        if fail:
            raise ValueError("bad field")
        return threading.current_thread().name

    async def go():
        loop_thread = threading.current_thread().name
        inline = await parse_checked(_req(), where)
        off = await parse_checked(_req(guided_regex="a"), where)
        try:
            await parse_checked(_req(guided_regex="a"), where, fail=True)
        except ValueError as exc:
            raised = str(exc)
        return loop_thread, inline, off, raised

    loop_thread, inline, off, raised = _run(go())
    assert inline == loop_thread
    assert off.startswith("tidal-grammar-check")
    assert raised == "bad field"  # the parser's 400s come back as raised


def test_a_slow_compile_does_not_stall_other_requests(monkeypatch):
    """A schema whose compile takes 0.8 s (the backend's check made slow; it sleeps without the
    GIL, as llguidance compiles): a plain request sent after it is answered first, the slow
    one still gets its 200, and the same schema again is not compiled a second time."""
    compiles = _SlowCompiles(monkeypatch, 0.8, match="slow_")
    # Unique per run: the verdicts are kept for the process.
    schema = {"type": "object", "properties": {f"slow_{uuid.uuid4().hex}": {"type": "integer"}}}

    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            async def post(body: dict[str, Any]) -> tuple[int, float]:
                resp = await client.post("/v1/completions", json=body)
                await resp.read()
                return resp.status, time.perf_counter()

            start = time.perf_counter()
            slow_task = asyncio.create_task(post({"prompt": "hi", "guided_json": schema}))
            await asyncio.sleep(0.1)  # the slow one is compiling
            plain_status, plain_done = await post({"prompt": "hello"})
            slow_status, slow_done = await slow_task
            again = time.perf_counter()
            again_status, again_done = await post({"prompt": "hi", "guided_json": schema})
            return (start, plain_status, plain_done, slow_status, slow_done, again,
                    again_status, again_done)

    start, plain_status, plain_done, slow_status, slow_done, again, again_status, again_done = \
        _run(go())
    assert plain_status == slow_status == again_status == 200
    assert plain_done < slow_done
    assert plain_done - start < 0.6, "the plain request waited for the slow compile"
    assert slow_done - start >= 0.8
    assert again_done - again < 0.6
    assert len([c for c in compiles.compiled if "slow_" in c]) == 1, compiles.compiled


def test_a_bad_schema_is_still_a_400_naming_the_field():
    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            resp = await client.post("/v1/completions", json={
                "prompt": "hi", "guided_regex": f"(unclosed{uuid.uuid4().hex}"})
            return resp.status, await resp.json()

    status, body = _run(go())
    assert status == 400
    assert body["error"]["param"] == "guided_regex"


def test_a_burst_compiles_on_at_most_the_pool_threads(monkeypatch):
    """Eight requests with distinct slow schemas at once: they compile side by side, at most
    ``CHECK_THREADS`` at a time (a burst cannot start a thread per request), and all of them
    are answered."""
    compiles = _SlowCompiles(monkeypatch, 0.15)
    tag = uuid.uuid4().hex

    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            async def post(i: int) -> int:
                resp = await client.post("/v1/completions", json={
                    "prompt": "hi", "guided_json": {"type": "object", "properties": {
                        f"burst_{tag}_{i}": {"type": "integer"}}}})
                await resp.read()
                return resp.status

            return await asyncio.gather(*(post(i) for i in range(8)))

    assert _run(go()) == [200] * 8
    assert 2 <= compiles.most <= grammar_checks.CHECK_THREADS


def test_too_many_pending_checks_are_a_429(monkeypatch):
    """Past ``MAX_PENDING_CHECKS`` requests with grammars being checked (queued or compiling),
    a new one is a 429 (queue_full, Retry-After), not one more queued compile; those already
    taken are answered, and the count goes back down."""
    monkeypatch.setattr(grammar_checks, "MAX_PENDING_CHECKS", 2)
    _SlowCompiles(monkeypatch, 0.3)
    tag = uuid.uuid4().hex

    async def go():
        state, client = _serve(FakeEngine())
        async with client:
            async def post(i: int) -> tuple[int, dict[str, Any], str | None]:
                resp = await client.post("/v1/completions", json={
                    "prompt": "hi", "guided_regex": f"{tag}{i}[0-9]"})
                return resp.status, await resp.json(), resp.headers.get("Retry-After")

            first = [asyncio.create_task(post(i)) for i in range(2)]
            await asyncio.sleep(0.1)  # both are being checked
            refused = await post(2)
            taken = await asyncio.gather(*first)
            later = await post(3)
            return refused, taken, later

    (status, body, retry), taken, later = _run(go())
    assert status == 429 and body["error"]["code"] == "queue_full" and retry == "1"
    assert [t[0] for t in taken] == [200, 200]
    assert later[0] == 200
    assert grammar_checks._pending == 0


def test_every_compile_is_off_the_loop_with_a_configured_backend(monkeypatch):
    """With --structured-outputs-backend guidance the engine's own request checks (on the
    loop) check the spec under that backend: parsing checks it so too, on the worker thread,
    so those find the verdict kept. Chat with a named tool_choice and completions alike."""
    import msgspec

    threads: list[str] = []
    real = spec._validate

    def where(params, backend):
        threads.append(f"{backend}@{threading.current_thread().name}")
        real(params, backend)

    monkeypatch.setattr(spec, "_validate", where)

    class ToolsEngine(FakeEngine):
        async def apply_chat_template(self, messages, *args: Any, tools: Any = None,
                                      **kwargs: Any) -> list[int]:
            return await super().apply_chat_template(messages)

    engine = ToolsEngine()
    engine.config = msgspec.structs.replace(engine.config, scheduler=msgspec.structs.replace(
        engine.config.scheduler, structured_outputs_backend="guidance"))
    tag = uuid.uuid4().hex
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {f"p_{tag}": {"type": "integer"}}}}}

    async def go():
        state, client = _serve(engine)
        async with client:
            done = await client.post("/v1/completions", json={
                "prompt": "hi", "guided_regex": f"{tag}[0-9]"})
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "f"}}})
            return done.status, chat.status

    assert _run(go()) == (200, 200)
    assert any(t.startswith("guidance@") for t in threads)
    assert threads and all("@tidal-grammar-check" in t for t in threads), threads
