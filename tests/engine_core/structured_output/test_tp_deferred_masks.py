"""Constrained requests with tensor-parallel worker processes under async scheduling: the step
is sent first, the ranks compute the logits and wait, and the grammar masks follow on the ring
(`FinishSample`), so a constrained request gets a token every step, and the tokens are those of
a step-by-step engine. A tiny random Qwen3 with the real Qwen3 tokenizer (in the repository, so
the test runs on a GPU machine too: two GPUs and NCCL there, gloo on a CPU)."""

from __future__ import annotations

import re

import pytest
import torch

from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow


def test_tp2_constrained_requests_run_every_step_and_match_sync(tiny_qwen3):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
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
                  tensor_parallel_size=2)
        try:
            core = llm.engine.core
            assert core.defer_masks == async_on
            prompt = llm.get_tokenizer().encode("Go:")
            core.add_request(EngineCoreRequest("one", prompt, params[0]))
            steps = tokens = n = 0
            while core.has_unfinished_requests() and n < 1000:
                outs = core.step().outputs
                n += 1
                tokens += sum(len(o.new_token_ids) for o in outs if o.request_id == "one")
                steps += tokens > 0  # counted from its first token (after compile, prefill)
            assert tokens >= 8 and steps <= tokens + 2, (async_on, steps, tokens)
            outs = llm.generate(["Go:"] * 4, params, use_tqdm=False)
            texts[async_on] = [o.outputs[0].text for o in outs]
        finally:
            llm.shutdown()
    assert texts[True] == texts[False]
    assert all(re.fullmatch(rx, t) for t in texts[True]), texts[True]
