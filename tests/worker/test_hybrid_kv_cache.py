"""The hybrid KV cache manager end to end: tiny Gemma 2, Gemma 3 and Mistral models (random
weights, CPU) generate HF transformers' greedy tokens with prompts and outputs longer than their
16-token window, while their sliding-window groups give blocks back: with chunked prefill, a
prefix-cache hit and preemptions in the same run, and holding fewer blocks than the same model
with every layer kept whole."""

from __future__ import annotations

import random

import pytest

import reference
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.hybrid_kv_cache_manager import HybridKVCacheManager
from tidal.engine_core.kv_cache_manager import KVCacheManager
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams

NEW_TOKENS = 24
BLOCK = 4
# family -> (HF overrides, pool blocks: small enough that four requests preempt each other)
FAMILIES = {
    "gemma2": ({}, 64),  # 2 full + 2 sliding layers: g = 2, groups (full, sliding)
    "gemma3": ({}, 128),  # 1 full + 5 sliding: g = 1, six groups
    "mistral": ({"sliding_window": 16, "attn_implementation": "eager"}, 20),  # one sliding
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    family = request.param
    overrides, blocks = FAMILIES[family]
    folder = tmp_path_factory.mktemp(f"hybrid-{family}")
    hf = reference.make_tiny_model(family, folder, **overrides)
    rng = random.Random(11)
    vocab = hf.config.vocab_size
    shared = [rng.randrange(vocab) for _ in range(48)]
    prompts = {f"p{n}": [rng.randrange(vocab) for _ in range(n)] for n in (23, 61, 97)}
    prompts["p40"] = [rng.randrange(vocab) for _ in range(40)]
    # Sent after "s1" finished: its first 48 tokens are a prefix-cache hit.
    prompts["s1"] = shared + [rng.randrange(vocab) for _ in range(9)]
    prompts["s2"] = shared + [rng.randrange(vocab) for _ in range(30)]
    refs = {rid: reference.hf_greedy(hf, p, NEW_TOKENS)[0] for rid, p in prompts.items()}
    return family, folder, blocks, prompts, refs


def run(core: EngineCore, prompts: dict[str, list[int]], waves: list[list[str]]):
    """Each wave's requests run together to completion; returns (tokens per request, the
    step stats, the most pool blocks held at once)."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out: dict[str, list[int]] = {}
    stats, peak = [], 0
    for wave in waves:
        for rid in wave:
            out[rid] = []
            core.add_request(EngineCoreRequest(rid, prompts[rid], params))
        while core.has_unfinished_requests():
            step = core.step()
            kv = core.scheduler.kv
            kv.check_invariants()
            peak = max(peak, kv.pool.num_blocks - kv.pool.num_reserved - kv.num_free_blocks)
            if step.scheduler_stats is not None:
                stats.append(step.scheduler_stats)
            for o in step.outputs:
                out[o.request_id] += o.new_token_ids
    return out, stats, peak


def make_core(folder, **kw) -> EngineCore:
    args = EngineArgs(model=str(folder), block_size=BLOCK, max_num_seqs=4,
                      max_num_batched_tokens=32, max_model_len=160, dtype="float32",
                      device="cpu", prefix_hash_seed=0, **kw)
    return EngineCore(args.create_config())


def test_hybrid_matches_hf_with_chunks_hits_and_preemption(model):
    family, folder, blocks, prompts, refs = model
    core = make_core(folder, num_kv_blocks=blocks)
    kv = core.scheduler.kv
    assert isinstance(kv, HybridKVCacheManager) and kv.sliding_groups
    waves = [["p23", "p61", "p97", "p40"], ["s1"], ["s2"]]
    got, stats, _ = run(core, prompts, waves)
    for rid, tokens in got.items():
        assert tokens == refs[rid], f"{family} {rid} ({len(prompts[rid])} prompt tokens)"
    assert sum(s.num_preemptions for s in stats) > 0, "the small pool must preempt"
    assert sum(s.prefix_cache_hits for s in stats) >= 48 // BLOCK * BLOCK
    assert all(len(s.kv_cache_usage_groups) == len(kv.windows) for s in stats)
    assert kv.num_free_blocks + kv.pool.num_reserved == kv.pool.num_blocks


def test_hybrid_holds_fewer_blocks_than_all_full(model):
    """The same requests, one at a time (no preemption), on the same amount of KV memory: the
    sliding groups' blocks are given back, so the hybrid pool's peak is a smaller share."""
    family, folder, _, prompts, refs = model
    hybrid = make_core(folder, num_kv_blocks=400)
    full = make_core(folder, num_kv_blocks=400, disable_hybrid_kv_cache_manager=True)
    assert isinstance(full.scheduler.kv, KVCacheManager)
    layout = hybrid.config.kv_layout()
    n_layers = len(layout.layer_group)
    got_h, _, peak_h = run(hybrid, prompts, [["p97"]])
    got_f, _, peak_f = run(full, prompts, [["p97"]])
    assert got_h == got_f == {"p97": refs["p97"]}
    # Memory in layer-blocks: a hybrid block holds g layers, an all-full block every layer.
    assert peak_h * layout.group_size < peak_f * n_layers
    assert layout.has_sliding and peak_f == -(-(97 + NEW_TOKENS - 1) // BLOCK)


def test_torch_backend_never_reads_entries_before_the_window():
    """A windowed group's table keeps stale ids where it gave blocks back: pointing them at a
    block of NaNs must not change the output (the backend skips those blocks)."""
    import numpy as np
    import torch

    from tidal.worker.attention.backend import AttentionMetadata
    from tidal.worker.attention.torch_backend import TorchAttention

    gen = torch.Generator().manual_seed(0)
    window, seq, q_len, heads, kv_heads, dim = 9, 43, 3, 4, 2, 8
    n_blocks = -(-seq // BLOCK)
    cache = torch.randn(2, n_blocks + 1, BLOCK, kv_heads, dim, generator=gen)
    cache[:, n_blocks] = float("nan")  # the block the stale entries point at
    query = torch.randn(q_len, heads, dim, generator=gen)
    first_seen = seq - q_len - window + 1  # the first query's earliest key
    outs = []
    for stale in (False, True):
        table = torch.arange(n_blocks, dtype=torch.int32)
        if stale:
            table[:first_seen // BLOCK] = n_blocks
        qsl, lens = np.array([0, q_len], np.int32), np.array([seq], np.int32)
        meta = AttentionMetadata(
            num_actual_tokens=q_len, num_reqs=1, max_query_len=q_len, max_seq_len=seq,
            query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(lens),
            block_table=table[None], slot_mapping=torch.full((q_len,), -1, dtype=torch.int64),
            query_start_loc_cpu=qsl, seq_lens_cpu=lens)
        out = torch.empty_like(query)
        TorchAttention().forward(query, cache, meta, dim**-0.5, out, sliding_window=window)
        outs.append(out)
    assert first_seen // BLOCK >= 2 and not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
