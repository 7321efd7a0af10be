"""AWQ / GPTQ ``quantization_config`` blocks: what loads, and what is refused naming the value."""

from __future__ import annotations

import pytest

from tidal.engine_core.quantization_config import QuantConfigError, build_quant_config

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
       "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def _build(qc: dict | None, requested: str | None = None, family: str = "llama", **kw):
    hf = {} if qc is None else {"quantization_config": qc}
    return build_quant_config(requested, hf, family, **kw)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_checkpoints_load_as_they_are(group):
    config = _build(dict(AWQ, group_size=group))
    assert (config.method, config.group_size, config.int4) == ("awq", group, True)
    assert config.prequantized and not config.desc_act and not config.zeros_minus_one
    assert _build(AWQ, "awq").method == "awq"  # asked for by name: the same


@pytest.mark.parametrize("group", [128, -1])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_checkpoints_load_as_they_are(group, desc_act):
    config = _build(dict(GPTQ, group_size=group, desc_act=desc_act, sym=not desc_act))
    assert (config.method, config.group_size, config.desc_act) == ("gptq", group, desc_act)
    assert config.zeros_minus_one  # the classic format stores zero points minus one
    v2 = _build(dict(GPTQ, checkpoint_format="gptq_v2"), "gptq")
    assert not v2.zeros_minus_one


@pytest.mark.parametrize("qc,requested,named", [
    (dict(AWQ, bits=8), None, "bits 8"),
    (dict(GPTQ, bits=3), None, "bits 3"),
    (dict(AWQ, version="gemv"), None, "'gemv'"),
    (dict(AWQ, version="exllama"), None, "'exllama'"),
    (dict(AWQ, group_size=256), None, "group_size 256"),
    (dict(AWQ, zero_point=False), None, "zero_point False"),
    (dict(AWQ, modules_to_not_convert=["mlp"]), None, "['mlp']"),
    (dict(GPTQ, checkpoint_format="marlin"), None, "'marlin'"),
    (dict(GPTQ, group_size=100), None, "group_size 100"),
    (dict(GPTQ, desc_act="yes"), None, "'yes'"),
    (dict(GPTQ, lm_head=True), None, "lm_head"),
    ({"quant_method": "awq_marlin", "bits": 4}, None, "'awq_marlin'"),
    (AWQ, "gptq", "'gptq'"),
    (GPTQ, "fp8", "'fp8'"),
    (None, "awq", "'awq'"),  # a 16-bit checkpoint: tidal does not quantize to INT4 itself
    (None, "gptq_marlin", "'gptq_marlin'"),
])
def test_refused_formats_name_the_value(qc, requested, named):
    with pytest.raises(QuantConfigError) as exc:
        _build(qc, requested)
    assert named in str(exc.value)


def test_other_families_and_dummy_weights():
    with pytest.raises(QuantConfigError, match="INT4.*'gemma2'"):
        _build(AWQ, family="gemma2")
    # Random weights (benchmarks) need no INT4 checkpoint: groups of 128.
    config = _build(None, "gptq", dummy=True)
    assert (config.method, config.group_size) == ("gptq", 128)


def test_engine_args_refuse_at_start_up(tiny_models, tmp_path):
    import json
    import shutil

    from tidal.engine_core.config import ConfigError, EngineArgs

    folder, _ = tiny_models["llama"]
    dst = tmp_path / "awq-gemv"
    shutil.copytree(folder, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = dict(AWQ, version="gemv")
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="--quantization: AWQ version 'gemv'"):
        EngineArgs(model=str(dst), device="cpu").create_config()
