"""Constrained requests under async scheduling: the step is launched first and sampled once the
mask, filled from the previous token meanwhile, is there (the worker in the EngineCore's
process; with tensor-parallel worker processes the ranks compute the logits and wait for the
masks, sent after the step as `FinishSample`), so a constrained request gets a token every step,
and the tokens are those of a step-by-step engine. A tiny random Qwen3 with the real Qwen3
tokenizer (in the repository, so the test runs on a GPU machine too: two GPUs and NCCL there
for TP=2, gloo on a CPU)."""

from __future__ import annotations

import re

import pytest
import torch

from tidal.engine_core import control
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_constrained_requests_run_every_step_and_match_sync(tiny_qwen3, tp):
    if tp > 1 and torch.cuda.is_available() and torch.cuda.device_count() < tp:
        pytest.skip("tensor parallel on a GPU machine needs 2 GPUs")
    from tidal.frontend import LLM

    rx = r"[a-z]{2,5}-[0-9]{1,3}( [a-z]{3,8}){2,6}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(regex=rx))
              for i in range(4)]
    texts = {}
    for async_on in (False, True):
        llm = LLM(str(tiny_qwen3), max_num_seqs=8, num_kv_blocks=256, max_model_len=256,
                  async_scheduling=async_on, cpu_threads=1, dtype="float32",
                  tensor_parallel_size=tp)
        try:
            core = llm.engine.core
            assert core.defer_masks == async_on
            prompt = llm.get_tokenizer().encode("Go:")
            core.add_request(EngineCoreRequest("one", prompt, params[0]))
            steps = n = 0
            got: list[int] = []
            while core.has_unfinished_requests() and n < 1000:
                outs = core.step().outputs
                n += 1
                got += [t for o in outs if o.request_id == "one" for t in o.new_token_ids]
                steps += bool(got)  # counted from its first token (after compile, prefill)
                if n % 3 == 0:
                    # A control call between steps samples the step in flight first.
                    assert core.handle_control(control.Ping()).num_unfinished <= 1
            assert len(got) >= 8 and steps <= len(got) + 2, (async_on, steps, len(got))
            assert re.fullmatch(rx, llm.get_tokenizer().decode(got)), got
            outs = llm.generate(["Go:"] * 4, params, use_tqdm=False)
            texts[async_on] = [o.outputs[0].text for o in outs]
        finally:
            llm.shutdown()
    assert texts[True] == texts[False]
    assert all(re.fullmatch(rx, t) for t in texts[True]), texts[True]


def test_an_abort_and_a_new_request_between_lazily_sampled_steps(tiny_qwen3):
    """A request aborted while its step waits to be sampled (booked, its masks filling) and a
    new request taking its row right after: every request keeps its own grammar's masks (each
    grammar has its own alphabet, so a mask on the wrong row would show), none fails."""
    from tidal.frontend import LLM

    grammars = {"a": r"[a-f]{3,6}-[0-9]{2}( [a-f]{3,6}){3,8}",
                "b": r"[g-k]{3,6}( [g-k]{3,6}){3,8}",
                "c": r"[0-4]{2,5}( [0-4]{2,5}){3,8}",
                "d": r"[p-z]{4,8}\.[5-9]{3}( [p-z]{4,8}){2,6}"}
    llm = LLM(str(tiny_qwen3), max_num_seqs=3, num_kv_blocks=256, max_model_len=256,
              async_scheduling=True, cpu_threads=1, dtype="float32")
    try:
        core = llm.engine.core
        tok = llm.get_tokenizer()
        prompt = tok.encode("Go:")

        def add(rid: str) -> None:
            core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(
                temperature=1.0, seed=ord(rid), max_tokens=40,
                structured_outputs=StructuredOutputsParams(regex=grammars[rid]))))

        for rid in "abc":
            add(rid)
        got: dict[str, list[int]] = {rid: [] for rid in grammars}
        finish: dict[str, str] = {}
        n = 0
        while core.has_unfinished_requests() and n < 2000:
            outs = core.step().outputs
            n += 1
            for o in outs:
                got[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    finish[o.request_id] = str(o.finish_reason)
                    assert o.error is None, (o.request_id, o.error)
            if "d" not in finish and len(got["b"]) >= 3 and "b" not in finish \
                    and core._open_fill is None and core._deferred is not None:
                core.abort_requests(["b"])  # its step is launched, its masks filling
                finish["b"] = "aborted"  # (checked below: not a natural end)
                add("d")  # takes the row "b" leaves
        assert set(finish) == set(grammars) and finish["b"] == "aborted", finish
        for rid in "acd":
            text = tok.decode(got[rid], skip_special_tokens=True)  # (a final end of sequence)
            assert re.fullmatch(grammars[rid], text), (rid, text)
    finally:
        llm.shutdown()
