"""The host-memory KV tier (OffloadingConnector) end to end in one in-process engine: a prefix
evicted from a tiny KV cache comes back from host memory (loaded, not recomputed) with the same
greedy tokens as a GPU-cache hit and as no caching; the host LRU under pressure; stats."""

from __future__ import annotations

import random

import pytest

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.kv_transfer.offloading_connector import kv_bytes_per_block
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams

BS = 16  # block size (EngineArgs' default)
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def make_core(folder, *, blocks: int = 8, host_blocks: int | None = None,
              caching: bool = True, **kw) -> EngineCore:
    """An engine with ``blocks`` KV blocks (128 tokens: the context) and a host tier of
    ``host_blocks`` blocks (None: no tier)."""
    kv = None
    if host_blocks is not None:
        probe = EngineArgs(model=str(folder), max_model_len=blocks * BS,
                           num_kv_blocks=blocks).create_config()
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_buffer_size": host_blocks * kv_bytes_per_block(probe)}
    args = EngineArgs(model=str(folder), max_model_len=blocks * BS, num_kv_blocks=blocks,
                      enable_prefix_caching=caching, kv_transfer_config=kv, **kw)
    return EngineCore(args.create_config())


def run(core: EngineCore, reqs: list[EngineCoreRequest], stats: list | None = None,
        wave: int | None = None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    while pending or core.has_unfinished_requests():
        while pending and (wave is None or core.scheduler.num_unfinished < wave):
            core.add_request(pending.pop(0))
        step = core.step()
        core.scheduler.kv.check_invariants()
        connector = core.scheduler.connector
        if connector is not None:
            connector.index.check_invariants()
        if stats is not None:
            stats.append(step.scheduler_stats)
        for o in step.outputs:
            out[o.request_id] += o.new_token_ids
    return out


def total(stats: list, field: str) -> int:
    return sum(getattr(s, field) for s in stats)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, hf = tiny_models["llama"]
    return folder, hf.config.vocab_size


@pytest.fixture(scope="module")
def plain(tiny):
    """The reference: the same pool without prefix caching (shared by the tests here)."""
    return make_core(tiny[0], caching=False)


def prompts(vocab: int) -> tuple[list[int], list[int]]:
    rng = random.Random(7)
    a = [rng.randrange(3, vocab) for _ in range(64)]  # 4 blocks: 3 reusable, 1 recomputed
    b = [rng.randrange(3, vocab) for _ in range(120)]  # with 4 tokens: all 8 blocks
    return a, b


def test_evicted_prefix_is_loaded_from_host_with_identical_tokens(tiny, plain):
    folder, vocab = tiny
    a, b = prompts(vocab)
    expected = run(plain, [EngineCoreRequest("a", a, GREEDY)])["a"]

    # GPU-cache hit: a roomy pool keeps the prefix.
    roomy = make_core(folder, blocks=32)
    run(roomy, [EngineCoreRequest("a", a, GREEDY)])
    stats: list = []
    gpu_hit = run(roomy, [EngineCoreRequest("a2", a, GREEDY)], stats)["a2"]
    assert total(stats, "prefix_cache_hits") == 48

    core = make_core(folder, host_blocks=16)
    first = run(core, [EngineCoreRequest("a", a, GREEDY)])["a"]
    stats = []
    run(core, [EngineCoreRequest("b", b, GREEDY)], stats)  # evicts every block of "a"
    assert total(stats, "kv_connector_stores") >= 3 * BS
    stats = []
    host_hit = run(core, [EngineCoreRequest("a2", a, GREEDY)], stats)["a2"]
    assert total(stats, "prefix_cache_hits") == 0  # not in the pool any more
    assert total(stats, "kv_connector_hits") == 48  # ... but in host memory
    assert total(stats, "kv_connector_queries") == len(a)
    # Only the last block was computed: the three loaded ones were not.
    assert total(stats, "num_prompt_tokens") == len(a) - 48
    assert first == expected
    assert host_hit == expected
    assert gpu_hit == expected
    # reset_prefix_cache empties the host tier too.
    from tidal.engine_core.control import ResetPrefixCache, execute

    assert len(core.scheduler.connector.index) > 0
    assert execute(core, ResetPrefixCache()) is True
    assert len(core.scheduler.connector.index) == 0


def test_host_lru_keeps_the_most_recent_blocks(tiny, plain):
    """A host tier of 4 blocks: "b"'s eviction stores push "a"'s older blocks out; "a" then
    finds only what is left, in chain order from its first block (none: its first is gone)."""
    folder, vocab = tiny
    a, b = prompts(vocab)
    expected = run(plain, [EngineCoreRequest("a", a, GREEDY)])["a"]
    core = make_core(folder, host_blocks=4)
    run(core, [EngineCoreRequest("a", a, GREEDY)])
    run(core, [EngineCoreRequest("b", b, GREEDY)])
    c = [t + 1 if t + 1 < vocab else 3 for t in b]  # other tokens: evicts "b"'s blocks
    run(core, [EngineCoreRequest("c", c, GREEDY)])
    assert len(core.scheduler.connector.index) == 4  # full: the LRU evicted to make room
    stats: list = []
    out = run(core, [EngineCoreRequest("a2", a, GREEDY)], stats)["a2"]
    assert total(stats, "kv_connector_hits") == 0
    assert total(stats, "num_prompt_tokens") == len(a)
    assert out == expected


def test_eviction_under_pressure_with_host_tier_keeps_outputs_right(tiny, plain):
    """Requests sharing prefixes through an 8-block pool and a 6-block host tier: blocks go
    to host and come back all the time; outputs equal those without any caching."""
    folder, vocab = tiny
    rng = random.Random(5)
    roots = [[rng.randrange(3, vocab) for _ in range(rng.randint(33, 70))] for _ in range(3)]
    reqs = []
    for i in range(9):
        root = roots[i % 3]
        suffix = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
        params = (SamplingParams(temperature=0, max_tokens=3, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True))
        reqs.append(EngineCoreRequest(f"r{i}", root + suffix, params))
    expected = run(plain, reqs, wave=2)
    stats: list = []
    core = make_core(folder, host_blocks=6, max_num_seqs=2)
    assert run(core, reqs, stats, wave=2) == expected
    assert total(stats, "kv_connector_hits") > 0
    assert total(stats, "kv_connector_stores") > 0


@pytest.mark.parametrize("kw, match", [
    (dict(enable_prefix_caching=False, kv_offload_gb=1.0), "needs prefix caching"),
    (dict(kv_offload_gb=0.0), "--kv-offload-gb must be"),
    (dict(kv_offload_gb=-2.0), "--kv-offload-gb must be"),
    (dict(kv_transfer_config={"kv_connector": "OffloadingConnector", "kv_buffer_size": 10}),
     "holds no KV block"),
    (dict(kv_transfer_config={"kv_connector": "NoSuchConnector"}), "not a known KV connector"),
    (dict(kv_offload_gb=1.0, kv_transfer_config={"kv_connector": "OffloadingConnector"}),
     "not both"),
])
def test_bad_host_tier_configs_are_refused(tiny, kw, match):
    folder, _ = tiny
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8, **kw).create_config()


