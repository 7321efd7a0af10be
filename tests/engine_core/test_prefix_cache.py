"""Prefix caching: same outputs as without it, only suffixes computed, safe under eviction,
salts isolate."""

from __future__ import annotations

import random

import pytest

from tidal.engine_core import cli as engine_cli
from tidal.engine_core.block_hash import BlockHasher
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams


def make_core(folder, caching: bool, **kw) -> EngineCore:
    kw.setdefault("num_kv_blocks", 512)
    args = EngineArgs(model=str(folder), enable_prefix_caching=caching, max_model_len=512,
                      prefix_hash_seed=kw.pop("seed", None), **kw)
    return EngineCore(args.create_config())


def run(core: EngineCore, reqs: list[EngineCoreRequest], stats: list | None = None,
        wave: int | None = None) -> dict[str, list[int]]:
    """Run requests to completion (``wave`` at a time), checking pool invariants every step."""
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    pending = list(reqs)
    while pending or core.has_unfinished_requests():
        while pending and (wave is None or core.scheduler.num_unfinished < wave):
            core.add_request(pending.pop(0))
        step = core.step()
        core.scheduler.kv.check_invariants()
        if stats is not None:
            stats.append(step.scheduler_stats)
        for o in step.outputs:
            out[o.request_id] += o.new_token_ids
    assert core.scheduler.kv.num_free_blocks == core.config.cache.num_blocks
    return out


def shared_prefix_requests(vocab: int, n: int, seed: int = 0) -> list[EngineCoreRequest]:
    """Requests sharing prefixes of varied lengths (mid-block ends, whole-prompt repeats)."""
    rng = random.Random(seed)
    roots = [[rng.randrange(vocab) for _ in range(rng.randint(20, 90))] for _ in range(3)]
    reqs = []
    for i in range(n):
        root = roots[i % 3]
        cut = rng.choice([len(root), 16, 17, 33, 47, len(root) - 1])
        suffix = [] if i % 5 == 0 else [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        params = (SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True))
        reqs.append(EngineCoreRequest(f"r{i}", root[:cut] + suffix, params))
    return reqs


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, hf = tiny_models["llama"]
    return folder, hf.config.vocab_size


def test_outputs_identical_with_and_without_caching(tiny):
    folder, vocab = tiny
    reqs = shared_prefix_requests(vocab, 30)
    off = run(make_core(folder, False), reqs, wave=6)
    stats: list = []
    on = run(make_core(folder, True), reqs, stats, wave=6)
    assert on == off
    assert sum(s.prefix_cache_hits for s in stats) > 0, "the workload should hit the cache"


