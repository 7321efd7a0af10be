"""Gemma 2 and Gemma 3 (text) against HF transformers on tiny random weights (float32, CPU):
greedy tokens and logprobs match with prompts longer than the sliding window, each Gemma feature
(window, attention and final soft-caps, local rope base) changes the result when switched off,
tensor and pipeline parallelism (TP=2, PP=2) match them too, and so does a llama.cpp-style GGUF
of the same weights."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

import reference
from tidal.frontend import SamplingParams

# The tiny configs slide a 16-token window: all prompts but the first are longer than it, and
# decoding runs on past it.
PROMPT_LENGTHS = [3, 17, 40, 97]
NEW_TOKENS = 24
LOGPROB_TOL = 2e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma_models(tmp_path_factory):
    """family -> (folder, HF model, prompts, HF greedy tokens and logprobs per prompt)."""
    out = {}
    for family in ("gemma2", "gemma3"):
        folder = tmp_path_factory.mktemp(f"tiny-{family}")
        hf = reference.make_tiny_model(family, folder)
        rng = random.Random(len(family) + hf.config.num_hidden_layers)
        prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)]
                   for n in PROMPT_LENGTHS]
        refs = [reference.hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
        out[family] = (folder, hf, prompts, refs)
    return out


def _generate(folder, prompts, **kw) -> list[tuple[list[int], list[float]]]:
    return reference.engine_greedy(folder, prompts, GREEDY, **kw)


_max_logprob_diff = reference.max_logprob_diff


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_matches_hf(gemma_models, family):
    folder, hf, prompts, refs = gemma_models[family]
    cfg = hf.config
    assert max(map(len, prompts)) > 4 * cfg.sliding_window
    assert "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    for prompt, (tokens, lps), (ref_tokens, ref_lps) in zip(prompts, _generate(folder, prompts),
                                                            refs):
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert _max_logprob_diff(lps, ref_lps) < LOGPROB_TOL, f"prompt of {len(prompt)} tokens"


GPU_LOGPROB_TOL = 2e-3  # float32 on the GPU: Triton kernels and cuBLAS round otherwise


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the fused Gemma kernels run only on one")
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
@pytest.mark.parametrize("max_num_seqs", [8, 1])
def test_gemma_matches_hf_on_gpu(gemma_models, family, max_num_seqs):
    """The GPU path (Triton Gemma norms fused with the residual adds, q/k norms + rotary + K/V
    write in one kernel, GeGLU, CUDA graphs) gives HF's greedy tokens too; one request at a time
    (``max_num_seqs`` 1) runs the batch-1 kernels: the GEMVs, with GeGLU as the gate/up one's
    epilogue."""
    folder, hf, prompts, refs = gemma_models[family]
    got = reference.engine_greedy(folder, prompts, GREEDY, device="cuda",
                                  max_num_seqs=max_num_seqs)
    for prompt, (tokens, lps), (ref_tokens, ref_lps) in zip(prompts, got, refs):
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert _max_logprob_diff(lps, ref_lps) < GPU_LOGPROB_TOL, f"prompt of {len(prompt)}"


def _gemma3_same_rope_everywhere(cfg: dict) -> None:
    rope = cfg["rope_parameters"]
    rope["sliding_attention"]["rope_theta"] = rope["full_attention"]["rope_theta"]


# Each change turns one feature off in the checkpoint's config; HF keeps the real one.
ABLATIONS = {
    "gemma2-window": ("gemma2", lambda cfg: cfg.update(sliding_window=4096)),
    "gemma2-attn-softcap": ("gemma2", lambda cfg: cfg.update(attn_logit_softcapping=None)),
    "gemma2-final-softcap": ("gemma2", lambda cfg: cfg.update(final_logit_softcapping=None)),
    "gemma3-window": ("gemma3", lambda cfg: cfg.update(sliding_window=4096)),
    "gemma3-local-rope": ("gemma3", _gemma3_same_rope_everywhere),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_each_feature_changes_the_result(gemma_models, tmp_path, name):
    """Proof that the comparison above can fail: without the feature, tidal departs from HF."""
    family, change = ABLATIONS[name]
    folder, _, prompts, refs = gemma_models[family]
    ablated = tmp_path / name
    shutil.copytree(folder, ablated)
    cfg = json.loads((ablated / "config.json").read_text())
    change(cfg)
    (ablated / "config.json").write_text(json.dumps(cfg))
    departed = [
        tokens != ref_tokens or _max_logprob_diff(lps, ref_lps) > 50 * LOGPROB_TOL
        for (tokens, lps), (ref_tokens, ref_lps) in zip(_generate(ablated, prompts), refs)
    ]
    assert any(departed), name


@pytest.mark.slow
@pytest.mark.parametrize("family,tp,pp", [("gemma2", 2, 1), ("gemma3", 2, 1), ("gemma3", 1, 2)],
                         ids=["gemma2-tp2", "gemma3-tp2", "gemma3-pp2"])
def test_parallel_matches_hf(gemma_models, family, tp, pp):
    """TP shards heads, MLP and vocabulary; PP passes hidden states (no residual stream) to a
    last stage that holds its own copy of the tied embedding as the LM head."""
    folder, _, prompts, refs = gemma_models[family]
    got = _generate(folder, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                    distributed_executor_backend="mp", cpu_threads=1, max_num_batched_tokens=64)
    # The single worker matches HF (above); so must TP and PP, chunked prefill included.
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in refs]
    assert max(_max_logprob_diff(a, b[1]) for (_, a), b in zip(got, refs)) < LOGPROB_TOL



def _write_gguf(hf, path) -> None:
    """The HF model as llama.cpp's converter writes it: its tensor names (from gguf-py's own
    map), norms stored with the 1 added, and only the metadata llama.cpp keeps (no
    query_pre_attn_scalar, local rope base or Gemma 3 window pattern: those are implied)."""
    import gguf
    import numpy as np

    cfg = hf.config
    arch = "gemma3" if cfg.model_type == "gemma3_text" else "gemma2"
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()),
                                     cfg.num_hidden_layers)
    writer = reference.gguf_writer(cfg, path, arch)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        full = cfg.rope_parameters["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: llama.cpp writes no output.weight
        data = tensor.float().numpy()
        if name.endswith("norm.weight"):
            data = data + np.float32(1.0)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), data)
    reference.write_gguf(writer)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gguf_matches_hf(tmp_path, family):
    # GGUF has no query_pre_attn_scalar: llama.cpp uses head_dim (below 27B), so this model does.
    hf = reference.make_tiny_model(family, tmp_path / "hf", query_pre_attn_scalar=16)
    path = tmp_path / f"tiny-{family}.gguf"
    _write_gguf(hf, path)
    rng = random.Random(7)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (9, 70)]
    for prompt, (tokens, lps) in zip(prompts, _generate(path, prompts)):
        ref_tokens, ref_lps = reference.hf_greedy(hf, prompt, NEW_TOKENS)
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert _max_logprob_diff(lps, ref_lps) < LOGPROB_TOL
