"""Scheduler behaviour on the CPU with fake model outputs (no model runs)."""

from __future__ import annotations

import msgspec
import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason, ModelRunnerOutput
from tidal.engine_core.request import Request
from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.scheduler import Scheduler

EOS = 2


@pytest.fixture(scope="module")
def base_config(tiny_models):
    return EngineArgs(model=str(tiny_models["llama"][0]), num_kv_blocks=64, max_num_seqs=4,
                      max_num_batched_tokens=64, max_model_len=256).create_config()


def make_scheduler(cfg, **changes):
    sched = msgspec.structs.replace(cfg.scheduler, **{k: v for k, v in changes.items()
                                                      if k != "num_blocks"})
    cache = msgspec.structs.replace(cfg.cache, num_blocks=changes.get("num_blocks",
                                                                      cfg.cache.num_blocks))
    return Scheduler(msgspec.structs.replace(cfg, scheduler=sched, cache=cache))


def add(s: Scheduler, rid: str, n_prompt: int, prompt: list[int] | None = None,
        **params) -> Request:
    params.setdefault("max_tokens", 8)
    # Distinct prompts per request id, so the prefix cache only hits where a test wants it.
    base = 10 + 1000 * (sum(map(ord, rid)) % 50)
    prompt = prompt if prompt is not None else list(range(base, base + n_prompt))
    req = Request.from_engine_request(
        EngineCoreRequest(rid, prompt, SamplingParams(**params)),
        s.max_model_len, frozenset({EOS}))
    s.add_request(req)
    return req


def fake_step(s: Scheduler, token: int = 7):
    """Schedule, then pretend the model sampled ``token`` for every request that samples."""
    so = s.schedule()
    ids, toks = [], []
    for rid in so.req_ids:
        req = s.requests[rid]
        if req.num_computed_tokens >= req.num_tokens:
            ids.append(rid)
            toks.append([token])
    outs = s.update_from_output(so, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks))
    s.kv.check_invariants()
    return so, outs


def test_budget_running_first_then_fcfs_with_chunking(base_config):
    s = make_scheduler(base_config, max_num_batched_tokens=32)
    add(s, "a", 20)
    add(s, "b", 30)
    add(s, "c", 5)
    so, _ = fake_step(s)
    # a fits whole, b is chunked with what is left; c waits (FCFS: no skipping ahead).
    assert so.scheduled() == {"a": 20, "b": 12}
    so, _ = fake_step(s)
    # running first: a decodes (1), b continues its prompt (18), then c is admitted (5).
    assert so.scheduled() == {"a": 1, "b": 18, "c": 5}
    assert so.total_num_scheduled_tokens == 24


def test_no_chunking_waits_for_room(base_config):
    s = make_scheduler(base_config, max_num_batched_tokens=256, enable_chunked_prefill=False)
    add(s, "a", 200)
    add(s, "b", 100)
    so, _ = fake_step(s)
    assert so.scheduled() == {"a": 200}
    so, _ = fake_step(s)
    assert so.scheduled() == {"a": 1, "b": 100}


