"""Structural tags (spec.py): free text in which every trigger starts a tagged section whose
body must be JSON valid under its structure's schema, on both backends (llguidance through a
Lark grammar with lazy trigger lexemes, xgrammar natively).

The generation test biases a tiny random-weight model towards the trigger ``<`` so outputs
hold many tagged sections; each complete section must match one structure and validate
(``jsonschema`` is the reference), free text must not hold a stray trigger, and only an
output cut by max_tokens may end inside a section.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from tidal.engine_core.sampling_params import (
    SamplingParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from tidal.engine_core.structured_output.spec import (
    StructuralTag,
    TagStructure,
    parse_structural_tag,
    structural_tag_lark,
    structural_tag_params,
    validate,
)

pytest.importorskip("xgrammar", reason="xgrammar is not installed (pip install 'tidal[xgrammar]')")

NUM = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["n"], "additionalProperties": False}
WORDS = {"type": "array", "items": {"enum": ["x", "yy"]}, "maxItems": 3}
STRUCTURES = [TagStructure("<a>", NUM, "</a>"), TagStructure("<b>", WORDS, "</b>")]
SCHEMAS = {"a": NUM, "b": WORDS}


def test_the_spec_and_its_errors():
    params = structural_tag_params(STRUCTURES, ["<"])
    assert params.kind == "structural_tag"
    tag = parse_structural_tag(params.structural_tag)
    assert isinstance(tag, StructuralTag) and tag.triggers == ("<",)
    assert tag.structures[1] == STRUCTURES[1]
    validate(params, "guidance")
    validate(params, "xgrammar")
    lark = structural_tag_lark(tag)
    assert "[lazy]" in lark and "%json" in lark

    def fails(obj, param, words):
        with pytest.raises(SamplingParamError) as err:
            validate(StructuredOutputsParams(structural_tag=json.dumps(obj)))
        assert err.value.param == param and words in str(err.value), str(err.value)

    good = {"begin": "<a>", "schema": NUM, "end": "</a>"}
    fails({"structures": [good]}, "structured_outputs.structural_tag.triggers", "list")
    fails({"structures": [], "triggers": ["<"]},
          "structured_outputs.structural_tag.structures", "list")
    fails({"structures": [{**good, "begin": "x"}], "triggers": ["<"]},
          "structured_outputs.structural_tag.structures[0].begin", "does not start")
    fails({"structures": [{**good, "schema": 3}], "triggers": ["<"]},
          "structured_outputs.structural_tag.structures[0].schema", "JSON schema")
    fails({"structures": [good], "triggers": ["<"], "extra": 1},
          "structured_outputs.structural_tag.extra", "not a structural tag field")
    fails({"structures": [{**good, "schema": {"type": "wat"}}], "triggers": ["<"]},
          "structured_outputs.structural_tag", "wat")
    # xgrammar's own form: xgrammar only.
    xgr_form = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<a>"],
        "tags": [{"type": "tag", "begin": "<a>", "end": "</a>",
                  "content": {"type": "json_schema", "json_schema": NUM}}]}}
    params = StructuredOutputsParams(structural_tag=json.dumps(xgr_form))
    validate(params, "auto")
    validate(params, "xgrammar")
    with pytest.raises(SamplingParamError, match="xgrammar"):
        validate(params, "guidance")


def _check(text: str, finished: bool) -> int:
    """The tagged sections of ``text`` (each validated); raises AssertionError if not."""
    decoder = json.JSONDecoder()
    pos, sections = 0, 0
    while True:
        start = text.find("<", pos)
        if start < 0:
            return sections
        m = re.match(r"<(a|b)>", text[start:])
        if m is None:
            assert not finished and len(text) - start < 3, text[start:]
            return sections
        name, body = m.group(1), start + 3
        while body < len(text) and text[body] in " \n\t":
            body += 1
        try:
            value, end = decoder.raw_decode(text, body)
        except ValueError:
            assert not finished, text[start:]  # cut inside the section by max_tokens
            return sections
        jsonschema.validate(value, SCHEMAS[name])
        rest = text[end:].lstrip(" \n\t")
        close = f"</{name}>"
        if not rest.startswith(close):
            assert not finished and close.startswith(rest), text[start:]
            return sections
        pos = len(text) - len(rest) + len(close)
        sections += 1


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_outputs_follow_the_structures(tiny_smol_path, backend):
    from tidal.frontend import LLM

    llm = LLM(str(tiny_smol_path), max_num_seqs=16, num_kv_blocks=256, max_model_len=192,
              cpu_threads=1, dtype="float32", structured_outputs_backend=backend)
    try:
        tok = llm.get_tokenizer()
        bias = {t: 6.0 for t in {*tok.encode("<", add_special_tokens=False),
                                 *tok.encode(" <", add_special_tokens=False)}}
        spec = structural_tag_params(STRUCTURES, ["<"])
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, logit_bias=bias,
                                 structured_outputs=spec) for s in range(8)]
        outs = llm.generate(["Tags:"] * len(params), params, use_tqdm=False)
        sections = 0
        for out in outs:
            c = out.outputs[0]
            sections += _check(c.text, c.finish_reason == "stop")
        assert sections >= 8, [o.outputs[0].text for o in outs]
        assert llm.engine.core.structured._backend.compiled_by == {backend: 1}
    finally:
        llm.shutdown()
