"""Mixtral against HF transformers on tiny random weights (float32, CPU): greedy tokens and
logprobs match with prompts longer than the sliding window; the routing (top-k, renormalised)
and the window each change the result when altered; tensor parallelism (TP=2, each rank holding
half of every expert) matches; and a llama.cpp-style GGUF of the same weights (``llama`` with an
expert count, experts stacked) matches too."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import moe_harness as mh
from tidal.engine_core.gguf_config import gguf_to_hf_config
from tidal.engine_core.model_arch import arch_from_hf_dict

PROMPT_LENGTHS = (3, 17, 60)


def _config(**overrides):
    from transformers import MixtralConfig

    return MixtralConfig(**{**mh.SHAPES, "num_hidden_layers": 2, "intermediate_size": 64,
                            "num_local_experts": 8, "tie_word_embeddings": False,
                            "sliding_window": 24, **overrides})


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory) -> mh.TinyMoE:
    # A window shorter than the longer prompts and their continuations.
    return mh.make_tiny_moe(_config(), tmp_path_factory.mktemp("tiny-mixtral"), PROMPT_LENGTHS)


def test_config_normalises_to_moe_fields() -> None:
    cfg = _config(num_hidden_layers=3, sliding_window=32).to_dict() | {
        "architectures": ["MixtralForCausalLM"]}
    spec = arch_from_hf_dict(cfg, "mixtral.json")
    assert (spec.family, spec.num_experts, spec.num_experts_per_tok) == ("mixtral", 8, 2)
    # Mixtral's router always renormalises; every layer is MoE with experts of the MLP's size.
    assert spec.norm_topk_prob and spec.moe_intermediate_size == 64
    assert all(spec.is_moe_layer(i) for i in range(3)) and spec.sliding_window == 32
    # Keys other families' modeling code reads and HF's Mixtral ignores: tidal ignores them too.
    foreign = {"norm_topk_prob": False, "moe_intermediate_size": 7, "mlp_only_layers": [0],
               "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
               "n_shared_experts": 1, "scoring_func": "sigmoid"}
    assert arch_from_hf_dict(cfg | foreign, "mixtral.json") == spec
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        arch_from_hf_dict({**_config().to_dict(), "architectures": ["MixtralForCausalLM"],
                           "num_experts_per_tok": 9}, "bad.json")


def test_mixtral_matches_hf(mixtral) -> None:
    mh.assert_matches(mh.generate(mixtral.folder, mixtral.prompts), mixtral.refs,
                      mixtral.prompts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton fused-MoE kernel runs only on one")
def test_mixtral_matches_hf_on_gpu(mixtral) -> None:
    mh.assert_matches_on_gpu(mixtral)


@pytest.mark.parametrize("change", [{"num_experts_per_tok": 1}, {"sliding_window": None}],
                         ids=["top1", "no-window"])
def test_each_feature_changes_the_result(mixtral, tmp_path, change) -> None:
    """Proof that the comparison can fail: routing each token to one expert, or attending
    past the window, departs from HF."""
    ablated = tmp_path / "ablated"
    shutil.copytree(mixtral.folder, ablated)
    cfg = json.loads((ablated / "config.json").read_text())
    cfg.update(change)
    (ablated / "config.json").write_text(json.dumps(cfg))
    assert mh.departs(mh.generate(ablated, mixtral.prompts), mixtral.refs)


@pytest.mark.slow
def test_tp2_matches_hf(mixtral) -> None:
    """TP=2 shards heads and each expert's intermediate size; chunked prefill included."""
    got = mh.generate(mixtral.folder, mixtral.prompts, tensor_parallel_size=2,
                      distributed_executor_backend="mp", cpu_threads=1,
                      max_num_batched_tokens=32)
    mh.assert_matches(got, mixtral.refs, mixtral.prompts)


def test_gguf_matches_hf(mixtral, tmp_path) -> None:
    path = tmp_path / "tiny-mixtral.gguf"
    mh.write_moe_gguf(mixtral.hf, path, "llama", {"w1": "gate", "w3": "up", "w2": "down"})
    # llama.cpp's Mixtral is ``llama`` with an expert count: that count picks the family.
    cfg = gguf_to_hf_config(path)
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["num_local_experts"] == 8
    mh.assert_matches(mh.generate(path, mixtral.prompts), mixtral.refs, mixtral.prompts)


def _load(folder, rank: int = 0, world: int = 1):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.distributed.parallel_state import ParallelGroup
    from tidal.worker.loader.model_loader import load_model

    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=16).create_config()
    tp = ParallelGroup(rank=rank, world_size=world, ranks=tuple(range(world)))
    return load_model(config.model, torch.device("cpu"), TorchAttention(), tp, None)


def _checkpoint(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_each_rank_holds_its_half_of_every_expert(mixtral) -> None:
    ckpt = _checkpoint(mixtral.folder)
    half = mixtral.hf.config.intermediate_size // 2
    model = _load(mixtral.folder, rank=1, world=2)
    for layer in range(mixtral.hf.config.num_hidden_layers):
        moe = model.layers[str(layer)].mlp
        prefix = f"model.layers.{layer}.block_sparse_moe"
        torch.testing.assert_close(moe.gate.weight, ckpt[f"{prefix}.gate.weight"], rtol=0, atol=0)
        for e in range(mixtral.hf.config.num_local_experts):
            w1, w3, w2 = (ckpt[f"{prefix}.experts.{e}.{w}.weight"] for w in ("w1", "w3", "w2"))
            torch.testing.assert_close(moe.experts.w13[e], torch.cat([w1[half:], w3[half:]]),
                                       rtol=0, atol=0)
            torch.testing.assert_close(moe.experts.w2[e], w2[:, half:], rtol=0, atol=0)


def test_a_missing_expert_tensor_is_named(mixtral, tmp_path) -> None:
    from safetensors.torch import save_file

    from tidal.worker.loader.model_loader import ModelLoadError

    broken = tmp_path / "broken"
    shutil.copytree(mixtral.folder, broken)
    ckpt = _checkpoint(broken)
    del ckpt["model.layers.1.block_sparse_moe.experts.5.w2.weight"]
    save_file(ckpt, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts \(down of expert 5"):
        _load(broken)
