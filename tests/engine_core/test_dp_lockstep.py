"""``--data-parallel-lockstep``: two DP ranks (``AsyncLLM`` with ``data_parallel_size=2``) on a
tiny model, one of them idle. While the other works, the idle rank steps with it (the same
step count, reported by both in their heartbeats); once nothing is left both go quiet (no more
steps, next to no CPU), and a second wave works the same way. Outputs are those of the
offline engine. A rank that cannot meet its peers fails its start-up with a reason (never a
silent wait), and a rank whose wave watcher loses the ranks' store fails loudly."""

from __future__ import annotations

import asyncio
import queue
import time

import psutil
import pytest

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.core_proc import Stop
from tidal.engine_core.dp_lockstep import DPGroup, WaveStarted
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.dp_client import DPAsyncClient

pytestmark = pytest.mark.slow

PROMPT = [5, 6, 7, 8, 9]
TOKENS = 12


def _steps(client: DPAsyncClient, at_least: int, timeout: float = 15.0) -> list[int]:
    """Each rank's finished steps once both report the same count of at least ``at_least``
    (from heartbeats, which a rank sends once it has had nothing else to say for half a
    second); what they report at ``timeout`` if they never agree."""
    deadline = time.monotonic() + timeout
    while True:
        now = [c._steps_seen for c in client.clients]
        if (min(now) >= at_least and len(set(now)) == 1) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


def test_lockstep_needs_several_ranks_and_no_kv_connector(tiny_models):
    folder, _ = tiny_models["qwen3"]
    with pytest.raises(ConfigError, match="data-parallel-size > 1"):
        EngineArgs(model=str(folder), data_parallel_lockstep=True).create_config()
    with pytest.raises(ConfigError, match="KV connector is not yet supported"):
        EngineArgs(model=str(folder), data_parallel_size=2, data_parallel_lockstep=True,
                   kv_offload_gb=1.0).create_config()


def test_an_idle_rank_steps_with_the_busy_one_and_both_go_quiet(tiny_models):
    from tidal.frontend import LLM

    folder, _ = tiny_models["qwen3"]
    args = dict(model=str(folder), num_kv_blocks=64, cpu_threads=1)
    llm = AsyncLLM.from_engine_args(EngineArgs(**args, data_parallel_size=2,
                                               data_parallel_lockstep=True),
                                    skip_tokenizer_init=True)
    client = llm.client
    assert isinstance(client, DPAsyncClient)
    engines = [psutil.Process(c.conn.engine_pid) for c in client.clients]
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)

    async def one(rid: str) -> list[int]:
        tokens: list[int] = []
        async for out in llm.generate(PROMPT, params, rid):
            tokens = list(out.outputs[0].token_ids)
        return tokens

    async def waves() -> tuple[list[int], list[int], list[int], list[float], list[int]]:
        first = await one("a")
        # Heartbeats reach the event loop's reader: wait for them in a thread.
        after_first = await asyncio.to_thread(_steps, client, TOKENS)
        cpu0 = [sum(p.cpu_times()[:2]) for p in engines]
        await asyncio.sleep(1.5)  # three heartbeat intervals
        cpu = [sum(p.cpu_times()[:2]) - c for p, c in zip(engines, cpu0)]
        quiet = [c._steps_seen for c in client.clients]
        second = await one("b")
        after_second = await asyncio.to_thread(_steps, client, max(after_first) + TOKENS)
        assert second == first
        return first, after_first, quiet, cpu, after_second

    try:
        tokens, after_first, quiet, cpu, after_second = asyncio.run(waves())
        ranks = [r.routed for r in client.coordinator.ranks]
    finally:
        llm.shutdown()
    offline = LLM(skip_tokenizer_init=True, **args)
    try:
        expected = offline.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        offline.shutdown()
    assert tokens == list(expected)
    # One request per wave: one rank did the work, the other only kept step.
    assert sum(ranks) == 2, ranks
    assert after_first[0] == after_first[1] >= TOKENS, after_first
    assert quiet == after_first, (after_first, quiet)  # idle: no steps...
    assert max(cpu) < 0.3, cpu  # ...and no busy loop (a 2-core CI machine, several seconds)
    assert after_second[0] == after_second[1] >= after_first[0] + TOKENS, after_second


