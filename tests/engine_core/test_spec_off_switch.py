"""Speculative decoding's off-switch: the decision from a fake acceptance history (warm-up,
drafting stops below the cost model's break-even point, probes, resumes once acceptance
recovers), its config fields (vLLM's batch-size name too), the scheduler dropping drafts above
the batch-size limit and at zero acceptance, the counts in the stats line, and end to end a
tiny model at synthetic acceptance 0: drafting stops after the warm-up, output unchanged."""

from __future__ import annotations

import msgspec
import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.protocol import (
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerStats,
)
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.spec_off_switch import SpecOffSwitch
from tidal.engine_core.speculative_config import SpeculativeConfig, SpeculativeConfigError

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def switch(**kw) -> SpecOffSwitch:
    fields = dict(disable_by_batch_size=8, by_acceptance=True, verify_token_cost=0.1,
                  window=4, probe_interval=3)
    fields.update(kw)
    return SpecOffSwitch(**fields)


# --- the decision -------------------------------------------------------------------------------


def test_zero_acceptance_stops_drafting_after_the_warm_up_then_probes():
    s = switch()
    for _ in range(3):
        s.observe(4, 0)
        assert s.decide(1)  # warm-up: fewer verifies than the window
    s.observe(4, 0)
    # Window full: 0 accepted per verify never pays for 4 verified draft tokens.
    decisions = [s.decide(1) for _ in range(8)]
    # Three steps off, then one probe step, and so on.
    assert decisions == [False, False, False, True, False, False, False, True]
    assert s.take_counts() == (0, 6)
    assert s.take_counts() == (0, 0)  # counts are since the previous report


def test_break_even_follows_the_cost_model():
    # c = 0.25, 4 draft tokens a verify: a verify step costs ~2 plain steps, so it pays only
    # above 1 accepted token per verify (2 tokens out).
    at = switch(verify_token_cost=0.25)
    for _ in range(4):
        at.observe(4, 1)
    assert not at.pays()
    above = switch(verify_token_cost=0.25)
    for accepted in (1, 1, 1, 2):
        above.observe(4, accepted)
    assert above.pays() and above.decide(1)
    # Shorter drafts cost less: 1 accepted of 2 draft tokens pays at the same c.
    short = switch(verify_token_cost=0.25)
    for _ in range(4):
        short.observe(2, 1)
    assert short.pays()


def test_probes_resume_drafting_once_acceptance_recovers():
    s = switch()
    for _ in range(4):
        s.observe(4, 0)
    steps = resumed_at = 0
    while resumed_at == 0 and steps < 100:
        steps += 1
        if s.decide(1):
            if s.pays():
                resumed_at = steps
            else:
                s.observe(4, 4)  # the probe finds every draft accepted now
    # Off 3 steps, a probe: the average (window 4) pays again after the first probe.
    assert resumed_at == 5
    assert all(s.decide(1) for _ in range(5))


def test_batch_size_limit_and_switches_turned_off():
    s = switch(disable_by_batch_size=8)
    assert s.decide(8) and not s.decide(9)
    assert s.take_counts() == (1, 0)
    never = switch(disable_by_batch_size=None, by_acceptance=False)
    for _ in range(10):
        never.observe(4, 0)
    assert never.decide(10_000) and never.take_counts() == (0, 0)


# --- config -------------------------------------------------------------------------------------


def test_config_defaults_and_vllm_name():
    spec = SpeculativeConfig.parse(NGRAM)
    # Where EAGLE-3 measured a gain on an H200 (batch 64: 1.35x; 128: 0.97x; 256 never drafts).
    assert spec.disable_by_batch_size == 64
    assert (spec.disable_by_acceptance, spec.verify_token_cost) == (True, 0.1)
    assert SpeculativeConfig.parse(
        {**NGRAM, "speculative_disable_by_batch_size": 4}).disable_by_batch_size == 4
    assert SpeculativeConfig.parse(
        {**NGRAM, "disable_by_batch_size": None}).disable_by_batch_size is None
    custom = SpeculativeConfig.parse({**NGRAM, "verify_token_cost": 0.3, "acceptance_window": 8,
                                      "acceptance_probe_interval": 5,
                                      "disable_by_acceptance": False})
    off = SpecOffSwitch.from_config(custom)
    assert (off.verify_token_cost, off.window, off.probe_interval, off.by_acceptance) == \
        (0.3, 8, 5, False)
    assert "never by acceptance" in off.describe()