def test_max_num_seqs(base_config):
    s = make_scheduler(base_config, max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", 3)
    so, _ = fake_step(s)
    assert so.req_ids == ["r0", "r1"]


def test_preempts_newest_and_resumes_with_all_tokens(base_config):
    # 6 blocks of 16 tokens: three requests of 30 prompt tokens need 2 blocks each, then grow.
    s = make_scheduler(base_config, num_blocks=6, max_num_batched_tokens=128)
    for rid in "abc":
        add(s, rid, 30, max_tokens=40, ignore_eos=True)
    fake_step(s)
    assert s.kv.num_free_blocks == 0
    c = s.requests["c"]
    for _ in range(4):  # decode until the sequences outgrow two blocks (32 tokens)
        so, _ = fake_step(s)
        if c.num_preemptions:
            break
    # The newest request ("c") is the one preempted; the older ones keep running.
    assert c.num_preemptions == 1 and c.num_computed_tokens == 0 and c in s.waiting
    assert s.requests["a"].num_preemptions == 0 and s.requests["b"].num_preemptions == 0
    assert "c" in so.finished_req_ids  # the worker is told to drop its state
    # It comes back later as a new request carrying its generated tokens.
    for _ in range(60):
        before = list(c.output_token_ids)
        so, _ = fake_step(s)
        resumed = [r for r in so.new_reqs if r.req_id == "c"]
        if resumed:
            assert before and resumed[0].output_token_ids == before
            assert resumed[0].num_computed_tokens == 0
            break
    else:
        pytest.fail("the preempted request never resumed")
    while s.has_unfinished():
        fake_step(s)
    assert s.kv.num_free_blocks == 6


@pytest.mark.parametrize("params, token, reason, stop_reason, n_out", [
    (dict(max_tokens=3, ignore_eos=True), EOS, FinishReason.LENGTH, None, 3),
    (dict(max_tokens=5), EOS, FinishReason.STOP, None, 1),
    (dict(max_tokens=5, stop_token_ids=[9]), 9, FinishReason.STOP, 9, 1),
    (dict(max_tokens=5, min_tokens=3), EOS, FinishReason.STOP, None, 3),
])
def test_finish_conditions(base_config, params, token, reason, stop_reason, n_out):
    s = make_scheduler(base_config)
    req = add(s, "a", 4, **params)
    outs = []
    while s.has_unfinished():
        outs += fake_step(s, token)[1]
    assert req.finish_reason == reason and req.stop_reason == stop_reason
    assert req.num_output_tokens == n_out
    assert outs[-1].finish_reason == reason
    assert s.kv.num_free_blocks == s.config.cache.num_blocks


def test_max_model_len_finishes_with_length(base_config):
    s = make_scheduler(base_config)
    req = add(s, "a", 250, max_tokens=None, ignore_eos=True)
    assert req.max_tokens == 6
    while s.has_unfinished():
        fake_step(s)
    assert req.finish_reason == FinishReason.LENGTH and req.num_tokens == 256


def test_abort_frees_blocks_and_tells_the_worker(base_config):
    s = make_scheduler(base_config)
    add(s, "a", 40)
    add(s, "b", 40)
    fake_step(s)
    s.finish_requests(["a", "unknown"], FinishReason.ABORT)
    so, _ = fake_step(s)
    assert "a" in so.finished_req_ids and "a" not in so.req_ids
    assert s.kv.num_free_blocks == s.config.cache.num_blocks - 3


def test_pipeline_stages_each_get_a_share_of_the_requests(tiny_models):
    """With 2 stages, two steps are in flight; a request whose step is in flight sits out, so
    each step takes at most half the sequences and the second step gets the other half."""
    cfg = EngineArgs(model=str(tiny_models["llama"][0]), num_kv_blocks=64, max_num_seqs=8,
                     max_num_batched_tokens=256, pipeline_parallel_size=2,
                     distributed_executor_backend="mp").create_config()
    s = Scheduler(cfg)
    for i in range(8):
        add(s, f"r{i}", 5)
    first = s.schedule()
    second = s.schedule()  # step 1 still in flight: no outputs applied yet
    assert len(first.num_scheduled_tokens) == 4 and len(second.num_scheduled_tokens) == 4
    assert not set(first.req_ids) & set(second.req_ids)
    third = s.schedule()  # both steps in flight: every request waits for its token
    assert third.total_num_scheduled_tokens == 0
    s.update_from_output(first, ModelRunnerOutput(
        req_ids=first.req_ids,
        sampled_token_ids=[[7]] * len(first.num_scheduled_tokens)))
    fourth = s.schedule()
    assert set(fourth.req_ids) == set(first.req_ids)
    # The last stage's tokens travel to every stage with the next step.
    assert all(t == [7] for t in fourth.cached_reqs.new_token_ids)


def test_preempted_request_finished_by_its_step_in_flight_leaves_the_queue(base_config):
    """Async scheduling: a request preempted while its step is in flight, whose in-flight token
    then finishes it, must leave the waiting queue (it used to stay there, released, and crash
    the next admission)."""
    s = make_scheduler(base_config, num_blocks=4, max_num_batched_tokens=128,
                       async_scheduling=True)
    add(s, "a", 31, max_tokens=10, ignore_eos=True)
    b = add(s, "b", 31, max_tokens=10)
    first = s.schedule()  # both prefill 31 tokens: two blocks each, the pool is full
    second = s.schedule()  # both decode position 31 on their placeholders: still two blocks
    s.update_from_output(first, ModelRunnerOutput(req_ids=["a", "b"],
                                                  sampled_token_ids=[[7], [7]]))
    third = s.schedule()  # "a" needs a third block: "b" (newest, step in flight) is preempted
    assert b.num_preemptions == 1 and b in s.waiting and third.req_ids == ["a"]
    outs = s.update_from_output(second, ModelRunnerOutput(req_ids=["a", "b"],
                                                          sampled_token_ids=[[7], [EOS]]))
    assert [o.finish_reason for o in outs] == [None, FinishReason.STOP]
    assert b not in s.waiting and "b" not in s.requests
    s.schedule()  # nothing to admit; no released request comes back
    s.kv.check_invariants()


def _lockstep_run(cfg, seed: int, inflight: int) -> int:
    """Two schedulers, decode fast path on and off, fed the same random workload (arrivals,
    shared prefixes, EOS and length stops, aborts, preemptions from a small KV pool) with up to
    ``inflight`` steps in flight; every scheduler output, engine output and stat must match.
    Returns how many steps the fast path served every running request."""
    import random

    from tidal.engine_core.core import NoopExecutor

    fast, slow = Scheduler(cfg), Scheduler(cfg)
    slow.decode_fast_path = False
    executors = {id(fast): NoopExecutor(cfg), id(slow): NoopExecutor(cfg)}
    served = 0
    plain = fast._schedule_decodes

    def counting(*args):
        nonlocal served
        consumed, prompt_tokens = plain(*args)
        served += consumed == len(fast.running)
        return consumed, prompt_tokens

    fast._schedule_decodes = counting
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(48)]
    queues: dict[int, list] = {id(fast): [], id(slow): []}
    n_added = 0
    for step in range(400):
        if n_added < 40 and rng.random() < 0.3:
            n = rng.randrange(1, 90)
            prompt = (shared[:rng.choice((0, 16, 32, 48))]
                      + [rng.randrange(3, 500) for _ in range(n)])
            max_tokens = rng.randrange(1, 60)
            params = dict(max_tokens=max_tokens, ignore_eos=rng.random() < 0.5,
                          min_tokens=min(max_tokens, rng.choice((0, 0, 2))))
            for s in (fast, slow):
                add(s, f"q{n_added}", 0, prompt=list(prompt), **params)
            n_added += 1
        if fast.requests and rng.random() < 0.03:
            victim = rng.choice(sorted(fast.requests))
            for s in (fast, slow):
                s.finish_requests([victim], FinishReason.ABORT)
        # Tokens the fake model samples this step: EOS now and then.
        token = EOS if rng.random() < 0.05 else rng.randrange(3, 500)
        outs = {}
        for s in (fast, slow):  # as EngineCore.step does it
            q = queues[id(s)]
            launched = False
            if len(q) < inflight and s.has_unfinished():
                so = s.schedule()
                if so.total_num_scheduled_tokens:
                    q.append((so, executors[id(s)]._execute(so)))
                    launched = True
            if q and (len(q) >= inflight or not launched):
                so, result = q.pop(0)
                result.sampled_token_ids = [[token]] * len(result.req_ids)
                # (Clock readings differ between the two; which outputs carry them must not.)
                untimed = [msgspec.structs.replace(o, queued_ts=float(o.queued_ts > 0),
                                                   scheduled_ts=float(o.scheduled_ts > 0))
                           for o in s.update_from_output(so, result)]
                outs[id(s)] = (so, untimed, s.make_stats())
            s.kv.check_invariants()
        assert outs.get(id(fast)) == outs.get(id(slow)), f"seed {seed}, step {step}"
        if n_added >= 40 and not fast.has_unfinished() and not queues[id(fast)]:
            break
    return served


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_fast_path_matches_the_general_loop(base_config, async_scheduling):
    cfg = make_scheduler(base_config, max_num_seqs=8, max_num_batched_tokens=64,
                         num_blocks=24, async_scheduling=async_scheduling).config
    served = sum(_lockstep_run(cfg, seed, 2 if async_scheduling else 1) for seed in range(6))
    print(f"fast path served every running request in {served} steps")
    assert served > 100  # the workload did exercise decode-only steps


