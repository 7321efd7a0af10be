"""Phi-3 against HF transformers on tiny random weights (float32, CPU): greedy tokens and
logprobs, with and without LongRoPE and with a sliding window shorter than the prompts; the
LongRoPE cos/sin table against HF's rotary module; the fused q/k/v and gate/up checkpoint
tensors landing in each tensor-parallel rank's shard exactly (read lazily, slice by slice);
hub-style configs normalised; a GGUF file of the model; TP=2 equal to one worker."""

from __future__ import annotations

import random

import pytest
import torch

import reference
from tidal.frontend import LLM, SamplingParams

NEW_TOKENS = 24
LOGPROB_TOL = 2e-4
HALF_ROTARY = 8  # tiny head_dim 16


def _longrope(original: int) -> dict:
    # Factors far from 1 and from each other: using the wrong set, or none, moves every
    # frequency.
    g = torch.Generator().manual_seed(1)
    return {"rope_type": "longrope",
            "short_factor": (1 + 0.5 * torch.rand(HALF_ROTARY, generator=g)).tolist(),
            "long_factor": (1 + 8 * torch.rand(HALF_ROTARY, generator=g)).tolist(),
            "original_max_position_embeddings": original}


# name -> (config overrides, prompt lengths). tidal picks the LongRoPE factor set once, by the
# model's context (max_position_embeddings) against original_max_position_embeddings; HF picks
# per forward pass by the current length. They agree when every sequence stays on the same side
# of the original length as the context: "longrope" (context 512 > 32) uses prompts longer than
# 32 only, "longrope-short" (context = original = 128) keeps prompt + output within 128.
CASES = {
    "plain": ({}, [1, 5, 16, 17, 40, 97, 160]),
    "longrope": ({"original_max_position_embeddings": 32, "rope_scaling": _longrope(32)},
                 [33, 40, 97, 160, 300]),
    "longrope-short": ({"max_position_embeddings": 128, "original_max_position_embeddings": 128,
                        "rope_scaling": _longrope(128)}, [1, 17, 40, 97]),
    "window": ({"sliding_window": 24}, [5, 30, 97, 160]),
}


