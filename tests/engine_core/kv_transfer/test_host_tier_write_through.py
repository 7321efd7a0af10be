"""The host KV tier's write-through stores (scheduler side, and one in-process engine on the
CPU): a block goes to the host once, in the step after the forward that computed it, and the
pool's later eviction of it copies nothing; a host hit after that eviction gives the greedy
tokens of recomputing; the per-step store cap and the bounded queue; blocks the host lacks
when the pool evicts them are still stored then (before the forward)."""

from __future__ import annotations

import random

import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.kv_transfer.connector_base import KVConnectorRole
from tidal.engine_core.kv_transfer.offloading_connector import (
    OffloadingConnector,
    OffloadMeta,
    kv_bytes_per_block,
)
from tidal.engine_core.protocol import EngineCoreRequest, SchedulerOutput
from tidal.engine_core.sampling_params import SamplingParams

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _core(folder, *, blocks: int = 8, host_blocks: int | None = None,
          extra: dict | None = None, **kw) -> EngineCore:
    kv = None
    if host_blocks is not None:
        # (Sized with the engine's own device and dtype: a probe left at dtype "auto" resolves
        # to bfloat16 on a GPU, so a float32 engine got half the slots asked for.)
        probe = EngineArgs(model=str(folder), max_model_len=blocks * BS,
                           num_kv_blocks=blocks, **kw).create_config()
        kv = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
              "kv_buffer_size": host_blocks * kv_bytes_per_block(probe),
              "kv_connector_extra_config": extra or {}}
    args = EngineArgs(model=str(folder), max_model_len=blocks * BS, num_kv_blocks=blocks,
                      enable_prefix_caching=host_blocks is not None, kv_transfer_config=kv,
                      **kw)
    return EngineCore(args.create_config())


def _record_metas(core: EngineCore) -> list[OffloadMeta]:
    """Every step's host-tier metadata, as the scheduler built it."""
    conn = core.scheduler.connector
    metas: list[OffloadMeta] = []
    build = conn.build_connector_meta

    def recording(out):
        meta = build(out)
        metas.append(meta)
        return meta

    conn.build_connector_meta = recording
    return metas


def _run(core: EngineCore, reqs: list[EngineCoreRequest], stats: list | None = None,
         wave: int | None = None) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    while pending or core.has_unfinished_requests():
        while pending and (wave is None or core.scheduler.num_unfinished < wave):
            core.add_request(pending.pop(0))
        step = core.step()
        core.scheduler.kv.check_invariants()
        if core.scheduler.connector is not None:
            core.scheduler.connector.index.check_invariants()
        if stats is not None:
            stats.append(step.scheduler_stats)
        for o in step.outputs:
            out[o.request_id] += o.new_token_ids
    return out


def _total(stats: list, field: str) -> int:
    return sum(getattr(s, field) for s in stats)


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, hf = tiny_models["llama"]
    return folder, hf.config.vocab_size


@pytest.fixture(scope="module")
def plain(tiny):
    """Recompute everything: the same pool, no prefix caching, no host tier."""
    return _core(tiny[0])