@pytest.mark.parametrize("fields,needle", [
    ({"disable_by_batch_size": 0}, "disable_by_batch_size must be >= 1"),
    ({"speculative_disable_by_batch_size": "8"}, "speculative_disable_by_batch_size must be"),
    ({"disable_by_batch_size": 4, "speculative_disable_by_batch_size": 4}, "not both"),
    ({"disable_by_acceptance": 1}, "disable_by_acceptance must be true or false"),
    ({"verify_token_cost": 1.5}, "verify_token_cost must be in [0, 1]"),
    ({"acceptance_window": 0}, "acceptance_window must be in"),
    ({"acceptance_probe_interval": 10**6}, "acceptance_probe_interval must be in"),
])
def test_bad_off_switch_fields_are_named(fields, needle):
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.parse({**NGRAM, **fields})
    assert needle in str(info.value)


# --- the scheduler ------------------------------------------------------------------------------


def _scheduler(tiny_models, **off) -> Scheduler:
    config = EngineArgs(model=str(tiny_models["llama"][0]), num_kv_blocks=64, max_num_seqs=8,
                        max_num_batched_tokens=128, max_model_len=256,
                        speculative_config={**NGRAM, **off}).create_config()
    return Scheduler(config)


def _add(s: Scheduler, rid: str) -> None:
    s.add_request(Request.from_engine_request(
        EngineCoreRequest(rid, [10, 11, 12, 13], SamplingParams(max_tokens=200)),
        s.max_model_len, frozenset({2})))


PROPOSED: list[bool] = []  # each step's ``propose_drafts``, as the fake model saw it


def _step(s: Scheduler, accepted: int) -> dict[str, list[int]]:
    """One step of a fake model: each verify accepts ``accepted`` drafts, every request
    proposes 4 drafts next where the step asks for proposals. Returns the drafts the step
    verified."""
    so = s.schedule()
    PROPOSED.append(so.propose_drafts)
    ids, toks = [], []
    for rid in so.req_ids:
        req = s.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            ids.append(rid)
            drafts = so.scheduled_spec_decode_tokens.get(rid, [])
            toks.append(drafts[:accepted] + [7])
    proposals = [[3, 4, 5, 6]] * len(ids) if so.propose_drafts else []
    s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks,
                                               spec_token_ids=proposals))
    s.kv.check_invariants()
    return so.scheduled_spec_decode_tokens


def test_scheduler_drafts_nothing_above_the_batch_size_limit(tiny_models, caplog):
    with caplog.at_level("INFO", logger="tidal.engine_core.scheduler"):
        s = _scheduler(tiny_models, disable_by_batch_size=3)
    # The start-up log says when drafting stops.
    assert any("off-switch: drafting off with more than 3 running requests" in r.getMessage()
               for r in caplog.records)
    for i in range(3):
        _add(s, f"r{i}")
    _step(s, 2)  # prefill; drafts proposed
    assert set(_step(s, 2)) == {"r0", "r1", "r2"}  # 3 running: at the limit, still drafts
    _add(s, "r3")
    _step(s, 2)  # r3's prefill joins the batch: 3 running when scheduled
    # 4 running: above the limit, no drafts at all (plain decodes, one token each), and
    # the workers are not asked to propose any (pure cost).
    PROPOSED.clear()
    for _ in range(3):
        assert _step(s, 2) == {}
    assert PROPOSED == [False] * 3
    stats = s.make_stats()
    assert (stats.spec_off_steps_batch_size, stats.spec_off_steps_acceptance) == (3, 0)
    # Back to 3 running: drafting resumes the next step the worker proposed for.
    s.finish_requests(["r3"], FinishReason.ABORT)
    _step(s, 2)
    assert set(_step(s, 2)) == {"r0", "r1", "r2"}


