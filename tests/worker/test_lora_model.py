"""LoRA adapters in the engine against HF transformers + PEFT on the same random base model and
random adapters (written by ``peft`` itself): one batch mixing four adapters (ranks 8 and 16,
different target sets, rsLoRA, a per-module alpha) and the base model gives each request the
reference's greedy tokens and close logprobs; with fewer device slots than adapters (slots
recycled), a small host cache (evicted and read again), and tensor parallelism the same."""

from __future__ import annotations

import pytest
import torch

from lora_adapters import make_peft_adapter, peft_reference
from reference import hf_greedy, max_logprob_diff
from tidal.engine_core.lora_adapter import LoRAAdapterError
from tidal.frontend import LLM, LoRARequest, SamplingParams

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 33, 99, 7, 12], [200, 3, 8], list(range(40, 75)), [11] * 20,
           [300, 301, 2, 9, 9, 1, 4]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_setup(tiny_models, tmp_path_factory):
    """(base folder, adapters, per prompt (adapter, expected tokens, expected logprobs))."""
    folder, hf = tiny_models["llama"]
    root = tmp_path_factory.mktemp("lora")
    specs = [
        dict(r=8, targets=["q_proj", "v_proj"]),
        dict(r=16, targets=ALL, alpha=32.0),
        dict(r=8, targets=["o_proj", "gate_proj", "up_proj"], rslora=True),
        dict(r=16, targets=["k_proj", "down_proj"], alpha_pattern={"down_proj": 4.0}),
    ]
    loras = []
    for i, spec in enumerate(specs):
        path = make_peft_adapter(hf, root / f"adapter{i}", seed=i, **spec)
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
    per_prompt = []
    for prompt, lora in zip(PROMPTS, loras + [None]):
        model = peft_reference(hf, None if lora is None else lora.lora_path)
        tokens, logprobs = hf_greedy(model, prompt, MAX_TOKENS)
        per_prompt.append((lora, tokens, logprobs))
    # The adapters change the outputs (else the comparison would prove nothing).
    base = [hf_greedy(hf, p, MAX_TOKENS)[0] for p in PROMPTS[:4]]
    assert all(b != exp for b, (_, exp, _) in zip(base, per_prompt))
    return folder, loras, per_prompt


def _llm(folder, **kw) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, max_num_seqs=8,
               dtype="float32", device="cpu", enable_lora=True, **kw)


def _check(outs, per_prompt) -> None:
    for out, (lora, tokens, logprobs) in zip(outs, per_prompt):
        got = out.outputs[0]
        name = lora.lora_name if lora else "base"
        assert got.token_ids == tokens, name
        lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
        assert max_logprob_diff(lps, logprobs) < 1e-3, name


def _runner(llm: LLM):
    return llm.engine.core.executor.worker.runner


def test_mixed_batch_matches_peft(lora_setup):
    folder, loras, per_prompt = lora_setup
    llm = _llm(folder, max_loras=4)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                            lora_request=[lora for lora, _, _ in per_prompt])
        _check(outs, per_prompt)
        assert llm.list_loras() == [1, 2, 3, 4]
        # Prefix caching keeps adapters apart: the same prompt under another adapter (and
        # under none) is computed afresh and gives that adapter's tokens.
        again = llm.generate([PROMPTS[0]] * 2, PARAMS, use_tqdm=False,
                             lora_request=[loras[1], None])
        assert again[0].outputs[0].token_ids != per_prompt[0][1]
        base = llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
        assert base == again[1].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_fewer_slots_than_adapters(lora_setup):
    """Two device slots for four adapters in one call: the scheduler holds back what does
    not fit, slots are reused, and every request still gets its own adapter's outputs; a host
    cache of two reads evicted adapters again."""
    folder, loras, per_prompt = lora_setup
    llm = _llm(folder, max_loras=2, max_cpu_loras=2)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                            lora_request=[lora for lora, _, _ in per_prompt])
        _check(outs, per_prompt)
        lora = _runner(llm).lora
        assert lora.slots.loads >= 4  # every adapter went through one of two slots
        assert len(lora.cache) == 2  # the LRU kept two of the four
        # An adapter evicted from both the host cache and the slots is read from disk again.
        evicted = next(r for r in loras if (r.lora_int_id, r.lora_path) not in lora.cache
                       and lora.slots.slot_of((r.lora_int_id, r.lora_path)) is None)
        i = loras.index(evicted)
        again = llm.generate([PROMPTS[i]], PARAMS, use_tqdm=False, lora_request=evicted)
        _check(again, [per_prompt[i]])
        assert (evicted.lora_int_id, evicted.lora_path) in lora.cache
    finally:
        llm.shutdown()


def test_qwen3_adapter(tiny_models, tmp_path):
    """Another family: Qwen3 (q/k norms, tied embeddings, head_dim != hidden / heads)."""
    folder, hf = tiny_models["qwen3"]
    path = make_peft_adapter(hf, tmp_path / "q3", r=8, targets=ALL, seed=7)
    expected = hf_greedy(peft_reference(hf, path), PROMPTS[0], MAX_TOKENS)
    llm = _llm(folder)
    try:
        out = llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False,
                           lora_request=LoRARequest("q3", 9, str(path)))
        _check(out, [(None, *expected)])
    finally:
        llm.shutdown()


