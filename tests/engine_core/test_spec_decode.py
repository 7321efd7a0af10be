"""Speculative decoding in the engine: the config, the scheduler with fake model outputs (drafts
scheduled as verify tokens, computed counts rolled back over rejected drafts, stops exact at any
acceptance count, preemption), and end to end against the same engine without speculation
(greedy identical on the real SmolLM2 and a random-weight Llama; seeded sampling reproducible)."""

from __future__ import annotations

import msgspec
import pytest

import reference
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.protocol import (
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerStats,
)
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.speculative_config import SpeculativeConfig, SpeculativeConfigError
from tidal.engine_core.validation import RequestValidationError, validate_request

EOS = 2
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}

# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw,needle", [
    ({"method": "eagle3", "num_speculative_tokens": 3}, "needs model"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs model"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "not yet"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "model applies to"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"},
     "unknown field(s) draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic"},
     "exactly one of"),
    ({"method": "ngram", "num_speculative_tokens": 2, "synthetic_acceptance_rate": 0.5},
     "needs rejection_sample_method 'synthetic'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "synthetic",
      "synthetic_acceptance_rates": [0.5, 0.7]}, "non-increasing"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_on_device": "yes"},
     "prompt_lookup_on_device must be true, false or null"),
    ({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_on_device": True},
     "for method 'ngram' only"),
])
def test_bad_speculative_configs_name_the_field(raw, needle):
    with pytest.raises(SpeculativeConfigError, match="speculative-config") as info:
        SpeculativeConfig.parse(raw)
    assert needle in str(info.value)


def test_synthetic_rates_resolve_to_conditional_rates():
    def rates(**fields):
        return SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3,
                                        "rejection_sample_method": "synthetic",
                                        **fields}).synthetic_conditional_rates

    assert rates(synthetic_acceptance_rate=0.8) == (0.8, 0.8, 0.8)
    assert rates(synthetic_acceptance_rates=[0.8, 0.4, 0.2]) == pytest.approx((0.8, 0.5, 0.5))
    assert rates(synthetic_acceptance_length=2.5) == pytest.approx((1.0, 0.5, 0.0))
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2,
                                    "prompt_lookup_max": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)


@pytest.fixture(scope="module")
def spec_config(tiny_models):
    return EngineArgs(model=str(tiny_models["llama"][0]), num_kv_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=256,
                      speculative_config=NGRAM).create_config()


def test_engine_config_keeps_async_scheduling(tiny_models, spec_config, tmp_path):
    assert spec_config.speculative.num_speculative_tokens == 4
    assert not spec_config.scheduler.async_scheduling  # (its CPU default)
    both = EngineArgs(model=str(tiny_models["llama"][0]), async_scheduling=True,
                      speculative_config=NGRAM).create_config()
    assert both.scheduler.async_scheduling and both.max_concurrent_batches == 2
    # The n-gram lookup's place is decided once: on the host on a CPU (on a GPU on the
    # device, unless the rows' tokens would take over 2 GiB there), unless asked for.
    assert both.speculative.prompt_lookup_on_device is False
    assert "looked up on the host" in both.speculative.describe()
    asked = EngineArgs(model=str(tiny_models["llama"][0]), speculative_config={
        **NGRAM, "prompt_lookup_on_device": True}).create_config()
    assert asked.speculative.prompt_lookup_on_device and asked.speculative.drafts_on_device
    # Speculative steps pipeline with drafts on the device, except over sliding-window layers
    # (their blocks below the window are freed by the optimistic computed count).
    from tidal.engine_core.scheduler import Scheduler

    spec = {**NGRAM, "prompt_lookup_on_device": True}
    assert Scheduler(EngineArgs(model=str(tiny_models["llama"][0]), async_scheduling=True,
                                num_kv_blocks=64,
                                speculative_config=spec).create_config()).async_spec
    reference.make_tiny_model("gemma2", tmp_path)
    assert not Scheduler(EngineArgs(model=str(tmp_path), async_scheduling=True, num_kv_blocks=64,
                                    speculative_config=spec).create_config()).async_spec
    with pytest.raises(ConfigError, match="not yet"):
        EngineArgs(model=str(tiny_models["llama"][0]),
                   speculative_config={"method": "medusa",
                                       "num_speculative_tokens": 2}).create_config()
    # The config travels to the engine and workers as it is.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(spec_config), type=type(spec_config))
    assert again.speculative == spec_config.speculative


