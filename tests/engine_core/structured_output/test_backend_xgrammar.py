"""The xgrammar backend (engine_core/structured_output/backend_xgrammar.py), the per-request
backend choice (spec.choose_backend, router.py) and the mask layout both backends share.

Validity regardless of weights, as for llguidance (tests/engine_core/test_structured_output.py):
a tiny random-weight Llama with SmolLM2's real tokenizer generates under another seeded subset
of the schema corpus (tools/schema_corpus.py), regexes, choices and grammars with
``--structured-outputs-backend xgrammar``; every output must parse and validate (``jsonschema``
and ``re`` are the references). Masks: both backends' first masks for the same spec allow the
same tokens (so the bit layout is the same), and a model vocabulary wider than the tokenizer's
never has its extra ids allowed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

import reference
from tidal.engine_core.sampling_params import (
    SamplingParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from tidal.engine_core.structured_output.spec import choose_backend, validate, xgrammar_refusal

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'tidal[xgrammar]')")


@pytest.fixture(scope="module")
def corpus():
    with reference.tool_module("schema_corpus") as module:
        yield module


@pytest.fixture(scope="module")
def llm(tiny_smol_path):
    from tidal.frontend import LLM

    engine = LLM(str(tiny_smol_path), max_num_seqs=64, num_kv_blocks=1024, max_model_len=512,
                 cpu_threads=1, dtype="float32", structured_outputs_backend="xgrammar")
    yield engine
    engine.shutdown()


def so(**kwargs) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kwargs)


def sampled(seed: int, max_tokens: int, spec: StructuredOutputsParams) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=spec)


# --- which backend ---------------------------------------------------------------------------

def test_auto_picks_guidance_but_for_xgrammar_format_tags():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt_tag = json.dumps({"type": "structural_tag", "format": {
        "type": "const_string", "value": "hi"}})
    legacy_tag = json.dumps({"type": "structural_tag", "triggers": ["<f>"], "structures": [
        {"begin": "<f>", "schema": schema, "end": "</f>"}]})
    cases = [
        (so(json=schema), "guidance"),
        (so(json_object=True), "guidance"),
        (so(regex="[a-z]+"), "guidance"),
        (so(choice=["x", "y"]), "guidance"),
        (so(grammar='root ::= "a"'), "guidance"),  # GBNF: llguidance converts it
        (so(grammar='start: "a"'), "guidance"),
        (so(structural_tag=legacy_tag), "guidance"),
        (so(structural_tag=fmt_tag), "xgrammar"),  # only xgrammar compiles its own form
    ]
    for params, want in cases:
        got, why = choose_backend(params, "auto", has_xgrammar=True)
        assert got == want, (params, why)
        assert why
    # A property *named* like an unenforced keyword is just a name.
    named = so(json={"type": "object", "properties": {"not": {"type": "string"}}})
    assert xgrammar_refusal(named) is None
    assert choose_backend(so(regex="a"), "auto", has_xgrammar=False) == (
        "guidance", "xgrammar is not installed")
    assert choose_backend(so(regex="a"), "guidance")[0] == "guidance"
    assert choose_backend(so(grammar='start: "a"'), "xgrammar")[0] == "xgrammar"
    assert choose_backend(so(regex="a", backend="guidance"), "auto")[0] == "guidance"


def test_validation_names_the_field_and_the_backend():
    def fails(params, backend, param, *words):
        with pytest.raises(SamplingParamError) as err:
            validate(params, backend)
        assert err.value.param == param, err.value
        for w in words:
            assert w in str(err.value), str(err.value)

    fails(so(json={"type": "array", "uniqueItems": True}), "xgrammar",
          "structured_outputs.json", "uniqueItems", "guidance")
    fails(so(regex=r"(?i)abc"), "xgrammar", "structured_outputs.regex", "xgrammar")
    fails(so(grammar='root ::= foo'), "xgrammar", "structured_outputs.grammar", "foo")
    fails(so(grammar="%llguidance {}\nstart: \"a\""), "xgrammar", "structured_outputs.grammar",
          "%llguidance")
    fails(so(regex="a", backend="xgrammar"), "guidance", "structured_outputs.backend",
          "guidance")
    # auto: what xgrammar refuses, llguidance compiles (and the engine does the same).
    validate(so(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), "auto")
    # Neither enforces uniqueItems: refused whatever the backend, never half-enforced.
    fails(so(json={"type": "array", "uniqueItems": True}), "auto", "structured_outputs.json",
          "uniqueItems")
    validate(so(regex=r"(?i)abc"), "auto")
    validate(so(regex="a", backend="xgrammar"), "auto")
    with pytest.raises(SamplingParamError, match="structured_outputs.backend"):
        so(regex="a", backend="outlines")


# --- masks -----------------------------------------------------------------------------------

def _backends(path: Path):
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.structured_output.router import BackendRouter

    model = EngineArgs(model=str(path), device="cpu").create_config().model
    router = BackendRouter(model, "auto")
    return model, router, router.backend("guidance"), router.backend("xgrammar")


def _allowed(row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.flatnonzero(bits).tolist())


def test_both_backends_fill_the_same_layout(tiny_smol_path):
    model, router, guidance, xgr = _backends(tiny_smol_path)
    vocab = model.vocab_size
    specs = [so(choice=["alpha", "beta gamma", "δέλτα"]), so(regex=r"[0-9]{2}-[a-z]{1,3}"),
             so(json={"type": "object", "properties": {"k": {"enum": ["v", "w"]}},
                      "required": ["k"], "additionalProperties": False})]
    for params in specs[:2]:  # JSON: the two may split a lexeme differently ('{' '"' or '{"')
        rows = np.empty((2, guidance.words), dtype=np.int32)
        guidance.fill([guidance.compile(params)], rows[0:1])
        xgr.fill([xgr.compile(params)], rows[1:2])
        g, x = _allowed(rows[0], vocab), _allowed(rows[1], vocab)
        assert g and g == x, (params, sorted(g ^ x)[:10])
    # One fill over matchers of both backends: each row is its matcher's own mask.
    matchers = [router.compile(p) for p in specs]
    alone = np.empty((len(specs), guidance.words), dtype=np.int32)
    for i, m in enumerate(matchers):
        (xgr if getattr(m, "backend", "") == "xgrammar" else guidance).fill([m], alone[i:i + 1])
    mixed = [guidance.compile(specs[0]), matchers[1], guidance.compile(specs[2]), matchers[0]]
    out = np.empty((4, guidance.words), dtype=np.int32)
    router.fill(mixed, out)
    assert (out[1] == alone[1]).all() and (out[3] == alone[0]).all()
    assert _allowed(out[0], vocab) == _allowed(alone[0], vocab)


def test_a_vocabulary_wider_than_the_tokenizer_never_allows_the_padding(smollm2_tokenizer,
                                                                        tmp_path):
    tok = smollm2_tokenizer
    reference.make_tiny_model("llama", tmp_path, vocab_size=len(tok) + 77, hidden_size=32,
                              intermediate_size=64, num_hidden_layers=1,
                              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tok.save_pretrained(tmp_path)
    model, _, guidance, xgr = _backends(tmp_path)
    assert model.vocab_size == len(tok) + 77 and guidance.words == xgr.words
    for backend in (guidance, xgr):
        out = np.empty((1, backend.words), dtype=np.int32)
        backend.fill([backend.compile(so(regex="(.|\n)*"))], out)  # any text
        allowed = _allowed(out[0], model.vocab_size)
        assert max(allowed) < len(tok), backend.name
        assert len(allowed) > len(tok) // 2, backend.name


# --- validity regardless of weights ----------------------------------------------------------

def test_json_schema_corpus_outputs_validate(llm, corpus):
    """Another subset of the corpus than llguidance's test, under xgrammar: the schemas it
    enforces in full (the others are refused: a pattern next to a length bound)."""
    schemas, refused = [], 0
    for s in corpus.corpus(100, seed=5):
        if xgrammar_refusal(so(json=s)) is None:
            schemas.append(s)
        else:
            refused += 1
            with pytest.raises(SamplingParamError, match="guidance backend can"):
                validate(so(json=s), "xgrammar")
    assert len(schemas) >= 50 and refused
    params = [sampled(i, 256, so(json=s)) for i, s in enumerate(schemas)]
    outs = llm.generate(["Answer in JSON:"] * len(params), params, use_tqdm=False)
    for schema, out in zip(schemas, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.core.structured._backend.compiled_by["xgrammar"] >= len(schemas)


def test_regex_choice_grammar_and_json_object(llm):
    regexes = [r"[0-9]{3}-[a-z]{2,4}", r"(yes|no), because [a-z ]{1,10}\.",
               r"\([0-9]{1,2}(,[0-9]{1,2}){0,3}\)"]
    choices = ["alpha", "beta gamma", "δέλτα", 'a "quoted" \\ one']
    gbnf = 'root ::= "[" item ", " item "]"\nitem ::= [0-9]{1,3} | [a-z]{1,5}'
    gbnf_re = r"\[([0-9]{1,3}|[a-z]{1,5}), ([0-9]{1,3}|[a-z]{1,5})\]"
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,4}/'  # the Lark subset xgrammar parses
    params, checks = [], []
    for seed in range(4):
        for rx in regexes:
            params.append(sampled(seed, 64, so(regex=rx)))
            checks.append(lambda t, rx=rx: re.fullmatch(rx, t) is not None)
        params.append(sampled(seed, 16, so(choice=choices)))
        checks.append(lambda t: t in choices)
        # ignore_eos: the request still stops where the grammar ends.
        params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=30, ignore_eos=True,
                                     structured_outputs=so(choice=choices)))
        checks.append(lambda t: t in choices)
        params.append(sampled(seed, 32, so(grammar=gbnf)))
        checks.append(lambda t: re.fullmatch(gbnf_re, t) is not None)
        params.append(sampled(seed, 16, so(grammar=lark)))
        checks.append(lambda t: re.fullmatch(r"<[a-z]{1,4}>", t) is not None)
    outs = llm.generate(["Say:"] * len(params), params, use_tqdm=False)
    for p, check, out in zip(params, checks, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (p.structured_outputs, c.text)
    objs = llm.generate(["JSON:"] * 6, [sampled(s, 48, so(json_object=True)) for s in range(6)],
                        use_tqdm=False)
    for out in objs:
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and c.text.startswith("{")


def test_auto_routes_per_request_in_one_batch(tiny_smol_path):
    """One engine on auto: a regex only llguidance parses (a Unicode class), a Lark grammar and
    a schema go to llguidance, a structural tag in xgrammar's format form to xgrammar, in the
    same batch; all valid."""
    from tidal.frontend import LLM

    llm = LLM(str(tiny_smol_path), max_num_seqs=8, num_kv_blocks=128, max_model_len=128,
              cpu_threads=1, dtype="float32")
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}},
                  "required": ["n"], "additionalProperties": False}
        tag = {"type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<a>"],
            "tags": [{"type": "tag", "begin": "<a>", "end": "</a>",
                      "content": {"type": "json_schema", "json_schema": schema}}]}}
        params = [sampled(1, 16, so(regex=r"\p{Lu}{2,4}")),
                  sampled(2, 16, so(grammar='start: "x" /[0-9]{2}/')),
                  sampled(3, 32, so(json=schema)),
                  sampled(4, 32, so(structural_tag=json.dumps(tag)))]
        outs = llm.generate(["Go:"] * 4, params, use_tqdm=False)
        texts = [o.outputs[0].text for o in outs]
        assert re.fullmatch(r"[^\W\d_a-z]{2,4}", texts[0]) and texts[0].upper() == texts[0]
        assert re.fullmatch(r"x[0-9]{2}", texts[1])
        assert json.loads(texts[2])["n"] in range(10)
        assert outs[3].outputs[0].finish_reason in ("stop", "length")
        for body in re.findall(r"<a>(.*?)</a>", texts[3], re.S):
            assert json.loads(body)["n"] in range(10)
        used = llm.engine.core.structured._backend.compiled_by
        assert used == {"guidance": 3, "xgrammar": 1}
    finally:
        llm.shutdown()


def test_a_complete_grammar_stops_with_two_stop_ids_in_one_mask_word(qwen3_tokenizer, tmp_path):
    """Qwen's end-of-sequence ids 151643 and 151645 share bitmask word 4738: both must be
    cleared when asking whether only a stop token is left, or the matcher never stops."""
    tok = qwen3_tokenizer
    reference.make_tiny_model("qwen3", tmp_path, vocab_size=(len(tok) + 63) // 64 * 64,
                              hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              eos_token_id=[tok.convert_tokens_to_ids("<|endoftext|>"),
                                            tok.convert_tokens_to_ids("<|im_end|>")])
    tok.save_pretrained(tmp_path)
    _, _, _, xgr = _backends(tmp_path)
    stops = sorted(int(i) for i in xgr._stop_ids)
    assert len({i // 32 for i in stops}) < len(stops), stops  # the case under test
    m = xgr.compile(so(grammar='root ::= "a"'))
    assert m.consume_tokens(qwen3_tokenizer.encode("a", add_special_tokens=False))
    assert m.is_stopped()