def test_scheduler_stops_drafting_at_zero_acceptance(tiny_models):
    s = _scheduler(tiny_models, acceptance_window=6, acceptance_probe_interval=4)
    _add(s, "a")
    _add(s, "b")
    _step(s, 0)
    PROPOSED.clear()
    verified = [bool(_step(s, 0)) for _ in range(12)]
    # 3 steps of 2 verifies fill the window; then 4 steps off, a probe, 4 off, a probe...
    assert verified == [True] * 3 + [False] * 4 + [True] + [False] * 4
    # ... and the workers propose only for the step after (the warm-up's last step still
    # does: the window is not full when it is scheduled).
    assert PROPOSED == [True] * 3 + [False] * 3 + [True] + [False] * 4 + [True]
    stats = s.make_stats()
    assert stats.spec_num_drafts == 8 and stats.spec_off_steps_acceptance == 8
    # Rejected drafts rolled back: KV through all but the newest token, as without drafts.
    assert s.requests["a"].num_computed_tokens == s.requests["a"].num_tokens - 1
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=SchedulerStats)
    assert again.spec_off_steps_acceptance == 8  # travels to the frontend


def test_stats_line_counts_steps_off(caplog):
    from tidal.engine_core.stats_logger import StatsLogger

    log = StatsLogger(interval_s=0.0)
    with caplog.at_level("INFO", logger="tidal.engine_core.stats_logger"):
        log.record(SchedulerStats(num_running=40, num_generation_tokens=40,
                                  spec_off_steps_batch_size=1))
        log.record(SchedulerStats(num_running=1, num_generation_tokens=3, spec_num_drafts=1,
                                  spec_num_draft_tokens=4, spec_num_accepted_tokens=2,
                                  spec_accepted_per_pos=[1, 1, 0, 0],
                                  spec_off_steps_acceptance=5))
    lines = [r.getMessage() for r in caplog.records if "speculative" in r.getMessage()]
    assert lines[0] == ("speculative decoding: no drafts verified, drafting off for 1 steps "
                        "(batch size) and 0 steps (acceptance)")
    assert "mean acceptance length 3.00" in lines[1] and "acceptance rate 50.0%" in lines[1]
    assert lines[1].endswith("drafting off for 0 steps (batch size) and 5 steps (acceptance)")


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_llama_zero_acceptance_stops_drafting_output_unchanged(tiny_models):
    """Synthetic acceptance 0 (every draft rejected; what is emitted is the target's own
    token): after the warm-up window drafting stops, probes aside, and the greedy output is the
    plain engine's."""
    from tidal.frontend import LLM

    folder = str(tiny_models["llama"][0])
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9] * 6},
               {"prompt_token_ids": [11, 12, 13, 11, 12, 13, 11, 12]}]
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, max_num_seqs=4, kv_cache_memory_bytes=32 << 20)
    plain = LLM(folder, **kw)
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    finally:
        plain.shutdown()
    spec = {**NGRAM, "rejection_sample_method": "synthetic", "synthetic_acceptance_rate": 0,
            "acceptance_window": 8, "acceptance_probe_interval": 16}
    llm = LLM(folder, speculative_config=spec, **kw)
    core = llm.engine.core
    seen: list[SchedulerStats] = []
    record = core.stats_logger.record

    def keep(stats, *args):
        seen.append(stats)
        return record(stats, *args)

    core.stats_logger.record = keep
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        core.stats_logger.record = record
        llm.shutdown()
    assert got == want
    drafts = sum(s.spec_num_drafts for s in seen)
    off = sum(s.spec_off_steps_acceptance for s in seen)
    assert sum(s.spec_num_accepted_tokens for s in seen) == 0
    # 2 requests x 47 decode steps: the warm-up's 8 verifies and a couple of probes draft.
    assert 8 <= drafts <= 8 + 2 * 3
    assert off >= 30 and sum(s.spec_off_steps_batch_size for s in seen) == 0
