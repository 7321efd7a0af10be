"""The start-up warm-up (``tidal.worker.warmup``) on CPU: it drives every sampling path through
the worker's real step path, leaves the runner as it found it (no request, nothing in flight,
every KV block free, the same tokens and random draws as an engine that never warmed up), and
its plan of attention launches covers every launch a served step can make. The GPU side
(zero JIT compiles after ready under a served workload) is ``test_gpu_warmup.py``."""

from __future__ import annotations

import logging
import re

import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.control import GetCompileStats, GetKVStats, ResetPrefixCache
from tidal.frontend import LLM, SamplingParams
from tidal.worker.warmup import Warmup, warm_up
from tidal.worker.worker import Worker

PROMPTS = [[5, 9, 2, 7, 1], list(range(3, 40)), [11] * 17]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=7, max_tokens=12,
                       ignore_eos=True),
        # Unseeded: equal only if the warm-up gave back the random state it used.
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, presence_penalty=0.5,
                       repetition_penalty=1.1),
    ]


def _llm(folder, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(str(folder), skip_tokenizer_init=True, max_model_len=256, cpu_threads=1, **kw)


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Each request's tokens and logprobs (token -> logprob per position, where asked)."""
    outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [{t: lp.logprob for t, lp in pos.items()} for pos in c.logprobs or []]
        res.append((list(c.token_ids), lps))
    return res


class _Spy:
    """Wraps the runner's sampler, prompt logprobs and placeholder fill, recording each call."""

    def __init__(self, runner) -> None:
        self.metas = []
        self.prompt_logprobs = 0
        self.fills: list[str] = []  # how each step got inputs sampled by the step before
        sampler, prompt_lp, fill = runner.sampler, runner._prompt_logprobs, \
            runner._placeholder_fill

        def placeholder_fill(*args):
            out = fill(*args)
            self.fills.append("none" if out is None else "all" if out[0] is None else "some")
            return out

        def sample(logits, meta):
            self.metas.append(meta)
            return sampler(logits, meta)

        def prompt(*args):
            out = prompt_lp(*args)
            self.prompt_logprobs += len(out)
            return out

        runner.sampler = sample
        runner._prompt_logprobs = prompt
        runner._placeholder_fill = placeholder_fill


def _assert_every_feature(spy: _Spy, config) -> None:
    metas = spy.metas
    assert any(not m.all_greedy and not m.all_random for m in metas), \
        "no batch mixing greedy and sampled rows"
    for field in ("top_k", "top_p", "min_p", "output_counts", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "bias_rows", "ban_rows"):
        assert any(getattr(m, field) is not None for m in metas), f"{field} never used"
    assert any(m.seeded_rows is not None for m in metas), "no seeded row"
    assert max(m.max_num_logprobs or 0 for m in metas) == config.runner.max_logprobs
    assert spy.prompt_logprobs > 0, "no prompt logprobs"


def test_warmup_samples_every_way_and_leaves_the_runner_clean(tiny_models):
    folder, _ = tiny_models["qwen3"]
    config = EngineArgs(model=str(folder), num_kv_blocks=128, max_model_len=256,
                        cpu_threads=1, async_scheduling=True, device="cpu").create_config()
    worker = Worker(config)
    worker.load_model()
    runner = worker.runner
    spy = _Spy(runner)
    worker.init_kv_cache(worker.determine_num_blocks())

    report = worker.warmup
    # On a CPU: a prompt step and a decode step of one batch, then the step that ends it.
    assert report is not None and report.sampling_steps == 2 and report.steps == 3
    assert "CPU" in report.skipped and report.wide_steps == report.attention_steps == 0
    _assert_every_feature(spy, config)

    # Clean: no request, nothing in flight, nothing linking the next step to a warm-up one.
    assert len(runner.batch) == 0 and not runner._inflight
    assert (runner._index_of_row == -1).all() and len(runner._last_sampled_rows) == 0
    assert runner.batch._free_rows[-1] == 0  # rows are handed out from 0 again
    assert worker.ready and worker.compile_stats().ready
    assert not worker.compile_stats().active  # no triton on a CPU worker
    worker.shutdown()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_served_tokens_are_those_of_an_engine_without_warmup(tiny_models, monkeypatch,
                                                             async_scheduling):
    folder, _ = tiny_models["llama"]
    monkeypatch.setenv("TIDAL_WARMUP", "0")
    cold = _llm(folder, async_scheduling=async_scheduling)
    try:
        assert cold.engine.core.executor.worker.warmup is None
        expected = _run(cold)
    finally:
        cold.shutdown()
    monkeypatch.delenv("TIDAL_WARMUP")
    warm = _llm(folder, async_scheduling=async_scheduling)
    try:
        assert warm.engine.core.executor.worker.warmup.steps > 0
        stats = warm.engine.call(GetKVStats())
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0
        assert _run(warm) == expected
    finally:
        warm.shutdown()


def test_warming_up_again_changes_nothing_served(tiny_models):
    """Same greedy request before and after a second warm-up on the live engine (the
    warm-up writes into free KV blocks, so cached prefixes are dropped first, as at
    start-up where there are none)."""
    folder, _ = tiny_models["qwen3"]
    llm = _llm(folder)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy,
                                                               use_tqdm=False)]
        core = llm.engine.core
        assert llm.engine.call(ResetPrefixCache()) is True
        free = llm.engine.call(GetKVStats()).num_free_blocks
        report = warm_up(core.executor.worker, core.config.cache.num_blocks)
        assert report.steps > 0
        assert llm.engine.call(GetKVStats()).num_free_blocks == free
        held = core.executor.worker.runner.batch.row_of  # the served ones, dropped next step
        assert len(held) == len(PROMPTS) and not [r for r in held if r.startswith("__warmup")]
        after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy,
                                                              use_tqdm=False)]
        assert after == before
    finally:
        llm.shutdown()


