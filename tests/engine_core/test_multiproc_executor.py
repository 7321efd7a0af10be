"""The multiprocess executor on CPU (gloo, TP=2): idle workers block instead of spinning; a
worker killed with ``kill -9`` mid-generation fails every in-flight request with
``EngineDeadError`` within 5 s and leaves no process behind; workers die with their EngineCore;
a worker that fails at start-up or inside a step is reported with its rank, pid and reason;
with async scheduling the output rank's held step replies come back in order, around control
requests and when no next step follows."""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import time

import psutil
import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.protocol import NewRequestData, SchedulerOutput
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.async_llm import AsyncLLM, EngineDeadError

pytestmark = pytest.mark.slow


def _args(folder, **kw) -> EngineArgs:
    # Two CPU ranks whatever the machine: a one-GPU host has no device for rank 1.
    return EngineArgs(model=str(folder), tensor_parallel_size=2, distributed_executor_backend="mp",
                      num_kv_blocks=256, cpu_threads=1, device="cpu", **kw)


def _tree(pid: int) -> list[psutil.Process]:
    proc = psutil.Process(pid)
    return [proc, *proc.children(recursive=True)]


def _workers(engine_pid: int) -> list[psutil.Process]:
    """The engine's worker processes (spawned children; not the resource tracker)."""
    out = []
    for p in psutil.Process(engine_pid).children():
        cmd = " ".join(p.cmdline())
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            out.append(p)
    return out


