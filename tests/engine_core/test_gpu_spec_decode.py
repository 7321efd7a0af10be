"""Speculative decoding on the GPU: the uniform propose step replays its CUDA graphs
(``spec_decode.uniform_propose``), and what it drafts is what the same step run eagerly drafts;
greedy output stays the plain engine's; a draft that is the target itself has every draft
accepted through the graphs; the n-gram lookup runs on the device.

Tiny random-weight models with 64-wide heads (what the GPU attention kernels are built for), in
float32 so that token equality across paths is meaningful.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests replay the propose step's CUDA graphs",
                allow_module_level=True)

import reference  # noqa: E402
from tidal.engine_core.sampling_params import SamplingParams  # noqa: E402
from tidal.frontend import LLM  # noqa: E402

K = 3
VOCAB = 512
TARGET = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
OPS = os.environ.get("TIDAL_GPU_TEST_OPS", "triton")
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-spec")
    out = {"target": root / "target", "draft": root / "draft", "eagle3": root / "eagle3"}
    reference.make_tiny_model("llama", out["target"], **TARGET)
    reference.make_tiny_model("qwen2", out["draft"], seed=1, vocab_size=VOCAB, hidden_size=128,
                              intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, max_position_embeddings=1024)
    out["eagle3"].mkdir()
    reference.make_eagle3_head(out["eagle3"], vocab=VOCAB, hidden=256, heads=4, kv_heads=2,
                               inter=512, draft_vocab=128, target_hidden=256)
    return out


def _prompts() -> list[dict]:
    rng = random.Random(5)
    # Repeated patterns: some drafts are accepted even from random weights.
    return [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(n)] * 3}
            for n in (1, 5, 16, 17, 40, 3, 9)]


def _llm(target, spec=None, **kw) -> LLM:
    return LLM(str(target), skip_tokenizer_init=True, dtype="float32", device="cuda",
               num_kv_blocks=512, max_num_seqs=8, max_model_len=512, ops_backend=OPS,
               speculative_config=spec, **kw)


def _spec(method: str, model) -> dict:
    return {"method": method, "model": str(model), "num_speculative_tokens": K,
            "disable_by_batch_size": None, "disable_by_acceptance": False}


def _run(llm: LLM) -> tuple[list[list[int]], list[tuple[int, list[int]]], tuple[int, int]]:
    """Tokens per prompt, the drafts proposed (with the sequence length they follow), and
    (draft tokens, accepted tokens) over the run."""
    core = llm.engine.core
    scheduler = core.scheduler
    update = scheduler.update_from_output
    record = core.stats_logger.record
    drafts: list[tuple[int, list[int]]] = []
    counts = [0, 0]

    def recording(sched, result):
        outputs = update(sched, result)
        for rid, d in zip(result.req_ids, result.spec_token_ids or []):
            req = scheduler.requests.get(rid)
            if d and req is not None:
                drafts.append((len(req.all_token_ids), list(d)))
        return outputs

    def counting(stats, *args):
        counts[0] += stats.spec_num_draft_tokens
        counts[1] += stats.spec_num_accepted_tokens
        return record(stats, *args)

    scheduler.update_from_output = recording
    core.stats_logger.record = counting
    try:
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    finally:
        scheduler.update_from_output = update
        core.stats_logger.record = record
    return [o.outputs[0].token_ids for o in outs], drafts, (counts[0], counts[1])


def _drafter(llm: LLM):
    return llm.engine.core.executor.worker.runner.spec.drafter


@pytest.fixture(scope="module")
def plain(models):
    llm = _llm(models["target"])
    try:
        return _run(llm)[0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_graphed_proposals_equal_eager_ones(models, plain, method):
    runs = {}
    for eager in (False, True):
        llm = _llm(models["target"], _spec(method, models[method if method == "eagle3"
                                                           else "draft"]),
                   enforce_eager=eager)
        try:
            drafter = _drafter(llm)
            assert (drafter.graphs is None) == eager
            runs[eager] = _run(llm)
            assert drafter.uniform_steps > 0
            # Graphed steps launch from the verify step's device outputs (an EAGLE-3 head's
            # and a draft model's alike).
            assert (drafter.early_steps > 0) == (not eager)
        finally:
            llm.shutdown()
    for tokens, drafts, _ in runs.values():
        assert tokens == plain
    assert runs[False][1] == runs[True][1]


def test_the_target_as_its_own_draft_through_the_graphs(models, plain):
    llm = _llm(models["target"], _spec("draft_model", models["target"]))
    try:
        tokens, _, (n_drafted, accepted) = _run(llm)
        assert _drafter(llm).graphs is not None and _drafter(llm).uniform_steps > 0
    finally:
        llm.shutdown()
    assert tokens == plain
    assert n_drafted > 0 and accepted == n_drafted


def test_ngram_lookup_runs_on_the_device(models, plain):
    """On a GPU the prompt lookup is batched on the device (``spec_decode.ngram_device``): the
    repeated prompts give drafts that are accepted, and greedy output is the plain engine's,
    with async scheduling (n-gram steps pipelined, their drafts left on the device) and
    without."""
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": None,
            "disable_by_acceptance": False}
    for async_on in (True, False):
        llm = _llm(models["target"], spec, async_scheduling=async_on)
        try:
            assert llm.engine.core.executor.worker.runner.spec.device_proposer is not None
            tokens, drafts, (n_drafted, accepted) = _run(llm)
        finally:
            llm.shutdown()
        assert tokens == plain
        assert drafts and n_drafted > 0 and accepted > 0