def test_bad_adapters_refused_engine_unharmed(lora_setup, tiny_models, tmp_path):
    folder, loras, per_prompt = lora_setup
    _, hf = tiny_models["llama"]
    rank32 = make_peft_adapter(hf, tmp_path / "r32", r=32, targets=["q_proj"])
    dora = make_peft_adapter(hf, tmp_path / "dora", r=8, targets=["q_proj"], use_dora=True)
    embed = make_peft_adapter(hf, tmp_path / "embed", r=8, targets=["q_proj", "embed_tokens"])
    _, qwen = tiny_models["qwen3"]
    other = make_peft_adapter(qwen, tmp_path / "other", r=8, targets=["q_proj"])
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((rank32 / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not loaded")
    cases = [
        (tmp_path / "missing", "is not a directory"),
        (rank32, "rank 32 exceeds --max-lora-rank 16"),
        (dora, "DoRA"),
        (embed, "embedding"),
        (other, "do not fit the base model"),
        (pickled, "pickle"),
    ]
    llm = _llm(folder)
    try:
        for i, (path, why) in enumerate(cases):
            bad = LoRARequest(f"bad{i}", 50 + i, str(path))
            with pytest.raises(LoRAAdapterError, match=why):
                llm.add_lora(bad)
            with pytest.raises(ValueError, match=why):
                llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False, lora_request=bad)
        assert llm.list_loras() == []
        # Still serving, adapters and base alike.
        outs = llm.generate(PROMPTS[:1] + PROMPTS[4:], PARAMS, use_tqdm=False,
                            lora_request=[loras[0], None])
        _check(outs, [per_prompt[0], per_prompt[4]])
        assert llm.remove_lora(1) and not llm.remove_lora(1)
    finally:
        llm.shutdown()


def test_lora_request_without_enable_lora(tiny_models):
    folder, _ = tiny_models["llama"]
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, dtype="float32",
              device="cpu")
    try:
        with pytest.raises(ValueError, match="enable_lora"):
            llm.generate([PROMPTS[0]], PARAMS, use_tqdm=False,
                         lora_request=LoRARequest("x", 1, "/nowhere"))
        assert _runner(llm).lora is None  # no LoRA layers, no cost
        qkv = _runner(llm).model.layers["0"].self_attn.qkv_proj
        assert qkv.lora is None
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tp2_matches_tp1(lora_setup):
    folder, _, per_prompt = lora_setup
    loras = [lora for lora, _, _ in per_prompt]

    def run(**kw):
        llm = _llm(folder, max_loras=4, cpu_threads=1, **kw)
        try:
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False, lora_request=loras)
            return [o.outputs[0].token_ids for o in outs]
        finally:
            llm.shutdown()

    tp1 = run()
    assert tp1 == [tokens for _, tokens, _ in per_prompt]
    assert run(tensor_parallel_size=2, distributed_executor_backend="mp") == tp1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager,grouped", [(False, 0), (True, 0), (False, 2)],
                         ids=["cuda_graphs", "eager", "grouped_graphs"])
def test_gpu_mixed_batch_matches_peft(lora_setup, eager, grouped):
    """On the GPU: the Triton kernels, decode CUDA graphs (slot ids as graph inputs) and
    async scheduling, against the same PEFT reference; ``grouped``: decode batches of 2+
    sorted by adapter in tiles. Every pass takes its shrinks' outputs from the context's
    scratch (zeroed once per pass: inside the captured graphs too)."""
    folder, _, per_prompt = lora_setup
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, max_num_seqs=8,
              dtype="float32", device="cuda", enable_lora=True, max_loras=2,
              enforce_eager=eager,
              kernel_config={"lora_grouped_min_tokens": grouped} if grouped else {})
    try:
        runner = _runner(llm)
        assert runner.kernels.policy.triton_lora
        assert runner.lora.ctx.scratch is not None
        assert not grouped or runner.lora.grouped_min == grouped
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                            lora_request=[lora for lora, _, _ in per_prompt])
        for out, (lora, tokens, logprobs) in zip(outs, per_prompt):
            got = out.outputs[0]
            assert got.token_ids == tokens, lora
            lps = [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)]
            assert max_logprob_diff(lps, logprobs) < 1e-2
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_compiled_mixed_batch_matches_peft_with_one_trace(lora_setup, tmp_path):
    """torch.compile (mode 3, Inductor) with LoRA: every linear's adapter products are
    ``tidal::lora_shrink`` / ``tidal::lora_expand`` ops in the trace (the expand declared as
    mutating its output), reading the step's token slots from the persistent buffer: PEFT's
    tokens for a batch mixing four adapters and the base model, and later batches with other
    adapters in other slots run the same trace (no recompile)."""
    folder, loras, per_prompt = lora_setup
    llm = _llm(folder, max_loras=4, compilation_config={"mode": 3, "cache_dir": str(tmp_path)})
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False,
                            lora_request=[lora for lora, _, _ in per_prompt])
        _check(outs, per_prompt)
        again = llm.generate(PROMPTS[:2][::-1], PARAMS, use_tqdm=False,
                             lora_request=[per_prompt[1][0], per_prompt[0][0]])
        _check(again, [per_prompt[1], per_prompt[0]])
        stats = _runner(llm).compiled.stats
        assert stats.dynamo_traces == 1 and stats.pieces >= 2
    finally:
        llm.shutdown()