def test_requests_speculation_cannot_serve_are_refused(spec_config, monkeypatch):
    ok = SamplingParams(max_tokens=4, temperature=0.7, seed=1, min_tokens=2,
                        presence_penalty=0.5)
    validate_request([5, 6], ok, spec_config)
    validate_request([5, 6], SamplingParams(logprobs=2), spec_config)
    # Constrained requests and thinking budgets verify drafts under one mask per position
    # (tests/engine_core/structured_output/test_spec_masks.py).
    validate_request([5, 6], SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="a+"), thinking_token_budget=8),
        spec_config)
    from tidal.engine_core import plugins

    monkeypatch.setattr(plugins, "plugin_names", lambda group: ["mine"])
    with pytest.raises(RequestValidationError, match="speculative") as info:
        validate_request([5, 6], SamplingParams(logits_processors=["mine"]), spec_config)
    assert info.value.param == "logits_processors"


# --- scheduler ----------------------------------------------------------------------------------


def add(s: Scheduler, rid: str, prompt: list[int], **params) -> Request:
    params.setdefault("max_tokens", 32)
    req = Request.from_engine_request(EngineCoreRequest(rid, prompt, SamplingParams(**params)),
                                      s.max_model_len, frozenset({EOS}))
    s.add_request(req)
    return req


def step(s: Scheduler, emit: dict[str, list[int]], drafts: dict[str, list[int]]):
    """Schedule, then pretend the model emitted ``emit[rid]`` (default: one token, 7) for each
    request that samples and proposed ``drafts[rid]`` next."""
    so = s.schedule()
    ids, toks, spec = [], [], []
    for rid in so.req_ids:
        req = s.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            ids.append(rid)
            toks.append(emit.get(rid, [7]))
            spec.append(drafts.get(rid, []))
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks,
                                                      spec_token_ids=spec))
    s.kv.check_invariants()
    return so, {o.request_id: o for o in outs}


def test_drafts_are_verified_and_rejected_ones_rolled_back(spec_config):
    s = Scheduler(spec_config)
    req = add(s, "a", [10, 11, 12, 13, 14])
    so, _ = step(s, {"a": [20]}, {"a": [21, 22, 23, 24]})
    assert so.num_scheduled_tokens == [5] and not so.scheduled_spec_decode_tokens
    # The next step verifies the drafts: the last token plus 4 drafts.
    so, outs = step(s, {"a": [21, 22, 30]}, {"a": [31]})  # 2 of 4 accepted, then 30
    assert so.scheduled_spec_decode_tokens == {"a": [21, 22, 23, 24]}
    assert so.num_scheduled_tokens == [5]
    assert outs["a"].new_token_ids == [21, 22, 30]
    # KV holds the last token and the 2 accepted drafts; the rejected 2 are computed again.
    assert req.num_computed_tokens == req.num_tokens - 1 == 8
    stats = s.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens) == (1, 4, 2)
    assert stats.spec_accepted_per_pos == [1, 1, 0, 0]
    so, _ = step(s, {}, {})
    assert so.scheduled_spec_decode_tokens == {"a": [31]} and so.num_scheduled_tokens == [2]
    assert s.make_stats().spec_accepted_per_pos == [0, 0, 0, 0]  # counters reset per report
    so, _ = step(s, {}, {})  # no drafts proposed: a plain decode
    assert not so.scheduled_spec_decode_tokens and so.num_scheduled_tokens == [1]


