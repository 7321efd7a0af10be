"""tidal's tokens and logprobs against HF transformers on the same weights (greedy, float32)."""

from __future__ import annotations

import random

import pytest
import torch

import reference
from tidal.frontend import LLM, SamplingParams

# Eight prompts from 1 to 300 tokens, batched together; lengths straddle block boundaries.
PROMPT_LENGTHS = [1, 5, 16, 17, 40, 97, 160, 300]
NEW_TOKENS = 32
# float32 end to end: differences are summation order only.
LOGPROB_TOL = 2e-4


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2", "qwen3"])
def test_tiny_models_match_hf(tiny_models, family):
    folder, hf = tiny_models[family]
    prompts = _prompts(hf.config.vocab_size, seed=hash(family) % 1000)
    # float32 on a GPU too ("auto" would pick bfloat16 there).
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, max_num_seqs=16,
              dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lp = reference.hf_greedy(hf, prompt, NEW_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == ref_tokens, f"prompt of {len(prompt)} tokens"
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < LOGPROB_TOL


def test_sharded_checkpoint_loads_the_same(tmp_path, tiny_models):
    _, hf = tiny_models["llama"]
    folder = tmp_path / "sharded"
    model = reference.make_tiny_model("llama", folder, max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    prompt = list(range(3, 40))
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, dtype="float32")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference.hf_greedy(hf, prompt, 16)[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_close_to_hf(tiny_models, dtype):
    """Half precision cannot be token-exact across implementations over long runs; the first
    step's distribution must agree with HF's in the same dtype."""
    folder, _ = tiny_models["qwen3"]
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype).eval()
    prompt = list(range(5, 70))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype=dtype, num_kv_blocks=64)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] == int(ref.argmax())
    for tok, lp in out.logprobs[0].items():
        assert abs(lp.logprob - float(ref[tok])) < 0.05


SMOL_PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Translate to French: I would like a cup of coffee, please.",
    "List three colours:",
    "In 1905, Albert Einstein published four papers that " * 3,
    "Once upon a time, in a land far away, there lived a curious fox who " * 12,
]


def test_smollm2_gguf_matches_hf(smollm2_hf, smollm2_llm):
    """Real weights: our GGUF loader vs HF's GGUF loader of the same file, 8 prompts batched."""
    hf = smollm2_hf
    tok = smollm2_llm.get_tokenizer()
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    assert min(map(len, prompts)) <= 2 and max(map(len, prompts)) >= 150
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = out.outputs[0]
        ref_tokens, ref_lp = reference.hf_teacher_forced(hf, prompt, got.token_ids)
        assert got.token_ids == ref_tokens, tok.decode(prompt)
        ours = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max(abs(a - b) for a, b in zip(ours, ref_lp)) < 1e-3
        assert got.text == tok.decode(got.token_ids, skip_special_tokens=True)
