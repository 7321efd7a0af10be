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
