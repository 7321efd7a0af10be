"""A standalone ``engine-core`` shared by several frontends: each gets only its own outputs (even
with the same request ids), a frontend that leaves or vanishes has its requests aborted while
the others keep working, and a killed engine fails every remote frontend's requests."""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tidal.engine_core.control import KVStats
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.async_llm import AsyncLLM, EngineDeadError


def _engine_core_command() -> list[str]:
    script = Path(sys.executable).with_name("engine-core")  # the console script
    try:
        importlib.metadata.version("tidal")
    except importlib.metadata.PackageNotFoundError:
        # Not installed (a GPU image running the repo from PYTHONPATH): no console script.
        return [sys.executable, "-m", "tidal.engine_core.cli"]
    assert script.is_file(), f"the engine-core console script is not installed at {script}"
    return [str(script)]


class EngineCoreCLI:
    """An ``engine-core`` subprocess; its log lines are collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*_engine_core_command(), "--listen", "tcp://127.0.0.1:0",
                                      *args], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._new_line = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            self.address = self.wait_for(r"EngineCore serving at (\S+)", 120).group(1)
        except AssertionError:
            self.proc.kill()
            raise

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()

    def wait_for(self, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """The first log line matching ``pattern``, waiting for it to be logged."""
        deadline = time.monotonic() + timeout
        seen = 0
        with self._new_line:
            while True:
                for line in self.lines[seen:]:
                    if match := re.search(pattern, line):
                        return match
                seen = len(self.lines)
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.proc.poll() is not None and seen == len(self.lines):
                    raise AssertionError(f"engine-core never logged {pattern!r}:\n"
                                         + "".join(self.lines))
                self._new_line.wait(remaining)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def engine_core(tiny_models):
    folder, _ = tiny_models["qwen3"]
    cli = EngineCoreCLI("--model", str(folder), "--num-kv-blocks", "512", "--max-num-seqs",
                        "64", "--cpu-threads", "1")
    yield cli
    cli.stop()


def _connect(address: str) -> AsyncLLM:
    return AsyncLLM.from_address(address, skip_tokenizer_init=True)


def _params(n: int, kind: OutputKind = OutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, output_kind=kind)


async def _tokens(llm: AsyncLLM, prompt: list[int], params: SamplingParams, rid: str):
    tokens: list[int] = []
    async for out in llm.generate(prompt, params, rid):
        tokens.extend(out.outputs[0].token_ids)
    return tokens


async def _wait_all_free(llm: AsyncLLM, timeout: float = 10.0) -> KVStats:
    """Another frontend's departure is not ordered with this frontend's calls, so poll."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await llm.get_kv_stats()
        if stats.num_running == stats.num_waiting == 0 and \
                stats.num_free_blocks == stats.num_blocks:
            return stats
        assert time.monotonic() < deadline, f"requests were not aborted: {stats}"
        await asyncio.sleep(0.05)


def test_startup_phases_are_logged_with_timings(engine_core):
    log = "".join(engine_core.lines)
    for phase in (r"start-up: config resolved in \d+\.\d+ s",
                  r"start-up: handshake socket bound at tcp://127\.0\.0\.1:\d+ in \d+\.\d+ s",
                  r"executor UniprocExecutor up \(model loaded\) in \d+\.\d+ s",
                  r"start-up: EngineCore initialised in \d+\.\d+ s \(512 KV blocks",
                  r"EngineCore serving at tcp://127\.0\.0\.1:\d+"):
        assert re.search(phase, log), phase


def test_two_frontends_get_only_their_own_outputs(engine_core):
    a, b = _connect(engine_core.address), _connect(engine_core.address)
    try:
        assert a.client.conn.client_index != b.client.conn.client_index
        prompts = {"a": [[10 + i, 20, 30] for i in range(8)],
                   "b": [[50 + i, 60, 70, 80] for i in range(8)]}

        async def main():
            alone = {name: [await _tokens(a, p, _params(10), f"alone-{name}{i}")
                            for i, p in enumerate(prompts[name])] for name in prompts}
            # Interleaved: both frontends at once, with the same request ids.
            jobs = [_tokens(llm, prompts[name][i], _params(10), f"r{i}")
                    for i in range(8) for name, llm in (("a", a), ("b", b))]
            together = await asyncio.gather(*jobs)
            # Quiet for longer than the heartbeat timeout: heartbeats keep the engine alive.
            await asyncio.sleep(a.client.conn.heartbeat_timeout_s + 1.0)
            assert a.client.dead_error is None and b.client.dead_error is None
            again = await _tokens(a, prompts["a"][0], _params(10), "again")
            return alone, together + [again]

        alone, together = asyncio.run(main())
        assert together.pop() == alone["a"][0]
        for i in range(8):
            assert together[2 * i] == alone["a"][i]
            assert together[2 * i + 1] == alone["b"][i]
        assert alone["a"] != alone["b"]
    finally:
        a.shutdown()
        b.shutdown()


