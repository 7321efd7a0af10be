"""A deferred constrained step's fill job advances the matchers by their previous tokens before
it fills their masks (``begin_fill(tokens=...)``), off the engine thread; the engine reads what
``advance`` would have said (``PendingFill.verdicts``) when it collects that step. Checked
against the engine thread's own advance, on both backends: the same masks, the same verdicts,
and through an engine the same tokens and finish reasons, a request its grammar ends getting
one more output of no tokens."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason, ModelRunnerOutput
from tidal.engine_core.sampling_params import SamplingParams, StructuredOutputsParams


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_the_fill_job_advances_as_the_engine_thread_does(manager, qwen3_tokenizer, admit):
    tok = qwen3_tokenizer
    three = StructuredOutputsParams(regex=r"[0-9]{3}")
    for rid in ("a", "b"):  # advanced on the engine thread, then by the job: the same
        admit(manager, rid, [1, 2], structured_outputs=three)
    admit(manager, "c", [1, 2], structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,9}"))
    try:
        assert manager.advance("a", _ids(tok, "12")) is None
        pending = manager.begin_fill(["b", "c"], tokens=[_ids(tok, "1")[0], None])
        pending.wait()
        assert pending.verdicts() == []
        pending = manager.begin_fill(["b"], tokens=[_ids(tok, "2")[0]])
        np.testing.assert_array_equal(pending.wait(), manager.fill_bitmask(["a"]))
        # The grammar's last token: "stop", as advance says of it.
        last = _ids(tok, "3")[0]
        want = manager.advance("a", [last])
        pending = manager.begin_fill(["b", "c"], tokens=[last, _ids(tok, "q")[0]])
        assert pending.verdicts() == [("b", want)] and want == "stop"
        # Its row still gets a mask (end-of-sequence alone), never an exception; so does a
        # matcher fed end-of-sequence after its end (ignore_eos: xgrammar's has terminated).
        stops = set(manager.model.eos_token_ids)
        for pending in (pending, manager.begin_fill(["b"], tokens=[min(stops)])):
            bits = np.unpackbits(pending.wait()[0].view(np.uint8), bitorder="little")
            assert stops >= set(np.flatnonzero(bits).tolist()) != set()
        # A token the grammar refuses: the error advance gives.
        digit = _ids(tok, "7")[0]
        pending = manager.begin_fill(["c"], tokens=[digit])
        (rid, verdict), = pending.verdicts()
        assert rid == "c" and "rejected by the grammar" in verdict and str(digit) in verdict
    finally:
        manager.drop(["a", "b", "c"])


def test_no_verdict_for_a_request_dropped_meanwhile(manager, qwen3_tokenizer, admit):
    tok = qwen3_tokenizer
    admit(manager, "x", [1], structured_outputs=StructuredOutputsParams(regex=r"[0-9]"))
    try:
        pending = manager.begin_fill(["x"], tokens=[_ids(tok, "5")[0]])
        manager.drop(["x"])  # an abort before the step is collected
        # A new request under the same id is another request: the old verdict is not its.
        admit(manager, "x", [1], structured_outputs=StructuredOutputsParams(regex=r"[0-9]"))
        assert pending.verdicts() == []
    finally:
        manager.drop(["x"])


def test_a_gated_request_is_not_advanced_by_the_fill(manager, qwen3_tokenizer, admit):
    think = _ids(qwen3_tokenizer, "<|im_start|>assistant\n<think>\n")
    admit(manager, "t", think, structured_outputs=StructuredOutputsParams(regex=r"[0-9]"),
          reasoning_first=True)
    try:
        with pytest.raises(ValueError, match="reasoning gate"):
            manager.begin_fill(["t"], tokens=[5])
    finally:
        manager.drop(["t"])


def _run(llm, prompts: list[list[int]], params: list[SamplingParams]):
    """Step the engine core until done: per request, (tokens, finish reason, outputs that
    finished it with no tokens)."""
    core = llm.engine.core
    for i, (p, sp) in enumerate(zip(prompts, params)):
        core.add_request(EngineCoreRequest(f"r{i}", p, sp))
    got = {f"r{i}": [[], None, 0] for i in range(len(prompts))}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step().outputs:
            g = got[o.request_id]
            assert g[1] is None, f"{o.request_id}: an output after its last"
            g[0] += o.new_token_ids
            if o.finished:
                g[1] = o.finish_reason
                g[2] += not o.new_token_ids
    assert not core.has_unfinished_requests()
    return got


@pytest.mark.parametrize("backend", ["guidance", "xgrammar"])
def test_engine_tokens_and_finishes_match_the_engine_threads_advance(
        tiny_qwen3, backend, monkeypatch):
    if backend == "xgrammar":
        pytest.importorskip("xgrammar", reason="the optional xgrammar backend is not installed")
    from tidal.frontend import LLM

    grammars = [r"[0-9]{3}", r"(yes|no|maybe)", r"[a-f]{2,4}-[0-9]{2}", r"[a-z]{3,40}"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=i == 3,
                             structured_outputs=StructuredOutputsParams(
                                 regex=grammars[i % len(grammars)], backend=backend))
              for i in range(6)]
    results = {}
    # The fill job begun before the scheduler's update (early), after it, and no advance in it
    # (the late order once: it is the backends' common path to the same matchers).
    modes = (("early", "1", "1"), ("late", "1", "0"), ("off", "0", "1"))
    if backend == "xgrammar":
        modes = modes[::2]
    for mode, in_fill, early in modes:
        monkeypatch.setenv("TIDAL_GRAMMAR_ADVANCE_IN_FILL", in_fill)
        monkeypatch.setenv("TIDAL_GRAMMAR_FILL_EARLY", early)
        llm = LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=256, max_model_len=256,
                  async_scheduling=True, cpu_threads=1, dtype="float32")
        try:
            core = llm.engine.core
            assert core.defer_masks and core.advance_in_fill == (in_fill == "1")
            assert core.fill_early == (mode == "early")
            handed, early_fills = [], []
            begin = core.structured.begin_fill
            begin_early = core._begin_fill_early

            def spy(ids, out=None, background=True, tokens=None, upload=None):
                handed.append(sum(t is not None for t in tokens or ()))
                return begin(ids, out, background, tokens, upload)

            def spy_early(*args):
                began = begin_early(*args)
                early_fills.append(began is not None)
                return began

            core.structured.begin_fill = spy
            core._begin_fill_early = spy_early
            prompt = llm.get_tokenizer().encode("Go:")
            results[mode] = _run(llm, [prompt] * len(params), params)
            # The fill jobs took the advances (all but a request's first token) or none did.
            assert (sum(handed) > 0) == (in_fill == "1"), handed
            # Early: the fills after each request's first began before the update.
            assert (sum(early_fills) >= 5) == (mode == "early"), early_fills
        finally:
            llm.shutdown()
    off = results["off"]
    for mode in set(results) - {"off"}:
        on = results[mode]
        assert {r: (t, f) for r, (t, f, _) in on.items()} == \
            {r: (t, f) for r, (t, f, _) in off.items()}, mode
        # The grammars that end before max_tokens end by STOP; on the fill job's path each
        # such request learns it one output later, in an output of no tokens.
        ended = [r for r, (t, f, _) in off.items() if f == FinishReason.STOP]
        assert ended, off
        assert all(on[r][2] == 1 for r in ended) and all(off[r][2] == 0 for r in ended)
    assert all(f == FinishReason.LENGTH for r, (t, f, _) in off.items() if r not in ended)


class _Structured:
    """What ``EngineCore._begin_fill_early`` asks of the manager, recorded."""

    def __init__(self, gated: bool = False) -> None:
        self.has_gates = gated
        self.begun: list[tuple[list[str], list[int | None]]] = []

    def needing_masks(self, ids):
        return [rid for rid in ids if rid != "gone"]

    def begin_fill(self, ids, out, tokens=None, upload=None):
        self.begun.append((ids, tokens))
        return SimpleNamespace(adv_matchers=[t for t in tokens if t is not None])


def _early(structured, result, verdicts=(), connector=None):
    core = SimpleNamespace(
        structured=structured, scheduler=SimpleNamespace(connector=connector),
        executor=SimpleNamespace(grammar_buffer=lambda n: None), _advanced=deque())
    began = EngineCore._begin_fill_early(core, "launched", ["a", "b", "c", "gone"], result,
                                         list(verdicts))
    return began, core._advanced


def test_the_early_fill_takes_the_tokens_from_the_result_and_falls_back_when_it_must():
    result = ModelRunnerOutput(req_ids=["a", "c", "x"], sampled_token_ids=[[7], [8], [9]])
    structured = _Structured()
    # "b" sampled nothing in the collected step (its first token comes now), "gone" has no
    # grammar any more, "c" its grammar ended at the token before: left out.
    began, advanced = _early(structured, result, verdicts=[("c", "stop")])
    assert structured.begun == [(["a", "b"], [7, None])]
    assert began[:2] == ("launched", ["a", "b"]) and advanced[0][0] == "launched"
    # The engine thread goes first for: a reasoning gate, several tokens, a failed request,
    # a KV connector (a failed load may change the tokens).
    several = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7, 8]])
    failed = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]], failed={"b": "oom"})
    for structured, result, connector in ((_Structured(gated=True), result, None),
                                          (_Structured(), several, None),
                                          (_Structured(), failed, None),
                                          (_Structured(), result, object())):
        began, advanced = _early(structured, result, connector=connector)
        assert began is None and not advanced and structured.begun == []
