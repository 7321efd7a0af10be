"""The hybrid KV cache manager on its own (no model): per-group tables over one pool, blocks
given back as they leave the window, prefix hits that need each group's blocks, and the real
per-group need when the pool runs short. Plus the scheduler picking it, and leaving models with
one group of full attention on the plain manager."""

from __future__ import annotations

import random

import msgspec
import pytest

from tidal.engine_core.hybrid_kv_cache_manager import HybridKVCacheManager
from tidal.engine_core.kv_cache_manager import KVCacheManager
from tidal.engine_core.kv_groups import build_layout
from tidal.engine_core.protocol import EngineCoreRequest, ModelRunnerOutput
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams

BS = 4
W = 10  # a token sees itself and the 9 before it


def make(windows, num_blocks=64, caching=True) -> HybridKVCacheManager:
    return HybridKVCacheManager(build_layout(windows), num_blocks, BS, caching, hash_seed=0)


def request(rid: str, prompt: list[int]) -> Request:
    return Request.from_engine_request(
        EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=64)), 1024, frozenset())


def expected_live(computed: int, total: int, window: int | None) -> set[int]:
    """Block indices a group must hold for tokens [computed, total): the blocks of positions
    first..total-1, first being the earliest position any of those tokens sees."""
    first = 0 if window is None else max(0, computed - window + 1)
    return set(range(first // BS, -(-total // BS)))


def live(kv: HybridKVCacheManager, rid: str, group: int) -> set[int]:
    table = kv.reqs[rid].tables[group]
    return {i for i, b in enumerate(table) if b is not kv.null_block}


def advance(kv: HybridKVCacheManager, req: Request, n: int) -> list[list[int]] | None:
    out = kv.allocate_slots(req, n)
    if out is not None:
        req.num_computed_tokens += n
    kv.check_invariants()
    return out


def test_sliding_group_holds_only_its_window_as_the_request_grows():
    kv = make([None, W, None, W])  # g = 2: a full group and a sliding one
    assert kv.windows == (None, W)
    req = request("a", list(range(100, 160)))
    steps = [7, 13, 20, 20] + [1] * 30  # chunked prefill, then decoding
    for n in steps:
        c = req.num_computed_tokens
        if c + n > len(req.all_token_ids):
            req.all_token_ids.append(5)
        new = advance(kv, req, n)
        assert new is not None
        for g, w in enumerate(kv.windows):
            assert live(kv, "a", g) == expected_live(c, c + n, w), (g, c, n)
        assert len(live(kv, "a", 1)) <= -(-(W - 2 + n) // BS) + 1
        # Every group's table covers the same positions; the returned entries keep them aligned.
        assert len({len(t) for t in kv.reqs["a"].tables}) == 1
        if new:
            assert len({len(ids) for ids in new}) == 1
    total = req.num_computed_tokens
    assert live(kv, "a", 0) == set(range(-(-total // BS)))
    assert len(live(kv, "a", 1)) < len(live(kv, "a", 0)) // 3
    # The pool knows which group holds what.
    assert kv.pool.group_used == [len(live(kv, "a", 0)), len(live(kv, "a", 1))]
    kv.free(req)
    kv.check_invariants()
    assert kv.pool.group_used == [0, 0] and kv.usage == 0.0


def test_dropped_blocks_stay_cached_and_a_hit_needs_only_the_window():
    kv = make([None, W], num_blocks=64)
    prompt = list(range(200, 240))  # 40 tokens: 10 blocks
    a = request("a", prompt)
    advance(kv, a, 40)
    a.all_token_ids.append(1)
    advance(kv, a, 1)  # the decode step gives back what slid out of the window
    dropped = [i for i, b in enumerate(kv.reqs["a"].tables[1]) if b is kv.null_block]
    assert dropped, "blocks before the window should have been given back"
    kv.free(a)
    b = request("b", prompt + [7, 8, 9])
    hit = kv.get_computed_blocks(b)
    assert len(hit) == 10  # (43 - 1) // 4 blocks could hit; all are cached in both groups
    # The sliding group resumes from the window at position 40 only: nulls before it.
    first = (40 - W + 1) // BS
    assert [x is kv.null_block for x in hit.tables[1]] == [i < first for i in range(10)]
    assert all(x is not kv.null_block for x in hit.tables[0])
    b.num_computed_tokens = 40
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 3, hit) is not None
    kv.check_invariants()
    # Taken from the free list: the full group's 10, the window's 10 - first, one new block
    # for positions 40..42 in each group.
    assert free_before - kv.num_free_blocks == 10 + (10 - first) + 2
    assert kv.block_ids("b")[:10] == [x.block_id for x in hit.tables[0]]
    assert kv.group_block_ids("b")[0][:first] == [kv.null_id] * first


def reference_hit(kv: HybridKVCacheManager, hashes: list[bytes], usable: int) -> int:
    """The longest n <= usable with every full group holding blocks 0..n-1 and every sliding
    group the blocks of the window at position n * BS, by trying every n."""
    for n in range(usable, 0, -1):
        ok = True
        for g, w in enumerate(kv.windows):
            first = 0 if w is None else max(0, n * BS - w + 1) // BS
            if any(hashes[i] not in kv.pool.group_cached[g] for i in range(first, n)):
                ok = False
        if ok:
            return n
    return 0


@pytest.mark.parametrize("seed", range(6))
def test_prefix_hit_is_the_longest_every_group_can_resume(seed):
    rng = random.Random(seed)
    kv = make([None, W, 2 * W + 3, None, W, 2 * W + 3], num_blocks=200)
    prompt = [rng.randrange(1000) for _ in range(60)]
    a = request("a", prompt)
    advance(kv, a, 60)
    kv.free(a)
    # Forget random cached blocks of random groups (as eviction would).
    for g, cached in enumerate(kv.pool.group_cached):
        for h in list(cached):
            if rng.random() < 0.15:
                cached.pop(h).block_hash = None
    b = request("b", prompt + [1, 2])
    hit = kv.get_computed_blocks(b)
    n = reference_hit(kv, b.block_hashes, (62 - 1) // BS)
    assert len(hit) == n
    if n:
        b.num_computed_tokens = n * BS
        assert kv.allocate_slots(b, 62 - n * BS, hit) is not None
        kv.check_invariants()


def test_shortage_counts_each_group_and_the_block_a_window_gives_back():
    kv = make([None, W], num_blocks=1 + 12)  # the null block, then 12 usable
    req = request("a", list(range(20)))
    advance(kv, req, 20)  # 5 blocks in each group: 10 used, 2 free
    assert kv.num_free_blocks == 2
    # Position 20 needs a 6th block in both groups; the window (positions 11..20) no longer
    # sees block 0 (positions 0..3) nor block 1 (4..7), so two come back: it fits.
    req.all_token_ids.append(1)
    assert advance(kv, req, 1) is not None
    assert kv.pool.group_used == [6, 4]
    # A second request of 20 tokens needs 5 + 5 with only 3 free: refused, nothing taken.
    other = request("b", list(range(50, 70)))
    free = kv.num_free_blocks
    assert kv.allocate_slots(other, 20) is None
    assert kv.num_free_blocks == free and "b" not in kv.reqs
    kv.check_invariants()


def test_without_windows_the_plain_manager_allocates_the_same_blocks():
    """One sliding group with a window longer than anything computed holds what the plain
    manager holds, block for block (plus the null block taken up front)."""
    hybrid = make([1000], num_blocks=33)
    plain = KVCacheManager(32, BS, True, hash_seed=0)
    rng = random.Random(3)
    for rid in "abc":
        r1 = request(rid, [rng.randrange(500) for _ in range(30)])
        r2 = request(rid, list(r1.all_token_ids))
        for n in (9, 11, 10):
            ids = hybrid.allocate_slots(r1, n)
            ids_plain = plain.allocate_slots(r2, n)
            assert ids is not None and ids_plain is not None
            # The hybrid pool's block 0 is its null block: its ids are one higher.
            assert (ids[0] if ids else []) == [i + 1 for i in ids_plain]
            r1.num_computed_tokens += n
            r2.num_computed_tokens += n
    hybrid.check_invariants()
    plain.check_invariants()


# --- the scheduler --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory):
    import reference

    folder = tmp_path_factory.mktemp("tiny-gemma2-kv")
    reference.make_tiny_model("gemma2", folder)  # 4 layers alternating, window 16
    return folder


def make_scheduler(folder, **kw):
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.scheduler import Scheduler

    kw.setdefault("num_kv_blocks", 48)
    args = EngineArgs(model=str(folder), block_size=BS, max_num_seqs=4,
                      max_num_batched_tokens=24, max_model_len=128, device="cpu",
                      prefix_hash_seed=0, **kw)
    return Scheduler(args.create_config())


def test_scheduler_preempts_by_the_real_per_group_need(gemma2_folder):
    s = make_scheduler(gemma2_folder)
    assert isinstance(s.kv, HybridKVCacheManager) and s.kv.windows == (None, 16)
    rng = random.Random(0)
    for i in range(4):
        prompt = [rng.randrange(500) for _ in range(30 + 7 * i)]
        s.add_request(Request.from_engine_request(
            EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=40, ignore_eos=True)),
            s.max_model_len, frozenset()))
    preemptions = steps = 0
    peak_sliding = 0
    while s.has_unfinished() and steps < 2000:
        so = s.schedule()
        steps += 1
        # Wire: group 0 in the usual fields, the other group alongside, aligned.
        cr = so.cached_reqs
        assert len(cr.new_group_block_ids) == len(cr.new_block_ids)
        for g0, rest in zip(cr.new_block_ids, cr.new_group_block_ids):
            assert len(rest) == 1 and len(rest[0]) == len(g0)
        for new in so.new_reqs:
            assert len(new.group_block_ids) == 1
            assert len(new.group_block_ids[0]) == len(new.block_ids)
        ids, toks = [], []
        for rid in so.req_ids:
            req = s.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                ids.append(rid)
                toks.append([7])
        s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))
        s.kv.check_invariants()
        stats = s.make_stats()
        preemptions += stats.num_preemptions
        assert len(stats.kv_cache_usage_groups) == 2
        assert sum(stats.kv_cache_usage_groups) == pytest.approx(stats.kv_cache_usage)
        peak_sliding = max(peak_sliding, s.kv.pool.group_used[1])
    assert not s.has_unfinished()
    assert preemptions > 0, "the pool is small enough that requests must be preempted"
    assert s.kv.pool.group_used == [0, 0]
    # The sliding group never needed as much as the full one would have.
    assert peak_sliding < 4 * -(-(30 + 7 * 3 + 40) // BS)


def test_full_attention_models_keep_the_plain_manager_and_wire(gemma2_folder, tiny_models):
    plain = make_scheduler(tiny_models["llama"][0])
    assert isinstance(plain.kv, KVCacheManager) and not plain.hybrid_kv
    disabled = make_scheduler(gemma2_folder, disable_hybrid_kv_cache_manager=True)
    assert isinstance(disabled.kv, KVCacheManager)
    for s in (plain, disabled):
        s.add_request(Request.from_engine_request(
            EngineCoreRequest("a", list(range(40)), SamplingParams(max_tokens=4)),
            s.max_model_len, frozenset()))
        so = s.schedule()
        (new,) = so.new_reqs
        assert new.group_block_ids == []
        # Nothing of the groups goes on the wire with one group.
        bare = msgspec.msgpack.encode(msgspec.structs.replace(new, group_block_ids=[]))
        assert msgspec.msgpack.encode(new) == bare
        assert s.make_stats().kv_cache_usage_groups == []


def test_a_lone_request_shrinks_its_chunk_instead_of_stalling(gemma2_folder):
    """The smallest pool the config accepts fits one token of a lone request at a time; a long
    prompt's chunks then shrink to what the window leaves room for, never preempting itself."""
    s = make_scheduler(gemma2_folder, num_kv_blocks=38)
    need = s.config.kv_layout().blocks_per_seq(128, BS)
    assert need == 38  # 32 full-attention blocks, 5 of the window, the null block
    prompt = list(range(100, 220))
    s.add_request(Request.from_engine_request(
        EngineCoreRequest("long", prompt, SamplingParams(max_tokens=8, ignore_eos=True)),
        s.max_model_len, frozenset()))
    chunks, preemptions = [], 0
    for _ in range(200):
        if not s.has_unfinished():
            break
        so = s.schedule()
        req = s.requests["long"]
        chunks.append(so.num_scheduled_tokens[0] if so.num_scheduled_tokens else 0)
        done = req.num_computed_tokens >= req.num_tokens
        s.update_from_output(so, ModelRunnerOutput(req_ids=["long"] if done else [],
                                                   sampled_token_ids=[[7]] if done else []))
        s.kv.check_invariants()
        preemptions += s.make_stats().num_preemptions
    assert not s.has_unfinished() and preemptions == 0
    prefill = chunks[:chunks.index(1)] if 1 in chunks else chunks
    assert sum(prefill) + chunks.count(1) >= len(prompt)
    assert any(0 < c < 24 for c in prefill[:-1]), f"no chunk shrank: {chunks}"
