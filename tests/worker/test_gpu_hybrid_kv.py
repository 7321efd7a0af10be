"""The hybrid KV cache manager on a GPU: per-group block tables and slot mappings through the
Triton attention kernels, eager and replayed in CUDA graphs (decode batches read each group's
fixed step buffers). A tiny Gemma 3 (one global layer, five windowed) must give the same greedy
tokens with the hybrid manager as with every layer kept whole, and HF transformers' tokens."""

from __future__ import annotations

import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: the per-group tables feed the Triton kernels and the CUDA "
                "graphs only there (the CPU path is tests/worker/test_hybrid_kv_cache.py)",
                allow_module_level=True)

import reference  # noqa: E402
from tidal.frontend import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-hybrid-gemma3")
    hf = reference.make_tiny_model("gemma3", folder)
    rng = random.Random(5)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)]
               for n in (5, 23, 61, 97, 130)]
    refs = [reference.hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
    return folder, prompts, refs


@pytest.mark.parametrize("eager", [False, True], ids=["cuda-graphs", "eager"])
def test_hybrid_matches_all_full_and_hf_on_gpu(gemma3, eager):
    folder, prompts, refs = gemma3
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    results = {}
    for disable in (False, True):
        llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda",
                  attention_backend="triton", enforce_eager=eager, num_kv_blocks=256,
                  max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                  disable_hybrid_kv_cache_manager=disable)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.shutdown()
        results[disable] = [o.outputs[0].token_ids for o in outs]
    assert results[False] == results[True]
    assert results[False] == refs