def test_counters_count_proposed_drafts_not_padding(tiny_models):
    """Async n-gram steps on the device: a request takes as many placeholders as its last
    proposal seen had, and a shorter lookup after it is padded by the workers. The acceptance
    counters (and the off-switch) count the drafts proposed, whose length reached the scheduler
    with the step before's output; a pad that happens to match the target is no accepted
    draft. Drafts the scheduler holds as lists count in full."""
    cfg = EngineArgs(model=str(tiny_models["llama"][0]), async_scheduling=True,
                     num_kv_blocks=64, speculative_config={
                         **NGRAM, "prompt_lookup_on_device": True,
                         "disable_by_batch_size": None}).create_config()
    s = Scheduler(cfg)
    assert s.async_spec and s._proposed_len is not None
    for rid in "abc":
        add(s, rid, [10, 11, 12, 13, 14])
    step(s, {}, {})  # (their prompts: now running)
    s.make_stats()
    s._proposed_len.update(a=2, b=0)  # the lookups after the step before: 2 and 0 drafts
    for rid in "abc":
        s.requests[rid].num_placeholders = 5
    s._verified({"a": [-1, -1, -1, -1], "b": [-1, -1], "c": [21, 22, 23]},
                ModelRunnerOutput(req_ids=["a", "b", "c"],
                                  sampled_token_ids=[[5, 6, 7, 8], [9, 1], [21, 30]]))
    stats = s.make_stats()
    # a: 2 proposed of 4 placeholders, 3 matched (the third a pad): 2 accepted; b: only pads
    # (a matched one among them), no draft; c: 3 proposed, 1 accepted.
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens) == (2, 5, 3)
    assert stats.spec_accepted_per_pos == [2, 1, 0, 0]
    # The worker's own bookkeeping still covers every placeholder it verified.
    assert [s.requests[r].num_placeholders for r in "abc"] == [1, 3, 2]


def test_stop_token_and_max_tokens_exact_at_any_acceptance(spec_config):
    s = Scheduler(spec_config)
    add(s, "stop", [10, 11, 12], stop_token_ids=[99])
    add(s, "eos", [40, 41, 42])
    add(s, "len", [50, 51, 52], max_tokens=4)
    add(s, "min", [60, 61, 62], min_tokens=3)
    step(s, {"stop": [20], "eos": [20], "len": [20], "min": [20]},
         {r: [1, 1, 1, 1] for r in ("stop", "eos", "len", "min")})
    so, outs = step(s, {"stop": [21, 99, 23, 24], "eos": [21, EOS, 5], "len": [1, 1, 1, 1, 1],
                        "min": [EOS, EOS, EOS]}, {})
    # Every draft is verified, past what max_tokens leaves room for (4 - 1 tokens out): the
    # step stays uniform (k drafts a request); what it emits past the limit is dropped.
    assert so.scheduled_spec_decode_tokens["len"] == [1, 1, 1, 1]
    assert outs["stop"].new_token_ids == [21, 99]
    assert outs["stop"].finish_reason == FinishReason.STOP and outs["stop"].stop_reason == 99
    assert outs["eos"].new_token_ids == [21, EOS]
    assert outs["eos"].finish_reason == FinishReason.STOP
    assert outs["len"].new_token_ids == [1, 1, 1]
    assert outs["len"].finish_reason == FinishReason.LENGTH
    # min_tokens=3: the first EOS (2nd output token) does not stop it, the next one does.
    assert outs["min"].new_token_ids == [EOS, EOS]
    assert outs["min"].finish_reason == FinishReason.STOP
    assert not s.requests


