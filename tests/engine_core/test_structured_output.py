"""Constrained decoding (engine_core/structured_output) with the llguidance backend.

Validity regardless of weights: a tiny random-weight Llama with SmolLM2's real tokenizer
generates under a seeded corpus of JSON schemas (tools/schema_corpus.py), regexes, choices and
Lark / GBNF grammars; every output must parse and validate (``jsonschema`` is the reference).
Set TIDAL_FULL_SCHEMA_CORPUS=1 to run the whole 2,000-schema corpus instead of CI's subset.
Also: unconstrained requests batched with constrained ones sample exactly what they sample
alone; n > 1, preemption / recompute, chunked prefill, prefix hits and async scheduling keep
each sequence's grammar state consistent; a grammar that fails to compile fails its request
alone; the spec checks name the field.
"""

from __future__ import annotations

import json
import os
import re
import time

import jsonschema
import pytest

import reference
from tidal.engine_core.config import ConfigError, EngineArgs, check_backend
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
from tidal.engine_core.sampling_params import (
    SamplingParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from tidal.engine_core.structured_output.spec import cache_key, escape_regex, validate

FULL = os.environ.get("TIDAL_FULL_SCHEMA_CORPUS") == "1"


@pytest.fixture(scope="module")
def corpus():
    with reference.tool_module("schema_corpus") as module:
        yield module


@pytest.fixture(scope="module")
def llm(tiny_smol_path):
    from tidal.frontend import LLM

    # llguidance pinned: the validity tests here are its own; xgrammar's are in
    # structured_output/test_backend_xgrammar.py (the default, auto, would pick xgrammar).
    engine = LLM(str(tiny_smol_path), max_num_seqs=64, num_kv_blocks=1024, max_model_len=512,
                 cpu_threads=1, dtype="float32", structured_outputs_backend="guidance")
    yield engine
    engine.shutdown()


def so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def sampled(seed: int, max_tokens: int, spec: StructuredOutputsParams | None) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec)


# --- the spec --------------------------------------------------------------------------------