@pytest.fixture(scope="module")
def phi3_models(tmp_path_factory):
    out = {}
    for name, (overrides, _) in CASES.items():
        folder = tmp_path_factory.mktemp(f"tiny-phi3-{name}")
        out[name] = (folder, reference.make_tiny_model("phi3", folder, **overrides))
    return out


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_phi3_matches_hf(phi3_models, case):
    folder, hf = phi3_models[case]
    prompts = _prompts(hf.config.vocab_size, CASES[case][1])
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, max_num_seqs=16,
              dtype="float32")
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                                logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    refs = [reference.hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    for prompt, out, (ref_tokens, ref_lp) in zip(prompts, outs, refs):
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < LOGPROB_TOL
    if case == "window":
        # The prompts reach past the window far enough that ignoring it changes the tokens.
        hf.config.sliding_window = None
        try:
            unwindowed = [reference.hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]
        finally:
            hf.config.sliding_window = CASES[case][0]["sliding_window"]
        assert unwindowed != [t for t, _ in refs]


@pytest.mark.parametrize("context,original", [(512, 32), (128, 128)])
def test_longrope_table_matches_hf(context, original):
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.worker.layers.rotary import build_cos_sin_cache

    cfg = reference.tiny_hf_config("phi3", max_position_embeddings=context,
                                   original_max_position_embeddings=original,
                                   rope_scaling=_longrope(original))
    cfg.architectures = ["Phi3ForCausalLM"]
    arch = arch_from_hf_dict(cfg.to_dict(), "config.json")
    table = build_cos_sin_cache(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                arch.rope_scaling)
    # HF's choice for a sequence of n tokens: long factors iff n > original.
    n = context if context > original else original
    cos, sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(n)[None])
    torch.testing.assert_close(table[:n, :HALF_ROTARY], cos[0, :, :HALF_ROTARY],
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(table[:n, HALF_ROTARY:], sin[0, :, :HALF_ROTARY],
                               rtol=0, atol=1e-6)
    # The other factor set gives a different table: the check above can tell them apart.
    other = dict(arch.rope_scaling, short_factor=arch.rope_scaling["long_factor"],
                 long_factor=arch.rope_scaling["short_factor"])
    swapped = build_cos_sin_cache(arch.head_dim, n, arch.rope_theta, other)
    assert not torch.allclose(swapped[:n], table[:n], atol=1e-3)


# --- the fused checkpoint tensors, split per tensor-parallel rank ------------------------------


def _rank_model(folder, rank: int, world: int, reads: dict[str, list[str]]):
    """Rank ``rank``'s model, loaded lazily; ``reads`` collects, per fused checkpoint tensor,
    how it was read: "slice" (just some rows) or "whole"."""
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.distributed.parallel_state import ParallelGroup
    from tidal.worker.loader import safetensors_weights
    from tidal.worker.loader.model_loader import load_model

    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64).create_config()
    tp = ParallelGroup(rank=rank, world_size=world, ranks=tuple(range(world)))
    lazy = safetensors_weights.LazyTensor

    def recording(method, how):
        def read(self, *args):
            if "qkv_proj" in self.name or "gate_up_proj" in self.name:
                reads.setdefault(self.name, []).append(how)
            return method(self, *args)
        return read

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lazy, "narrow", recording(lazy.narrow, "slice"))
        patch.setattr(lazy, "materialize", recording(lazy.materialize, "whole"))
        return load_model(config.model, torch.device("cpu"), TorchAttention(), tp, None)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fused_checkpoint_tensors_split_per_rank(phi3_models, world):
    """Each rank's fused q/k/v holds its own q heads, then its k heads, then its v heads (a KV
    head replicated when ranks outnumber KV heads), and its gate/up its gate rows then its up
    rows; built here from HF's fused tensors by head, so any mix-up of the parts fails."""
    folder, hf = phi3_models["plain"]
    cfg = hf.config
    d = cfg.hidden_size // cfg.num_attention_heads
    heads, kv_heads, inter = cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.intermediate_size
    for rank in range(world):
        reads: dict[str, list[str]] = {}
        model = _rank_model(folder, rank, world, reads)
        # Read lazily, each part just for this rank's rows: 3 slices per q/k/v, 2 per gate/up.
        assert len(reads) == 2 * cfg.num_hidden_layers
        assert all(set(how) == {"slice"} and len(how) == (3 if "qkv" in name else 2)
                   for name, how in reads.items())
        for i in range(cfg.num_hidden_layers):
            fused = hf.model.layers[i].self_attn.qkv_proj.weight
            q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d])
            per_q = heads // world
            kv_head = rank * kv_heads // world
            per_kv = max(1, kv_heads // world)
            want = torch.cat([q[rank * per_q * d:(rank + 1) * per_q * d],
                              k[kv_head * d:(kv_head + per_kv) * d],
                              v[kv_head * d:(kv_head + per_kv) * d]])
            layer = model.layers[str(i)]
            assert torch.equal(layer.self_attn.qkv_proj.weight, want)
            gate, up = hf.model.layers[i].mlp.gate_up_proj.weight.split([inter, inter])
            part = inter // world
            want = torch.cat([gate[rank * part:(rank + 1) * part],
                              up[rank * part:(rank + 1) * part]])
            assert torch.equal(layer.mlp.gate_up_proj.weight, want)


def test_hub_config_is_normalised():
    """Hub configs (Phi-3-mini-128k-instruct's shape): ``rope_scaling`` of type "su" or
    "longrope" with the trained length at the top level, and a window on every layer."""
    from tidal.engine_core.model_arch import arch_from_hf_dict

    half = 48
    cfg = {"architectures": ["Phi3ForCausalLM"], "hidden_size": 3072, "intermediate_size": 8192,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "vocab_size": 32064, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
           "sliding_window": 262144, "hidden_act": "silu", "rms_norm_eps": 1e-5,
           "rope_scaling": {"type": "su", "short_factor": [1.0] * half,
                            "long_factor": [2.0] * half}}
    arch = arch_from_hf_dict(cfg, "config.json")
    assert arch.family == "phi3" and arch.head_dim == 96 and not arch.qkv_bias
    assert arch.rope_scaling["rope_type"] == "longrope"
    assert arch.rope_scaling["original_max_position_embeddings"] == 4096
    assert [arch.layer_sliding_window(i) for i in (0, 31)] == [262144, 262144]
    short = dict(cfg, rope_scaling=dict(cfg["rope_scaling"], short_factor=[1.0] * (half - 1)))
    with pytest.raises(ValueError, match="short_factor"):
        arch_from_hf_dict(short, "config.json")
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        arch_from_hf_dict(dict(cfg, partial_rotary_factor=0.75), "config.json")


def test_fused_tensor_of_the_wrong_size_is_named():
    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.worker.models.decoder import WeightLoadError
    from tidal.worker.models.phi3 import split_fused

    cfg = reference.tiny_hf_config("phi3")
    cfg.architectures = ["Phi3ForCausalLM"]
    arch = arch_from_hf_dict(cfg.to_dict(), "config.json")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    bad = torch.zeros(arch.q_size + arch.kv_size, arch.hidden_size)  # v missing
    with pytest.raises(WeightLoadError, match="qkv_proj"):
        list(split_fused([(name, bad)], arch))


@pytest.mark.slow
def test_tp2_matches_single_worker(phi3_models):
    """LongRoPE model: greedy tokens at TP=2 (gloo, CPU) equal one worker's exactly."""
    folder, hf = phi3_models["longrope"]
    prompts = _prompts(hf.config.vocab_size, [40, 97, 150], seed=3)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def generate(**kw) -> list[list[int]]:
        llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, cpu_threads=1,
                  max_num_batched_tokens=128, device="cpu", **kw)
        try:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                 use_tqdm=False)]
        finally:
            llm.shutdown()

    single = generate()
    assert generate(tensor_parallel_size=2, distributed_executor_backend="mp") == single


def _write_gguf(hf, path) -> None:
    """The HF model as llama.cpp's converter lays Phi-3 out (fused tensors kept, F32)."""
    pytest.importorskip("gguf")
    cfg = hf.config
    writer = reference.gguf_writer(cfg, path, "phi3")
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_tokenizer_model("llama")
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    stems = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    for name, tensor in hf.state_dict().items():
        if name in top:
            gguf_name = top[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{stems[module]}.{kind}"
        writer.add_tensor(gguf_name, tensor.numpy().astype("float32"))
    reference.write_gguf(writer)


def test_gguf_matches_hf(phi3_models, tmp_path):
    """A Phi-3 GGUF (fused tensors as llama.cpp stores them, window in the metadata) gives the
    HF model's greedy tokens."""
    _, hf = phi3_models["window"]
    path = tmp_path / "tiny-phi3.gguf"
    _write_gguf(hf, path)
    # The file is laid out as transformers' own GGUF reader expects: it reads back every tensor.
    theirs = reference.load_hf_gguf(path).state_dict()
    assert all(torch.equal(t, theirs[name]) for name, t in hf.state_dict().items())
    prompts = _prompts(hf.config.vocab_size, [5, 97], seed=5)
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=128, dtype="float32")
    try:
        assert llm.engine.core.config.model.arch.sliding_window == hf.config.sliding_window
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference.hf_greedy(hf, prompt, NEW_TOKENS)[0]