def test_frontend_that_leaves_has_its_requests_aborted(engine_core):
    a, b = _connect(engine_core.address), _connect(engine_core.address)
    try:
        async def main():
            streaming = [asyncio.Event() for _ in range(4)]

            async def consume(i: int) -> None:
                async for _ in a.generate([1, 2, i + 3], _params(400), f"long-{i}"):
                    streaming[i].set()

            tasks = [asyncio.create_task(consume(i)) for i in range(4)]
            for event in streaming:
                await event.wait()
            busy = await b.get_kv_stats()
            index = a.client.conn.client_index
            a.shutdown()  # says goodbye
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            free = await _wait_all_free(b)
            still = await _tokens(b, [4, 5, 6], _params(5), "after")
            return busy, free, still, index

        busy, free, still, index = asyncio.run(main())
        # Aborted by the goodbye, not finished on their own (400 tokens take a while).
        engine_core.wait_for(rf"frontend {index} left \(said goodbye\); aborted its 4 "
                             r"unfinished request\(s\)")
        assert busy.num_running == 4
        assert free.num_free_blocks == free.num_blocks
        assert len(still) == 5
    finally:
        a.shutdown()
        b.shutdown()


_VANISHING_FRONTEND = textwrap.dedent("""
    import asyncio, sys
    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.frontend.async_llm import AsyncLLM

    async def main(llm):
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        gens = [llm.generate([7, 8, i], params, f"v{i}") for i in range(3)]
        for g in gens:
            await g.__anext__()
        print("streaming", flush=True)
        await asyncio.Event().wait()  # until killed

    if __name__ == "__main__":
        asyncio.run(main(AsyncLLM.from_address(sys.argv[1], skip_tokenizer_init=True)))
""")


def test_frontend_that_vanishes_has_its_requests_aborted(engine_core, tmp_path):
    script = tmp_path / "vanishing.py"
    script.write_text(_VANISHING_FRONTEND)
    other = subprocess.Popen([sys.executable, str(script), engine_core.address],
                             stdout=subprocess.PIPE, text=True)
    b = _connect(engine_core.address)
    try:
        assert other.stdout.readline().strip() == "streaming"
        busy = asyncio.run(b.get_kv_stats())
        other.kill()  # no goodbye: the engine notices the connection drop
        other.wait()
        free = asyncio.run(_wait_all_free(b))
        assert busy.num_running == 3 and free.num_running == 0
        engine_core.wait_for(r"frontend \d+ left \(connection lost\); aborted its 3 "
                             r"unfinished request\(s\)")
        assert engine_core.proc.poll() is None, "the engine must survive its frontends"
    finally:
        other.kill()
        other.wait()
        b.shutdown()


def test_killed_engine_fails_remote_frontends(engine_core):
    """Run last in this module: it kills the shared engine."""
    a, b = _connect(engine_core.address), _connect(engine_core.address)
    try:
        async def main():
            streaming = [asyncio.Event() for _ in range(6)]

            async def consume(llm: AsyncLLM, i: int) -> None:
                async for _ in llm.generate([3, 2, i + 1], _params(None), f"k{i}"):
                    streaming[i].set()

            tasks = [asyncio.create_task(consume(a if i % 2 else b, i)) for i in range(6)]
            for event in streaming:
                await event.wait()
            os.kill(engine_core.proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            return results, time.monotonic() - killed

        results, elapsed = asyncio.run(main())
        print(f"remote frontends saw the engine dead {elapsed:.2f} s after kill -9")
        assert all(isinstance(r, EngineDeadError) for r in results), results
        assert "no message from the EngineCore" in str(results[0])
        assert elapsed < 6.5  # heartbeat timeout (4 s) plus one watchdog period
        engine_core.proc.wait(5)
    finally:
        a.shutdown()
        b.shutdown()


def test_engine_core_sigterm_is_graceful(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024}))
    cli = EngineCoreCLI("--model", str(tmp_path), "--distributed-executor-backend", "noop",
                        "--num-kv-blocks", "256")
    llm = _connect(cli.address)
    try:
        async def main():
            async def consume():
                # The no-op executor runs a request to the context limit in milliseconds: keep
                # requests coming, so the signal lands while one streams.
                for i in itertools.count():
                    async for _ in llm.generate([1, 2], _params(None), f"r{i}"):
                        streaming.set()

            streaming = asyncio.Event()
            task = asyncio.create_task(consume())
            await streaming.wait()
            cli.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(task, return_exceptions=True)

        (result,) = asyncio.run(main())
        assert isinstance(result, EngineDeadError) and "received SIGTERM" in str(result)
        assert cli.proc.wait(10) == 0
    finally:
        llm.shutdown()
        cli.stop()