def test_the_wave_watcher_fails_the_engine_when_the_store_goes(monkeypatch):
    from tidal.engine_core import dp_lockstep
    from tidal.frontend.dp_engines import serve_rendezvous_store

    monkeypatch.setattr(dp_lockstep, "_WAVE_WAIT_S", 0.2)  # idle spells longer than a wait
    store = serve_rendezvous_store()
    group = DPGroup(0, 1, store.port)
    inputs: queue.SimpleQueue = queue.SimpleQueue()
    try:
        group.watch_waves(inputs)
        time.sleep(0.6)  # waits that timed out: the watcher keeps watching
        group.start_wave(0)
        assert inputs.get(timeout=5) == WaveStarted(0)
        del store  # the launcher's store is gone (its server stops with its last reference)
        stop = inputs.get(timeout=10)
        assert isinstance(stop, Stop) and stop.failed, stop
        assert "wave watcher failed" in stop.reason
    finally:
        group.close()


def test_ranks_agree_on_a_decode_graph_only_when_every_rank_decodes():
    """``agree_graph_batch``: the largest decode batch when every rank runs one or nothing,
    else 0 (eager everywhere): a prompt step or drafts on any rank make the step eager, and so
    does a step with no token anywhere."""
    import threading

    from tidal.engine_core.dp_lockstep import graph_batch_proposal
    from tidal.engine_core.protocol import SchedulerOutput
    from tidal.frontend.dp_engines import serve_rendezvous_store

    def decode(n: int) -> SchedulerOutput:
        return SchedulerOutput(step_id=1, num_scheduled_tokens=[1] * n,
                               total_num_scheduled_tokens=n)

    prompt = SchedulerOutput(step_id=1, num_scheduled_tokens=[1, 7],
                             total_num_scheduled_tokens=8)
    drafts = SchedulerOutput(step_id=1, num_scheduled_tokens=[1],
                             total_num_scheduled_tokens=1,
                             scheduled_spec_decode_tokens={"a": [3]})
    assert graph_batch_proposal(decode(3)) == 3
    assert graph_batch_proposal(drafts) > 1 << 30
    store = serve_rendezvous_store()
    groups: list[DPGroup | None] = [None, None]

    def join(rank: int) -> None:
        groups[rank] = DPGroup(rank, 2, store.port)

    threads = [threading.Thread(target=join, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        for a, b, want in ((decode(3), decode(5), 5), (decode(4), decode(1), 4),
                           (decode(3), prompt, 0), (SchedulerOutput(step_id=-1), decode(2), 2),
                           (SchedulerOutput(step_id=-1), prompt, 0),
                           (SchedulerOutput(step_id=-1), SchedulerOutput(step_id=-1), 0),
                           (drafts, decode(2), 0)):
            got = [0, 0]

            def agree(rank: int, so: SchedulerOutput) -> None:
                group = groups[rank]
                assert group is not None
                got[rank] = group.agree_graph_batch(graph_batch_proposal(so))

            pair = [threading.Thread(target=agree, args=(0, a)),
                    threading.Thread(target=agree, args=(1, b))]
            for t in pair:
                t.start()
            for t in pair:
                t.join(30)
            assert got == [want, want], (a, b, got)
    finally:
        for g in groups:
            if g is not None:
                g.close()


def test_a_rank_that_cannot_meet_its_peers_fails_its_start_up(tiny_models):
    from tidal.frontend.mp_client import EngineConnection, EngineStartupError

    folder, _ = tiny_models["qwen3"]
    # No rendezvous store (only dp_engines starts lockstep ranks, with one): the rank must
    # say why it cannot start, after loading its model, and exit.
    config = EngineArgs(model=str(folder), num_kv_blocks=64, cpu_threads=1,
                        data_parallel_size=2, data_parallel_lockstep=True).create_config()
    conn = EngineConnection.spawn(config)
    proc = conn.proc
    with pytest.raises(EngineStartupError, match="no rendezvous store port"):
        conn.wait_ready()
    assert proc is not None
    proc.join(10)
    assert proc.exitcode == 1