def test_startup_phases_are_logged_in_one_format(tiny_models, caplog, monkeypatch):
    folder, _ = tiny_models["qwen3"]
    with caplog.at_level(logging.INFO):
        llm = _llm(folder)
    llm.shutdown()
    text = caplog.text
    for phase in ("model load", "kv profile", "kv allocate", "graph capture", "warm-up"):
        assert re.search(rf"start-up: rank 0 {phase} in \d+\.\d+ s \(", text), phase
    assert re.search(r"start-up: rank 0 warm-up in \d+\.\d+ s \(\d+ steps: ", text)
    assert re.search(r"start-up: engine executor UniprocExecutor up \(model loaded\) in "
                     r"\d+\.\d+ s", text)
    assert re.search(r"start-up: engine EngineCore ready in \d+\.\d+ s \(128 KV blocks", text)
    phases = llm.engine.core.startup.phases
    assert list(phases) == ["executor", "kv profile", "kv init", "ready"]
    assert phases["ready"] >= phases["executor"] + phases["kv init"]

    caplog.clear()
    monkeypatch.setenv("TIDAL_WARMUP", "0")
    with caplog.at_level(logging.INFO):
        _llm(folder).shutdown()
    assert re.search(r"start-up: rank 0 warm-up in \d+\.\d+ s \(off \(TIDAL_WARMUP=0\)",
                     caplog.text)


def test_multiprocess_workers_warm_up_and_report_compiles(tiny_models, capfd):
    """Tensor parallel over the shared-memory executor: every rank warms up (same steps, so
    their collectives pair up) and answers the compile-stats control call."""
    folder, _ = tiny_models["llama"]
    llm = _llm(folder, tensor_parallel_size=2, distributed_executor_backend="mp", device="cpu")
    try:
        stats = llm.engine.call(GetCompileStats())
        assert stats.ready and not stats.active and stats.after_ready == 0
        greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0]
                   .token_ids) == 4
    finally:
        llm.shutdown()
    err = capfd.readouterr().err
    for rank in (0, 1):
        assert re.search(rf"start-up: rank {rank} warm-up in \d+\.\d+ s \(\d+ steps", err), rank


