"""The EngineCore process behind its sockets, driven by a raw (synchronous) frontend connection:
handshake, malformed input, idle CPU, fatal executor errors, signals, start-up failures."""

from __future__ import annotations

import json
import os
import signal
import time

import msgspec
import psutil
import pytest
import torch

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.control import GetKVStats, KVStats, Ping, Pong, ResetPrefixCache
from tidal.engine_core.core_proc import run_engine_core
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.async_llm import EngineDeadError
from tidal.frontend.mp_client import EngineConnection, EngineStartupError, MPSyncClient

# A no-op engine (no model, one fixed token per step) needs only a config.json and starts
# without importing torch: cheap enough to spawn one per failure test.
NOOP_HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def noop_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("noop-model")
    (folder / "config.json").write_text(json.dumps(NOOP_HF_CONFIG))
    return str(folder)


def _noop_config(folder: str):
    return EngineArgs(model=folder, distributed_executor_backend="noop",
                      num_kv_blocks=256).create_config()


def _spawn(config, **kwargs) -> MPSyncClient:
    conn = EngineConnection.spawn(config, **kwargs)
    conn.wait_ready(timeout_s=120)
    return MPSyncClient(conn)


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _collect(client: MPSyncClient, n_finishes: int) -> dict[str, list]:
    """request id -> [tokens, [(finish_reason, error), ...]] until ``n_finishes`` requests
    finished."""
    out: dict[str, list] = {}
    done = 0
    while done < n_finishes:
        for o in client.step().unpack():
            entry = out.setdefault(o.request_id, [[], []])
            entry[0].extend(o.new_token_ids)
            if o.finish_reason is not None:
                entry[1].append((o.finish_reason, o.error))
                done += 1
    return out


def _gone(pid: int, timeout: float = 10.0) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


# --- one real engine, several behaviours -----------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_models):
    folder, _ = tiny_models["qwen3"]
    # The frontend leaves the KV block count open; the engine measures it from this budget.
    config = EngineArgs(model=str(folder), kv_cache_memory_bytes=2 << 20,
                        cpu_threads=1).create_config()
    assert config.cache.num_blocks is None
    client = _spawn(config)
    yield client
    pid = client.conn.engine_pid
    client.shutdown()
    assert client.conn.proc.exitcode == 0
    assert _gone(pid)


def test_ready_carries_the_resolved_config(engine):
    config = engine.config
    itemsize = torch.empty(0, dtype=getattr(torch, config.model.dtype)).element_size()
    per_block = 2 * 3 * 16 * 2 * 32 * itemsize  # K+V, layers, block size, KV heads, head dim
    assert config.cache.num_blocks == (2 << 20) // per_block
    assert config.model.max_model_len == 512
    stats = engine.call(GetKVStats())
    assert stats == KVStats(config.cache.num_blocks, config.cache.num_blocks, 0, 0)
    pong = engine.call(Ping())
    assert isinstance(pong, Pong) and pong.engine_pid == engine.conn.engine_pid != os.getpid()