def test_only_the_suffix_is_computed(tiny):
    folder, vocab = tiny
    rng = random.Random(1)
    prefix = [rng.randrange(vocab) for _ in range(400)]
    core = make_core(folder, True, max_num_batched_tokens=1024)
    first = EngineCoreRequest("first", prefix + [5, 6, 7],
                              SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    run(core, [first])
    stats: list = []
    follow = [EngineCoreRequest(f"f{i}", prefix + [rng.randrange(vocab) for _ in range(9)],
                                SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
              for i in range(4)]
    run(core, follow, stats)
    computed = sum(s.num_prompt_tokens for s in stats)
    hit = sum(s.prefix_cache_hits for s in stats)
    assert hit == 4 * (400 // 16) * 16  # every full block of the shared prefix
    assert computed == 4 * (409 - 400 // 16 * 16)  # the suffix, from the last partial block


def test_whole_prompt_hit_still_computes_one_token(tiny):
    folder, _ = tiny
    core = make_core(folder, True)
    prompt = list(range(1, 33))  # exactly two blocks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    a = run(core, [EngineCoreRequest("a", prompt, params)])
    stats: list = []
    b = run(core, [EngineCoreRequest("b", prompt, params)], stats)
    assert a["a"] == b["b"]
    assert sum(s.prefix_cache_hits for s in stats) == 16  # the last block is recomputed
    assert sum(s.num_prompt_tokens for s in stats) == 16


def test_eviction_under_pressure_keeps_outputs_right(tiny):
    folder, vocab = tiny
    reqs = shared_prefix_requests(vocab, 40, seed=3)
    expected = run(make_core(folder, False), reqs)
    # 40 blocks cannot hold every prefix: cached blocks get evicted and reused constantly.
    tight = make_core(folder, True, num_kv_blocks=40, max_num_seqs=4)
    assert run(tight, reqs) == expected


def test_salts_never_share_blocks(tiny):
    folder, _ = tiny
    core = make_core(folder, True)
    prompt = list(range(3, 70))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    stats: list = []
    run(core, [EngineCoreRequest("a", prompt, params, cache_salt="alice")], stats)
    run(core, [EngineCoreRequest("b", prompt, params, cache_salt="bob")], stats)
    run(core, [EngineCoreRequest("c", prompt, params)], stats)
    assert sum(s.prefix_cache_hits for s in stats) == 0
    run(core, [EngineCoreRequest("d", prompt, params, cache_salt="alice")], stats)
    assert sum(s.prefix_cache_hits for s in stats) == 64


def test_reset_prefix_cache(tiny):
    folder, _ = tiny
    core = make_core(folder, True)
    prompt = list(range(3, 70))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run(core, [EngineCoreRequest("a", prompt, params)])
    assert core.scheduler.kv.reset_prefix_cache()
    stats: list = []
    run(core, [EngineCoreRequest("b", prompt, params)], stats)
    assert sum(s.prefix_cache_hits for s in stats) == 0


def test_block_hashes_chain_and_seed():
    def req(tokens, salt=None):
        return Request.from_engine_request(
            EngineCoreRequest("x", tokens, SamplingParams(), cache_salt=salt), 4096, frozenset())

    h = BlockHasher(4, seed=7)
    a = h.update(req([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = h.update(req([1, 2, 3, 4, 5, 6, 7, 0]))
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # chained: a prefix shares hashes
    c = h.update(req([9, 2, 3, 4, 5, 6, 7, 8]))
    assert c[1] != a[1]  # a different first block changes every later hash
    assert h.update(req([1, 2, 3, 4], salt="s"))[0] != a[0]
    assert BlockHasher(4, seed=7).update(req([1, 2, 3, 4]))[0] == a[0]
    assert BlockHasher(4).update(req([1, 2, 3, 4]))[0] != BlockHasher(4).update(
        req([1, 2, 3, 4]))[0], "unseeded hashers must differ (random per-process seed)"


def test_busy_engine_logs_hit_rate(tiny, caplog):
    folder, _ = tiny
    core = make_core(folder, True)
    core.stats_logger.interval_s = 0.0
    prompt = list(range(3, 70))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    run(core, [EngineCoreRequest("a", prompt, params)])
    with caplog.at_level("INFO", logger="tidal.engine_core.stats_logger"):
        run(core, [EngineCoreRequest("b", prompt, params)])
    lines = [r.getMessage() for r in caplog.records if "prefix cache hit rate" in r.getMessage()]
    assert lines and "KV cache usage" in lines[0]
    assert any("hit rate: 47.8%" in line for line in lines), lines  # 64 of 134 tokens looked up


def test_disable_log_stats_silences_the_engine(tiny, caplog):
    """--disable-log-stats (an engine flag: serve passes it to every engine) leaves the
    EngineCore's periodic stats line out."""
    folder, _ = tiny
    core = make_core(folder, True, disable_log_stats=True)
    assert core.config.log_stats is False
    core.stats_logger.interval_s = 0.0
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with caplog.at_level("INFO", logger="tidal.engine_core.stats_logger"):
        run(core, [EngineCoreRequest("a", list(range(3, 40)), params)])
    assert not [r for r in caplog.records if "KV cache usage" in r.getMessage()]
    ns = engine_cli.build_parser().parse_args(["--model", str(folder), "--disable-log-stats"])
    assert engine_cli.engine_args_from(ns).disable_log_stats is True
