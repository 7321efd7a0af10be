"""Failure semantics seen through ``AsyncLLM``: a killed engine fails every in-flight request with
``EngineDeadError`` within seconds and leaves no process behind; an engine that cannot start
raises at once; a spawned engine dies with its frontend; a bad request fails alone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend import async_llm as async_llm_module
from tidal.frontend.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from tidal.frontend.mp_client import EngineStartupError

NOOP_HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def noop_model(tmp_path_factory) -> str:
    """A model folder for the no-op executor (no weights, no torch import in the engine)."""
    folder = tmp_path_factory.mktemp("noop-model")
    (folder / "config.json").write_text(json.dumps(NOOP_HF_CONFIG))
    return str(folder)


def _noop_args(folder: str) -> EngineArgs:
    return EngineArgs(model=folder, distributed_executor_backend="noop", num_kv_blocks=4096,
                      max_num_seqs=64)


def _tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def _all_gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def test_kill_9_fails_every_in_flight_request_fast(noop_model):
    llm = AsyncLLM.from_engine_args(_noop_args(noop_model), skip_tokenizer_init=True)
    pid = llm.client.conn.engine_pid
    engine_tree = _tree(pid)
    params = SamplingParams(max_tokens=None, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        streaming = [asyncio.Event() for _ in range(20)]

        async def consume(i: int) -> None:
            async for _ in llm.generate([1, 2, 3, i + 1], params, f"r{i}"):
                streaming[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(20)]
        for event in streaming:
            await event.wait()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate([1, 2], params, "after"):
                pass
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        return results, elapsed

    try:
        results, elapsed = asyncio.run(main())
    finally:
        llm.shutdown()
    print(f"all 20 in-flight requests failed {elapsed:.3f} s after kill -9")
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "exited with code -9" in str(results[0])
    assert elapsed < 5.0
    assert not _all_gone(engine_tree), "orphaned engine processes"


def test_engine_that_cannot_start_raises_at_once(tiny_models, tmp_path):
    folder, _ = tiny_models["qwen3"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())  # no weights
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    start = time.monotonic()
    with pytest.raises(EngineStartupError, match=r"ModelLoadError|FileNotFoundError") as info:
        AsyncLLM.from_engine_args(EngineArgs(model=str(tmp_path), num_kv_blocks=64,
                                             cpu_threads=1), skip_tokenizer_init=True)
    print(f"start-up failure reported after {time.monotonic() - start:.2f} s: {info.value}")
    assert "no *.safetensors weight files" in str(info.value)
    leftover = [p for p in psutil.Process().children(recursive=True) if p.pid not in before
                and p.name() != "resource_tracker" and "resource_tracker" not in
                " ".join(p.cmdline())]
    assert not leftover, leftover


_FRONTEND_SCRIPT = textwrap.dedent("""
    import sys
    from tidal.engine_core.config import EngineArgs
    from tidal.frontend.async_llm import AsyncLLM

    if __name__ == "__main__":
        args = EngineArgs(model=sys.argv[1], distributed_executor_backend="noop",
                          num_kv_blocks=512)
        llm = AsyncLLM.from_engine_args(args, skip_tokenizer_init=True)
        print(llm.client.conn.engine_pid, flush=True)
        if sys.argv[2] == "wait":
            sys.stdin.readline()  # until killed
        # "exit": leave without calling shutdown(); atexit must stop the engine