def test_short_of_blocks_drafts_go_first_then_preemption(spec_config):
    s = Scheduler(msgspec.structs.replace(
        spec_config, cache=msgspec.structs.replace(spec_config.cache, num_blocks=3)))
    a = add(s, "a", list(range(10, 25)))  # 15 tokens: one block each, one block free
    b = add(s, "b", list(range(30, 45)))
    step(s, {"a": [20], "b": [20]}, {"a": [31, 32, 33, 34], "b": [41, 42, 43, 44]})
    so, _ = step(s, {"a": [31, 32, 33, 34, 35]}, {"b": [51, 52, 53, 54]})
    # a takes the free block to verify its drafts; b, with no block left for its drafts,
    # verifies none rather than preempt anyone for them.
    assert so.scheduled_spec_decode_tokens == {"a": [31, 32, 33, 34]}
    assert so.scheduled() == {"a": 5, "b": 1}
    assert a.num_computed_tokens == a.num_tokens - 1 == 20
    # Next, b's one token needs a block too: b is preempted, its drafts dropped; it resumes
    # from scratch (no drafts) once a finishes.
    so, _ = step(s, {"a": [EOS]}, {})
    assert b.num_preemptions == 1 and "b" not in s._drafts
    assert so.scheduled() == {"a": 1} and not so.scheduled_spec_decode_tokens
    so, _ = step(s, {}, {})
    assert [r.req_id for r in so.new_reqs] == ["b"] and not so.scheduled_spec_decode_tokens
    assert so.new_reqs[0].output_token_ids == [20, 7]


def test_stats_line_reports_acceptance(caplog):
    from tidal.engine_core.stats_logger import StatsLogger

    logger = StatsLogger(interval_s=0.0)
    with caplog.at_level("INFO", logger="tidal.engine_core.stats_logger"):
        logger.record(SchedulerStats(num_running=1, num_generation_tokens=9, spec_num_drafts=4,
                                     spec_num_draft_tokens=12, spec_num_accepted_tokens=6,
                                     spec_accepted_per_pos=[3, 2, 1]))
    line = next(r.getMessage() for r in caplog.records if "speculative" in r.getMessage())
    assert "mean acceptance length 2.50" in line and "acceptance rate 50.0%" in line
    assert "[0.750, 0.500, 0.250]" in line


def test_stats_fold_per_position_counts():
    late = SchedulerStats(spec_num_drafts=1, spec_num_draft_tokens=3,
                          spec_num_accepted_tokens=2, spec_accepted_per_pos=[1, 1, 0])
    early = SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=4,
                           spec_num_accepted_tokens=1, spec_accepted_per_pos=[1, 0])
    late.add_counters(early)
    assert (late.spec_num_drafts, late.spec_num_draft_tokens,
            late.spec_num_accepted_tokens) == (3, 7, 3)
    assert late.spec_accepted_per_pos == [2, 1, 0]


# --- end to end ---------------------------------------------------------------------------------


def _generate(llm, prompts, params):
    outs, (_, _, accepted) = reference.generate_counting_spec(llm, prompts, params)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0] for o in outs], accepted


REPETITIVE = ("Copy the list: red, green, blue, yellow, red, green, blue, yellow, red, green, "
              "blue, yellow, red, green,")
CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n")


