"""Structured outputs under speculative decoding (``StructuredOutputManager.valid_drafts`` /
``fill_draft_bitmask``, the verify rows of ``worker/sample/grammar_mask.grammar_rows``).

Drafts of a constrained request are cut to the prefix its grammar (and thinking gate) allows;
a step that verifies them carries one mask per verify position, the mask after the drafts
before it, so the target samples each position under the grammar and the rejection rule keeps
its (masked) distribution. The manager's matchers end every call where they started: the
accepted tokens advance them when the step's results come back.

With the real Qwen3 tokenizer (``<think>`` / ``</think>`` single tokens) and a tiny random
Qwen3: each mask row equals what a copy of the matcher, fed the drafts one by one, fills; end to
end, greedy constrained output (JSON schemas, regexes, a thinking budget) with n-gram drafts is
the plain engine's token for token, and with synthetic acceptance (drafts accepted whatever the
weights) every output still validates.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

import reference
from tidal.engine_core.sampling_params import SamplingParams, StructuredOutputsParams
from tidal.engine_core.structured_output.manager import StructuredOutputManager
from tidal.worker.sample.grammar_mask import grammar_rows

RX = r"[a-z]{2,5}-[0-9]{1,3}"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "tag": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "tag"], "additionalProperties": False}


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _reference_rows(mgr: StructuredOutputManager, rid: str, drafts: list[int]) -> np.ndarray:
    """The masks a copy of the request's matcher and gate fill, fed the drafts one by one."""
    state = mgr.states[rid]
    m = None if state.matcher is None else state.matcher.deep_copy()
    gate = None if state.gate is None else state.gate.fork()
    rows = np.empty((len(drafts) + 1, (mgr.model.vocab_size + 31) // 32), dtype=np.int32)
    for j in range(len(drafts) + 1):
        mgr._fill([m], [gate], rows[j:j + 1])
        if j < len(drafts):
            answer = [drafts[j]] if gate is None else gate.feed([drafts[j]])
            if answer and m is not None:
                assert m.consume_tokens(answer)
    return rows


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool(int(row.view(np.uint32)[token >> 5]) >> (token & 31) & 1)


def test_drafts_cut_where_the_grammar_refuses_or_completes(manager, qwen3_tokenizer, admit):
    tok = qwen3_tokenizer
    admit(manager, "rx", _ids(tok, "Go:"), structured_outputs=StructuredOutputsParams(regex=RX))
    good = _ids(tok, "abc-12")
    bad = _ids(tok, "!")
    assert manager.valid_drafts("rx", good + bad + good) == good
    assert manager.valid_drafts("rx", bad + good) == []
    # The grammar's last token ("abc-123": no fourth digit may follow) completes it: drafts end
    # before it, the step samples it itself.
    done = _ids(tok, "abc-123")
    assert manager.valid_drafts("rx", done) == done[:-1]
    # Nothing consumed: the next mask is still the grammar's first.
    before = manager.fill_bitmask(["rx"]).copy()
    manager.valid_drafts("rx", good)
    assert np.array_equal(manager.fill_bitmask(["rx"]), before)
    manager.drop(["rx"])


def test_one_mask_per_verify_position(manager, qwen3_tokenizer, admit):
    tok = qwen3_tokenizer
    admit(manager, "a", _ids(tok, "Go:"), structured_outputs=StructuredOutputsParams(regex=RX))
    admit(manager, "b", _ids(tok, "JSON:"),
           structured_outputs=StructuredOutputsParams(json=SCHEMA))
    drafts = {"a": _ids(tok, "xy-4"), "b": _ids(tok, '{"ok": true')}
    for rid, d in drafts.items():
        assert manager.valid_drafts(rid, d) == d
    first = {rid: manager.fill_bitmask([rid]).copy() for rid in ("a", "b")}
    out = manager.fill_draft_bitmask(["a", "b"], drafts)
    na, nb = len(drafts["a"]) + 1, len(drafts["b"]) + 1
    assert out.shape[0] == na + nb
    assert np.array_equal(out[:na], _reference_rows(manager, "a", drafts["a"]))
    assert np.array_equal(out[na:], _reference_rows(manager, "b", drafts["b"]))
    for j, t in enumerate(drafts["a"]):
        assert _allowed(out[j], t)
    assert not np.array_equal(out[0], out[1])  # the rows do move with the drafts
    # A request without drafts gets its one row; the matchers are where they were.
    out = manager.fill_draft_bitmask(["b", "a"], {"a": drafts["a"]})
    assert out.shape[0] == 1 + na and np.array_equal(out[0], first["b"][0])
    for rid in ("a", "b"):
        assert np.array_equal(manager.fill_bitmask([rid]), first[rid])
    manager.drop(["a", "b"])


def test_drafts_through_the_end_of_thinking_and_a_forced_end(manager, qwen3_tokenizer,
                                                             admit):
    tok = qwen3_tokenizer
    think = _ids(tok, "<|im_start|>assistant\n<think>\n")
    end = tok.convert_tokens_to_ids("</think>")
    spec = StructuredOutputsParams(regex=RX)
    admit(manager, "t", think, structured_outputs=spec, reasoning_first=True)
    drafts = _ids(tok, "hmm ok") + [end] + _ids(tok, "ab-1")
    # Free text while thinking, the grammar from the token after the end marker on.
    assert manager.valid_drafts("t", drafts + _ids(tok, "!")) == drafts
    rows = manager.fill_draft_bitmask(["t"], {"t": drafts})
    assert np.array_equal(rows, _reference_rows(manager, "t", drafts))
    k = drafts.index(end)
    assert all((rows[j] == -1).all() for j in range(k + 1))  # thinking: all allowed
    assert not _allowed(rows[k + 1], _ids(tok, "!")[0]) and _allowed(rows[k + 1], drafts[k + 1])
    manager.drop(["t"])
    # A budget of 2: the third token must be the forced end's first, and so on.
    admit(manager, "f", think, structured_outputs=spec, reasoning_first=True,
           thinking_token_budget=2)
    forced = list(manager.states["f"].gate.markers.forced)
    two = _ids(tok, "a b")[:2]
    assert manager.valid_drafts("f", two + _ids(tok, "zzz")) == two
    drafts = two + forced + _ids(tok, "ab")
    assert manager.valid_drafts("f", drafts) == drafts
    rows = manager.fill_draft_bitmask(["f"], {"f": drafts})
    assert np.array_equal(rows, _reference_rows(manager, "f", drafts))
    for j, t in enumerate(forced):
        bits = np.flatnonzero(rows[2 + j].view(np.uint32))
        assert len(bits) == 1 and _allowed(rows[2 + j], t)
    manager.drop(["f"])


def test_grammar_rows_place_each_request_on_its_verify_positions():
    # Sampling rows: x (2 drafts) -> 0..2, y (none) -> 3, z (1 draft) -> 4..5.
    drafts = {"x": [1, 2], "z": [3]}
    src, dst = grammar_rows(["z", "x"], ["x", "y", "z"], drafts)
    assert src.tolist() == [0, 1, 2, 3, 4] and dst.tolist() == [4, 5, 0, 1, 2]
    src, dst = grammar_rows(["x", "y", "z"], ["x", "y", "z"], drafts)
    assert src.tolist() == list(range(6)) and dst is None
    # A grammar request that does not sample this step keeps its rows out.
    src, dst = grammar_rows(["w", "z"], ["z"], {"w": [9, 9], "z": [3]})
    assert src.tolist() == [3, 4] and dst.tolist() == [0, 1]


# --- end to end ----------------------------------------------------------------------------------

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


def _run(llm, prompts, params):
    outs, (_, drafted, accepted) = reference.generate_counting_spec(llm, prompts, params)
    return outs, drafted, accepted


def _cases(tok):
    """(prompt, params, check): prompts that repeat what the grammar asks for, so the n-gram
    lookup proposes drafts the grammar allows."""
    think = _ids(tok, "<|im_start|>user\nJSON<|im_end|>\n<|im_start|>assistant\n<think>\n")
    js = '{"ok": true, "tag": "red"} {"ok": false, "tag": "blue"} '
    cases = []
    for i in range(3):
        cases.append((_ids(tok, js * 3), dict(structured_outputs=StructuredOutputsParams(
            json=SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None))
        cases.append((_ids(tok, "abc-12 xyz-9 " * 4), dict(
            structured_outputs=StructuredOutputsParams(regex=RX)),
            lambda t: re.fullmatch(RX, t) is not None))
        cases.append((think + _ids(tok, js * 2), dict(
            structured_outputs=StructuredOutputsParams(json=SCHEMA), reasoning_first=True,
            thinking_token_budget=3 + i, skip_special_tokens=False),
            lambda t: jsonschema.validate(json.loads(t.split("</think>")[-1]), SCHEMA) is None))
    return cases


@pytest.mark.slow
def test_greedy_constrained_output_is_the_plain_engines(tiny_qwen3, qwen3_tokenizer):
    from tidal.frontend import LLM

    cases = _cases(qwen3_tokenizer)
    prompts = [{"prompt_token_ids": p} for p, _, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=48, **kw) for _, kw, _ in cases]
    kw = dict(max_num_seqs=16, num_kv_blocks=256, max_model_len=512, cpu_threads=1,
              dtype="float32", reasoning_parser="qwen3", structured_outputs_backend="guidance")
    plain = LLM(str(tiny_qwen3), **kw)
    try:
        want, _, _ = _run(plain, prompts, params)
    finally:
        plain.shutdown()
    llm = LLM(str(tiny_qwen3), speculative_config=NGRAM, **kw)
    try:
        got, drafted, accepted = _run(llm, prompts, params)
    finally:
        llm.shutdown()
    for w, g, (_, _, check) in zip(want, got, cases, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        if g.outputs[0].finish_reason == "stop":
            assert check(g.outputs[0].text), g.outputs[0].text
    assert drafted > 0 and accepted > 0, (drafted, accepted)


@pytest.mark.slow
def test_outputs_validate_with_drafts_accepted_whatever_the_weights(tiny_qwen3, qwen3_tokenizer,
                                                                    corpus_module):
    """Synthetic acceptance (each draft taken with probability 0.8, the logits unseen): the
    emitted drafts are the grammar's because the trimmed drafts are, and the tokens after them
    are sampled under their position's mask."""
    from tidal.frontend import LLM

    tok = qwen3_tokenizer
    schemas = corpus_module.corpus(24, seed=5)
    cases = _cases(tok)
    prompts = [{"prompt_token_ids": p} for p, _, _ in cases]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=96, **kw)
              for i, (_, kw, _) in enumerate(cases)]
    for i, schema in enumerate(schemas):
        prompts.append({"prompt_token_ids": _ids(tok, "JSON: {\"a\": 1, \"b\": [2, 3]} " * 3)})
        params.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=256,
                                     structured_outputs=StructuredOutputsParams(json=schema)))
    synthetic = dict(NGRAM, rejection_sample_method="synthetic", synthetic_acceptance_rate=0.8)
    llm = LLM(str(tiny_qwen3), speculative_config=synthetic, max_num_seqs=32,
              num_kv_blocks=512, max_model_len=512, cpu_threads=1, dtype="float32",
              reasoning_parser="qwen3", structured_outputs_backend="guidance")
    try:
        outs, drafted, accepted = _run(llm, prompts, params)
    finally:
        llm.shutdown()
    for (_, _, check), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text
    for schema, out in zip(schemas, outs[len(cases):]):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert accepted > 0.3 * drafted > 0, (drafted, accepted)


@pytest.fixture(scope="module")
def corpus_module():
    with reference.tool_module("schema_corpus") as module:
        yield module