def test_sliding_window_models_are_refused(tmp_path):
    from tests.reference import make_tiny_model

    make_tiny_model("gemma2", tmp_path)
    with pytest.raises(ConfigError, match="sliding-window layers .* not yet supported"):
        EngineArgs(model=str(tmp_path), max_model_len=128, num_kv_blocks=64,
                   kv_offload_gb=1.0).create_config()
    # The way out the message names: every layer's KV in one group.
    config = EngineArgs(model=str(tmp_path), max_model_len=128, num_kv_blocks=64,
                        kv_offload_gb=1.0, disable_hybrid_kv_cache_manager=True).create_config()
    assert config.kv_transfer.kv_connector == "OffloadingConnector"


def _offload(**kv) -> dict:
    return {"kv_transfer_config": {"kv_connector": "OffloadingConnector", **kv}}


@pytest.mark.parametrize("kw, match", [
    (_offload(kv_role="kv_producer"), "kv_role must be 'kv_both'"),
    (_offload(kv_connector_extra_config={"num_cpu_blockz": 4}), "unknown key.*num_cpu_blockz"),
    (_offload(kv_connector_extra_config={"num_cpu_blocks": 4, "cpu_bytes_to_use": 10**6}),
     "not both"),
    (_offload(kv_connector_extra_config={"num_cpu_blocks": 0}), "num_cpu_blocks must be"),
    (_offload(kv_connector_extra_config={"cpu_bytes_to_use": "1GB"}), "cpu_bytes_to_use must"),
    (_offload(kv_connector_extra_config={"block_size": 64}), "block_size 64.*not yet supported"),
    (_offload(kv_connector_extra_config={"spec_name": "TieringOffloadingSpec"}),
     "spec_name.*not yet supported"),
])
def test_vllm_offload_keys_are_honoured_or_refused(tiny, kw, match):
    folder, _ = tiny
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8, **kw).create_config()