def test_a_block_is_stored_once_as_computed_and_not_again_on_eviction(tiny, plain):
    folder, vocab = tiny
    rng = random.Random(11)
    a = [rng.randrange(3, vocab) for _ in range(64)]  # 4 full blocks
    b = [rng.randrange(3, vocab) for _ in range(120)]  # + 4 tokens: 7 full, every pool block
    expected = _run(plain, [EngineCoreRequest("a", a, GREEDY)])["a"]
    core = _core(folder, host_blocks=16)
    metas = _record_metas(core)
    index = core.scheduler.connector.index

    assert _run(core, [EngineCoreRequest("a", a, GREEDY)])["a"] == expected
    # a's prompt step registered its 4 blocks; that step's message saves them (after its
    # forward), so the host has them before anything evicts them.
    saved_a = [m.save_block_ids for m in metas if m.save_block_ids]
    assert len(saved_a) == 1 and len(saved_a[0]) == 4
    n_meta = len(metas)
    stats: list = []
    _run(core, [EngineCoreRequest("b", b, GREEDY)], stats)
    later = metas[n_meta:]
    # b takes every pool block: a's 4 are reused, and none is copied again (no eviction
    # store); their ids travel only so a store still in flight is waited for.
    assert not any(m.store_block_ids for m in later)
    assert len({bid for m in later for bid in m.reused_block_ids}) >= 4
    assert sum(len(m.save_block_ids) for m in later) == 7  # b's own blocks, once each
    assert _total(stats, "kv_connector_stores") == 7 * BS
    saved = [bid for m in metas for bid in m.save_block_ids]
    slots = [s for m in metas for s in m.save_slots]
    assert len(saved) == 11 and len(set(slots)) == 11 and len(index) == 11

    # The host hit after the eviction: 3 blocks loaded (the 4th is computed, a token must be),
    # the same greedy tokens as recomputing everything, and still nothing stored again.
    stats = []
    n_meta = len(metas)
    hit = _run(core, [EngineCoreRequest("a2", a, GREEDY)], stats)["a2"]
    assert _total(stats, "kv_connector_hits") == 3 * BS
    assert _total(stats, "num_prompt_tokens") == len(a) - 3 * BS
    assert hit == expected
    assert sum(len(m.save_block_ids) + len(m.store_block_ids) for m in metas[n_meta:]) == 0
    assert len(index) == 11


def _connector(folder, **extra) -> OffloadingConnector:
    config = EngineArgs(model=str(folder), max_model_len=128, num_kv_blocks=8,
                        kv_transfer_config={
                            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                            "kv_connector_extra_config": dict(num_cpu_blocks=64, **extra)},
                        ).create_config()
    return OffloadingConnector(config, KVConnectorRole.SCHEDULER)


def _step(conn: OffloadingConnector) -> OffloadMeta:
    return conn.build_connector_meta(SchedulerOutput(step_id=0))


def test_store_cap_per_step_and_the_bounded_queue(tiny):
    folder, _ = tiny
    conn = _connector(folder, store_blocks_per_step=2)
    for i in range(5):
        conn.on_block_cached(i, b"h%d" % i)
    # FIFO, two a step.
    assert [_step(conn).save_block_ids for _ in range(4)] == [[0, 1], [2, 3], [4], []]
    assert conn.take_stats().stores == 5 * BS

    # The queue holds 16 steps' worth (32 blocks): the oldest overflow is dropped first.
    assert conn.max_queue == 32
    for i in range(40):
        conn.on_block_cached(100 + i, b"q%d" % i)
    assert conn.dropped == 8
    assert _step(conn).save_block_ids == [108, 109]
    # A block the host has already (stored, or loaded from it) is not queued again.
    conn.on_block_cached(55, b"h0")
    assert b"h0" not in conn._queue


def test_evictions_store_only_what_the_host_lacks(tiny):
    folder, _ = tiny
    conn = _connector(folder, store_blocks_per_step=1)
    conn.on_block_cached(1, b"old")
    conn.on_block_cached(2, b"queued")
    assert _step(conn).save_block_ids == [1]  # b"queued" waits for the next step
    conn.on_block_cached(3, b"now")
    # This step reuses all three: b"old" is on the host (nothing copied); b"queued" is not
    # yet (stored before the forward overwrites it); b"now" was registered this very step,
    # its K/V never computed (dropped).
    for block, h in ((1, b"old"), (2, b"queued"), (3, b"now")):
        conn.on_block_evicted(block, h)
    meta = _step(conn)
    assert meta.reused_block_ids == [1, 2, 3]
    assert meta.store_block_ids == [2] and meta.save_block_ids == []
    assert b"queued" in conn.index and b"now" not in conn.index
    # The host LRU had made b"old" its most recent entry on that eviction.
    assert list(conn.index._slots)[-2:] == [b"old", b"queued"]
    conn.index.check_invariants()


