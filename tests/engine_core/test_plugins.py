"""The entry-point plugin loader (``tidal.engine_core.plugins``): discovery through
importlib.metadata, the ``$TIDAL_PLUGINS`` allow-list, failing plugins named, model
registration, and platforms."""

from __future__ import annotations

import sys

import pytest

from plugins.plugin_env import install_here
from tidal.engine_core import plugins
from tidal.engine_core.plugins import (
    GENERAL,
    IO_PROCESSOR,
    LOGITS_PROCESSORS,
    PluginError,
    load_plugin,
    load_plugins,
    plugin_names,
)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The test plugin package, installed for this process (a .dist-info on sys.path)."""
    monkeypatch.delenv("TIDAL_PLUGINS", raising=False)
    paths = install_here(tmp_path)
    yield tmp_path
    for p in paths:
        sys.path.remove(p)


def _broken_dist(folder, group: str, name: str, target: str) -> None:
    info = folder / "tidal_broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tidal-broken-plugin\n"
                                   "Version: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")


def test_entry_points_are_found_in_every_group(installed):
    assert plugin_names(GENERAL) == ["test_models"]
    assert plugin_names(LOGITS_PROCESSORS) == ["ban_token"]
    loaded = load_plugins(IO_PROCESSOR)
    assert list(loaded) == ["token_counts"]
    assert loaded["token_counts"].__name__ == "TokenCounts"


def test_allow_list_filters_and_orders(installed, monkeypatch):
    monkeypatch.setenv("TIDAL_PLUGINS", "file_stats, ban_token")
    assert plugin_names(LOGITS_PROCESSORS) == ["ban_token"]
    assert plugin_names(GENERAL) == []  # test_models is not on the list
    monkeypatch.setenv("TIDAL_PLUGINS", "")
    assert load_plugins(LOGITS_PROCESSORS) == {}
    with pytest.raises(PluginError, match="no plugin 'ban_token'.*none"):
        load_plugin(LOGITS_PROCESSORS, "ban_token")


def test_a_plugin_that_cannot_import_is_named(installed, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    _broken_dist(broken, LOGITS_PROCESSORS, "broken_proc", "tidal_no_such_module:Thing")
    sys.path.insert(0, str(broken))
    try:
        with pytest.raises(PluginError, match=r"'broken_proc'.*tidal_no_such_module.*"
                                              r"ModuleNotFoundError"):
            load_plugins(LOGITS_PROCESSORS)
    finally:
        sys.path.remove(str(broken))


def test_general_plugin_failure_stops_start_up_named(installed, monkeypatch):
    monkeypatch.setattr(plugins, "_general_done", False)
    monkeypatch.setenv("TIDAL_TEST_PLUGIN_FAIL", "general")
    with pytest.raises(PluginError, match="'test_models'.*told to fail"):
        plugins.load_general_plugins()


def test_general_plugin_registers_a_model_family(installed, tmp_path, monkeypatch):
    import json

    from reference import make_tiny_model
    from tidal.engine_core.config import EngineArgs

    monkeypatch.setattr(plugins, "_general_done", False)
    folder = tmp_path / "model"
    make_tiny_model("llama", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["TidalTestLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    config = EngineArgs(model=str(folder), device="cpu", max_model_len=64,
                        num_kv_blocks=16, block_size=16).create_config()
    assert config.model.arch.family == "TidalTestLlamaForCausalLM"
    from tidal.engine_core.model_registry import family

    assert family("TidalTestLlamaForCausalLM").model_class.endswith(":TidalTestLlamaForCausalLM")


def test_register_model_refuses_a_served_architecture():
    from tidal.engine_core.model_registry import register_model

    with pytest.raises(ValueError, match="LlamaForCausalLM.*already served"):
        register_model("LlamaForCausalLM", "pkg.mod:Cls")
    with pytest.raises(ValueError, match="config_like"):
        register_model("NewForCausalLM", "pkg.mod:Cls", config_like="NoSuchArch")


def test_platform_plugin_picked_when_available(installed, monkeypatch):
    from tidal.engine_core.plugins.platform import current_platform

    current_platform.cache_clear()
    try:
        monkeypatch.delenv("TIDAL_TEST_PLATFORM", raising=False)
        assert current_platform().name in ("cuda", "cpu")  # the plugin reports no device
        current_platform.cache_clear()
        monkeypatch.setenv("TIDAL_TEST_PLATFORM", "1")
        plat = current_platform()
        assert (plat.name, plat.device_type, plat.default_attention_backend) == (
            "test-cpu", "cpu", "torch")
    finally:
        current_platform.cache_clear()


def test_builtin_platforms():
    from tidal.engine_core.plugins.platform import BUILTIN, Platform

    assert BUILTIN["cpu"].is_available() and BUILTIN["cpu"].dist_backend == "gloo"
    assert BUILTIN["cuda"].dist_backend == "nccl"
    assert all(isinstance(p, Platform) for p in BUILTIN.values())


def test_request_naming_an_unknown_logits_processor_is_refused(installed):
    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.engine_core.validation import RequestValidationError, _check_logits_processors

    _check_logits_processors(["ban_token"])
    with pytest.raises(RequestValidationError, match="unknown logits processor 'nope'") as exc:
        _check_logits_processors(["ban_token", "nope"])
    assert exc.value.param == "logits_processors"
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[""])


def test_global_logits_processors_flag(installed, tmp_path):
    from reference import make_tiny_model
    from tidal.engine_core.config import ConfigError, EngineArgs
    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.frontend import LLM

    make_tiny_model("llama", tmp_path / "m")
    base = dict(model=str(tmp_path / "m"), device="cpu", max_model_len=64, num_kv_blocks=16)
    with pytest.raises(ConfigError, match="--logits-processors.*'nope'"):
        EngineArgs(**base, logits_processors="nope").create_config()
    with pytest.raises(ConfigError, match="--logits-processors.*no_such_module"):
        EngineArgs(**base, logits_processors="no_such_module:Cls").create_config()
    # By import string (global processors may be any class, not only entry points).
    llm = LLM(skip_tokenizer_init=True, logits_processors="tidal_test_plugins.logits:BanToken",
              **base)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                logit_bias={7: 100.0})
        out = llm.generate([[1, 2, 3]], params, use_tqdm=False)[0].outputs[0].token_ids
        assert out and 7 not in out  # the +100 bias would have made every token 7
    finally:
        llm.shutdown()
