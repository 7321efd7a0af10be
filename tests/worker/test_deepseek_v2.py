"""DeepSeek-V2 (multi-head latent attention + routed/shared experts) against HF transformers'
``DeepseekV2ForCausalLM`` on tiny random weights (float32, CPU).

- greedy tokens identical and logprobs close, for V2-Lite's shape (q as one projection, greedy
  routing, a dense first layer) and V2's (q through a LoRA, group-limited top-k over 4 groups,
  YaRN rope with DeepSeek's mscale); prompts span several cache blocks, a small token budget
  chunks the prefills (the expanded path reads earlier chunks back from the latent cache),
  batches mix decodes (the absorbed path) with prefills, and a second pass over the same prompts
  starts from prefix-cache hits;
- the YaRN rotary table and softmax scale equal HF's;
- the latent cache: the model runner's block size for V2-Lite's shape is 576 values per token
  per layer, >= 7x smaller than the same model with multi-head attention;
- TP=2 and PP=2 match HF too (heads sharded, latent cache replicated; stages split).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tidal.engine_core.model_arch import arch_from_hf_dict
from tidal.frontend import LLM, SamplingParams

NEW_TOKENS = 12
PROMPT_LENGTHS = [5, 23, 61]
LOGPROB_TOL = 5e-4
GPU_LOGPROB_TOL = 2e-3
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)

# V2-Lite's and V2's layouts at a tiny size.
CONFIGS = {
    "lite": dict(q_lora_rank=None, topk_method="greedy", n_group=None, topk_group=None,
                 first_k_dense_replace=1, rope_parameters={"rope_theta": 10000.0,
                                                           "rope_type": "default"}),
    "v2": dict(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4, topk_group=2,
               first_k_dense_replace=0, routed_scaling_factor=1.5,
               rope_parameters={"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 64, "mscale": 0.9,
                                "mscale_all_dim": 0.7, "beta_fast": 32, "beta_slow": 1}),
}


def _hf_config(kind: str):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
        n_shared_experts=1, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attn_implementation="eager", **CONFIGS[kind])


@pytest.fixture(scope="module")
def deepseek_models(tmp_path_factory):
    """kind -> (folder, HF model, prompts, HF greedy tokens and logprobs per prompt)."""
    from transformers import DeepseekV2ForCausalLM

    import reference

    out = {}
    for seed, kind in enumerate(CONFIGS):
        folder = tmp_path_factory.mktemp(f"tiny-deepseek-{kind}")
        torch.manual_seed(seed)
        hf = DeepseekV2ForCausalLM(_hf_config(kind)).float().eval()
        with torch.no_grad():  # peaked distributions: greedy choices are not near-ties
            for name, p in hf.named_parameters():
                if "norm" not in name:
                    p.mul_(3.0)
        hf.save_pretrained(folder)
        rng = random.Random(seed)
        prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)]
                   for n in PROMPT_LENGTHS]
        out[kind] = (folder, hf, prompts, [reference.hf_greedy(hf, p, NEW_TOKENS)
                                           for p in prompts])
    return out


BLOCK = 8


def _generate(folder, prompts, passes: int = 1, device: str = "cpu", **kw):
    """Per pass: (tokens, logprobs, prefix-cached prompt tokens) of each prompt."""
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, block_size=BLOCK,
              max_num_seqs=4, max_num_batched_tokens=32, dtype="float32", device=device, **kw)
    results = []
    try:
        for _ in range(passes):
            outs = llm.generate(prompts, GREEDY, use_tqdm=False)
            results.append([(o.outputs[0].token_ids,
                             [o.outputs[0].logprobs[i][t].logprob
                              for i, t in enumerate(o.outputs[0].token_ids)],
                             o.num_cached_tokens) for o in outs])
    finally:
        llm.shutdown()
    return results


def _check(got, refs, tol: float = LOGPROB_TOL) -> None:
    for n, (tokens, lps, _), (ref_tokens, ref_lps) in zip(PROMPT_LENGTHS, got, refs):
        assert tokens == ref_tokens, f"prompt of {n} tokens"
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < tol, f"prompt of {n}"


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_deepseek_v2_matches_hf(deepseek_models, kind):
    folder, hf, prompts, refs = deepseek_models[kind]
    arch = arch_from_hf_dict(hf.config.to_dict(), "config.json")
    assert arch.is_mla and arch.num_experts == 8
    assert (arch.q_lora_rank is None) == (kind == "lite")
    assert arch.n_group == (4 if kind == "v2" else 1)
    # Pass 1 computes everything; pass 2 starts from the prefix cache's blocks (the latent
    # rows written in pass 1) for every whole block of each prompt.
    first, second = _generate(folder, prompts, passes=2)
    _check(first, refs)
    _check(second, refs)
    assert [cached for *_, cached in second] == [(n - 1) // BLOCK * BLOCK
                                                 for n in PROMPT_LENGTHS]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton MLA kernels and decode graphs run on one")
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_deepseek_v2_matches_hf_on_gpu(deepseek_models, kind):
    """The GPU path: latent writes and absorbed decode in Triton, decode steps replayed from
    CUDA graphs, the fused MoE kernel; float32 (the kernels' dots in IEEE precision)."""
    folder, _, prompts, refs = deepseek_models[kind]
    first, second = _generate(folder, prompts, passes=2, device="cuda")
    _check(first, refs, GPU_LOGPROB_TOL)
    _check(second, refs, GPU_LOGPROB_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,pp", [("v2", 2, 1), ("lite", 1, 2)], ids=["v2-tp2", "lite-pp2"])
def test_parallel_matches_hf(deepseek_models, kind, tp, pp):
    """TP shards the heads (latent cache replicated) and every expert's intermediate size; PP
    hands hidden states and the residual stream from the dense layer's stage to the MoE one."""
    folder, _, prompts, refs = deepseek_models[kind]
    (got,) = _generate(folder, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       distributed_executor_backend="mp", cpu_threads=1)
    _check(got, refs)


def test_yarn_rotary_and_scale_match_hf():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2Attention,
        DeepseekV2RotaryEmbedding,
    )

    from tidal.worker.layers.mla import mla_softmax_scale
    from tidal.worker.layers.rotary import build_cos_sin_cache

    cfg = _hf_config("v2")
    arch = arch_from_hf_dict(cfg.to_dict() | {"architectures": ["DeepseekV2ForCausalLM"]},
                             "config.json")
    assert arch.rope_scaling["rope_type"] == "yarn"
    hf_rope = DeepseekV2RotaryEmbedding(cfg)
    pos = torch.arange(cfg.max_position_embeddings)[None]
    freqs = hf_rope(torch.zeros(1), pos)[0]  # complex: (cos + i sin) * attention factor
    table = build_cos_sin_cache(arch.qk_rope_head_dim, arch.max_position_embeddings,
                                arch.rope_theta, arch.rope_scaling)
    cos, sin = table.chunk(2, dim=-1)
    torch.testing.assert_close(cos, freqs.real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, freqs.imag, atol=1e-5, rtol=1e-5)
    assert abs(hf_rope.attention_scaling - 1.0) > 1e-3  # mscale != mscale_all_dim: it matters
    hf_attn = DeepseekV2Attention(cfg, 0)
    assert math.isclose(mla_softmax_scale(arch), hf_attn.scaling, rel_tol=1e-9)
    assert not math.isclose(hf_attn.scaling, (16 + 8) ** -0.5, rel_tol=1e-3)


V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "num_experts_per_tok": 6,
    "moe_intermediate_size": 1408, "n_shared_experts": 2, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "norm_topk_prob": False, "topk_method": "greedy", "n_group": 1,
    "topk_group": 1, "scoring_func": "softmax", "routed_scaling_factor": 1.0,
    "vocab_size": 102400, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32,
                     "beta_slow": 1},
}