def test_vllm_offload_sizes_set_the_host_tier(tiny):
    from tidal.engine_core.kv_transfer.offloading_connector import host_tier_slots

    folder, _ = tiny
    per_block = kv_bytes_per_block(EngineArgs(model=str(folder), max_model_len=128,
                                              num_kv_blocks=8).create_config())
    for extra, slots in [({"num_cpu_blocks": 5, "block_size": BS,
                           "spec_name": "CPUOffloadingSpec"}, 5),
                         ({"cpu_bytes_to_use": 3 * per_block + 1}, 3)]:
        config = EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
                            **_offload(kv_connector_extra_config=extra)).create_config()
        assert host_tier_slots(config) == slots


def test_a_host_tier_larger_than_free_memory_is_refused(tiny, monkeypatch):
    from tidal.engine_core.kv_transfer import offloading_connector

    folder, _ = tiny
    monkeypatch.setattr(offloading_connector, "available_host_bytes", lambda: 5 * 10**8)
    with pytest.raises(ConfigError, match=r"2\.00 GB asked for \(--kv-offload-gb.* only "
                                          r"0\.50 GB of host memory is available"):
        EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
                   kv_offload_gb=2.0).create_config()
    EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
               kv_offload_gb=0.4).create_config()  # fits


def test_steps_with_nothing_to_copy_send_no_connector_message(tiny):
    """The host tier on: the prompt step carries its full blocks' write-through stores; a
    decode step that fills no block, evicts and hits nothing sends b"", so the workers make no
    connector call (2 x layers per step otherwise)."""
    import msgspec

    from tidal.engine_core.kv_transfer.offloading_connector import OffloadMeta
    from tidal.engine_core.protocol import ModelRunnerOutput
    from tidal.engine_core.request import Request
    from tidal.engine_core.scheduler import Scheduler

    folder, vocab = tiny
    config = EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
                        kv_offload_gb=0.01).create_config()
    sched = Scheduler(config)
    sched.add_request(Request.from_engine_request(
        EngineCoreRequest("r", list(range(3, 40)), GREEDY), 128, frozenset()))
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 37
    meta = msgspec.msgpack.decode(out.kv_connector_metadata, type=OffloadMeta)
    assert meta.save_block_ids == sched.kv.block_ids("r")[:2] and len(meta.save_slots) == 2
    assert not (meta.store_block_ids or meta.load_block_ids)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[5]]))
    out = sched.schedule()
    assert out.total_num_scheduled_tokens == 1 and out.kv_connector_metadata == b""
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["r"], sampled_token_ids=[[6]]))
    # A block the host does not have, evicted: stored before the forward, in the message.
    sched.connector.on_block_evicted(7, b"h")
    meta = msgspec.msgpack.decode(sched.schedule().kv_connector_metadata, type=OffloadMeta)
    assert meta.store_block_ids == [7] and meta.reused_block_ids == [7]


def test_blocks_evicted_last_first_are_stored_and_loaded_as_one_run(tiny):
    """The pool evicts a prefix's blocks last position first; the step's host slots follow the
    block ids, so the copies are one run each way (on an H100 an 8k-token host hit took longer
    than recomputing while every block was its own copy)."""
    from tidal.engine_core.kv_transfer.connector_base import KVConnectorRole
    from tidal.engine_core.kv_transfer.offloading_connector import OffloadingConnector
    from tidal.engine_core.protocol import SchedulerOutput
    from tidal.worker.kv_transfer.host_kv_store import block_runs

    folder, _ = tiny
    config = EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
                        kv_offload_gb=0.01).create_config()
    conn = OffloadingConnector(config, KVConnectorRole.SCHEDULER)
    for block in (7, 6, 5, 4):
        conn.on_block_evicted(block, b"h%d" % block)
    meta = conn.build_connector_meta(SchedulerOutput(step_id=0))
    assert meta.store_block_ids == [4, 5, 6, 7]
    assert len(block_runs(meta.store_block_ids, meta.store_slots)) == 1
    assert [conn.index.lookup(b"h%d" % b) for b in (4, 5, 6, 7)] == meta.store_slots
    conn.index.check_invariants()
    # Loaded back in position order into consecutive blocks: one run again.
    slots = [conn.index.take(b"h%d" % b) for b in (4, 5, 6, 7)]
    assert len(block_runs([0, 1, 2, 3], slots)) == 1
