"""Pipeline parallelism on CPU (gloo): greedy tokens at PP=2 and TP=2 x PP=2 equal a single
worker's exactly, with the EngineCore keeping two steps in flight (one per stage)."""

from __future__ import annotations

import random

import pytest

from tidal.frontend import LLM, SamplingParams
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.models.decoder import layer_range

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 50))] for _ in range(n)]


def _engine(folder, **kw) -> LLM:
    # max_num_seqs below the number of prompts: the scheduler fills a second batch from the
    # waiting queue while the first is still in the pipeline.
    # On the CPU whatever the machine (see test_tensor_parallel._generate).
    return LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, cpu_threads=1,
               max_num_seqs=4, max_num_batched_tokens=96, device="cpu", **kw)


def _collective_segments(pid: int) -> int:
    """How many shared-memory collective segments (``shm_collectives``) process ``pid`` maps."""
    import psutil

    return sum("tidal-coll-" in m.path for m in psutil.Process(pid).memory_maps())


def _tokens(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,pp", [("llama", 1, 2), ("qwen3", 2, 2)],
                         ids=["llama-pp2", "qwen3-tp2xpp2"])
def test_pipeline_matches_single_worker(tiny_models, family, tp, pp):
    folder, hf = tiny_models[family]
    prompts = _prompts(10, hf.config.vocab_size)
    single = _engine(folder)
    try:
        reference = _tokens(single, prompts)
    finally:
        single.shutdown()
    llm = _engine(folder, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  distributed_executor_backend="mp")
    core = llm.engine.core
    assert core.executor.max_concurrent_batches == pp
    depth: list[int] = []
    launch = core.executor.execute_model

    def spy(so, non_block=False):
        out = launch(so, non_block)
        depth.append(len(core.batch_queue) + 1)  # this step, plus those already in flight
        return out

    core.executor.execute_model = spy
    try:
        got = _tokens(llm, prompts)
        # CPU workers of the mp executor talk over shared memory by default (--cpu-collectives
        # auto): every rank maps one segment per group it is in (tensor and/or pipeline).
        segments = [_collective_segments(pid) for pid in core.executor.worker_pids]
    finally:
        llm.shutdown()
    assert got == reference
    assert segments == [(tp > 1) + (pp > 1)] * (tp * pp), segments
    assert max(depth) == pp, depth  # the pipeline was kept full at some point


def test_layer_split_covers_every_layer_once():
    for n_layers in (1, 3, 7, 32):
        for stages in range(1, n_layers + 1):
            ranges = [layer_range(n_layers, ParallelGroup(rank=s, world_size=stages))
                      for s in range(stages)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n_layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [e - s for s, e in ranges]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