@pytest.mark.slow
def test_greedy_identical_on_smollm2(smollm2_path, smollm2_llm):
    from tidal.frontend import LLM

    params = SamplingParams(max_tokens=32, temperature=0.0)
    prompts = [REPETITIVE, CODE]
    want, _, _ = _generate(smollm2_llm, prompts, params)
    llm = LLM(str(smollm2_path), max_num_seqs=8, speculative_config=NGRAM,
              kv_cache_memory_bytes=512 << 20)
    try:
        got, _, accepted = _generate(llm, prompts, params)
        assert got == want
        assert accepted > 0
        # Exact stops at any acceptance count: max_tokens, a stop token mid-draft.
        short, _, _ = _generate(llm, [REPETITIVE], SamplingParams(max_tokens=7,
                                                                      temperature=0.0))
        assert short == [want[0][:7]]
        stop_at = want[0][5]
        stopped, outs, _ = _generate(llm, [REPETITIVE],
                                     SamplingParams(max_tokens=32, temperature=0.0,
                                                    stop_token_ids=[stop_at]))
        assert stopped == [want[0][:want[0].index(stop_at) + 1]]
        assert outs[0].finish_reason == "stop"
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tiny_llama_greedy_identical_and_seeds_reproducible(tiny_models):
    from tidal.frontend import LLM

    folder = str(tiny_models["llama"][0])
    # Token-id prompts with repeats, so the n-gram lookup finds drafts.
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
               {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]},
               {"prompt_token_ids": list(range(20, 40))}]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    # A fixed KV pool: two engines one after the other in this process (on a GPU the first
    # one's cached memory would otherwise leave the second no room).
    kw = dict(skip_tokenizer_init=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20)
    plain = LLM(folder, **kw)
    try:
        want, want_outs, _ = _generate(plain, prompts, greedy)
    finally:
        plain.shutdown()
    llm = LLM(folder, speculative_config=NGRAM, **kw)
    try:
        got, got_outs, accepted = _generate(llm, prompts, greedy)
        assert got == want
        assert accepted > 0
        # Logprobs of every emitted token, accepted drafts included, as without speculation.
        for w, g in zip(want_outs, got_outs):
            assert len(g.logprobs) == len(w.logprobs) == 24
            for wp, gp in zip(w.logprobs, g.logprobs):
                assert wp.keys() == gp.keys()
                for t in wp:
                    assert gp[t].logprob == pytest.approx(wp[t].logprob, abs=1e-4)
                    assert gp[t].rank == wp[t].rank
        seeded = [SamplingParams(max_tokens=24, temperature=1.0, seed=s, ignore_eos=True)
                  for s in (1, 1, 2)]
        first, _, _ = _generate(llm, [prompts[0]] * 3, seeded)
        again, _, _ = _generate(llm, [prompts[0]] * 3, seeded)
        assert first == again
        assert first[0] == first[1] and first[0] != first[2]
        # The device lookup (a GPU's, run here on the CPU) through the same engine: the same
        # drafts, so the same tokens, acceptance and seeded draws.
        import torch

        from tidal.worker.spec_decode.ngram_device import NgramDeviceProposer

        spec = llm.engine.core.executor.worker.runner.spec
        runner = llm.engine.core.executor.worker.runner
        spec.device_proposer = NgramDeviceProposer(
            4, 1, 3, runner.max_num_reqs, runner.batch.max_model_len, torch.device("cpu"))
        spec.proposer = None
        on_device, _, accepted_dev = _generate(llm, prompts, greedy)
        assert on_device == want and accepted_dev == accepted
        assert _generate(llm, [prompts[0]] * 3, seeded)[0] == first
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_async_scheduling_pipelines_only_steps_that_do_not_speculate(tiny_models):
    """With async scheduling, steps that verify or propose drafts run alone and the others
    (above the off-switch's batch size) pipeline two deep; requests finishing at different
    lengths take the batch across the limit both ways. Greedy output stays the plain
    engine's, logprobs included."""
    from tidal.frontend import LLM

    folder = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
               {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]},
               {"prompt_token_ids": [30, 31, 32] * 5},
               {"prompt_token_ids": list(range(20, 40))}]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1)
              for n in (40, 12, 30, 8)]
    kw = dict(skip_tokenizer_init=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
              async_scheduling=True)
    plain = LLM(folder, **kw)
    try:
        want, want_outs, _ = _generate(plain, prompts, params)
    finally:
        plain.shutdown()
    llm = LLM(folder, speculative_config={**NGRAM, "disable_by_batch_size": 2}, **kw)
    core = llm.engine.core
    depths: list[tuple[int, bool]] = []  # (steps in flight, whether the newest speculates)
    launch = core.executor.execute_model

    def recording(sched, *args, **kwargs):
        out = launch(sched, *args, **kwargs)
        depths.append((len(core.batch_queue) + 1, bool(sched.scheduled_spec_decode_tokens
                                                       or sched.propose_drafts)))
        return out

    core.executor.execute_model = recording
    try:
        got, got_outs, accepted = _generate(llm, prompts, params)
    finally:
        llm.shutdown()
    assert got == want
    for w, g in zip(want_outs, got_outs):
        assert [list(p) for p in g.logprobs] == [list(p) for p in w.logprobs]
    assert accepted > 0  # drafting resumed once two requests were left
    # Pipelined steps while four or three requests ran; a step launched behind another never
    # followed one that speculates.
    assert any(d == 2 for d, _ in depths)
    for (d, _), (_, prev_spec) in zip(depths[1:], depths):
        assert not (d == 2 and prev_spec)


