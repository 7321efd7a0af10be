"""Ready means warm, on a GPU: after the engine is ready, a served-like workload (prompts of 1
to 600 tokens arriving alone, all at once and staggered; decode batches from 1 to 320; greedy,
top-k/top-p/min-p, seeded, logprobs with top-logprobs, prompt logprobs, penalties, logit_bias,
min_tokens, n > 1) makes the workers compile no Triton kernel at all (``GetCompileStats``:
the JIT compile watcher's count of compiles after ready, outside any warm-up).

The model has Qwen3-0.6B's attention and vocabulary layout (16 query / 8 KV heads of 128,
152k vocabulary, bf16: the kernel specialisations of the real model) with two layers and
dummy weights, so the workload itself takes seconds. Once with CUDA graphs (decode batches
replay them), once eager (every decode batch size runs its own attention launch).
"""

from __future__ import annotations

import gc
import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: the warm-up's purpose is compiling the Triton kernels a GPU "
                "serves with, and counting compiles needs them to run", allow_module_level=True)

from tidal.engine_core.control import CompileStats, GetCompileStats  # noqa: E402
from tidal.engine_core.protocol import EngineCoreRequest  # noqa: E402
from tidal.frontend import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu

SHAPE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "eos_token_id": 151645,
    "bos_token_id": 151643, "hidden_act": "silu", "attention_bias": False,
}
VOCAB = SHAPE["vocab_size"]
MAX_SEQS = 320


# Triton fused ops, as the other GPU engine tests (the CUDA extension takes minutes to build
# on a fresh machine; TIDAL_GPU_TEST_OPS=auto uses it).
OPS = os.environ.get("TIDAL_GPU_TEST_OPS", "triton")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-layout")
    (folder / "config.json").write_text(json.dumps(SHAPE))
    return folder


def _variants(i: int) -> SamplingParams:
    """The sampling variants of a served workload, by request index."""
    common = dict(max_tokens=1 + (i * 7) % 40, ignore_eos=True)
    variants = [
        lambda: SamplingParams(temperature=0.0, **common),
        lambda: SamplingParams(temperature=0.8, top_k=40, top_p=0.95, **common),
        lambda: SamplingParams(temperature=1.0, seed=i, **common),
        lambda: SamplingParams(temperature=0.7, logprobs=5, **common),
        lambda: SamplingParams(temperature=0.0, prompt_logprobs=3, **common),
        lambda: SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3,
                               repetition_penalty=1.1, **common),
        lambda: SamplingParams(temperature=1.0, logit_bias={7: 5.0, 11: -100.0}, **common),
        lambda: SamplingParams(temperature=0.9, min_tokens=min(5, common["max_tokens"]),
                               stop_token_ids=[3], **common),
        lambda: SamplingParams(temperature=0.9, n=3, seed=1000 + i, **common),
        lambda: SamplingParams(temperature=0.6, min_p=0.1, logprobs=20, **common),
        lambda: SamplingParams(temperature=0.0, logprobs=0, **common),
    ]
    return variants[i % len(variants)]()


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(length)]


def _served_workload(llm: LLM, requests: int, staggered_steps: int) -> None:
    rng = random.Random(0)
    # Alone: one token, then one long prompt.
    llm.generate([[1]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    llm.generate([_prompt(rng, 600)], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    # All at once: more requests than sequences, so decode batches shrink through every size
    # as requests finish, and waiting prompts join running decodes.
    prompts = [_prompt(rng, rng.randint(1, 600)) for _ in range(requests)]
    llm.generate(prompts, [_variants(i) for i in range(requests)], use_tqdm=False)
    # Staggered arrivals on the engine itself (0-3 new requests per step).
    core = llm.engine.core
    n = 0
    for _ in range(staggered_steps):
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
            params = _variants(n)
            if params.n == 1:
                core.add_request(EngineCoreRequest(f"s{n}", _prompt(rng, rng.randint(1, 600)),
                                                   params))
            n += 1
        core.step()
    while core.has_unfinished_requests():
        core.step()


def _check_no_compile_after_ready(llm: LLM) -> CompileStats:
    stats = llm.engine.call(GetCompileStats())
    assert isinstance(stats, CompileStats)
    assert stats.active, "the JIT compile watcher is not running (triton missing?)"
    assert stats.ready
    worker = llm.engine.core.executor.worker
    print(f"warm-up: {worker.warmup.describe() if worker.warmup else None}; "
          f"{stats.startup} JIT compiles at start-up, {stats.after_ready} after ready; "
          f"start-up phases: {worker.startup.phases}")
    assert stats.after_ready == 0, (
        f"{stats.after_ready} JIT compiles after ready:\n" + "\n".join(stats.kernels))
    return stats


def _engine(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
               device="cuda", max_model_len=2048, max_num_seqs=MAX_SEQS,
               num_kv_blocks=16384, ops_backend=OPS, **kw)


def _close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def test_no_jit_compile_after_ready_with_cuda_graphs(model_dir):
    llm = _engine(model_dir)
    try:
        runner = llm.engine.core.executor.worker.runner
        assert runner.graphs is not None and runner.graphs.sizes[-1] == MAX_SEQS
        _served_workload(llm, requests=400, staggered_steps=300)
        _check_no_compile_after_ready(llm)
    finally:
        _close(llm)


def test_no_jit_compile_after_ready_eager(model_dir):
    llm = _engine(model_dir, enforce_eager=True)
    try:
        assert llm.engine.core.executor.worker.runner.graphs is None
        _served_workload(llm, requests=360, staggered_steps=150)
        _check_no_compile_after_ready(llm)
    finally:
        _close(llm)