def test_spec_needs_exactly_one_kind_and_names_the_problem():
    for kwargs in ({}, {"regex": "a", "choice": ["a"]}, {"json_object": True, "grammar": "x"}):
        with pytest.raises(SamplingParamError) as err:
            so(**kwargs)
        assert err.value.param == "structured_outputs"
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    params = so(json=schema)
    assert json.loads(params.json) == schema and params.kind == "json"
    assert list(json.loads(params.json)["properties"]) == ["b", "a"]  # order kept
    with pytest.raises(SamplingParamError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=params)
    cases = [
        (so(json={"type": "frobnicate"}), "structured_outputs.json", "frobnicate"),
        (so(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (so(regex="a(b"), "structured_outputs.regex", "unclosed group"),
        (so(grammar="start: missing_rule"), "structured_outputs.grammar", "missing_rule"),
        (so(grammar="root ::= foo"), "structured_outputs.grammar", "foo"),
    ]
    for params, param, words in cases:
        with pytest.raises(SamplingParamError) as err:
            validate(params)
        assert err.value.param == param and words in str(err.value), str(err.value)
    with pytest.raises(SamplingParamError):
        so(choice=[])
    with pytest.raises(SamplingParamError):
        so(regex="x" * (1 << 18))


def test_cache_key_and_regex_escaping():
    assert cache_key(so(json={"type": "object"})) == cache_key(so(json='{"type": "object"}'))
    assert cache_key(so(regex="a")) != cache_key(so(grammar="a"))
    weird = "a.b*c (d)|e[f]{g}^$ h\\i-j"
    assert re.fullmatch(escape_regex(weird), weird)
    validate(so(choice=[weird, "plain"]))


def test_backend_flag():
    assert check_backend("auto") == "auto" and check_backend("guidance") == "guidance"
    with pytest.raises(ConfigError, match="must be one of"):
        check_backend("outlines")


def test_an_unknown_backend_flag_is_a_clear_config_error(tiny_smol_path):
    with pytest.raises(ConfigError, match="structured-outputs-backend"):
        EngineArgs(model=str(tiny_smol_path), structured_outputs_backend="outlines",
                   device="cpu").create_config()


# --- validity regardless of weights ----------------------------------------------------------

def test_json_schema_corpus_outputs_validate(llm, corpus):
    """Every output of a seeded corpus of schemas parses and validates (CI: a subset)."""
    schemas = corpus.corpus(2000 if FULL else 120, seed=0)
    params = [sampled(i, 256, so(json=s)) for i, s in enumerate(schemas)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_choice_and_grammar(llm):
    regexes = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no), because [a-z ]{1,10}\.",
               r"\([0-9]{1,2}(,[0-9]{1,2}){0,3}\)", r"[A-Z][a-z]{2,6}@[a-z]{2,5}\.(com|org)"]
    choices = ["alpha", "beta gamma", "δέλτα", "a.b*c"]
    lark = ('start: "[" item ", " item "]"\n'
            'item: NUM | WORD\n'
            'NUM: /[0-9]{1,3}/\n'
            'WORD: /[a-z]{1,5}/\n')
    lark_re = r"\[([0-9]{1,3}|[a-z]{1,5}), ([0-9]{1,3}|[a-z]{1,5})\]"
    gbnf = 'root ::= "ok" | "fail" "ed"?'
    params, checks = [], []
    for seed in range(6):
        for rx in regexes:
            params.append(sampled(seed, 64, so(regex=rx)))
            checks.append(lambda t, rx=rx: re.fullmatch(rx, t) is not None)
        params.append(sampled(seed, 16, so(choice=choices)))
        checks.append(lambda t: t in choices)
        # ignore_eos: the request still stops where the grammar ends.
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True,
                                     structured_outputs=so(choice=choices)))
        checks.append(lambda t: t in choices)
        params.append(sampled(seed, 32, so(grammar=lark)))
        checks.append(lambda t: re.fullmatch(lark_re, t) is not None)
        params.append(sampled(seed, 8, so(grammar=gbnf)))
        checks.append(lambda t: t in ("ok", "fail", "failed"))
    outs = llm.generate(["Say:"] * len(params), params, use_tqdm=False)
    for p, check, out in zip(params, checks, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (p.structured_outputs, c.text)
    # Any JSON object has no length bound (random weights rarely close one): the ones that
    # finish parse as objects, the rest are an object's beginning.
    objs = llm.generate(["JSON:"] * 8, [sampled(s, 48, so(json_object=True)) for s in range(8)],
                        use_tqdm=False)
    for out in objs:
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and c.text.startswith("{")


def test_unconstrained_requests_are_unchanged_by_a_constrained_one(llm):
    prompts = ["The first", "A second prompt", "Third and longest of the prompts"]
    plain = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3
    alone = llm.generate(prompts, plain, use_tqdm=False)
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}}, "required": ["x"]}
    mixed = llm.generate(prompts + ["JSON:", "Pick:"], plain + [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=so(json=schema)),
        sampled(3, 12, so(choice=["left", "right"]))], use_tqdm=False)
    for a, m in zip(alone, mixed):
        assert m.outputs[0].token_ids == a.outputs[0].token_ids
    assert json.loads(mixed[3].outputs[0].text)["x"] in range(100)
    assert mixed[4].outputs[0].text in ("left", "right")


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
def test_n_preemption_chunked_prefill_and_prefix_hits(tiny_smol_path, async_on):
    """n = 3 sequences per request, each with its own matcher; a KV pool so small that
    requests are preempted and recomputed; prompts longer than the token budget (chunked);
    a shared prefix (prefix-cache hits). Every output still validates, also with async
    scheduling (masks filled while the step runs, requests preempted with a token in flight)."""
    from tidal.frontend import LLM

    llm = LLM(str(tiny_smol_path), max_num_seqs=16, num_kv_blocks=20, block_size=16,
              max_num_batched_tokens=64, max_model_len=256, cpu_threads=1, dtype="float32",
              async_scheduling=async_on)
    sched = llm.engine.core.scheduler
    preempt, preempted = sched._preempt, []

    def counting(req):
        preempted.append(req.request_id)
        preempt(req)

    sched._preempt = counting
    try:
        schema = {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
            "n": {"type": "integer", "minimum": -50, "maximum": 50}},
            "required": ["name", "tags", "n"], "additionalProperties": False}
        prefix = "word " * 70
        prompts = [prefix + f"request {i}" for i in range(8)]
        params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=96,
                                structured_outputs=so(json=schema))
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert preempted  # the pool was too small for the batch: some were recomputed
        for out in outs:
            assert len(out.outputs) == 3
            for c in out.outputs:
                assert c.finish_reason == "stop", c.text
                jsonschema.validate(json.loads(c.text), schema)
    finally:
        llm.shutdown()


def test_async_scheduling(tiny_smol_path):
    from tidal.frontend import LLM

    llm = LLM(str(tiny_smol_path), max_num_seqs=16, num_kv_blocks=256, max_model_len=256,
              async_scheduling=True, cpu_threads=1, dtype="float32")
    try:
        assert llm.engine.core.max_inflight == 2
        rx = r"[a-z]{2,5}-[0-9]{1,3}"
        params = [sampled(i, 32, so(regex=rx)) for i in range(6)]
        params += [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 2
        outs = llm.generate(["Go:"] * len(params), params, use_tqdm=False)
        for out in outs[:6]:
            assert out.outputs[0].finish_reason == "stop"
            assert re.fullmatch(rx, out.outputs[0].text), out.outputs[0].text
        assert all(len(o.outputs[0].token_ids) == 20 for o in outs[6:])
    finally:
        llm.shutdown()


def test_a_grammar_that_fails_to_compile_fails_only_its_request(llm):
    """The engine compiles off its loop and does not re-validate: a spec the frontend would
    have refused (sent by a buggy frontend) fails that request alone."""
    core = llm.engine.core
    bad = SamplingParams(max_tokens=8, structured_outputs=so(regex="a(b"))
    good = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=so(regex="[ab]{3}"))
    core.add_request(EngineCoreRequest("bad", [1, 2, 3], bad))
    core.add_request(EngineCoreRequest("good", [1, 2, 3], good))
    # Aborted while its grammar compiles: it leaves the scheduler and the manager.
    core.add_request(EngineCoreRequest("gone", [1, 2, 3], SamplingParams(
        max_tokens=8, structured_outputs=so(regex="[xy]{4,9}"))))
    core.abort_requests(["gone"])
    finished = {}
    tokens: list[int] = []
    for _ in range(200):
        for out in core.step().outputs:
            if out.request_id == "good":
                tokens += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out
        if not core.has_unfinished_requests():
            break
    assert finished["bad"].finish_reason == FinishReason.ERROR
    assert "compile" in finished["bad"].error and "unclosed group" in finished["bad"].error
    assert finished["good"].finish_reason == FinishReason.STOP
    assert "gone" not in finished and "gone" not in core.scheduler.requests
    assert not core.structured.states and not core.structured.pending


