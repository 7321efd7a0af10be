"""``--compilation-config`` / ``-O<n>`` (``engine_core.compilation_config``): validated once into
a frozen section; every bad key or value, and every combination the compiled model does not
do yet, is a ConfigError naming it."""

from __future__ import annotations

import pytest

from tidal.engine_core import envs
from tidal.engine_core.cli import build_parser, engine_args_from
from tidal.engine_core.compilation_config import (
    CompilationConfig,
    build_compilation_config,
    check_combination,
    describe,
)
from tidal.engine_core.config import ConfigError, EngineArgs


def test_default_is_off_and_says_why():
    cc = build_compilation_config(None)
    assert cc.mode == 0 and not cc.enabled
    line = describe(cc, "cuda")
    assert line.startswith("off") and "default on every device" in line and "FULL" in line
    assert "NONE" in describe(cc, "cpu")


@pytest.mark.parametrize("raw", [3, "3", {"mode": 3}, {"level": 3}, '{"level": 3}',
                                 {"mode": 3, "level": 3}])
def test_level_three_in_every_spelling(raw):
    cc = build_compilation_config(raw)
    assert cc.mode == 3 and cc.enabled
    assert cc.cache_dir == str(envs.cache_dir() / "compile")
    assert "split at attention" in describe(cc, "cpu")


def test_fields_are_kept():
    cc = build_compilation_config({"mode": 3, "cudagraph_mode": "full", "backend": "eager",
                                   "cache_dir": "/tmp/x", "compile_sizes": [],
                                   "pass_config": {"enable_fusion": True}})
    assert cc == CompilationConfig(mode=3, cudagraph_mode="FULL", backend="eager",
                                   cache_dir="/tmp/x")


@pytest.mark.parametrize("raw, words", [
    ({"mode": 1}, ["mode", "not yet supported", "mode 1"]),
    ({"level": 2}, ["mode", "not yet supported", "mode 2"]),
    ({"mode": 7}, ["mode must be 0 or 3"]),
    ({"mode": "3"}, ["mode must be an integer"]),
    ({"mode": 3, "level": 0}, ["mode or level"]),
    # (The piecewise graphs themselves: tests/worker/test_compile_piecewise.py.)
    ({"cudagraph_mode": "PIECEWISE"}, ["cudagraph_mode", "needs mode 3", "PIECEWISE"]),
    ({"cudagraph_mode": "full_and_piecewise"}, ["needs mode 3", "FULL_AND_PIECEWISE"]),
    ({"cudagraph_mode": "SOME"}, ["cudagraph_mode must be one of"]),
    ({"cudagraph_capture_sizes": [1, 2]}, ["cudagraph_capture_sizes", "not yet supported"]),
    ({"compile_sizes": [8]}, ["compile_sizes", "not yet supported"]),
    ({"backend": "aot_eager"}, ["backend must be one of"]),
    ({"cache_dir": ""}, ["cache_dir"]),
    ({"cache_dir": 5}, ["cache_dir"]),
    ({"pass_config": {"enable_fusion": False}}, ["enable_fusion", "not yet supported"]),
    ({"pass_config": {"enable_noop": True}}, ["enable_noop"]),
    ({"pass_config": 3}, ["pass_config must be a JSON object"]),
    ({"custom_ops": ["+rms_norm"]}, ["custom_ops"]),
    ("{not json", ["not valid JSON"]),
    ([3], ["JSON object or a level"]),
])
def test_bad_config_names_the_field(raw, words):
    with pytest.raises(ConfigError) as info:
        build_compilation_config(raw)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("kw, word", [
    (dict(task="embed"), "task"),
    (dict(pipeline_parallel_size=2), "pipeline parallelism"),
])
def test_combinations_not_done_yet_are_refused(kw, word):
    args = dict(task="generate", pipeline_parallel_size=1)
    args.update(kw)
    check_combination(build_compilation_config(0), **args)  # off: anything goes
    with pytest.raises(ConfigError, match="not yet supported") as info:
        check_combination(build_compilation_config(3), **args)
    assert word in str(info.value)


def test_cli_shorthand_and_engine_config(tiny_models):
    folder = str(tiny_models["qwen3"][0])
    parser = build_parser()
    for argv, mode in ((["-O3"], 3), (["-O", "0"], 0),
                       (["--compilation-config", '{"level": 3, "cudagraph_mode": "NONE"}'], 3)):
        ns = parser.parse_args(["--model", folder, "--device", "cpu", *argv])
        config = engine_args_from(ns).create_config()
        assert config.runner.compilation.mode == mode
    assert config.runner.enforce_eager  # cudagraph_mode NONE (and a CPU)
    with pytest.raises(ConfigError, match="pipeline parallelism"):
        EngineArgs(model=folder, device="cpu", compilation_config=3,
                   pipeline_parallel_size=2).create_config()
    # (Speculative decoding and LoRA compile: tests/worker/test_compile_spec.py,
    # test_lora_model.py.)
    EngineArgs(model=folder, device="cpu", compilation_config=3,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                   "prompt_lookup_max": 2}).create_config()
    with pytest.raises(ConfigError, match="compile_sizes"):
        EngineArgs(model=folder, device="cpu",
                   compilation_config={"mode": 3, "compile_sizes": [4]}).create_config()
