"""The benchmarks' byte and FLOP accounting (tools/bench_common.py, docs/BENCHMARKS.md) against
numbers worked out by hand: the dense shapes as before, mixture-of-experts shapes (batch 1
reads exactly the top-k experts, a large batch all of them, in between the uniform-routing
expectation, checked against tidal's own router), DeepSeek-V2's latent KV cache, and the
throughput roofline's per-step expert bytes. CPU only, no model is built."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

from bench_common import SHAPES, config_facts, shape_facts, write_model_dir  # noqa: E402

# A Qwen3-MoE layout small enough to count by hand.
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
# DeepSeek-V2 (MLA, q_lora_rank null), one dense layer then one MoE layer with shared experts.
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 24,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 2, "num_experts_per_tok": 3,
    "first_k_dense_replace": 1, "topk_method": "greedy", "norm_topk_prob": False,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_dense_shapes_keep_their_numbers() -> None:
    # docs/BENCHMARKS.md's table: Qwen3-0.6B reads 1.19 GB per step and 112 KiB of KV per
    # token, Llama-3.1-8B 15.0 GB and 128 KiB.
    q = shape_facts("qwen3-0.6b")
    layer = 1024 * (16 + 2 * 8) * 128 + 16 * 128 * 1024 + 3 * 1024 * 3072
    norms = 28 * 2 * 1024 + 1024 + 28 * 2 * 128  # + Qwen3's q/k norms
    assert q.weight_bytes_per_step == 2 * (28 * layer + norms + 151936 * 1024)
    assert round(q.weight_bytes_per_step / 1e9, 2) == 1.19
    assert q.kv_bytes_per_token == 112 * 1024
    # Prefill: 2 FLOPs per parameter per token, QK^T and PV over the causal triangle.
    assert q.prefill_flops([4, 6], 2) == (2.0 * 28 * layer * 10
                                          + 4.0 * 28 * 16 * 128 * (4 * 5 / 2 + 6 * 7 / 2)
                                          + 2.0 * 151936 * 1024 * 2)
    llama = shape_facts("llama-3.1-8b")
    layer = 4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336
    assert llama.weight_bytes_per_step == 2 * (32 * layer + 32 * 2 * 4096 + 4096
                                               + 128256 * 4096)
    assert llama.kv_bytes_per_token == 128 * 1024
    for name in ("qwen3-0.6b", "llama-3.1-8b", "gemma-2-9b", "gemma-3-12b", "tiny"):
        f = shape_facts(name)
        assert f.num_experts == 0 and f.experts_touched(64) == 0.0
        # A dense step reads every weight whatever the batch.
        for b in (1, 64, 256):
            assert f.weight_bytes_batch(b) == f.weight_bytes_per_step
        assert f.decode_bytes_batch(1, 1000.0) == (f.weight_bytes_per_step
                                                    + 1000 * f.kv_bytes_per_token)


def test_moe_bytes_batch_one_reads_top_k_experts_and_large_batch_all() -> None:
    f = config_facts(TINY_QWEN3_MOE)
    attn = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64
    router, expert = 64 * 8, 3 * 64 * 32
    norms = 2 * (2 * 64 + 2 * 16) + 64  # two RMSNorms and q/k norms per layer, the final one
    head = 256 * 64
    assert f.expert_params == expert and f.num_moe_layers == 2
    assert f.linear_params == 2 * (attn + router + 2 * expert)  # the active parameters
    batch1 = 2 * (2 * (attn + router + 2 * expert) + norms + head)
    every = 2 * (2 * (attn + router + 8 * expert) + norms + head)
    assert f.experts_touched(1) == 2.0
    assert f.weight_bytes_batch(1) == batch1
    assert f.weight_bytes_per_step == every
    assert f.weight_bytes_batch(4096) == every
    # In between: 8·(1 − (3/4)^B) experts per layer, growing with the batch.
    assert f.experts_touched(4) == pytest.approx(8 * (1 - 0.75 ** 4))
    # Two MoE layers, each reading the extra touched experts in bf16.
    assert f.weight_bytes_batch(4) == round(batch1 + 2 * (8 * (1 - 0.75 ** 4) - 2) * expert * 2)
    sizes = [f.weight_bytes_batch(b) for b in (1, 2, 4, 8, 16, 64)]
    assert sizes == sorted(sizes) and batch1 < sizes[2] < every
    # Decode bytes add every request's KV: K and V of 2 heads of 16 per layer.
    assert f.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert f.decode_bytes_batch(4, 100.0) == f.weight_bytes_batch(4) + 400 * 2 * 2 * 2 * 16 * 2
    # Prefill FLOPs count the active experts only.
    assert f.prefill_flops([10], 1) == (2.0 * 2 * (attn + router + 2 * expert) * 10
                                        + 4.0 * 2 * 4 * 16 * 55 + 2.0 * head)


def test_uniform_routing_expectation_matches_the_router() -> None:
    """The distinct experts a batch touches under random router logits (tidal's top-k)
    average to E·(1 − (1 − k/E)^B)."""
    from tidal.worker.layers.fused_moe import RoutingConfig, select_experts

    f = config_facts(TINY_QWEN3_MOE)
    gen = torch.Generator().manual_seed(0)
    for batch in (1, 3, 8):
        trials = 2000
        logits = torch.randn(trials * batch, 8, generator=gen)
        _, ids = select_experts(logits, RoutingConfig(top_k=2))
        ids = ids.view(trials, batch * 2).long()
        hit = torch.zeros(trials, 8).scatter_(1, ids, 1.0)
        mean = hit.sum(1).mean().item()
        assert mean == pytest.approx(f.experts_touched(batch), abs=0.1), batch


def test_moe_with_dense_layers_and_shared_experts_mla() -> None:
    f = config_facts(TINY_DEEPSEEK)
    attn = (64 * 4 * (16 + 8)        # q_proj
            + 64 * (32 + 8)          # kv_a_proj_with_mqa: latent + rope key
            + 32 * 4 * (16 + 16)     # kv_b_proj: per head nope keys and values
            + 4 * 16 * 64)           # o_proj
    dense, router, shared, expert = 3 * 64 * 96, 64 * 8, 3 * 64 * 2 * 24, 3 * 64 * 24
    norms = 2 * (2 * 64 + 32) + 64  # per layer: two RMSNorms and kv_a_layernorm; the final
    assert f.num_moe_layers == 1  # first_k_dense_replace = 1
    assert f.linear_params == 2 * attn + dense + router + shared + 3 * expert
    assert f.weight_bytes_batch(1) == 2 * (f.linear_params + norms + 256 * 64)
    assert f.weight_bytes_per_step == 2 * (2 * attn + dense + router + shared + 8 * expert
                                           + norms + 256 * 64)
    # The cache holds the latent and the rope key per layer; MHA would hold K and V per head.
    assert f.kv_bytes_per_token == 2 * (32 + 8) * 2
    assert f.mha_kv_bytes_per_token == 2 * 2 * 4 * 16 * 2
    # Prefill runs MLA expanded: QK^T over nope + rope, PV over v_head_dim.
    assert f.prefill_flops([3], 0) == (2.0 * f.linear_params * 3
                                       + 2.0 * 2 * 4 * (24 + 16) * 6)


def test_deepseek_v2_lite_kv_is_seven_times_smaller_than_mha() -> None:
    f = shape_facts("deepseek-v2-lite")
    assert f.kv_bytes_per_token == 27 * (512 + 64) * 2
    assert f.mha_kv_bytes_per_token / f.kv_bytes_per_token >= 7
    assert f.num_moe_layers == 26 and f.experts_touched(1) == 6.0


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite",
                                   "tiny-moe"])
def test_moe_shapes_make_engine_configs(shape: str, tmp_path: Path) -> None:
    from tidal.engine_core.config import EngineArgs

    model = write_model_dir(shape, tmp_path / shape)
    arch = EngineArgs(model=model, load_format="dummy").create_config().model.arch
    f = shape_facts(shape)
    assert arch.num_experts == f.num_experts == (SHAPES[shape].get("num_experts")
                                                 or SHAPES[shape].get("num_local_experts")
                                                 or SHAPES[shape].get("n_routed_experts"))
    assert arch.num_experts_per_tok == f.experts_per_tok
    assert arch.vocab_size == f.vocab and arch.num_layers == f.num_layers


def test_throughput_roofline_reads_the_experts_of_the_live_sequences() -> None:
    from bench_throughput import roofline_seconds

    f = config_facts(TINY_QWEN3_MOE)
    prompts, max_tokens = [[1] * 3, [1] * 5], [2, 4]
    # Steps 0-1 decode both sequences, steps 2-3 only the second.
    weights = 2 * f.weight_bytes_batch(2) + 2 * f.weight_bytes_batch(1)
    kv = f.kv_bytes_per_token * ((3 + 4) + (5 + 6 + 7 + 8))
    flops = f.prefill_flops([3, 5], 0)
    got = roofline_seconds(prompts, max_tokens, 256, f, 1.0, 1.0)
    assert got == pytest.approx((weights + kv) / 1e9 + flops / 1e12)
