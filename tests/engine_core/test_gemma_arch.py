"""Gemma 2 / Gemma 3 config normalisation against HF transformers' own reading of the same
config.json: hub-style (pre-transformers-5) keys, defaults, and clear errors for what tidal's
Gemma does not implement."""

from __future__ import annotations

import pytest

from tidal.engine_core.model_arch import arch_from_hf_dict

# As on the hub: no layer_types, flat rope keys, the Gemma 3 window pattern as an int.
GEMMA3_HUB = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 12,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300,
    "max_position_embeddings": 1024, "query_pre_attn_scalar": 16, "sliding_window": 32,
    "sliding_window_pattern": 6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}
GEMMA2_HUB = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 300,
    "query_pre_attn_scalar": 144, "sliding_window": 4096, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
}


def _hf_windowed(cfg) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")


def test_gemma3_hub_config_as_hf_reads_it():
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(**{k: v for k, v in GEMMA3_HUB.items() if k != "architectures"})
    spec = arch_from_hf_dict(dict(GEMMA3_HUB), "config.json")
    assert spec.family == "gemma3" and spec.qk_norm and spec.tie_word_embeddings
    assert spec.window_layers == _hf_windowed(hf)
    assert spec.layer_sliding_window(5) is None and spec.layer_sliding_window(4) == 32
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert spec.rope_theta == full["rope_theta"]
    assert spec.rope_scaling == {"rope_type": "linear", "factor": full["factor"]}
    assert spec.rope_local_theta == local["rope_theta"]
    assert spec.attn_logit_softcap is hf.attn_logit_softcapping is None
    assert spec.final_logit_softcap is hf.final_logit_softcapping is None
    assert spec.query_pre_attn_scalar == hf.query_pre_attn_scalar


def test_gemma2_defaults_as_hf():
    from transformers import Gemma2Config

    hf = Gemma2Config(**{k: v for k, v in GEMMA2_HUB.items() if k != "architectures"})
    spec = arch_from_hf_dict(dict(GEMMA2_HUB), "config.json")
    assert spec.family == "gemma2" and not spec.qk_norm and spec.rope_local_theta is None
    assert spec.window_layers == _hf_windowed(hf) == (0, 2, 4)
    assert spec.attn_logit_softcap == hf.attn_logit_softcapping
    assert spec.final_logit_softcap == hf.final_logit_softcapping
    assert spec.rope_theta == hf.rope_parameters["rope_theta"] and spec.rope_scaling is None
    assert spec.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
])
def test_unsupported_settings_fail_clearly(change, needle):
    with pytest.raises(ValueError, match=needle):
        arch_from_hf_dict({**GEMMA3_HUB, **change}, "config.json")


def test_gguf_style_config_without_query_scale_or_layer_types():
    """GGUF metadata has no query_pre_attn_scalar: as llama.cpp, hidden / heads for the 27B
    shapes (the hub configs of gemma-2-27b and gemma-3-27b say 144 and 168), else head_dim;
    a per-layer window pattern list marks the windowed layers."""
    base = {k: v for k, v in GEMMA2_HUB.items() if k != "query_pre_attn_scalar"}
    g2_27b = dict(base, num_hidden_layers=46, hidden_size=4608, num_attention_heads=32,
                  head_dim=128)
    assert arch_from_hf_dict(g2_27b, "x.gguf").query_pre_attn_scalar == 144
    g3_27b = {**{k: v for k, v in GEMMA3_HUB.items() if k != "query_pre_attn_scalar"},
              "num_hidden_layers": 62, "hidden_size": 5376, "num_attention_heads": 32,
              "head_dim": 128, "sliding_window_pattern": 6}
    assert arch_from_hf_dict(g3_27b, "x.gguf").query_pre_attn_scalar == 168
    assert arch_from_hf_dict(dict(base), "x.gguf").query_pre_attn_scalar == 16  # head_dim
    flags = dict(base, sliding_window_pattern=[True, True, False, True, False])
    assert arch_from_hf_dict(flags, "x.gguf").window_layers == (0, 1, 3)