def test_latent_cache_is_7x_smaller_than_mha(capsys):
    """The cache the model runner allocates for V2-Lite's shape (built on the meta device)."""
    from tidal.worker.attention.backend import kv_cache_shape
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.models.registry import build_model

    arch = arch_from_hf_dict(V2_LITE, "config.json")
    assert arch.moe_layers == tuple(range(1, 27)) and not arch.norm_topk_prob
    with torch.device("meta"):
        model = build_model(arch, torch.bfloat16, TorchAttention())
    layers = model.attention_layers()
    assert len(layers) == 27
    elem = 2  # bf16
    mla = sum(math.prod(layer.cache_shape(1, 1)) for layer in layers) * elem
    assert mla == 27 * 576 * elem
    # The same model with multi-head attention caches every head's K (nope + rope) and V.
    heads = arch.num_heads
    mha = 27 * (math.prod(kv_cache_shape(1, 1, heads, 192)) // 2
                + math.prod(kv_cache_shape(1, 1, heads, 128)) // 2) * elem
    print(f"DeepSeek-V2-Lite KV bytes per token (bf16): MLA {mla}, MHA {mha}, "
          f"{mha / mla:.1f}x smaller")
    assert mha / mla >= 7.0


def test_unsupported_configs_are_refused():
    bad = [({"topk_method": "noaux_tc"}, "topk_method"),
           ({"scoring_func": "sigmoid"}, "scoring_func"),
           ({"attention_bias": True}, "attention_bias"),
           ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling")]
    for change, needle in bad:
        with pytest.raises(ValueError, match=needle):
            arch_from_hf_dict(V2_LITE | change, "config.json")


def test_a_checkpoint_missing_an_expert_is_refused(deepseek_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = deepseek_models["lite"][0]
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match=r"up of expert 5"):
        LLM(str(tmp_path), skip_tokenizer_init=True, num_kv_blocks=16, dtype="float32",
            device="cpu")


@pytest.mark.parametrize("s,n,max_scores", [(7, 7, 1 << 27), (3, 11, 1 << 27), (1, 5, 1 << 27),
                                            (7, 7, 4 * 7 * 2), (9, 13, 4 * 13 * 4)])
def test_padded_causal_prefill_attention_equals_the_dense_one(s, n, max_scores):
    """The GPU prefill's attention (V zero-padded to the Q/K width so SDPA can fuse; a chunk
    after a cached prefix aligned to the last key) equals the CPU path's, here on the CPU."""
    from tidal.worker.attention.torch_backend import attend_dense
    from tidal.worker.layers.mla import attend_causal_padded

    g = torch.Generator().manual_seed(s * 100 + n)
    q = torch.randn(4, s, 24, generator=g)
    k = torch.randn(4, n, 24, generator=g)
    v = torch.randn(4, n, 16, generator=g)
    got = attend_causal_padded(q, k, v, 0.3, max_scores)  # small max_scores: query chunks
    assert got.shape == (4, s, 16)
    torch.testing.assert_close(got, attend_dense(q, k, v, 0.3, 0), rtol=1e-5, atol=1e-5)
    # (It could fail: top-left causal alignment of a chunk after a prefix differs.)
    if s < n:
        wrong = torch.nn.functional.scaled_dot_product_attention(
            q, k, torch.nn.functional.pad(v, (0, 8)), is_causal=True, scale=0.3)[..., :16]
        assert not torch.allclose(wrong, got, atol=1e-3)