def test_first_outputs_carry_schedule_times_and_stats_count_each_step(base_config):
    """What the frontend's vLLM-style metrics are made of: a request's first output with tokens
    (and only that one) carries its queue and schedule times and its prefix-cache hit, and each
    step's scheduled tokens reach the stats, one entry per step."""
    s = make_scheduler(base_config)  # a 64-token budget, prefix caching on
    prompt = list(range(100, 140))  # 40 tokens: two full blocks a later request can share
    add(s, "a", 0, prompt=list(prompt), max_tokens=3, ignore_eos=True)
    _, (first,) = fake_step(s)
    stats = s.make_stats()
    assert 0 < first.queued_ts <= first.scheduled_ts and first.num_cached_tokens == 0
    assert stats.iteration_tokens == [40]
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40, 0)

    add(s, "b", 0, prompt=list(prompt), max_tokens=1)  # its one token is also its last
    add(s, "c", 100, max_tokens=2, ignore_eos=True)  # prefilled over two steps
    _, outs = fake_step(s)
    by_id = {o.request_id: o for o in outs}
    assert by_id["a"].scheduled_ts == 0.0 and by_id["a"].queued_ts == 0.0
    b = by_id["b"]
    assert b.finished and b.num_cached_tokens == 32 and b.scheduled_ts >= first.scheduled_ts
    assert "c" not in by_id  # its prompt is not done: no output, nothing carried yet
    stats = s.make_stats()
    assert stats.iteration_tokens == [1 + 8 + 55]  # a decodes, b's 8 uncached, c's first chunk
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (140, 32)

    c_scheduled = s.requests["c"].scheduled_ts
    _, outs = fake_step(s)  # c's last chunk and first token; a's last token
    assert {o.request_id: o.scheduled_ts for o in outs} == {"a": 0.0, "c": c_scheduled}
    _, outs = fake_step(s)  # c's last token, again without times
    assert [(o.request_id, o.scheduled_ts, o.finished) for o in outs] == [("c", 0.0, True)]
    # Two steps since the last report: two entries.
    assert s.make_stats().iteration_tokens == [1 + 45, 1]


