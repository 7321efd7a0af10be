"""LoRA's config and adapter checks: what ``--enable-lora`` does not combine with yet is
refused by name, the flags parse, and a PEFT adapter folder is read exactly (scaling with
alpha / r, rsLoRA, rank and alpha patterns) or refused with the field, tensor or shape named."""

from __future__ import annotations

import json
import math
import shutil

import msgspec
import pytest

from lora_adapters import make_peft_adapter
from tidal.engine_core import cli
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.lora_adapter import LoRAAdapterError, inspect_adapter
from tidal.engine_core.lora_config import LoRAConfigError, build_lora_config
from tidal.engine_core.lora_request import LoRARequest


@pytest.fixture(scope="module")
def arch(tiny_models):
    return EngineArgs(model=str(tiny_models["llama"][0])).create_config().model.arch


def _build(base_arch, **kw):
    args = dict(enable=True, max_loras=2, max_cpu_loras=None, max_lora_rank=16,
                arch=base_arch, task="generate", quantized=False, speculative=False,
                pipeline_parallel_size=1)
    args.update(kw)
    return build_lora_config(args.pop("enable"), args.pop("max_loras"),
                             args.pop("max_cpu_loras"), args.pop("max_lora_rank"), **args)


def test_lora_config_defaults_and_limits(arch):
    assert _build(arch, enable=False) is None
    cfg = _build(arch)
    assert (cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank) == (2, 2, 16)
    for kw, why in [(dict(max_loras=0), "--max-loras"),
                    (dict(max_cpu_loras=1), "--max-cpu-loras"),
                    (dict(max_lora_rank=4), "--max-lora-rank"),
                    (dict(max_lora_rank=512), "--max-lora-rank"),
                    (dict(task="embed"), "pooling"),
                    (dict(quantized=True), "--quantization"),
                    (dict(speculative=True), "speculative decoding"),
                    (dict(pipeline_parallel_size=2), "pipeline parallelism"),
                    (dict(arch=msgspec.structs.replace(arch, family="mixtral")), "mixtral")]:
        with pytest.raises(LoRAConfigError, match=why):
            _build(arch, **kw)


def test_engine_args_and_flags(tiny_models):
    folder = str(tiny_models["llama"][0])
    ns = cli.build_parser().parse_args(["--model", folder, "--enable-lora", "--max-loras", "3",
                                        "--max-cpu-loras", "5", "--max-lora-rank", "32"])
    config = cli.engine_args_from(ns).create_config()
    assert config.lora is not None
    assert (config.lora.max_loras, config.lora.max_cpu_loras, config.lora.max_lora_rank) == \
        (3, 5, 32)
    assert EngineArgs(model=folder).create_config().lora is None
    with pytest.raises(ConfigError, match="speculative decoding is not yet implemented"):
        EngineArgs(model=folder, enable_lora=True, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}).create_config()


def test_lora_request_fields():
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(msgspec.ValidationError, match="lora_int_id"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["a", -1, "/p"]), type=LoRARequest)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    _, hf = tiny_models["llama"]
    root = tmp_path_factory.mktemp("adapters")
    return {
        "plain": make_peft_adapter(hf, root / "plain", r=8, alpha=16.0,
                                   targets=["q_proj", "down_proj"]),
        "rslora": make_peft_adapter(hf, root / "rslora", r=16, alpha=8.0, rslora=True,
                                    targets=["v_proj"]),
        "patterns": make_peft_adapter(hf, root / "patterns", r=8, alpha=16.0,
                                      targets=["q_proj", "down_proj"],
                                      rank_pattern={"down_proj": 16},
                                      alpha_pattern={"q_proj": 4.0}),
    }


def test_scaling_and_patterns(arch, adapters):
    plain = inspect_adapter(str(adapters["plain"]), arch, 16)
    assert {(m.layer, m.proj) for m in plain.modules} == {
        (i, p) for i in range(arch.num_layers) for p in ("q_proj", "down_proj")}
    assert all(m.rank == 8 and m.scaling == 2.0 for m in plain.modules)
    rs = inspect_adapter(str(adapters["rslora"]), arch, 16)
    assert all(m.scaling == pytest.approx(8.0 / math.sqrt(16)) for m in rs.modules)
    pat = inspect_adapter(str(adapters["patterns"]), arch, 16)
    by_proj = {m.proj: m for m in pat.modules}
    assert (by_proj["down_proj"].rank, by_proj["down_proj"].scaling) == (16, 1.0)
    assert (by_proj["q_proj"].rank, by_proj["q_proj"].scaling) == (8, 0.5)
    assert pat.max_rank == 16
    with pytest.raises(LoRAAdapterError, match="rank 16 exceeds --max-lora-rank 8"):
        inspect_adapter(str(adapters["patterns"]), arch, 8)


@pytest.mark.parametrize("field,value,why", [
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("fan_in_fan_out", True, "fan_in_fan_out"),
    ("use_dora", True, "DoRA"),
    ("bias", "all", "bias 'all'"),
    ("target_modules", ["q_proj", "fc1"], "'fc1' is not supported"),
    ("target_modules", ["lm_head"], "embedding / LM head"),
    ("peft_type", "IA3", "not LORA"),
    ("lora_alpha", "x", "lora_alpha must be a positive number"),
])
def test_unsupported_config_fields_refused(arch, adapters, tmp_path, field, value, why):
    folder = tmp_path / "a"
    shutil.copytree(adapters["plain"], folder)
    cfg = json.loads((folder / "adapter_config.json").read_text())
    cfg[field] = value
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoRAAdapterError, match=why):
        inspect_adapter(str(folder), arch, 16)


def test_bad_tensors_refused(arch, adapters, tmp_path):
    from safetensors.torch import load_file, save_file

    def variant(name: str, edit) -> str:
        folder = tmp_path / name
        shutil.copytree(adapters["plain"], folder)
        weights = folder / "adapter_model.safetensors"
        tensors = load_file(weights)
        edit(tensors)
        save_file(tensors, weights)
        return str(folder)

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    no_b = variant("no_b", lambda t: t.pop(key.format("B")))
    with pytest.raises(LoRAAdapterError, match="layer 0 q_proj: lora_B is missing"):
        inspect_adapter(no_b, arch, 16)
    deep = variant("deep", lambda t: t.update({key.format("A").replace(".0.", ".9."):
                                               t[key.format("A")].clone()}))
    with pytest.raises(LoRAAdapterError, match="layer 9 but the base model has 3 layers"):
        inspect_adapter(deep, arch, 16)
    wide = variant("wide", lambda t: t.update({key.format("B"): t[key.format("B")].repeat(2, 1)}))
    with pytest.raises(LoRAAdapterError, match=r"shapes .* do not fit the base model"):
        inspect_adapter(wide, arch, 16)
    stray = variant("stray", lambda t: t.update({"base_model.model.lm_head.weight":
                                                 t[key.format("A")].clone()}))
    with pytest.raises(LoRAAdapterError, match="embedding / LM head"):
        inspect_adapter(stray, arch, 16)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "adapter_config.json").write_text("{}")
    (tmp_path / "junk" / "adapter_model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(LoRAAdapterError, match="not a safetensors file"):
        inspect_adapter(str(tmp_path / "junk"), arch, 16)