def test_bad_input_fails_alone_and_the_engine_keeps_serving(engine):
    conn = engine.conn
    good = {f"good-{i}": [3 + i, 4, 5, 6] for i in range(4)}
    alone = {}
    for rid, prompt in good.items():
        engine.add_request(EngineCoreRequest(rid, prompt, _greedy(8)))
        alone.update(_collect(engine, 1))

    for rid, prompt in good.items():
        engine.add_request(EngineCoreRequest(rid, prompt, _greedy(8)))
    # Garbage, and a frame with no payload at all: logged and dropped.
    conn.router.send_multipart([conn.engine_identity, b"\xc1\xc1 not msgpack"])
    conn.router.send_multipart([conn.engine_identity, b""])
    # Parameters the SamplingParams constructor would refuse, sent raw in a batch with a valid
    # request: undecodable as a whole, but the bad request's id is readable, so it fails
    # instead of hanging, and its batch-mate runs.
    raw = msgspec.msgpack.encode(["add", [
        ["bad-params", [1, 2, 3], {"n": 0}],
        ["batch-mate", [7, 8], {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}]]])
    conn.router.send_multipart([conn.engine_identity, raw])
    # Past the frontend's validation: an out-of-vocabulary logit bias, and a duplicate id.
    engine.add_request(EngineCoreRequest("bad-bias", [1, 2, 3],
                                         _greedy(4, logit_bias={10**6: 1.0})))
    engine.add_request(EngineCoreRequest("good-0", [9, 9], _greedy(4)))
    results = _collect(engine, len(good) + 4)
    assert results["batch-mate"] == [results["batch-mate"][0], [(FinishReason.LENGTH, None)]]
    assert len(results["batch-mate"][0]) == 3

    assert results["bad-params"][1] == [(FinishReason.ERROR, results["bad-params"][1][0][1])]
    assert "malformed request" in results["bad-params"][1][0][1]
    assert "n must be in" in results["bad-params"][1][0][1]
    (reason, error), = results["bad-bias"][1]
    assert reason == FinishReason.ERROR and "outside the vocabulary" in error
    finishes = results["good-0"][1]
    assert (FinishReason.LENGTH, None) in finishes
    dup_error = next(e for r, e in finishes if r == FinishReason.ERROR)
    assert "already in use" in dup_error and "'good-0'" in dup_error  # the frontend's own id
    for rid in good:
        assert results[rid][0] == alone[rid][0], rid
    stats = engine.call(GetKVStats())
    assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
    assert engine.call(ResetPrefixCache()) is True


def test_idle_engine_uses_almost_no_cpu(engine):
    engine.call(Ping())  # the busy loop has answered: it is waiting for input now
    proc = psutil.Process(engine.conn.engine_pid)
    procs = [proc, *proc.children(recursive=True)]
    before = sum(p.cpu_times().user + p.cpu_times().system for p in procs)
    start = time.monotonic()
    time.sleep(2.0)  # the measurement window itself, not a synchronisation
    used = sum(p.cpu_times().user + p.cpu_times().system for p in procs) - before
    share = used / (time.monotonic() - start)
    print(f"idle EngineCore CPU: {share:.2%} of one core")
    assert share < 0.02


# --- failures (no-op engines: no model, fast to start) ---------------------------------------------


def _engine_whose_executor_fails(config_bytes: bytes, listen: str) -> None:
    """Spawn target: the executor raises 5 steps after the test's last request (r2) was
    scheduled, as when a worker dies. Counting from r2, not from the first step, keeps a loaded
    machine from killing the engine before the test has sent all its requests."""
    from tidal.engine_core import core

    original = core.NoopExecutor.execute_model
    steps_since_r2: int | None = None

    def execute_model(self, so, non_block=False):
        nonlocal steps_since_r2
        if any(r.req_id.endswith(":r2") for r in so.new_reqs):  # ids carry a client prefix
            steps_since_r2 = 0
        if steps_since_r2 is not None:
            steps_since_r2 += 1
            if steps_since_r2 > 5:
                raise RuntimeError("worker rank 0 died (simulated)")
        return original(self, so, non_block)

    core.NoopExecutor.execute_model = execute_model
    run_engine_core(config_bytes, listen)


def _engine_whose_worker_dies_while_idle(config_bytes: bytes, listen: str) -> None:
    """Spawn target: the second idle health check finds a dead worker."""
    from tidal.engine_core import core

    checks = 0

    def check_health(self):
        nonlocal checks
        checks += 1
        if checks >= 2:
            raise RuntimeError("worker rank 1 exited with code -9 (simulated)")

    core.NoopExecutor.check_health = check_health
    run_engine_core(config_bytes, listen)


def _engine_that_crashes_on_start(config_bytes: bytes, listen: str) -> None:
    os._exit(3)


