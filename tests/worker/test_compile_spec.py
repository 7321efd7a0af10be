"""Speculative decoding with a compiled target (``--compilation-config`` mode 3): the
verification steps run the compiled forward (one trace for every step), n-gram and EAGLE-3
give the tokens of the plain engine, and the compiled target hands EAGLE-3 the same hidden
states as the eager one (the head proposes exactly the eager engine's drafts). The target
records EAGLE-3's hidden states inside its forward, so those configurations get their own
compile-cache entry."""

from __future__ import annotations

import random

import pytest
import torch

import reference
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend import LLM

VOCAB = 512
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile-spec")
    reference.make_tiny_model("llama", root / "target", vocab_size=VOCAB, hidden_size=64,
                              intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=1024)
    (root / "eagle3").mkdir()
    reference.make_eagle3_head(root / "eagle3", vocab=VOCAB, hidden=64, heads=4, kv_heads=2,
                               inter=128, draft_vocab=128, target_hidden=64)
    return root


def _prompts() -> list[dict]:
    rng = random.Random(5)
    # Repeated patterns: the n-gram drafter finds matches.
    return [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(n)] * 3}
            for n in (1, 5, 16, 9)]


def _run(models, spec, cc, device="cpu"):
    """(tokens per prompt, the drafts of every step, the compiled forward's stats or None)."""
    llm = LLM(str(models / "target"), skip_tokenizer_init=True, dtype="float32", device=device,
              num_kv_blocks=256, max_num_seqs=8, max_model_len=256, cpu_threads=1,
              speculative_config=spec, compilation_config=cc)
    try:
        scheduler = llm.engine.core.scheduler
        update = scheduler.update_from_output
        drafts: list[list[list[int]]] = []

        def recording(sched, result):
            drafts.append([list(d) for d in (result.spec_token_ids or [])])
            return update(sched, result)

        scheduler.update_from_output = recording
        tokens = [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY,
                                                               use_tqdm=False)]
        compiled = llm.engine.core.executor.worker.runner.compiled
        return tokens, drafts, None if compiled is None else compiled.stats
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_ngram_and_eagle3_with_a_compiled_target(models, tmp_path, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the compiled target's Triton pieces and CUDA graphs")
    # (On a GPU the verification steps also replay CUDA graphs of the compiled forward.)
    plain, _, _ = _run(models, None, None, device)
    eagle3 = {"method": "eagle3", "model": str(models / "eagle3"), "num_speculative_tokens": 3}
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    cc = {"mode": 3, "cache_dir": str(tmp_path)}

    tokens, drafts, stats = _run(models, ngram, cc, device)
    assert tokens == plain
    assert stats is not None and stats.dynamo_traces == 1
    assert sum(len(d) for step in drafts for d in step) > 0  # it did speculate

    eager_tokens, eager_drafts, _ = _run(models, eagle3, None, device)
    tokens, drafts, stats = _run(models, eagle3, cc, device)
    assert tokens == eager_tokens == plain
    assert drafts == eager_drafts and sum(len(d) for step in drafts for d in step) > 0
    # Its own entry (the n-gram run's pieces do not record the hidden states): compiled
    # afresh, not loaded.
    assert stats is not None and stats.dynamo_traces == 1 and stats.cache_hits == 0
    assert len(list(tmp_path.iterdir())) == 2
