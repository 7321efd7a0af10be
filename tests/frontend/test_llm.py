"""End-to-end behaviour of the offline engine through ``LLM`` (CPU, tiny random-weight models
and the real SmolLM2)."""

from __future__ import annotations

import random

import pytest

from tidal.frontend import LLM, SamplingParams


def _mixed_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 120))] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_models):
    folder, hf = tiny_models["qwen3"]
    return folder, hf.config.vocab_size


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=24,
                   ignore_eos=True),
], ids=["greedy", "seeded"])
def test_batch_invariance(tiny, params):
    """A request alone gives the same tokens as inside a batch of 32 mixed-length requests."""
    folder, vocab = tiny
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=512, max_num_seqs=32)
    prompts = _mixed_prompts(32, vocab)
    batched = _tokens(llm.generate(prompts, params, use_tqdm=False))
    for i in (0, 7, 31):
        alone = _tokens(llm.generate([prompts[i]], params, use_tqdm=False))
        assert alone[0] == batched[i]


def test_chunked_prefill_matches_unchunked(tiny):
    folder, vocab = tiny
    prompts = _mixed_prompts(6, vocab, seed=3) + [list(range(1, 200))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1,
                            prompt_logprobs=2)
    # On the CPU whatever the machine: equality across batch shapes is a float32 property
    # (a GPU picks other kernels for other batch sizes).
    whole = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, device="cpu",
                max_num_batched_tokens=512, enable_chunked_prefill=False, max_model_len=512)
    chunked = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, device="cpu",
                  max_num_batched_tokens=16)
    a = whole.generate(prompts, params, use_tqdm=False)
    b = chunked.generate(prompts, params, use_tqdm=False)
    assert _tokens(a) == _tokens(b)
    for x, y in zip(a, b):
        assert len(x.prompt_logprobs) == len(x.prompt_token_ids)
        assert x.prompt_logprobs[0] is None
        for px, py in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert px.keys() == py.keys()
            for tok in px:
                assert abs(px[tok].logprob - py[tok].logprob) < 1e-4


def test_preemption_gives_identical_output(tiny):
    """A pool too small for the batch forces recompute preemption; every request still ends
    with exactly the unconstrained output, and every block returns to the pool."""
    folder, vocab = tiny
    prompts = _mixed_prompts(12, vocab, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)] * 6
    # On the CPU whatever the machine (see test_chunked_prefill_matches_unchunked).
    free = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=512, device="cpu")
    tight = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=24, max_model_len=256,
                device="cpu")
    expected = _tokens(free.generate(prompts, params, use_tqdm=False))
    core = tight.engine.core
    preemptions = 0
    original_step = core.step

    def counting_step():
        nonlocal preemptions
        out = original_step()
        preemptions += out.scheduler_stats.num_preemptions
        core.scheduler.kv.check_invariants()
        return out

    core.step = counting_step
    assert _tokens(tight.generate(prompts, params, use_tqdm=False)) == expected
    assert preemptions > 0, "the pool was meant to be too small; no preemption happened"
    assert core.scheduler.kv.num_free_blocks == core.config.cache.num_blocks


def test_n_samples_come_back_as_one_result(tiny):
    folder, vocab = tiny
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    seqs = [tuple(c.token_ids) for c in out[0].outputs]
    assert len(set(seqs)) == 3, "seeded samples of one request should differ"
    again = llm.generate([[5, 6, 7]], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10,
                                                     ignore_eos=True), use_tqdm=False)
    assert _tokens(again) == _tokens(out)


def test_finish_reasons(tiny):
    folder, vocab = tiny
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=128, max_model_len=64)
    prompt = [9, 8, 7]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20,
                                                stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == free.token_ids[:first + 1]
    # min_tokens bans the stop token until reached.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=first + 2,
                                                stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= first + 2
    assert stop_tok not in out.token_ids[:first + 1]
    # The context limit ends a request with "length".
    long = llm.generate([list(range(1, 60))], SamplingParams(temperature=0, max_tokens=None,
                                                             ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 64 - 59


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    (list(range(1, 70)), SamplingParams(), "max_model_len"),
    ([1, 2, 10**6], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ([1, 2], SamplingParams(logprobs=20, prompt_logprobs=0), None),
])
def test_bad_input_is_refused_and_engine_keeps_serving(tiny, prompt, params, match):
    folder, vocab = tiny
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=64)
    good = [3, 4, 5]
    if match is None:
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert len(out.logprobs[0]) >= 20
    else:
        with pytest.raises(ValueError, match=match):
            llm.generate([good, prompt], params, use_tqdm=False)
    out = llm.generate([good], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.engine.core.scheduler.kv.num_free_blocks == llm.config.cache.num_blocks


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_text_prompts_chat_and_stop_strings(smollm2_llm):
    llm = smollm2_llm
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
    full = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0].text
    assert " " in full.strip()
    stop = full.strip().split(" ")[1]
    cut = llm.generate("The capital of France is",
                       SamplingParams(temperature=0, max_tokens=20, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[:full.index(stop)]
    assert stop not in cut.text


@pytest.mark.parametrize("num_blocks", [512, 24], ids=["roomy", "preempting"])
def test_async_scheduling_gives_identical_outputs(tiny, num_blocks):
    """Scheduling step N+1 before step N's tokens are known must not change any output, also
    when requests stop early (stop tokens, max_tokens) and when preemption kicks in."""
    folder, vocab = tiny
    prompts = _mixed_prompts(12, vocab, seed=11)
    free = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=512, multiprocess=False)
    probe = free.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=30,
                                                      ignore_eos=True), use_tqdm=False)
    stop_tok = probe[0].outputs[0].token_ids[7]
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_tok]),
              SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)] * 3
    expected = _tokens(free.generate(prompts, params, use_tqdm=False))
    fast = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=num_blocks,
               max_model_len=256, async_scheduling=True, multiprocess=False)
    core = fast.engine.core
    assert core.max_inflight == 2
    assert _tokens(fast.generate(prompts, params, use_tqdm=False)) == expected
    core.scheduler.kv.check_invariants()
    assert core.scheduler.kv.num_free_blocks == core.config.cache.num_blocks


def test_shutdown_releases_the_model_and_kv_cache(tiny):
    """An engine shut down in a longer-lived process (a notebook, a benchmark running engines
    one after another) leaves nothing of its model or KV cache alive."""
    import gc
    import weakref

    folder, _ = tiny
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, device="cpu",
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    llm.generate([[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(max_tokens=4, temperature=0.0),
                 use_tqdm=False)
    runner = llm.engine.core.executor.worker.runner
    model, kv = weakref.ref(runner.model), weakref.ref(runner.kv_caches[0])
    llm.shutdown()
    del runner
    gc.collect()
    assert model() is None and kv() is None
