"""Grammars after the reasoning, and thinking budgets (engine_core/structured_output/
reasoning_gate.py), with the real Qwen3 tokenizer (``<think>`` / ``</think>`` are single tokens).

The gate alone: markers found in the prompt's tail (Qwen3's ``enable_thinking: false`` ends the
thinking there; DeepSeek-R1's template opens it), marker sequences followed token by token, the
forced end. End to end: a tiny random-weight Qwen3 with that tokenizer, served by the engine
with ``reasoning_parser="qwen3"``; ``jsonschema`` checks the answer and the reasoning parser of
the frontend splits the text, so engine and parser must agree on where the thinking ends.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import msgspec
import pytest

from tidal.engine_core.reasoning_formats import REASONING_FORMATS
from tidal.engine_core.sampling_params import (
    SamplingParamError,
    SamplingParams,
    StructuredOutputsParams,
)
from tidal.engine_core.structured_output.reasoning_gate import (
    ANSWER,
    AWAIT,
    FORCING,
    REASONING,
    ReasoningGate,
    ReasoningMarkers,
)
from tidal.frontend.reasoning import get_reasoning_parser

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
          "required": ["ok", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def markers(qwen3_tokenizer) -> dict[str, ReasoningMarkers]:
    return {name: ReasoningMarkers.from_tokenizer(REASONING_FORMATS[name], qwen3_tokenizer)
            for name in ("qwen3", "deepseek_r1")}


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _chat(tok, msgs: list[dict], **kwargs) -> list[int]:
    return _ids(tok, tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False,
                                             **kwargs))


def _bits(row: np.ndarray) -> set[int]:
    words = row.view(np.uint32)
    return {int(w) * 32 + b for w in np.flatnonzero(words) for b in range(32)
            if int(words[w]) >> b & 1}


def test_markers_are_the_tokenizers_own_ids(markers, qwen3_tokenizer):
    m = markers["qwen3"]
    assert m.start == tuple(qwen3_tokenizer.convert_tokens_to_ids(["<think>"]))
    assert m.end == tuple(qwen3_tokenizer.convert_tokens_to_ids(["</think>"]))
    assert qwen3_tokenizer.decode(list(m.forced)) == "\n</think>\n\n"
    assert m.opens_in_output and not markers["deepseek_r1"].opens_in_output


def test_prompt_phase_reads_the_templates_tail(markers, qwen3_tokenizer):
    tok = qwen3_tokenizer
    msgs = [{"role": "user", "content": "Give me JSON"}]
    on = _chat(tok, msgs, enable_thinking=True)
    off = _chat(tok, msgs, enable_thinking=False)
    q3, r1 = markers["qwen3"], markers["deepseek_r1"]
    assert q3.prompt_phase(off) == ANSWER  # "<think>\n\n</think>\n\n": thinking is over
    assert q3.prompt_phase(on) == AWAIT  # the first token decides
    assert r1.prompt_phase(on) == REASONING  # the reasoning is implied
    opened = _ids(tok, "<|im_start|>assistant\n<think>\n")
    assert q3.prompt_phase(opened) == REASONING
    # An earlier turn's closed thinking is history, not this turn's answer.
    # (Qwen3's template drops old reasoning; others, and agent loops, keep it.)
    history = _ids(tok, "<|im_start|>assistant\n<think>\nhm\n</think>\n\n{}<|im_end|>\n"
                        "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    assert q3.prompt_phase(history) == AWAIT


def test_gate_follows_the_thinking_and_forces_its_end(markers, qwen3_tokenizer):
    tok = qwen3_tokenizer
    m = markers["qwen3"]
    words = (len(tok) + 31) // 32
    # Natural end: the tokens after </think> (same step or later) go to the grammar.
    gate = ReasoningGate.start(m, _ids(tok, "hi"), budget=None)
    row = np.zeros(words, dtype=np.int32)
    gate.shape_mask(row)
    assert _bits(row) == {m.start[0]}  # the grammar's mask (none here) plus <think>
    assert gate.feed([m.start[0]]) == [] and gate.phase == REASONING
    assert not gate.needs_mask(has_grammar=True)
    thought = _ids(tok, "let me think")
    assert gate.feed(thought) == []
    answer = _ids(tok, '{"ok": true}')
    assert gate.feed([*m.end, *answer[:1]]) == answer[:1] and gate.phase == ANSWER
    assert gate.feed(answer[1:]) == answer[1:]
    assert gate.thinking == len(thought) + len(m.end)
    # No <think> first: the output is all answer.
    gate = ReasoningGate.start(m, _ids(tok, "hi"), budget=3)
    assert gate.feed(answer) == answer
    # A budget: after 3 thinking tokens, the forced end, one token per mask.
    gate = ReasoningGate.start(m, _ids(tok, "hi"), budget=3)
    gate.feed([m.start[0], *thought[:2]])
    assert gate.phase == REASONING
    gate.feed(thought[2:3])
    assert gate.phase == FORCING and gate.needs_mask(has_grammar=False)
    seen = []
    for _ in m.forced:
        row = np.full(words, -1, dtype=np.int32)
        gate.shape_mask(row)
        (token,) = _bits(row)
        seen.append(token)
        assert gate.feed([token]) == []
    assert tuple(seen) == m.forced and gate.phase == ANSWER
    assert gate.feed(answer) == answer
    # Budget 0 with the thinking opened by the prompt: the end is forced at once.
    gate = ReasoningGate.start(markers["deepseek_r1"], _ids(tok, "x<think>\n"), budget=0)
    assert gate.phase == FORCING


def test_budget_field_checks():
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    for kwargs in ({"thinking_token_budget": -1},
                   {"thinking_token_budget": 4, "allowed_token_ids": [1, 2]}):
        with pytest.raises(SamplingParamError) as err:
            SamplingParams(**kwargs)
        assert err.value.param == "thinking_token_budget"


# --- end to end: a tiny random-weight Qwen3 ---------------------------------------------------

@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tiny_qwen3, request):
    """Async scheduling too: a forced token needs the previous one known when its mask is
    built, which the gate gets by sitting out the step after each of its own."""
    from tidal.frontend import LLM

    engine = LLM(str(tiny_qwen3), max_num_seqs=16, num_kv_blocks=256, max_model_len=512,
                 cpu_threads=1, dtype="float32", reasoning_parser="qwen3",
                 async_scheduling=request.param)
    assert engine.engine.core.max_inflight == (2 if request.param else 1)
    yield engine
    engine.shutdown()


def _split(text: str, implicit: bool) -> tuple[str | None, str | None]:
    return get_reasoning_parser("deepseek_r1" if implicit else "qwen3")().extract(text)


def test_budget_forces_the_end_then_the_schema_holds(llm, qwen3_tokenizer, markers):
    tok = qwen3_tokenizer
    m = markers["qwen3"]
    prompt = _ids(tok, "<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n"
                       "<think>\n")
    spec = StructuredOutputsParams(json=SCHEMA)
    budgets = [0, 1, 5, 12]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, thinking_token_budget=b,
                             structured_outputs=spec if s % 2 == 0 else None,
                             skip_special_tokens=False)
              for s, b in enumerate(budgets)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * len(params), params)
    for out, b, p in zip(outs, budgets, params, strict=True):
        ids = list(out.outputs[0].token_ids)
        # The prompt opened the thinking: exactly b tokens of it, then the forced end.
        assert tuple(ids[b:b + len(m.forced)]) == m.forced, (b, ids[:b + 4])
        assert m.end[0] not in ids[:b]
        reasoning, content = _split(out.outputs[0].text, implicit=True)
        # The frontend's parser ends the reasoning where the engine forced the end.
        assert (reasoning or "") == tok.decode(ids[:b]).strip()
        if p.structured_outputs is not None:
            jsonschema.validate(json.loads(content), SCHEMA)
            assert out.outputs[0].finish_reason == "stop"


def test_grammar_waits_for_the_models_own_end_of_thinking(llm, qwen3_tokenizer, markers):
    tok = qwen3_tokenizer
    m = markers["qwen3"]
    msgs = [{"role": "user", "content": "JSON please"}]
    on = _chat(tok, msgs, enable_thinking=True)
    off = _chat(tok, msgs, enable_thinking=False)
    spec = StructuredOutputsParams(json=SCHEMA)
    # Biases make the random model open its thinking (the first mask allows <think> besides
    # the grammar's tokens), then end it on its own: the grammar, which forbids both markers,
    # must not apply in between, and must apply after.
    think = SamplingParams(temperature=1.0, seed=7, max_tokens=80, structured_outputs=spec,
                           skip_special_tokens=False, reasoning_first=True,
                           logit_bias={m.start[0]: 99.0, m.end[0]: 100.0})
    # Thinking off in the prompt: the grammar applies from the first token; a bias towards
    # <think> cannot open a reasoning the template closed.
    plain = SamplingParams(temperature=1.0, seed=8, max_tokens=80, structured_outputs=spec,
                           skip_special_tokens=False, reasoning_first=True,
                           logit_bias={m.start[0]: 100.0})
    # A raw completion (no reasoning_first, as /v1/completions sends): all answer, so the
    # grammar holds from the first token whatever the biases.
    raw = msgspec.structs.replace(think, reasoning_first=False, seed=9)
    first, second, third = llm.generate(
        [{"prompt_token_ids": on}, {"prompt_token_ids": off}, {"prompt_token_ids": on}],
        [think, plain, raw])
    ids = list(third.outputs[0].token_ids)
    assert m.start[0] not in ids and m.end[0] not in ids
    jsonschema.validate(json.loads(third.outputs[0].text), SCHEMA)
    ids = list(first.outputs[0].token_ids)
    assert ids[:2] == [m.start[0], m.end[0]]
    assert m.start[0] not in ids[2:] and m.end[0] not in ids[2:]
    reasoning, content = _split(first.outputs[0].text, implicit=False)
    assert reasoning is None
    jsonschema.validate(json.loads(content), SCHEMA)
    ids = list(second.outputs[0].token_ids)
    assert m.start[0] not in ids and m.end[0] not in ids
    reasoning, content = _split(second.outputs[0].text, implicit=False)
    assert reasoning is None
    jsonschema.validate(json.loads(content), SCHEMA)


def test_an_engine_without_a_reasoning_parser_refuses_a_budget(tiny_qwen3):
    """(Its frontend answers 400 first: tests/frontend/test_server_thinking.py.)"""
    from types import SimpleNamespace

    from tidal.engine_core.config import ConfigError, EngineArgs
    from tidal.engine_core.core import EngineCore
    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.validation import RequestValidationError

    config = EngineArgs(model=str(tiny_qwen3), load_format="dummy").create_config()
    assert config.scheduler.reasoning_parser is None
    core = SimpleNamespace(config=config, _eos=frozenset(),
                           structured=SimpleNamespace(reasoning=None))
    req = EngineCoreRequest("r", [1, 2], SamplingParams(thinking_token_budget=3))
    with pytest.raises(RequestValidationError, match="--reasoning-parser"):
        EngineCore.add_request(core, req)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        EngineArgs(model=str(tiny_qwen3), reasoning_parser="nope").create_config()
    assert EngineArgs(model=str(tiny_qwen3), reasoning_parser="gpt_oss").create_config() \
        .scheduler.reasoning_parser == "gpt_oss"
