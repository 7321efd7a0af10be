"""``--quantization`` and a checkpoint's ``quantization_config``: what is accepted, and every
refusal naming the value or method it refuses."""

from __future__ import annotations

import json
import shutil

import pytest

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.quantization_config import (
    QuantConfig,
    QuantConfigError,
    build_quant_config,
)


def _ct(weights: dict, acts: dict | None, **extra) -> dict:
    group = {"weights": weights, "targets": ["Linear"]}
    if acts is not None:
        group["input_activations"] = acts
    return {"quantization_config": {"quant_method": "compressed-tensors",
                                    "config_groups": {"group_0": group}, **extra}}


FP8_W = {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True}
FP8_DYN = {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
FP8_STATIC = {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}


def test_accepted_values():
    assert build_quant_config(None, {}, "llama") is None
    assert build_quant_config("fp8", {}, "qwen3") == QuantConfig()
    for requested in (None, "fp8", "compressed-tensors"):
        got = build_quant_config(requested, _ct(FP8_W, FP8_DYN), "mistral")
        assert got == QuantConfig(prequantized=True, static_activations=False)
    got = build_quant_config(None, _ct(dict(FP8_W, strategy="tensor"), FP8_STATIC), "qwen2")
    assert got == QuantConfig(prequantized=True, static_activations=True)


def _fp8(**qc) -> dict:
    return {"quantization_config": {"quant_method": "fp8", **qc}}


def test_fp8_checkpoints():
    """``quant_method: fp8``: block-wise (``weight_block_size``) or AutoFP8's per-tensor."""
    block = _fp8(fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
    for requested in (None, "fp8"):
        got = build_quant_config(requested, block, "qwen3")
        assert got == QuantConfig(prequantized=True, weight_block=(128, 128))
    assert build_quant_config(None, _fp8(activation_scheme="static"), "llama") == QuantConfig(
        prequantized=True, static_activations=True)
    assert build_quant_config(None, _fp8(ignored_layers=["lm_head"]), "llama") == QuantConfig(
        prequantized=True)


@pytest.mark.parametrize("qc,family,needle", [
    ({"weight_block_size": [128, 100]}, "llama", "powers of two"),
    ({"weight_block_size": [128]}, "llama", "powers of two"),
    ({"weight_block_size": [8, 128]}, "llama", "powers of two"),
    ({"weight_block_size": [True, 128]}, "llama", "powers of two"),
    ({"weight_block_size": [128, 128], "activation_scheme": "static"}, "llama", "static"),
    ({"activation_scheme": "per-token"}, "llama", "'per-token'"),
    ({"fmt": "e5m2"}, "llama", "'e5m2'"),
    ({"ignored_layers": ["model.layers.0.mlp.down_proj"]}, "llama", "ignored_layers"),
    ({"modules_to_not_convert": ["model.layers.3.self_attn.o_proj"]}, "llama",
     "modules_to_not_convert"),
    ({"weight_block_size": [128, 128]}, "qwen3_moe", "'qwen3_moe'"),
    ({"weight_block_size": [128, 128]}, "deepseek_v3", "'deepseek_v3'"),
])
def test_fp8_checkpoint_refusals(qc, family, needle):
    with pytest.raises(QuantConfigError) as info:
        build_quant_config(None, _fp8(**qc), family)
    assert needle in str(info.value)


FP8_BLOCK_W = dict(FP8_W, strategy="block", block_structure=[128, 128])
FP8_GROUP_DYN = {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128,
                 "dynamic": True, "symmetric": True}


def test_compressed_tensors_block_strategy():
    """llm-compressor's FP8_BLOCK scheme: 128 x 128 weight blocks, dynamic activations per
    token and group of 128; its scale tensor is ``weight_scale``."""
    got = build_quant_config(None, _ct(FP8_BLOCK_W, FP8_GROUP_DYN), "qwen3")
    assert got == QuantConfig(prequantized=True, weight_block=(128, 128),
                              block_scale_name="weight_scale")


def test_the_block_layout_crosses_the_process_boundary():
    """Workers get the config over msgpack: the block size comes back a tuple, equal."""
    import msgspec

    cfg = build_quant_config(None, _ct(FP8_BLOCK_W, FP8_GROUP_DYN), "llama")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=QuantConfig)
    assert back == cfg and back.weight_block == (128, 128)


@pytest.mark.parametrize("weights,acts,needle", [
    (dict(FP8_W, strategy="block"), FP8_GROUP_DYN, "block_structure"),
    (dict(FP8_BLOCK_W, block_structure=[128, 96]), FP8_GROUP_DYN, "block_structure"),
    (FP8_BLOCK_W, FP8_DYN, "strategy 'group' with group_size 128"),
    (FP8_BLOCK_W, dict(FP8_GROUP_DYN, group_size=64), "group_size 128"),
    (FP8_BLOCK_W, dict(FP8_GROUP_DYN, dynamic=False), "dynamic"),
    (FP8_W, FP8_GROUP_DYN, "'group'"),  # per-channel weights with grouped activations
])
def test_compressed_tensors_block_refusals(weights, acts, needle):
    with pytest.raises(QuantConfigError) as info:
        build_quant_config(None, _ct(weights, acts), "llama")
    assert needle in str(info.value)


def test_mixed_weight_strategies_are_refused():
    hf = _ct(FP8_BLOCK_W, FP8_GROUP_DYN)
    hf["quantization_config"]["config_groups"]["group_1"] = {
        "weights": FP8_W, "input_activations": FP8_DYN, "targets": ["re:.*down_proj"]}
    with pytest.raises(QuantConfigError, match="different FP8 weight strategies"):
        build_quant_config(None, hf, "llama")


def test_a_requested_method_the_checkpoint_does_not_have_is_refused():
    with pytest.raises(QuantConfigError, match="quantized with 'fp8'"):
        build_quant_config("compressed-tensors", _fp8(), "llama")
    with pytest.raises(QuantConfigError, match="quant_method is 'compressed-tensors'"):
        build_quant_config("awq", _ct(FP8_W, FP8_DYN), "llama")  # (int4_config's words)


@pytest.mark.parametrize("requested,hf,family,needle", [
    ("awq", {}, "llama", "'awq'"),
    ("gptq", {}, "llama", "'gptq'"),
    ("int4", {}, "llama", "'int4'"),
    (None, {"quantization_config": {"quant_method": "gptq", "bits": 4}}, "llama",
     "group_size None"),  # (INT4 checkpoints: tests/engine_core/test_int4_config.py)
    ("fp8", {"quantization_config": {"quant_method": "awq"}}, "llama", "'awq'"),
    (None, {"quantization_config": {"quant_method": "bitsandbytes"}}, "llama", "bitsandbytes"),
    (None, _ct({"type": "int", "num_bits": 8}, FP8_DYN), "llama", "'int' with 8 bits"),
    (None, _ct({"type": "int", "num_bits": 4, "strategy": "group"}, None), "llama", "'int'"),
    (None, _ct(dict(FP8_W, strategy="group"), FP8_DYN), "llama", "'group'"),
    (None, _ct(FP8_W, None), "llama", "input_activations"),
    (None, _ct(FP8_W, FP8_DYN, ignore=["model.layers.0.mlp.down_proj"]), "llama", "ignore"),
    ("compressed-tensors", {}, "llama", "compressed-tensors"),
    ("fp8", {}, "gemma2", "'gemma2'"),
    ("fp8", {}, "phi3", "'phi3'"),
    ("fp8", {}, "deepseek_v2", "'deepseek_v2'"),
    # MoE families quantize their experts on load; their FP8 checkpoints are not read yet.
    (None, _ct(FP8_W, FP8_DYN), "qwen3_moe", "'qwen3_moe'"),
    (None, _ct(FP8_W, FP8_DYN), "mixtral", "'mixtral'"),
])
def test_refusals_name_what_they_refuse(requested, hf, family, needle):
    with pytest.raises(QuantConfigError, match="not yet implemented|needs") as info:
        build_quant_config(requested, hf, family)
    assert needle in str(info.value)


def test_fp8_group_size_quantizes_on_load_in_one_row_blocks():
    assert build_quant_config("fp8", {}, "llama", fp8_group_size=128) == QuantConfig(
        weight_block=(1, 128))
    assert build_quant_config("fp8", {}, "qwen3", fp8_group_size=None) == QuantConfig()


@pytest.mark.parametrize("requested,hf,family,group,needle", [
    (None, {}, "llama", 128, "applies to --quantization fp8 only, got --quantization None"),
    ("awq", {}, "llama", 128, "got --quantization awq"),
    ("fp8", _fp8(weight_block_size=[128, 128]), "llama", 128, "already quantized"),
    ("fp8", {}, "llama", 96, "a power of two from 16 to 1024, got 96"),
    ("fp8", {}, "llama", 8, "got 8"),
    ("fp8", {}, "llama", True, "got True"),
    ("fp8", {}, "mixtral", 128, "model family 'mixtral'"),
])
def test_fp8_group_size_refusals(requested, hf, family, group, needle):
    with pytest.raises(QuantConfigError, match="fp8-group-size|FP8 groups") as info:
        build_quant_config(requested, hf, family, fp8_group_size=group)
    assert needle in str(info.value)


def test_engine_args_carry_it_into_the_frozen_config(tiny_models, tmp_path):
    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64,
                        quantization="fp8").create_config()
    assert config.model.quantization == QuantConfig()
    assert EngineArgs(model=str(folder), device="cpu",
                      num_kv_blocks=64).create_config().model.quantization is None
    with pytest.raises(ConfigError, match=r"--quantization: quantization 'awq' needs a "):
        EngineArgs(model=str(folder), device="cpu", quantization="awq").create_config()
    # A draft model (or an EAGLE-3 head) stays 16-bit under a quantized target.
    from tidal.worker.spec_decode.draft_proposer import draft_model_config

    spec = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64, quantization="fp8",
                      speculative_config={"method": "draft_model", "model": str(folder),
                                          "num_speculative_tokens": 2}).create_config()
    assert spec.model.quantization == QuantConfig()
    assert draft_model_config(str(folder), spec.model).quantization is None
    # An 8-bit GPTQ checkpoint is refused at start-up, not loaded as if it were 16-bit.
    gptq = tmp_path / "gptq"
    shutil.copytree(folder, gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 8, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="--quantization: gptq with bits 8 is not yet "
                                          "implemented"):
        EngineArgs(model=str(gptq), device="cpu").create_config()


def test_cli_flag(tiny_models):
    import argparse

    from tidal.engine_core.cli import add_engine_args, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--quantization", "fp8"]))
    assert args.quantization == "fp8" and args.fp8_group_size is None
    args = engine_args_from(parser.parse_args(["--quantization", "fp8",
                                               "--fp8-group-size", "128"]))
    assert args.fp8_group_size == 128
    assert engine_args_from(parser.parse_args([])).quantization is None
