"""Shared by the mixture-of-experts family tests (Mixtral, Qwen3-MoE): tiny random HF models, a
run of tidal's ``LLM`` returning greedy tokens and their logprobs, and a llama.cpp-style GGUF of
an HF MoE model (experts stacked [E, ...] per layer, as llama.cpp's converter writes them)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

import reference
from tidal.frontend import SamplingParams

NEW_TOKENS = 16
LOGPROB_TOL = 2e-4
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
# Many experts, few chosen: each token's route matters, and different tokens take different ones.
SHAPES = dict(vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, num_experts_per_tok=2)


@dataclass(slots=True)
class TinyMoE:
    folder: Path
    hf: torch.nn.Module
    prompts: list[list[int]]
    refs: list[tuple[list[int], list[float]]]  # HF's greedy tokens and logprobs per prompt


def make_tiny_moe(cfg, folder: Path, prompt_lengths: tuple[int, ...], seed: int = 0) -> TinyMoE:
    """An HF model of ``cfg`` with random weights (scaled up, so greedy choices are not
    near-ties), saved as safetensors, with HF's greedy continuation of random prompts."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    hf.save_pretrained(folder)
    rng = random.Random(seed + 1)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in prompt_lengths]
    return TinyMoE(folder, hf, prompts,
                   [reference.hf_greedy(hf, p, NEW_TOKENS) for p in prompts])


def generate(model: str | Path, prompts: list[list[int]],
             **kw) -> list[tuple[list[int], list[float]]]:
    return generate_on(model, prompts, device="cpu", **kw)


def generate_on(model: str | Path, prompts: list[list[int]], device: str,
                **kw) -> list[tuple[list[int], list[float]]]:
    return reference.engine_greedy(model, prompts, GREEDY, device, **kw)


max_logprob_diff = reference.max_logprob_diff


def assert_matches(got: list[tuple[list[int], list[float]]],
                   refs: list[tuple[list[int], list[float]]], prompts: list[list[int]],
                   tol: float = LOGPROB_TOL) -> None:
    for prompt, (tokens, lps), (ref_tokens, ref_lps) in zip(prompts, got, refs, strict=True):
        assert tokens == ref_tokens, f"prompt of {len(prompt)} tokens"
        assert max_logprob_diff(lps, ref_lps) < tol, f"prompt of {len(prompt)} tokens"


def departs(got: list[tuple[list[int], list[float]]],
            refs: list[tuple[list[int], list[float]]]) -> bool:
    """Whether a run differs from the reference clearly (tokens, or logprobs well past the
    tolerance): what an ablated feature must cause."""
    return any(tokens != ref_tokens or max_logprob_diff(lps, ref_lps) > 50 * LOGPROB_TOL
               for (tokens, lps), (ref_tokens, ref_lps) in zip(got, refs, strict=True))


def _llama_cpp_rotary_layout(w, n_heads: int):
    # llama.cpp's converter interleaves the two rotary halves of each llama Q/K head.
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def write_moe_gguf(hf, path: Path, arch: str, experts: dict[str, str]) -> None:
    """``hf`` as llama.cpp writes it for GGUF ``arch`` ("llama" for Mixtral, "qwen3moe"):
    block tensors under llama.cpp's names, the router as ``ffn_gate_inp`` and each layer's
    experts stacked into ``ffn_{gate,up,down}_exps``. ``experts`` maps the HF expert tensor
    name (``w1``...) to gate / up / down."""
    import numpy as np

    cfg = hf.config
    writer = reference.gguf_writer(cfg, path, arch)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in hf.state_dict().items():
        data = tensor.float().numpy()
        if name in top:
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            writer.add_tensor(top[name], data)
            continue
        _, _, layer, rest = name.split(".", 3)
        module = rest.removesuffix(".weight")
        if ".experts." in module:
            # HF's per-expert tensors (transformers < 5) or its fused ones (>= 5) alike
            parts = module.split(".")
            if parts[-2] != "experts":  # mlp.experts.{e}.{part}
                stacks.setdefault((int(layer), experts[parts[-1]]), {})[int(parts[-2])] = data
                continue
            if parts[-1] == "gate_up_proj":
                half = data.shape[1] // 2
                stacks[(int(layer), "gate")] = dict(enumerate(data[:, :half]))
                stacks[(int(layer), "up")] = dict(enumerate(data[:, half:]))
                continue
            if parts[-1] == "down_proj":
                stacks[(int(layer), "down")] = dict(enumerate(data))
                continue
            raise AssertionError(name)
        if module.endswith(".gate"):  # the router
            writer.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", data)
            continue
        stem = block[module]
        if arch == "llama" and stem == "attn_q":
            data = _llama_cpp_rotary_layout(data, cfg.num_attention_heads)
        elif arch == "llama" and stem == "attn_k":
            data = _llama_cpp_rotary_layout(data, cfg.num_key_value_heads)
        writer.add_tensor(f"blk.{layer}.{stem}.weight", data)
    for (layer, which), per_expert in sorted(stacks.items()):
        stacked = np.stack([per_expert[e] for e in range(len(per_expert))])
        writer.add_tensor(f"blk.{layer}.ffn_{which}_exps.weight", stacked)
    reference.write_gguf(writer)


GPU_LOGPROB_TOL = 2e-3  # float32 on the GPU: the Triton MoE kernel and cuBLAS round otherwise


def assert_matches_on_gpu(model: TinyMoE) -> None:
    """The GPU path (the policy's Triton fused-MoE kernel, CUDA graphs for decode) gives HF's
    greedy tokens too."""
    got = generate_on(model.folder, model.prompts, device="cuda")
    assert_matches(got, model.refs, model.prompts, tol=GPU_LOGPROB_TOL)
