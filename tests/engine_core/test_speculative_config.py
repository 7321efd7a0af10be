"""``--speculative-config`` method ``mtp``: parsed without a model, resolved against the target
at config time, and refused with the reason where the target has no MTP layer it can use."""

from __future__ import annotations

import json

import pytest

from tests.worker.deepseek_v3_writer import hf_config
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.speculative_config import SpeculativeConfig, SpeculativeConfigError

MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _v3_folder(path, nextn: int, **extra):
    """A DeepSeek-V3 config alone (resolving the speculative config reads no weights)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(nextn).to_dict() | {"architectures": ["DeepseekV3ForCausalLM"]} | extra
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _config(folder, spec):
    return EngineArgs(model=str(folder), device="cpu", num_kv_blocks=16,
                      speculative_config=spec).create_config()


def test_mtp_parses_without_a_model():
    spec = SpeculativeConfig.parse(MTP)
    assert spec.method == "mtp" and spec.model is None and spec.uses_model


@pytest.mark.parametrize("raw,needle", [
    (MTP | {"prompt_lookup_max": 3}, "prompt_lookup_max applies to method 'ngram' only"),
    (MTP | {"model": 3}, "model of method 'mtp' must be the target's path"),
    (MTP | {"model": ""}, "model of method 'mtp' must be the target's path"),
    (MTP | {"draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size other than 1"),
])
def test_bad_mtp_configs_name_the_field(raw, needle):
    with pytest.raises(SpeculativeConfigError, match=needle):
        SpeculativeConfig.parse(raw)


def test_mtp_resolves_against_the_target(tmp_path):
    target = _v3_folder(tmp_path / "v3", 1)
    for spec in (MTP, MTP | {"model": str(target)}):
        got = _config(target, spec).speculative
        assert got.model is None and got.uses_model
        text = got.describe()
        assert "MTP layer 2 of the target" in text and "reused for each of the 2" in text


def test_targets_without_usable_mtp_layers_are_refused(tmp_path, tiny_models):
    no_mtp = _v3_folder(tmp_path / "v3-none", 0)
    with pytest.raises(ConfigError, match=r"v3-none.*DeepseekV3ForCausalLM.* has none "
                                          r"\(num_nextn_predict_layers is 0 or missing"):
        _config(no_mtp, MTP)
    llama, _ = tiny_models["llama"]
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM.*num_nextn_predict_layers"):
        _config(llama, MTP)
    # ``model`` names another model than the target.
    target = _v3_folder(tmp_path / "v3", 1)
    other = _v3_folder(tmp_path / "v3-other", 1, hidden_size=128)
    with pytest.raises(ConfigError, match="must be the target itself or omitted"):
        _config(target, MTP | {"model": str(other)})


def test_v3_configs_that_route_otherwise_are_refused(tmp_path):
    bad = _v3_folder(tmp_path / "v3-softmax", 1, scoring_func="softmax")
    with pytest.raises(ValueError, match="routes by sigmoid scores and noaux_tc top-k, got "
                                         "scoring_func 'softmax'"):
        _config(bad, None)
