"""GGUF metadata -> HF config dict: the real SmolLM2 file against transformers' AutoConfig, and
tiny metadata-only files (written with ``gguf.GGUFWriter``) for the keys transformers ignores.

Synthetic files for full models, compared with transformers' configs too, are in
tests/worker/test_gguf_weights.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tidal.engine_core.gguf_config import gguf_to_hf_config, read_gguf_header

# --- the real checkpoint ------------------------------------------------------------------

_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


@pytest.mark.slow
def test_smollm2_config_matches_autoconfig(smollm2_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    path = smollm2_path
    hf = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = gguf_to_hf_config(path)

    for key in _ARCH_FIELDS:
        assert ours[key] == getattr(hf, key), key
    hf_rope = getattr(hf, "rope_parameters", None) or {}
    assert ours["rope_theta"] == hf_rope.get("rope_theta", getattr(hf, "rope_theta", None))
    assert hf_rope.get("rope_type", "default") == "default"
    assert ours["rope_scaling"] is None
    # transformers leaves `architectures` unset for GGUF files; we name the class.
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["_chat_template"].startswith("{% for message in messages %}")
    assert "<|im_start|>" in ours["_chat_template"]


def test_smollm2_config_reads_no_tensor_data(monkeypatch: pytest.MonkeyPatch,
                                             smollm2_path: Path) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("the config must come from the header alone")

    monkeypatch.setattr(gguf.quants, "dequantize", forbidden)
    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    config = gguf_to_hf_config(smollm2_path)
    assert config["num_hidden_layers"] == 30
    assert config["head_dim"] == 64


def test_smollm2_header_lists_tokenizer_arrays_without_decoding_them(smollm2_path: Path) -> None:
    header = read_gguf_header(smollm2_path)
    assert header.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert "tokenizer.ggml.tokens" not in header.metadata  # too long to decode
    assert header.metadata["general.languages"] == ["en"]  # short arrays are decoded
    assert len(header.tensors) == 272


def test_smollm2_config_feeds_the_engine_arch_spec(smollm2_path: Path) -> None:
    from tidal.engine_core.model_arch import arch_from_hf_dict

    path = smollm2_path
    arch = arch_from_hf_dict(gguf_to_hf_config(path), str(path))
    assert (arch.family, arch.num_heads, arch.num_kv_heads, arch.head_dim) == ("llama", 9, 3, 64)
    assert arch.rope_theta == 100000.0
    assert arch.rope_scaling is None
    assert arch.tie_word_embeddings


# --- metadata-only synthetic files ----------------------------------------------------------

Customize = Callable[[gguf.GGUFWriter], None]


def write_metadata_file(
    tmp_path: Path,
    arch: str = "llama",
    customize: Customize | None = None,
    *,
    vocab: int | None = 40,
    output_weight: bool = False,
    kv_heads: int | list[int] = 2,
    feed_forward: int | list[int] = 128,
    **writer_kwargs: Any,
) -> Path:
    """A GGUF file with a minimal llama-style header and a small embedding table."""
    path = tmp_path / f"meta-{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch, **writer_kwargs)
    writer.add_block_count(2)
    writer.add_context_length(2048)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(feed_forward)
    writer.add_head_count(4)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    if vocab is not None:
        writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if customize is not None:
        customize(writer)
    writer.add_tensor("token_embd.weight", np.zeros((40, 64), dtype=np.float32))
    if output_weight:
        writer.add_tensor("output.weight", np.zeros((40, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("arch", "hf_arch"),
    [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")],
)
def test_architecture_names(tmp_path: Path, arch: str, hf_arch: str) -> None:
    config = gguf_to_hf_config(write_metadata_file(tmp_path, arch))
    assert config["architectures"] == [hf_arch]
    assert config["model_type"] == arch
    assert config["rope_scaling"] is None
    assert config["rope_theta"] == 10000.0  # llama.cpp's default when freq_base is absent
    assert config["_chat_template"] is None
    assert "pad_token_id" not in config


def test_head_dim_sources(tmp_path: Path) -> None:
    # hidden / heads when nothing says otherwise, then rope.dimension_count, then key_length.
    assert gguf_to_hf_config(write_metadata_file(tmp_path))["head_dim"] == 16
    path = write_metadata_file(tmp_path, customize=lambda w: w.add_rope_dimension_count(32))
    assert gguf_to_hf_config(path)["head_dim"] == 32

    def explicit(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(32)
        writer.add_key_length(48)
        writer.add_value_length(48)

    assert gguf_to_hf_config(write_metadata_file(tmp_path, "qwen3", explicit))["head_dim"] == 48


def test_vocab_size_sources(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert gguf_to_hf_config(write_metadata_file(tmp_path))["vocab_size"] == 40
    assert not caplog.records
    # Metadata wins, as in transformers, but a mismatch with the weights is reported.
    assert gguf_to_hf_config(write_metadata_file(tmp_path, vocab=32))["vocab_size"] == 32
    assert "disagrees" in caplog.text
    # No metadata key: the embedding's rows, which the weights need, over the token list.
    tokens = write_metadata_file(
        tmp_path, vocab=None, customize=lambda w: w.add_token_list([f"t{i}" for i in range(36)])
    )
    assert gguf_to_hf_config(tokens)["vocab_size"] == 40
    assert gguf_to_hf_config(write_metadata_file(tmp_path, vocab=None))["vocab_size"] == 40


def test_tie_word_embeddings_follows_output_weight(tmp_path: Path) -> None:
    assert gguf_to_hf_config(write_metadata_file(tmp_path))["tie_word_embeddings"] is True
    untied = write_metadata_file(tmp_path, output_weight=True)
    assert gguf_to_hf_config(untied)["tie_word_embeddings"] is False


def test_yarn_rope_scaling(tmp_path: Path) -> None:
    def yarn(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_freq_base(1_000_000.0)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(32768)
        writer.add_rope_scaling_yarn_beta_fast(32.0)

    config = gguf_to_hf_config(write_metadata_file(tmp_path, "qwen2", yarn))
    assert config["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32768,
        "beta_fast": 32.0,
    }
    assert config["rope_parameters"] == {**config["rope_scaling"], "rope_theta": 1_000_000.0}


def test_linear_rope_scaling_and_none(tmp_path: Path) -> None:
    def linear(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    config = gguf_to_hf_config(write_metadata_file(tmp_path, customize=linear))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}

    def legacy(writer: gguf.GGUFWriter) -> None:
        writer.add_float32("llama.rope.scale_linear", 2.0)

    config = gguf_to_hf_config(write_metadata_file(tmp_path, customize=legacy))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}

    def none(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)
        writer.add_rope_scaling_factor(1.0)

    assert gguf_to_hf_config(write_metadata_file(tmp_path, customize=none))["rope_scaling"] is None


def test_token_ids_and_chat_template(tmp_path: Path) -> None:
    def tokens(writer: gguf.GGUFWriter) -> None:
        writer.add_pad_token_id(0)
        writer.add_eot_token_id(7)
        writer.add_chat_template("{{ bos_token }}")

    config = gguf_to_hf_config(write_metadata_file(tmp_path, customize=tokens))
    assert config["bos_token_id"] == 1
    assert config["pad_token_id"] == 0
    # The end-of-turn token must stop generation as well as eos.
    assert config["eos_token_id"] == [2, 7]
    assert config["_chat_template"] == "{{ bos_token }}"


def test_per_layer_values_must_be_uniform(tmp_path: Path) -> None:
    path = write_metadata_file(tmp_path, "qwen3", kv_heads=[2, 2])
    assert gguf_to_hf_config(path)["num_key_value_heads"] == 2

    path = write_metadata_file(tmp_path, feed_forward=[128, 256])
    with pytest.raises(ValueError, match="feed_forward_length varies per layer") as excinfo:
        gguf_to_hf_config(path)
    assert str(path) in str(excinfo.value)


# --- errors -------------------------------------------------------------------------------


def test_unknown_architecture_names_file_and_architecture(tmp_path: Path) -> None:
    path = write_metadata_file(tmp_path, "gpt2")
    with pytest.raises(ValueError) as excinfo:
        gguf_to_hf_config(path)
    assert str(path) in str(excinfo.value)
    assert "'gpt2'" in str(excinfo.value)


def test_missing_required_key_is_named(tmp_path: Path) -> None:
    path = tmp_path / "no-layers.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="llama.feed_forward_length") as excinfo:
        gguf_to_hf_config(path)
    assert str(path) in str(excinfo.value)


def test_big_endian_file_is_refused(tmp_path: Path) -> None:
    path = write_metadata_file(tmp_path, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match="big-endian"):
        gguf_to_hf_config(path)


_TRUNCATED_HEADER = b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") * 2


@pytest.mark.parametrize("content", [b"", b"GGML" + b"\x00" * 60, _TRUNCATED_HEADER])
def test_not_a_gguf_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError) as excinfo:
        gguf_to_hf_config(path)
    assert str(path) in str(excinfo.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        gguf_to_hf_config(tmp_path / "absent.gguf")