def test_a_tiny_store_cap_keeps_outputs_right_under_pressure(tiny, plain):
    """One block stored per step through an 8-block pool and a 6-block host tier: blocks are
    stored as computed, on eviction when the queue lags, and loaded back; outputs equal
    recomputing everything."""
    folder, vocab = tiny
    rng = random.Random(5)
    roots = [[rng.randrange(3, vocab) for _ in range(rng.randint(33, 70))] for _ in range(3)]
    reqs = []
    for i in range(6):
        suffix = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 20))]
        params = (SamplingParams(temperature=0, max_tokens=3, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=1.0, seed=i, max_tokens=3, ignore_eos=True))
        reqs.append(EngineCoreRequest(f"r{i}", roots[i % 3] + suffix, params))
    expected = _run(plain, reqs, wave=2)
    core = _core(folder, host_blocks=6, max_num_seqs=2,
                 extra={"store_blocks_per_step": 1})
    metas = _record_metas(core)
    stats: list = []
    assert _run(core, reqs, stats, wave=2) == expected
    assert _total(stats, "kv_connector_hits") > 0
    assert any(m.store_block_ids for m in metas)  # the eviction fallback ran
    assert any(m.save_block_ids for m in metas)
    assert max(len(m.save_block_ids) for m in metas) == 1


@pytest.mark.parametrize("value", [0, -1, "8", 2**21])
def test_bad_store_caps_are_refused(tiny, value):
    from tidal.engine_core.config import ConfigError

    folder, _ = tiny
    with pytest.raises(ConfigError, match="store_blocks_per_step must be"):
        _connector(folder, store_blocks_per_step=value)


@pytest.mark.gpu
def test_host_hit_on_gpu_gives_the_tokens_of_recompute(tmp_path):
    """On a GPU (pinned host tier, side-stream stores and loads, CUDA graphs): a prefix stored
    as computed, evicted without a copy and loaded back gives the greedy tokens of recomputing
    it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the host tier's side-stream copies in a running engine "
                    "(unrun on CPU)")
    from tests.reference import make_tiny_model

    # 64-wide heads (what the GPU attention kernels are built for), float32 for exact tokens.
    make_tiny_model("llama", tmp_path, vocab_size=512, hidden_size=256, intermediate_size=512,
                    num_attention_heads=4, num_key_value_heads=2)
    kw = dict(device="cuda", dtype="float32", ops_backend="triton", max_num_seqs=4)
    rng = random.Random(3)
    a = [rng.randrange(3, 512) for _ in range(64)]
    b = [rng.randrange(3, 512) for _ in range(120)]
    plain_gpu = _core(tmp_path, **kw)
    expected = _run(plain_gpu, [EngineCoreRequest("a", a, GREEDY)])["a"]
    plain_gpu.shutdown()
    core = _core(tmp_path, host_blocks=16, **kw)
    # a's 4 blocks and b's 7 fit the tier; 8 slots (the tier sized for bfloat16) kept only
    # one of a's blocks (the LRU dropped the rest for b's): 16 hit tokens, not 48.
    assert core.scheduler.connector.num_slots == 16
    metas = _record_metas(core)
    assert _run(core, [EngineCoreRequest("a", a, GREEDY)])["a"] == expected
    _run(core, [EngineCoreRequest("b", b, GREEDY)])
    stats: list = []
    hit = _run(core, [EngineCoreRequest("a2", a, GREEDY)], stats)["a2"]
    assert _total(stats, "kv_connector_hits") == 3 * BS
    assert hit == expected
    assert not any(m.store_block_ids for m in metas)  # evictions copied nothing
    store = core.executor.worker.runner.kv_hooks.connector.store
    assert store.on_gpu and store.host[0].is_pinned()
    core.shutdown()
