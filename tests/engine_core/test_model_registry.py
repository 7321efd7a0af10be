"""The model registry: lookups, config normalisation per family, the sliding-window capability,
and the GGUF options a family can set (metadata keys, fixed config values)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tidal.engine_core import model_registry as reg
from tidal.engine_core.gguf_config import gguf_to_hf_config
from tidal.engine_core.model_arch import arch_from_hf_dict, decoder_arch


def _decoder_cfg(arch: str, **extra: Any) -> dict[str, Any]:
    return {
        "architectures": [arch], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "max_position_embeddings": 256, **extra,
    }


def test_every_architecture_resolves_to_its_family() -> None:
    for fam in reg.FAMILIES:
        for arch in fam.architectures:
            found = reg.family_for_architectures(["SomethingElse", arch])
            assert found == (arch, fam)
            assert reg.family(fam.name) is fam
    assert reg.family_for_architectures(["NoSuchForCausalLM"]) is None


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError) as excinfo:
        arch_from_hf_dict({"architectures": ["NoSuchForCausalLM"]}, "cfg.json")
    message = str(excinfo.value)
    assert "cfg.json" in message and "NoSuchForCausalLM" in message
    for arch in reg.supported_architectures():
        assert arch in message


def test_decoder_family_flags() -> None:
    qwen2 = arch_from_hf_dict(_decoder_cfg("Qwen2ForCausalLM"), "q2")
    qwen3 = arch_from_hf_dict(_decoder_cfg("Qwen3ForCausalLM"), "q3")
    llama = arch_from_hf_dict(_decoder_cfg("LlamaForCausalLM", attention_bias=True), "l")
    assert (qwen2.family, qwen2.qkv_bias, qwen2.qk_norm) == ("qwen2", True, False)
    assert (qwen3.family, qwen3.qkv_bias, qwen3.qk_norm) == ("qwen3", False, True)
    assert (llama.family, llama.qkv_bias, llama.qk_norm) == ("llama", True, False)
    assert not (qwen2.is_embedding or llama.is_embedding)


def test_sliding_window_gating_per_family() -> None:
    # Mistral: a set window always applies, to every layer.
    mistral = arch_from_hf_dict(_decoder_cfg("MistralForCausalLM", sliding_window=32), "m")
    assert (mistral.family, mistral.sliding_window) == ("mistral", 32)
    # Qwen2: only with use_sliding_window.
    off = arch_from_hf_dict(_decoder_cfg("Qwen2ForCausalLM", sliding_window=32), "q")
    on = arch_from_hf_dict(_decoder_cfg("Qwen2ForCausalLM", sliding_window=32,
                                        use_sliding_window=True), "q")
    assert off.sliding_window is None
    assert on.sliding_window == 32


def test_family_without_window_support_refuses_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    fam = reg.ModelFamily("nowindow", ("NoWindowForCausalLM",),
                          "tidal.worker.models.decoder:DecoderForCausalLM",
                          partial(decoder_arch, window_flag=None))
    monkeypatch.setitem(reg._BY_ARCH, "NoWindowForCausalLM", fam)
    monkeypatch.setitem(reg._BY_NAME, "nowindow", fam)
    assert arch_from_hf_dict(_decoder_cfg("NoWindowForCausalLM"), "c").sliding_window is None
    with pytest.raises(ValueError, match="sliding_window=32"):
        arch_from_hf_dict(_decoder_cfg("NoWindowForCausalLM", sliding_window=32), "c")


def test_bert_is_an_embedding_family() -> None:
    cfg = {"architectures": ["BertModel"], "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 50}
    arch = arch_from_hf_dict(cfg, "b")
    assert (arch.family, arch.is_embedding) == ("bert", True)


def test_registry_refuses_duplicates(monkeypatch: pytest.MonkeyPatch) -> None:
    llama = reg.family("llama")
    monkeypatch.setattr(reg, "FAMILIES", (*reg.FAMILIES, reg.ModelFamily(
        "llama2", llama.architectures, llama.model_class, llama.normalise)))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        reg._index()


def test_gguf_families_cover_their_architectures() -> None:
    assert {"llama", "qwen2", "qwen3"} <= set(reg.gguf_architectures())
    for name in reg.gguf_architectures():
        spec = reg.gguf_family(name)
        assert spec is not None and spec.arch == name
        assert reg.family_for_architectures([spec.hf_architecture]) is not None
    assert reg.gguf_family("gpt2") is None and reg.gguf_family(None) is None
    assert reg.gguf_family("llama").permuted_qk  # type: ignore[union-attr]
    assert not reg.gguf_family("qwen2").permuted_qk  # type: ignore[union-attr]


def test_gguf_metadata_keys_and_config_defaults(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A family's extra GGUF metadata lands under its HF key, and its fixed values are set.
    base = reg.family("llama")
    spec = reg.GGUFFamily("llama", "LlamaForCausalLM", "llama",
                          metadata_keys={"attn_logit_softcapping": "attn_logit_softcapping",
                                         "absent_key": "absent"},
                          config_defaults={"hidden_act": "gelu_pytorch_tanh"})
    fam = reg.ModelFamily(base.name, base.architectures, base.model_class, base.normalise,
                          gguf=spec)
    monkeypatch.setitem(reg._BY_GGUF, "llama", fam)

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_float32("llama.attn_logit_softcapping", 50.0)
    writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    config = gguf_to_hf_config(path)
    assert config["attn_logit_softcapping"] == 50.0
    assert "absent" not in config
    assert config["hidden_act"] == "gelu_pytorch_tanh"
    monkeypatch.setitem(reg._BY_GGUF, "llama", base)
    assert gguf_to_hf_config(path)["hidden_act"] == "silu"