@pytest.mark.slow
def test_async_scheduling_pipelines_ngram_steps_looked_up_on_the_device(tiny_models):
    """``prompt_lookup_on_device`` (a GPU's default): the drafts stay on the device, so with
    async scheduling n-gram steps pipeline like a model drafter's; the scheduler gives each
    request as many placeholders as its last proposal seen had (the worker pads a shorter
    lookup: verification stays exact). Greedy output stays the plain engine's, also with
    logprobs (verified at once, the next step still scheduled ahead)."""
    from tidal.frontend import LLM

    folder = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
               {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]},
               {"prompt_token_ids": [30, 31, 32] * 5},
               {"prompt_token_ids": list(range(20, 40))}]
    kw = dict(skip_tokenizer_init=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
              async_scheduling=True)
    rounds = [[SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=lp)
               for n in (40, 12, 30, 8)] for lp in (None, 1)]
    plain = LLM(folder, **kw)
    try:
        wants = [_generate(plain, prompts, params)[:2] for params in rounds]
    finally:
        plain.shutdown()
    spec = {**NGRAM, "prompt_lookup_on_device": True, "disable_by_batch_size": None,
            "disable_by_acceptance": False}
    llm = LLM(folder, speculative_config=spec, **kw)
    core = llm.engine.core
    assert core.executor.worker.runner.spec.device_proposer is not None
    ahead: list[int] = []
    launch = core.executor.execute_model

    def recording(sched, *args, **kwargs):
        if sched.spec_in_flight:
            assert core.batch_queue
            ahead.append(sum(len(d) for d in sched.scheduled_spec_decode_tokens.values()))
        return launch(sched, *args, **kwargs)

    core.executor.execute_model = recording
    try:
        for params, (want, want_outs) in zip(rounds, wants):
            ahead.clear()
            got, got_outs, accepted = _generate(llm, prompts, params)
            assert got == want
            if params[0].logprobs is not None:
                for w, g in zip(want_outs, got_outs):
                    assert [list(p) for p in g.logprobs] == [list(p) for p in w.logprobs]
            assert accepted > 0 and len(ahead) > 5 and sum(ahead) > 0
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tiny_llama_chunked_prefill_and_preemption_keep_greedy_output(tiny_models):
    """A token budget of 16 (prompts in chunks, drafts cut to the budget left) and a KV pool
    so small that requests are preempted and recomputed: still the plain engine's output."""
    from tidal.frontend import LLM

    folder = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": ([3 + i, 4, 5, 6, 7] * 9)[:40 + i]} for i in range(4)]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_num_seqs=4, max_model_len=96)
    plain = LLM(folder, kv_cache_memory_bytes=64 << 20, **kw)
    try:
        want, _, _ = _generate(plain, prompts, greedy)
    finally:
        plain.shutdown()
    # 12 blocks of 16 tokens for 4 requests of up to 83 tokens each.
    llm = LLM(folder, speculative_config=NGRAM, max_num_batched_tokens=16, num_kv_blocks=12,
              block_size=16, **kw)
    preempted = reference.record_preemptions(llm)
    try:
        got, _, accepted = _generate(llm, prompts, greedy)
        assert got == want
        assert accepted > 0 and preempted
    finally:
        llm.shutdown()
