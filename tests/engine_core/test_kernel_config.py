"""The engine config's kernel section: where each value comes from (flag > --kernel-config
JSON > TIDAL_* environment > default), the environment's historical parsing rules, and the
errors, each naming the key or variable at fault."""

from __future__ import annotations

import msgspec
import pytest

from tidal.engine_core.cli import build_parser, engine_args_from
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.envs import KERNEL_ENV
from tidal.engine_core.kernel_config import (
    KernelConfig,
    build_kernel_config,
    parse_gemv_configs,
)


@pytest.fixture(autouse=True)
def _no_kernel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in KERNEL_ENV.values():  # the machine's own settings must not leak in
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"][0])


def test_every_env_knob_is_a_field_and_defaults_hold() -> None:
    fields = {f.name for f in msgspec.structs.fields(KernelConfig)}
    assert set(KERNEL_ENV) <= fields
    assert build_kernel_config() == KernelConfig()
    cfg = KernelConfig()
    assert (cfg.ops, cfg.attention_backend, cfg.gemv, cfg.attn_fused_merge, cfg.push_allreduce,
            cfg.lamport_allreduce) == ("auto", None, True, False, False, "on")


def test_precedence_flag_over_json_over_env_over_default(monkeypatch) -> None:
    monkeypatch.setenv("TIDAL_GEMV", "0")
    monkeypatch.setenv("TIDAL_PDL", "0")
    monkeypatch.setenv("TIDAL_ATTN_SPLIT_STAGES", "2")
    cfg = build_kernel_config({"pdl": True, "ops": "triton", "attention_backend": "cuda"},
                              ops="torch", attention_backend=None)
    assert cfg.gemv is False  # env over default
    assert cfg.pdl is True  # JSON over env
    assert cfg.attn_split_stages == 2  # env, nothing above it
    assert cfg.ops == "torch"  # flag over JSON
    assert cfg.attention_backend == "cuda"  # an unset flag (None) leaves the JSON's
    assert cfg.norm_apart is True  # default


def test_environment_keeps_its_historical_rules() -> None:
    def env(**raw: str) -> KernelConfig:
        return build_kernel_config(env={k: (KERNEL_ENV[k], v) for k, v in raw.items()})

    # A default-on switch is off only for "0"; a default-off one is on only for "1".
    assert env(gemv="false").gemv is True and env(gemv="0").gemv is False
    assert env(attn_fused_merge="yes").attn_fused_merge is False
    assert env(attn_fused_merge="1").attn_fused_merge is True
    assert env(lamport_allreduce="force").lamport_allreduce == "force"
    assert env(lamport_allreduce="0").lamport_allreduce == "off"
    assert env(lamport_allreduce="1").lamport_allreduce == "on"
    assert env(gemv_max_mb="inf").gemv_max_mb is None
    assert env(gemv_max_mb="64").gemv_max_mb == 64.0
    assert env(symm_allreduce_max_bytes="4096").symm_allreduce_max_bytes == 4096
    assert env(lora_grouped_min_tokens="48").lora_grouped_min_tokens == 48
    assert env(lora_grouped_min_tokens="0").lora_grouped_min_tokens == 0
    assert env(moe_direct_max_pairs="0").moe_direct_max_pairs == 0


@pytest.mark.parametrize("overrides, match", [
    ({"gemv_fast": True}, "unknown key 'gemv_fast'"),
    ({"gemv": "no"}, "kernel_config.gemv must be true or false"),
    ({"ops": "fastest"}, "kernel_config.ops must be one of"),
    ({"attention_backend": "flash"}, "kernel_config.attention_backend"),
    ({"attn_split_stages": 0}, "kernel_config.attn_split_stages"),
    ({"lora_grouped_min_tokens": -1}, "kernel_config.lora_grouped_min_tokens must be an"),
    ({"moe_direct_max_pairs": 1.5}, "kernel_config.moe_direct_max_pairs must be an"),
    ({"attn_split_stages": True}, "kernel_config.attn_split_stages"),
    ({"gemv_max_mb": -1}, "kernel_config.gemv_max_mb"),
    ({"lamport_allreduce": "sometimes"}, "kernel_config.lamport_allreduce"),
    ({"gemv_configs": "4096x1024=8,1024,3,1"}, "kernel_config.gemv_configs entry"),
    ({"gemv_configs": "4096x1024"}, "kernel_config.gemv_configs entry"),
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_bad_json_values_name_the_key(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        build_kernel_config(overrides)


def test_bad_environment_values_name_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("TIDAL_ATTN_SPLIT_STAGES", "two")
    with pytest.raises(ConfigError, match="TIDAL_ATTN_SPLIT_STAGES"):
        build_kernel_config()
    monkeypatch.setenv("TIDAL_ATTN_SPLIT_STAGES", "1")
    monkeypatch.setenv("TIDAL_GEMV_CONFIGS", "1x2=3")
    with pytest.raises(ConfigError, match="TIDAL_GEMV_CONFIGS entry '1x2=3'"):
        build_kernel_config()


def test_gemv_configs_parse_to_launch_shapes() -> None:
    shapes = parse_gemv_configs("4096x1024=8,1024,4,1; 3072x1024s=8,512,4,2;")
    assert shapes == {(4096, 1024, False, 2): (8, 1024, 4, 1),
                      (3072, 1024, True, 2): (8, 512, 4, 2)}


def test_engine_config_carries_the_section(folder, monkeypatch) -> None:
    monkeypatch.setenv("TIDAL_NORM_APART", "0")
    cfg = EngineArgs(model=folder, num_kv_blocks=100, attention_backend="torch",
                     kernel_config={"gemv": False}).create_config()
    kc = cfg.runner.kernels
    assert (kc.attention_backend, kc.gemv, kc.norm_apart) == ("torch", False, False)
    assert cfg.runner.attention_backend == "torch"
    # It reaches the workers inside the config: a wire type, unchanged through msgpack.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=type(cfg))
    assert again.runner.kernels == kc
    with pytest.raises(ConfigError, match="kernel_config: unknown key 'gemv_fast'"):
        EngineArgs(model=folder, kernel_config={"gemv_fast": 1}).create_config()


def test_command_line_flags_and_json(folder) -> None:
    ns = build_parser().parse_args(["--model", folder, "--num-kv-blocks", "100",
                                    "--kernel-config", '{"ops": "triton", "pdl": false}',
                                    "--ops-backend", "torch"])
    kc = engine_args_from(ns).create_config().runner.kernels
    assert (kc.ops, kc.pdl) == ("torch", False)
    ns = build_parser().parse_args(["--model", folder, "--num-kv-blocks", "100"])
    assert engine_args_from(ns).create_config().runner.kernels == KernelConfig()
