"""Qwen3-MoE against HF transformers on tiny random weights (float32, CPU): greedy tokens and
logprobs match, with a dense layer among the MoE ones (``mlp_only_layers``), q/k norms, a head
size that is not hidden / heads, and tied embeddings; ``norm_topk_prob`` changes the result when
flipped; tensor parallelism (TP=2) matches; and a llama.cpp-style ``qwen3moe`` GGUF of the same
weights matches too."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import moe_harness as mh
from tidal.engine_core.model_arch import arch_from_hf_dict

PROMPT_LENGTHS = (3, 17, 60)


def _config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**mh.SHAPES, "num_hidden_layers": 3, "head_dim": 32,
                             "intermediate_size": 96, "moe_intermediate_size": 48,
                             "num_experts": 8, "mlp_only_layers": [1], "norm_topk_prob": False,
                             "tie_word_embeddings": True, **overrides})


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> mh.TinyMoE:
    return mh.make_tiny_moe(_config(), tmp_path_factory.mktemp("tiny-qwen3-moe"),
                            PROMPT_LENGTHS)


def _spec(**cfg):
    # Hub configs spell the expert count ``num_experts``; transformers >= 5 saves
    # ``num_local_experts``. Both must read the same.
    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100, "moe_intermediate_size": 48,
            "num_experts_per_tok": 2}
    return arch_from_hf_dict({**base, **cfg}, "qwen3_moe.json")


def test_config_normalises_to_moe_fields() -> None:
    spec = _spec(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert (spec.family, spec.num_experts, spec.num_experts_per_tok) == ("qwen3_moe", 8, 2)
    assert spec.qk_norm and spec.moe_intermediate_size == 48 and spec.intermediate_size == 96
    # HF: MoE where (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers.
    assert spec.moe_layers == (1, 5)
    assert not spec.norm_topk_prob  # Qwen3MoeConfig's default
    same = _spec(num_local_experts=8, norm_topk_prob=True)
    assert same.num_experts == 8 and same.moe_layers is None and same.norm_topk_prob
    assert same.is_moe_layer(5)
    with pytest.raises(ValueError, match="num_experts"):
        _spec()  # no experts: not a MoE config
    with pytest.raises(ValueError, match="sliding_window"):
        _spec(num_experts=8, use_sliding_window=True, sliding_window=16)


def test_qwen3_moe_matches_hf(qwen3_moe) -> None:
    assert not qwen3_moe.hf.config.norm_topk_prob
    mh.assert_matches(mh.generate(qwen3_moe.folder, qwen3_moe.prompts), qwen3_moe.refs,
                      qwen3_moe.prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton fused-MoE kernel runs only on one")
def test_qwen3_moe_matches_hf_on_gpu(qwen3_moe) -> None:
    mh.assert_matches_on_gpu(qwen3_moe)


def test_norm_topk_prob_changes_the_result(qwen3_moe, tmp_path) -> None:
    """Proof that the comparison can fail: renormalising the top-k weights departs from HF."""
    ablated = tmp_path / "renormalised"
    shutil.copytree(qwen3_moe.folder, ablated)
    cfg = json.loads((ablated / "config.json").read_text())
    cfg["norm_topk_prob"] = True
    (ablated / "config.json").write_text(json.dumps(cfg))
    assert mh.departs(mh.generate(ablated, qwen3_moe.prompts), qwen3_moe.refs)


@pytest.mark.slow
def test_tp2_matches_hf(qwen3_moe) -> None:
    """TP=2: heads, the dense layer's MLP and each expert split over two ranks."""
    got = mh.generate(qwen3_moe.folder, qwen3_moe.prompts, tensor_parallel_size=2,
                      distributed_executor_backend="mp", cpu_threads=1,
                      max_num_batched_tokens=32)
    mh.assert_matches(got, qwen3_moe.refs, qwen3_moe.prompts)


def test_gguf_matches_hf(tmp_path) -> None:
    # llama.cpp's qwen3moe renormalises the top-k weights and makes every layer MoE.
    model = mh.make_tiny_moe(_config(num_hidden_layers=2, mlp_only_layers=[],
                                     norm_topk_prob=True), tmp_path / "hf", (9, 40), seed=3)
    path = tmp_path / "tiny-qwen3-moe.gguf"
    mh.write_moe_gguf(model.hf, path, "qwen3moe",
                      {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
    mh.assert_matches(mh.generate(path, model.prompts), model.refs, model.prompts)


def test_warm_up_runs_every_moe_launch_config_within_the_token_budget(qwen3_moe, monkeypatch):
    """The GPU warm-up calls one MoE layer per expert shape with each token-count bucket
    (``moe_configs.M_BUCKETS``) up to the step budget, so no launch config is first compiled
    while serving; driven through a CPU runner here."""
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.layers.fused_moe import FusedMoE
    from tidal.worker.ops.moe_configs import M_BUCKETS
    from tidal.worker.warmup import Warmup
    from tidal.worker.worker import Worker

    monkeypatch.setenv("TIDAL_WARMUP", "0")
    config = EngineArgs(model=str(qwen3_moe.folder), num_kv_blocks=64, max_model_len=256,
                        max_num_batched_tokens=300, dtype="float32",
                        device="cpu").create_config()
    worker = Worker(config)
    worker.load_model()
    seen: list[tuple[int, int]] = []
    forward = FusedMoE.forward

    def spy(self, hidden, logits, *a, **kw):
        seen.append((id(self), hidden.shape[0]))
        return forward(self, hidden, logits, *a, **kw)

    monkeypatch.setattr(FusedMoE, "forward", spy)
    plan = Warmup(worker, 64, full=True)
    plan._moe_configs()
    # Two MoE layers of one shape (layer 1 is dense): one of them, every bucket up to 300.
    assert len({layer for layer, _ in seen}) == 1
    assert [m for _, m in seen] == [b for b in M_BUCKETS if b <= 300]
    assert plan.report.moe_calls == len(seen)
    worker.shutdown()