""")


@pytest.mark.parametrize("how", ["kill -9", "exit"])
def test_spawned_engine_does_not_outlive_its_frontend(noop_model, tmp_path, how):
    script = tmp_path / "frontend.py"
    script.write_text(_FRONTEND_SCRIPT)
    frontend = subprocess.Popen(
        [sys.executable, str(script), noop_model, "wait" if how == "kill -9" else "exit"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        engine_pid = int(frontend.stdout.readline())
        engine_tree = _tree(engine_pid)
        if how == "kill -9":
            frontend.kill()
        assert frontend.wait(30) == (-9 if how == "kill -9" else 0)
        assert not _all_gone(engine_tree), f"engine outlived its frontend ({how})"
    finally:
        frontend.kill()
        frontend.wait()


# --- one bad request among good ones (engine in a thread, so its internals can be patched) ---


@pytest.fixture
def thread_llm(tiny_models):
    folder, _ = tiny_models["qwen3"]
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(folder), num_kv_blocks=256,
                                               cpu_threads=1),
                                    mode="thread", skip_tokenizer_init=True)
    yield llm
    llm.shutdown()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


async def _run_batch(llm: AsyncLLM, requests: dict[str, tuple[list[int], SamplingParams]]):
    async def one(rid, prompt, params):
        tokens = []
        async for out in llm.generate(prompt, params, rid):
            tokens = out.outputs[0].token_ids
        return tokens

    results = await asyncio.gather(*(one(rid, p, sp) for rid, (p, sp) in requests.items()),
                                   return_exceptions=True)
    return dict(zip(requests, results))


def test_request_that_raises_in_the_sampler_fails_alone(thread_llm, monkeypatch):
    from tidal.worker.sample import sampler as sampler_module

    original = sampler_module.Sampler.__call__

    def sampler(self, logits, meta):
        # 0.5 marks the poisoned request (temperatures travel per row).
        if (meta.temperature == 0.5).any():
            raise RuntimeError("poisoned row")
        return original(self, logits, meta)

    good = {f"good-{i}": ([5 + i, 6, 7], _greedy(6)) for i in range(4)}
    alone = asyncio.run(_run_batch(thread_llm, good))
    monkeypatch.setattr(sampler_module.Sampler, "__call__", sampler)
    mixed = dict(good, bad=([1, 2, 3], SamplingParams(temperature=0.5, max_tokens=6)))
    together = asyncio.run(_run_batch(thread_llm, mixed))
    assert isinstance(together["bad"], RequestFailedError)
    assert "poisoned row" in str(together["bad"])
    for rid in good:
        assert together[rid] == alone[rid] and len(alone[rid]) == 6
    assert thread_llm.client.core.scheduler.kv.num_free_blocks == \
        thread_llm.config.cache.num_blocks


def test_request_the_engine_rejects_fails_alone(noop_model, monkeypatch):
    """Validation skipped in the frontend (as by a buggy one): the EngineCore process rejects
    the request on arrival; the others run normally."""
    llm = AsyncLLM.from_engine_args(_noop_args(noop_model), skip_tokenizer_init=True)
    monkeypatch.setattr(async_llm_module, "validate_request", lambda *a: None)
    requests = {f"ok-{i}": ([1, 2, i + 3], _greedy(5)) for i in range(3)}
    requests["bad"] = ([1, 2], _greedy(5, logit_bias={10**6: 5.0}))
    requests["too-long"] = (list(range(1, 4097)), _greedy(5))
    try:
        results = asyncio.run(_run_batch(llm, requests))
        stats = asyncio.run(llm.get_kv_stats())
    finally:
        llm.shutdown()
    assert isinstance(results["bad"], RequestFailedError)
    assert "outside the vocabulary" in str(results["bad"])
    assert isinstance(results["too-long"], RequestFailedError)
    assert "max_model_len" in str(results["too-long"])
    for i in range(3):
        assert len(results[f"ok-{i}"]) == 5
    assert stats.num_free_blocks == stats.num_blocks


def test_thread_engine_failure_is_engine_dead(thread_llm, monkeypatch):
    """The in-thread engine follows the same rule: an executor error fails everyone."""
    def broken(self, *args, **kwargs):
        raise RuntimeError("worker lost (simulated)")

    monkeypatch.setattr(type(thread_llm.client.core.executor), "execute_model", broken)
    results = asyncio.run(_run_batch(thread_llm, {f"r{i}": ([1, 2], _greedy(4))
                                                  for i in range(3)}))
    assert all(isinstance(r, EngineDeadError) for r in results.values())
    assert "worker lost" in str(results["r0"])
    assert thread_llm.client.dead_error is not None