def test_the_prompt_prefills_while_the_grammar_compiles(llm, monkeypatch):
    """A request's prompt is computed up to its last token while its grammar compiles (held
    here until the engine has done that), and it samples under the grammar once compiled: the
    same tokens as with the compile done first. A compile that fails after the prefill fails
    that request alone, its blocks freed."""
    core = llm.engine.core
    mgr = core.structured
    prompt = list(range(40, 70))
    spec = so(regex="[ab]{3,6}c")
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=spec)
    first = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert re.fullmatch("[ab]{3,6}c", first.outputs[0].text)
    compile_now = mgr._compile
    seen: dict[str, int] = {}

    def after_the_prefill(p):
        # (The pool thread: the engine keeps stepping in the test's thread meanwhile. It records
        # the request as pending just after submitting the compile, so this may run first.)
        rid = None
        for _ in range(500):
            rid = next((r for r, (req, _) in list(mgr.pending.items())
                        if req.sampling_params.structured_outputs == p), None)
            if rid is not None:
                break
            time.sleep(0.01)
        req = core.scheduler.requests[rid]
        for _ in range(500):
            if req.num_computed_tokens >= len(prompt) - 1 and not core.batch_queue:
                break
            time.sleep(0.01)
        seen[rid] = req.num_computed_tokens
        if p.regex == "a(b":
            raise ValueError("refused after the prefill")
        return compile_now(p)

    monkeypatch.setattr(mgr, "_compile", after_the_prefill)
    mgr._cache.clear()
    second = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert list(seen.values()) == [len(prompt) - 1]
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    free = core.scheduler.kv.num_free_blocks
    core.add_request(EngineCoreRequest("late-error", prompt, SamplingParams(
        max_tokens=8, structured_outputs=so(regex="a(b"))))
    outs = []
    for _ in range(500):
        outs += core.step().outputs
        if not core.has_unfinished_requests():
            break
    assert seen["late-error"] == len(prompt) - 1
    assert [(o.request_id, o.finish_reason) for o in outs] == [("late-error",
                                                                 FinishReason.ERROR)]
    assert "refused after the prefill" in outs[0].error
    assert core.scheduler.kv.num_free_blocks == free and not mgr.pending and not mgr.states


def test_llm_generate_refuses_an_invalid_schema_before_the_engine(llm):
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate(["x"], SamplingParams(structured_outputs=so(json={"type": 3})),
                     use_tqdm=False)


def test_requests_of_one_grammar_copy_templates_compiled_apart(llm, monkeypatch):
    """The first requests of a grammar each compile a template (up to the limit), later ones
    copy them in turn; every output still follows the grammar."""
    from tidal.engine_core.structured_output import manager as mgr

    monkeypatch.setattr(mgr, "_TEMPLATES_PER_GRAMMAR", 3)
    schema = {"type": "object", "properties": {"templated": {"type": "integer"}},
              "required": ["templated"], "additionalProperties": False}
    params = [sampled(100 + i, 64, so(json=schema)) for i in range(8)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    entry = llm.engine.core.structured._cache[cache_key(so(json=schema))]
    assert len(entry.futures) == 3 and entry.served == 8
    templates = [f.result().matcher for f in entry.futures]
    assert len({id(t) for t in templates}) == 3


def test_templates_hand_out_in_turn_and_fall_back_to_a_done_one(monkeypatch):
    from concurrent.futures import Future

    from tidal.engine_core.structured_output import manager as mgr

    monkeypatch.setattr(mgr, "_TEMPLATES_PER_GRAMMAR", 2)
    made: list[Future] = []

    def compile_one() -> Future:
        made.append(Future())
        return made[-1]

    t = mgr._Templates()
    got = [t.next(compile_one) for _ in range(5)]
    assert len(made) == 2 and got == [made[0], made[1], made[0], made[1], made[0]]
    assert t.done_template() is None and not t.failed()
    made[0].set_result("first")
    assert t.done_template() is made[0]
    made[1].set_result("second")
    assert t.done_template() is made[1]  # the newest done, to spread the copies
    broken = mgr._Templates()
    broken.next(compile_one)
    made[-1].set_exception(ValueError("bad"))
    assert broken.failed() and broken.done_template() is None
