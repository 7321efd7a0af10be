"""The GPU model runner end to end: CUDA-graph replay against eager execution, greedy tokens
against HF transformers, async scheduling against sync, and KV sizing from the profiling run.

Models are tiny random-weight Llama / Qwen2 / Qwen3 checkpoints with 64-wide heads (the size the
GPU attention kernels are built for), run in float32 so that token equality across
implementations is meaningful (bf16 cannot be token-exact over long runs). The HF reference
runs on the CPU in float32.
"""

from __future__ import annotations

import gc
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: these tests run the model runner's GPU path (CUDA graphs, "
                "pinned staging, side-stream output copies)", allow_module_level=True)

import reference  # noqa: E402
from tidal.frontend import LLM, SamplingParams  # noqa: E402

SHAPES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
# Seven prompts, 1 to 300 tokens, straddling block boundaries; seven decodes pad to graph 8.
PROMPT_LENGTHS = [1, 5, 16, 17, 97, 160, 300]
NEW_TOKENS = 32


def _make_tiny(family: str, folder):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(0)
    if family == "llama":
        cfg = LlamaConfig(**SHAPES, rope_theta=10000.0, tie_word_embeddings=False)
    elif family == "qwen2":
        cfg = Qwen2Config(**SHAPES, tie_word_embeddings=True)
    else:
        cfg = Qwen3Config(**SHAPES, head_dim=64, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # peaked distributions: greedy choices are not near-ties
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    model.save_pretrained(folder)
    return model


# Triton fused ops by default (--ops-backend): building the CUDA extension takes minutes on a
# fresh machine and is covered by the kernel tests (TIDAL_GPU_TEST_OPS=auto uses it here too).
OPS = os.environ.get("TIDAL_GPU_TEST_OPS", "triton")


@pytest.fixture(scope="module")
def gpu_models(tmp_path_factory):
    out = {}
    for family in ("llama", "qwen2", "qwen3"):
        folder = tmp_path_factory.mktemp(f"gpu-{family}")
        out[family] = (folder, _make_tiny(family, folder))
    return out


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def _llm(folder, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 512)
    kw.setdefault("ops_backend", OPS)
    return LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda", **kw)


def _close(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _runner(llm: LLM):
    return llm.engine.core.executor.worker.runner


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def _count_replays(runner) -> dict[int, int]:
    counts: dict[int, int] = {}
    graphs = runner.graphs
    assert graphs is not None and len(graphs) > 0, "no CUDA graphs were captured"
    original = graphs.replay

    def counting(size: int):
        counts[size] = counts.get(size, 0) + 1
        return original(size)

    graphs.replay = counting
    return counts


def _cuda_backend_or_skip() -> None:
    if os.environ.get("TIDAL_GPU_TEST_CUDA_EXT") != "1":
        pytest.skip("set TIDAL_GPU_TEST_CUDA_EXT=1 to build the CUDA extension and run the "
                    "graph test on the CUDA attention backend too")
    from tidal.worker.ops.cuda_ext import load_extension

    if load_extension() is None:
        pytest.skip("the CUDA extension did not build here")


@pytest.mark.parametrize("family, backend", [("llama", "triton"), ("qwen3", "triton"),
                                             ("qwen3", "cuda")])
def test_graph_replay_matches_eager(gpu_models, family, backend):
    if backend == "cuda":
        _cuda_backend_or_skip()
    folder, hf = gpu_models[family]
    prompts = _prompts(hf.config.vocab_size, seed=1)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    eager = _llm(folder, enforce_eager=True, attention_backend=backend)
    assert _runner(eager).graphs is None
    ref = eager.generate(prompts, params, use_tqdm=False)
    _close(eager)
    graphed = _llm(folder, attention_backend=backend)
    assert _runner(graphed).attn_impl.name == backend
    replays = _count_replays(_runner(graphed))
    got = graphed.generate(prompts, params, use_tqdm=False)
    # Also a lone request (graph 1) and a batch that pads to 16.
    alone = graphed.generate(prompts[:1], params, use_tqdm=False)
    more = graphed.generate(prompts + prompts[:3], params, use_tqdm=False)
    _close(graphed)
    assert _tokens(got) == _tokens(ref)
    assert _tokens(alone) == _tokens(ref[:1])
    assert _tokens(more) == _tokens(ref) + _tokens(ref[:3])
    assert {1, 8, 16} <= set(replays), f"graph sizes replayed: {sorted(replays)}"
    for a, b in zip(got, ref):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in pb:
                assert abs(pa[tok].logprob - pb[tok].logprob) < 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_step_graphs_match_eager(gpu_models, family):
    """Steps that mix prompt chunks with decodes replay the mixed graphs (token counts padded to
    a captured size, request slots padded) and give eager's tokens and log-probabilities."""
    folder, hf = gpu_models[family]
    prompts = _prompts(hf.config.vocab_size, seed=7)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    # A small token budget: the long prompts are prefilled in chunks while the short ones decode.
    kw = dict(attention_backend="triton", max_num_batched_tokens=128, max_num_seqs=16)
    eager = _llm(folder, enforce_eager=True, **kw)
    ref = eager.generate(prompts, params, use_tqdm=False)
    _close(eager)
    graphed = _llm(folder, **kw)
    runner = _runner(graphed)
    assert runner.graphs is not None and runner.graphs.mixed_sizes == [8, 16, 32, 64, 128]
    mixed: dict[int, int] = {}
    original = runner.graphs.replay_mixed

    def counting(tokens: int):
        mixed[tokens] = mixed.get(tokens, 0) + 1
        return original(tokens)

    runner.graphs.replay_mixed = counting
    got = graphed.generate(prompts, params, use_tqdm=False)
    _close(graphed)
    assert sum(mixed.values()) >= 5, f"mixed graphs replayed: {mixed}"
    assert _tokens(got) == _tokens(ref)
    for a, b in zip(got, ref):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok in pb:
                assert abs(pa[tok].logprob - pb[tok].logprob) < 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_gpu_greedy_matches_hf(gpu_models, family):
    folder, hf = gpu_models[family]
    prompts = _prompts(hf.config.vocab_size, seed=sum(map(ord, family)))
    llm = _llm(folder, max_num_seqs=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _close(llm)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lp = reference.hf_greedy(hf, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < 2e-3


@pytest.mark.parametrize("num_blocks", [512, 24], ids=["roomy", "preempting"])
def test_async_scheduling_matches_sync_on_gpu(gpu_models, num_blocks):
    """Scheduling step N+1 before step N's tokens reach the host: the inputs that need them
    come from the device (placeholder fill); outputs must not change, also with stop tokens,
    short max_tokens, seeded sampling and preemption."""
    folder, hf = gpu_models["qwen3"]
    vocab = hf.config.vocab_size
    rng = random.Random(11)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 120))] for _ in range(12)]
    sync = _llm(folder, max_model_len=256, async_scheduling=False)
    probe = sync.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30,
                                                      ignore_eos=True), use_tqdm=False)
    stop_tok = probe[0].outputs[0].token_ids[7]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)] * 3
    expected = _tokens(sync.generate(prompts, params, use_tqdm=False))
    _close(sync)
    fast = _llm(folder, num_kv_blocks=num_blocks, max_model_len=256, async_scheduling=True)
    core = fast.engine.core
    runner = _runner(fast)
    assert core.max_inflight == 2 and runner.defer_output
    fills = {"n": 0}
    original = runner._placeholder_fill

    def counting(*args):
        out = original(*args)
        fills["n"] += out is not None
        return out

    runner._placeholder_fill = counting
    got = _tokens(fast.generate(prompts, params, use_tqdm=False))
    core.scheduler.kv.check_invariants()
    free_ok = core.scheduler.kv.num_free_blocks == core.config.cache.num_blocks
    _close(fast)
    assert got == expected
    assert fills["n"] > 0, "no step took its input from the previous step's device tokens"
    assert free_ok


def test_kv_cache_sized_from_profile(gpu_models):
    folder, _ = gpu_models["llama"]
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda",
              gpu_memory_utilization=0.3, max_model_len=1024, ops_backend=OPS)
    blocks = llm.config.cache.num_blocks
    total = torch.cuda.mem_get_info()[1]
    per_block = _runner(llm).kv_bytes_per_block()
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4,
                                                   ignore_eos=True), use_tqdm=False)
    _close(llm)
    assert len(out[0].outputs[0].token_ids) == 4
    # Most of 30% of the GPU, never more.
    assert 0.15 * total < blocks * per_block < 0.3 * total


def test_model_that_does_not_fit_says_by_how_much(gpu_models):
    folder, _ = gpu_models["llama"]
    with pytest.raises(RuntimeError, match="short by"):
        LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda",
            gpu_memory_utilization=0.001, ops_backend=OPS)
    gc.collect()
    torch.cuda.empty_cache()