def test_prefix_lookups_count_new_prompts_only(base_config):
    """As vLLM counts them: a preempted request's lookup on resuming is not a query, and with
    prefix caching off nothing is."""
    s = make_scheduler(base_config, num_blocks=6, max_num_batched_tokens=128)
    reqs = [add(s, rid, 30, max_tokens=40, ignore_eos=True) for rid in "abc"]
    fake_step(s)
    assert s.make_stats().prefix_cache_queries == 90
    queries = 0
    while s.has_unfinished():
        fake_step(s)
        queries += s.make_stats().prefix_cache_queries
    assert reqs[2].num_preemptions >= 1 and queries == 0

    off = make_scheduler(base_config)
    off.kv.enable_caching = False
    add(off, "a", 30)
    fake_step(off)
    assert off.make_stats().prefix_cache_queries == 0


def test_grammar_wait_prefills_all_but_the_last_token(base_config):
    """A request whose grammar is still compiling computes its prompt up to its last token
    (chunked, beside decoding requests, on the fast path's steps too) and samples nothing; one
    with nothing left before its last token waits without holding up the queue; cleared, the
    last token is scheduled and samples. Async scheduling or not, the same."""
    for async_scheduling in (False, True):
        s = make_scheduler(base_config, max_num_batched_tokens=16,
                           async_scheduling=async_scheduling)
        add(s, "d", 4)
        fake_step(s)  # d decodes from here on
        w = add(s, "w", 30)
        w.grammar_wait = True
        one = add(s, "one", 1)  # nothing to prefill before its last token
        one.grammar_wait = True
        add(s, "after", 3)  # queued behind both: not held up
        so, outs = fake_step(s)
        assert so.scheduled() == {"d": 1, "w": 15}, async_scheduling
        so, outs = fake_step(s)
        assert so.scheduled() == {"d": 1, "w": 14, "after": 1}, async_scheduling
        assert w.num_computed_tokens == 29 and w.num_placeholders == 0
        assert one.num_computed_tokens == 0 and one in s.waiting
        for _ in range(2):  # prefilled up to its last token: left out, the others go on
            so, outs = fake_step(s)
            assert "w" not in so.scheduled() and "one" not in so.scheduled()
            assert not any(o.request_id == "w" for o in outs)
        w.grammar_wait = one.grammar_wait = False
        so, outs = fake_step(s)
        assert so.scheduled()["w"] == 1 and so.scheduled()["one"] == 1, async_scheduling
        assert [o.new_token_ids for o in outs if o.request_id == "w"] == [[7]]
        assert len(w.output_token_ids) == 1
        s.kv.check_invariants()