def test_executor_failure_is_fatal_and_reported(noop_model):
    client = _spawn(_noop_config(noop_model), target=_engine_whose_executor_fails)
    try:
        for i in range(3):
            client.add_request(EngineCoreRequest(f"r{i}", [1, 2, 3], _greedy(100)))
        with pytest.raises(EngineDeadError, match=r"worker rank 0 died \(simulated\)"):
            while True:
                client.step()
        client.conn.proc.join(10)
        assert client.conn.proc.exitcode == 1
        with pytest.raises(EngineDeadError):
            client.add_request(EngineCoreRequest("late", [1], _greedy(1)))
    finally:
        client.shutdown()


def test_worker_death_while_idle_is_noticed(noop_model):
    client = _spawn(_noop_config(noop_model), target=_engine_whose_worker_dies_while_idle)
    try:
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 exited"):
            client.step()  # nothing running: only the idle health check can find it
        assert time.monotonic() - start < 10
        client.conn.proc.join(10)
        assert client.conn.proc.exitcode == 1
    finally:
        client.shutdown()


def test_sigterm_shuts_down_gracefully(noop_model):
    client = _spawn(_noop_config(noop_model))
    try:
        client.add_request(EngineCoreRequest("r", [1, 2], _greedy(4000)))
        client.step()
        os.kill(client.conn.engine_pid, signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="received SIGTERM"):
            while True:
                client.step()
        client.conn.proc.join(10)
        assert client.conn.proc.exitcode == 0
    finally:
        client.shutdown()


def test_startup_error_reaches_the_frontend(tiny_models, tmp_path):
    folder, _ = tiny_models["qwen3"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())  # no weights
    config = EngineArgs(model=str(tmp_path), num_kv_blocks=64, cpu_threads=1).create_config()
    conn = EngineConnection.spawn(config)
    with pytest.raises(EngineStartupError, match=r"no \*\.safetensors weight files"):
        conn.wait_ready(timeout_s=120)  # a hang would end in a different message
    assert conn.closed and conn.proc.exitcode == 1


def test_startup_crash_without_a_word_raises_promptly(noop_model):
    conn = EngineConnection.spawn(_noop_config(noop_model), target=_engine_that_crashes_on_start)
    with pytest.raises(EngineStartupError, match="exited with code 3 during start-up"):
        conn.wait_ready(timeout_s=120)


def test_step_counters_reach_one_frontend_and_none_is_lost():
    """Frontends that add up their counters (the API servers of one server) must count each
    step once: the counters go to one frontend, the others get the gauges; a step without
    outputs keeps its counters for the next one."""
    from types import SimpleNamespace

    from tidal.engine_core.config import ParallelConfig
    from tidal.engine_core.core_proc import EngineCoreProc
    from tidal.engine_core.protocol import EngineCoreOutput, EngineCoreOutputs, SchedulerStats

    # Only publishing is used here (the core's parallel config: which DP rank this is).
    core = SimpleNamespace(config=SimpleNamespace(parallel=ParallelConfig()))
    proc = EngineCoreProc(core=core, ctx=None, handshake=None)
    proc._owners = {"c0:a": (0, "a"), "c1:b": (1, "b")}
    prefill = SchedulerStats(2, 0, 0.1, num_prompt_tokens=64)
    proc._publish(EngineCoreOutputs([], 1.0, prefill))  # a prefill chunk: nothing to send
    assert proc._outputs.empty()
    decode = SchedulerStats(2, 0, 0.2, num_prompt_tokens=8, num_generation_tokens=2)
    proc._publish(EngineCoreOutputs([EngineCoreOutput("c0:a", [5]),
                                     EngineCoreOutput("c1:b", [6])], 2.0, decode))
    sent = {}
    while not proc._outputs.empty():
        client, msg = proc._outputs.get()
        sent[client] = msg.outputs
    assert sent[0].req_ids == ["a"] and sent[1].req_ids == ["b"]
    stats = [sent[c].scheduler_stats for c in (0, 1)]
    assert sum(s.num_prompt_tokens for s in stats) == 72
    assert sum(s.num_generation_tokens for s in stats) == 2
    assert all((s.num_running, s.kv_cache_usage) == (2, 0.2) for s in stats)