def _gone(procs: list[psutil.Process], timeout: float = 10.0) -> list[psutil.Process]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def _cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def test_idle_workers_block_then_kill_9_fails_every_request(tiny_models):
    folder, _ = tiny_models["qwen3"]
    llm = AsyncLLM.from_engine_args(_args(folder), skip_tokenizer_init=True)
    engine_pid = llm.client.conn.engine_pid
    workers = _workers(engine_pid)
    assert len(workers) == 2, [p.cmdline() for p in psutil.Process(engine_pid).children()]
    tree = _tree(engine_pid)
    params = SamplingParams(max_tokens=None, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def warm_up() -> None:
        async for _ in llm.generate([1, 2, 3], SamplingParams(max_tokens=4), "warm"):
            pass

    async def main():
        streaming = [asyncio.Event() for _ in range(12)]

        async def consume(i: int) -> None:
            async for _ in llm.generate([5, 6, 7, i + 1], params, f"r{i}"):
                streaming[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(12)]
        for event in streaming:
            await event.wait()
        os.kill(workers[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        elapsed = time.monotonic() - killed
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate([1, 2], params, "after"):
                pass
        return results, elapsed

    try:
        asyncio.run(warm_up())
        # Idle: workers block on the ring and the engine on its queue.
        time.sleep(0.5)
        idle = [*workers, psutil.Process(engine_pid)]
        before, t0 = _cpu_seconds(idle), time.monotonic()
        time.sleep(2.0)
        share = (_cpu_seconds(idle) - before) / (time.monotonic() - t0)
        print(f"idle engine + 2 workers: {100 * share:.1f}% of one core")
        assert share < 0.05
        # Rank 0's rendezvous store and gloo's connections listen on loopback alone.
        listening = [c.laddr.ip for p in idle for c in p.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening and all(ipaddress.ip_address(ip).is_loopback for ip in listening), \
            listening
        results, elapsed = asyncio.run(main())
    finally:
        llm.shutdown()
    print(f"12 in-flight requests failed {elapsed:.3f} s after kill -9 of a worker; "
          f"first error: {results[0]}")
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert "rank 1" in str(results[0]) and str(workers[1].pid) in str(results[0])
    assert elapsed < 5.0
    assert llm.client.conn.proc.exitcode == 1  # the engine exits non-zero
    assert not _gone(tree), "orphaned engine or worker processes"


def test_workers_die_with_their_engine(tiny_models):
    """kill -9 of the EngineCore process: its workers notice (death pipe) and exit."""
    folder, _ = tiny_models["llama"]
    llm = AsyncLLM.from_engine_args(_args(folder), skip_tokenizer_init=True)
    try:
        engine_pid = llm.client.conn.engine_pid
        workers = _workers(engine_pid)
        assert len(workers) == 2
        os.kill(engine_pid, signal.SIGKILL)
        start = time.monotonic()
        alive = _gone(workers, timeout=10)
        print(f"workers exited {time.monotonic() - start:.2f} s after their engine")
        assert not alive, "workers outlived their engine"
    finally:
        llm.shutdown()


# --- the executor alone (in this process) -----------------------------------------------------


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline())}


def test_startup_failure_names_the_rank_and_reason(tiny_models, tmp_path):
    from tidal.engine_core.multiproc_executor import MultiprocExecutor, WorkerError

    folder, _ = tiny_models["qwen3"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())  # no weights
    config = _args(tmp_path).create_config()
    before = _children()
    start = time.monotonic()
    with pytest.raises(WorkerError, match="no \\*.safetensors weight files") as info:
        MultiprocExecutor(config)
    print(f"start-up failure after {time.monotonic() - start:.2f} s: {info.value}")
    assert "rank" in str(info.value)
    assert not (_children() - before)


def test_step_failure_in_a_worker_is_fatal_and_reported(tiny_models):
    from tidal.engine_core.multiproc_executor import MultiprocExecutor, WorkerError

    folder, _ = tiny_models["llama"]
    config = _args(folder).create_config()
    before = _children()
    executor = MultiprocExecutor(config)
    try:
        assert executor.determine_num_blocks() == 256
        executor.init_kv_cache(256)
        assert len(executor.worker_pids) == 2
        executor.check_health()
        # A block id far outside the cache: the workers fail while writing the KV cache.
        bad = NewRequestData(req_id="bad", prompt_token_ids=[1, 2, 3], output_token_ids=[],
                             sampling_params=SamplingParams(max_tokens=2),
                             block_ids=[10**7], num_computed_tokens=0)
        so = SchedulerOutput(step_id=0, new_reqs=[bad], num_scheduled_tokens=[3],
                             total_num_scheduled_tokens=3)
        with pytest.raises(WorkerError, match="rank 0") as info:
            executor.execute_model(so)
        print(f"step failure: {info.value}")
        with pytest.raises(WorkerError):
            executor.check_health()
        with pytest.raises(WorkerError):
            executor.execute_model(so)
    finally:
        executor.shutdown()
    assert not (_children() - before)


def test_held_step_replies_come_back_in_order_around_control_requests(tiny_models):
    """Async scheduling: the output rank answers step N once step N+1 is launched, or when the
    executor flushes (no newer step). Replies that arrive while the executor waits for a control
    answer are kept for their step. Tokens equal those of an in-process engine."""
    from tidal.engine_core.core import EngineCore
    from tidal.engine_core.protocol import EngineCoreRequest

    folder, _ = tiny_models["llama"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 2, 7], [11, 3], [4, 4, 4, 8, 1]]

    def run(core: EngineCore, interleave) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, params))
        tokens: dict[str, list[int]] = {}
        step = 0
        while core.has_unfinished_requests():
            for o in interleave(core, step) + core.step().outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            step += 1
        return tokens

    ref_core = EngineCore(EngineArgs(model=str(folder), num_kv_blocks=256, cpu_threads=1,
                                     async_scheduling=True, device="cpu").create_config())
    try:
        reference = run(ref_core, lambda core, step: [])
    finally:
        ref_core.shutdown()

    core = EngineCore(_args(folder, async_scheduling=True).create_config())
    ex = core.executor
    assert ex.max_concurrent_batches == 2

    def interleave(core: EngineCore, step: int) -> list:
        if step == 4:
            assert ex.determine_num_blocks() == 256  # with a step in flight (held)
        if step != 2:
            return []
        # Step 2: the core's own step left one step in flight; finish it, then launch two by
        # hand before collecting either: the first one's reply arrives (the second is
        # launched) while the executor waits for the control answer.
        sched, pending = core.batch_queue.popleft()
        outs = core.scheduler.update_from_output(sched, pending.result())
        s0 = core.scheduler.schedule()
        p0 = ex.execute_model(s0, non_block=True)
        s1 = core.scheduler.schedule()
        p1 = ex.execute_model(s1, non_block=True)
        assert ex.determine_num_blocks() == 256
        outs += core.scheduler.update_from_output(s0, p0.result())
        # The newest step: collecting it makes the executor flush the held reply.
        outs += core.scheduler.update_from_output(s1, p1.result())
        return outs

    try:
        tokens = run(core, interleave)
    finally:
        core.shutdown()
    assert tokens == reference
    assert all(len(v) == params.max_tokens for v in tokens.values())