@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_attention_plan_covers_every_served_launch(tiny_models, monkeypatch, impl):
    """The attention-launch steps the warm-up plans (for a GPU) include, for every mixed or
    eager decode step serving can make, one with the same launch specialisation."""
    from tidal.worker.ops import attention_plan

    # Plans of decode batches read the SM count: an H100's, without a GPU.
    monkeypatch.setattr(attention_plan, "num_sms", lambda index: 132)
    monkeypatch.setattr(attention_plan, "device_index", lambda device: 0)
    folder, _ = tiny_models["qwen3"]
    config = EngineArgs(model=str(folder), num_kv_blocks=8192, max_model_len=512,
                        max_num_seqs=256, max_num_batched_tokens=8192).create_config()
    worker = Worker(config)
    worker.load_model()
    worker.runner.allocate_kv_cache(8192)
    plan = Warmup(worker, 8192)
    shapes = plan.mixed_shapes(impl)
    planned = {plan.mixed_key(impl, d, p, q) for d, p, q in shapes}
    assert len(planned) == len(shapes) >= 8
    # Served steps: any mix of decode rows and prompts (longest prompt first) within limits.
    for decodes in range(0, 40, 3):
        for prefills in range(1, 60, 7):
            for q in (2, 3, 8, 9, 16, 17, 31, 64, 65, 127, 128, 129, 200, 400, 509):
                if decodes + prefills * q <= 8192 and decodes + prefills <= 256:
                    key = plan.mixed_key(impl, decodes, prefills, q)
                    assert key in planned, (decodes, prefills, q)
    sizes = plan.eager_decode_sizes(impl)  # no graphs on this CPU worker: all eager
    assert sizes[0] == 1 and len(sizes) == len(set(sizes))
    planned_decode = {plan.decode_key(impl, n) for n in sizes}
    assert all(plan.decode_key(impl, n) in planned_decode for n in range(1, 257))
    tokens = [d + p * q for d, p, q in shapes]
    assert max(tokens) <= 8192 and max(d + p for d, p, _ in shapes) <= 256
    worker.shutdown()


@pytest.mark.parametrize("impl", ["triton", "cuda"])
def test_gpu_plan_runs_through_a_cpu_runner(tiny_models, monkeypatch, impl):
    """The GPU parts of the warm-up (wide sampling, one step per attention launch, eager
    decodes of every launch) are real steps: driven through a CPU runner here, they run,
    sample, and leave nothing behind."""
    from tidal.worker.ops import attention_plan

    monkeypatch.setattr(attention_plan, "num_sms", lambda index: 132)
    monkeypatch.setattr(attention_plan, "device_index", lambda device: 0)
    folder, _ = tiny_models["qwen3"]
    config = EngineArgs(model=str(folder), num_kv_blocks=2048, max_model_len=512,
                        max_num_seqs=48, max_num_batched_tokens=1024, cpu_threads=1,
                        async_scheduling=True).create_config()
    monkeypatch.setenv("TIDAL_WARMUP", "0")  # the start-up one: this test runs its own
    worker = Worker(config)
    worker.load_model()
    worker.init_kv_cache(2048)
    spy = _Spy(worker.runner)
    plan = Warmup(worker, 2048, full=True, attention=impl)
    shapes, sizes = plan.mixed_shapes(impl), plan.eager_decode_sizes(impl)
    report = plan.run()
    _assert_every_feature(spy, config)
    metas = spy.metas
    assert any(m.all_greedy and m.max_num_logprobs is None and m.output_counts is None
               for m in metas), "no plain greedy batch"
    assert any(m.all_random and m.top_k is None and m.top_p is None for m in metas), \
        "no temperature-only batch"
    assert {"all", "some"} <= set(spy.fills), spy.fills
    # More sampling steps than sampler calls in them: one step sampled nothing (a prompt chunk).
    sampled_in_rounds = len(metas) - report.wide_steps - report.attention_steps
    assert sampled_in_rounds < report.sampling_steps
    assert report.wide_steps == 2 and max(len(m.temperature) for m in metas) == 48
    assert report.attention_steps == len(shapes) + len(sizes) >= 10
    assert report.steps == report.sampling_steps + report.wide_steps + \
        report.attention_steps + 1
    assert len(worker.runner.batch) == 0 and not worker.runner._inflight
    free = worker.runner.batch._free_rows
    assert sorted(free) == list(range(48)) and free[-1] == 0
    worker.shutdown()


def test_plan_fits_small_engines(tiny_models):
    """A small token budget, few sequences and few KV blocks: every planned step fits."""
    folder, _ = tiny_models["qwen3"]
    config = EngineArgs(model=str(folder), num_kv_blocks=24, max_model_len=64,
                        max_num_seqs=4, max_num_batched_tokens=32).create_config()
    worker = Worker(config)
    worker.load_model()
    worker.init_kv_cache(24)
    assert worker.warmup is not None and worker.warmup.steps >= 3
    plan = Warmup(worker, 24)
    for d, p, q in plan.mixed_shapes("triton"):
        assert d + p <= 4 and d + p * q <= 32
    worker.shutdown()
