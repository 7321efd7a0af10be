"""Beam search (``tidal.frontend.beam_search``): the ranking against a plain reference loop of
vLLM's algorithm, the top beams against Hugging Face transformers' ``generate(num_beams=...)`` on
a tiny random-weight Llama, ``AsyncLLM.beam_search`` (and its abort), and ``use_beam_search`` on
the OpenAI server through the official client."""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
from collections.abc import Callable

import openai
import pytest
import torch

from server_harness import API_KEY, generation_server
from tidal.engine_core.config import EngineArgs
from tidal.frontend import LLM, SamplingParams
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.beam_search import BeamSearch, BeamSearchParams
from tidal.frontend.outputs import Logprob, PositionLogprobs
from tidal.frontend.tokenizer import apply_chat_template

# --- a reference: vLLM's loop, written plainly ---------------------------------------------------

NextLogprobs = Callable[[list[int]], torch.Tensor]  # full sequence -> next-token log-probs


def reference_beam_search(next_logprobs: NextLogprobs, prompt: list[int], width: int,
                          max_tokens: int, eos: int | None, length_penalty: float,
                          include_stop: bool = False, early_stopping: object = "never"
                          ) -> list[tuple[list[int], str, float]]:
    """(generated tokens, finish reason, cumulative logprob) of the best ``width`` sequences.

    Every step takes each beam's top ``2 * width`` next tokens; EOS ends a candidate, the best
    ``width`` of the rest by cumulative logprob go on; all are ranked at the end by
    ``cum / len(prompt + tokens without EOS) ** length_penalty``. ``early_stopping``: True stops
    once ``width`` finished, False once the best open beam scored now ranks below them (both then
    return the finished ones only); "never" runs all ``max_tokens`` steps.
    """
    def score(item):
        tokens, reason, cum = item
        length = len(prompt) + len(tokens) - (1 if reason == "stop" and include_stop else 0)
        return cum / length ** length_penalty

    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], str, float]] = []
    for _ in range(max_tokens):
        grown = []
        for tokens, cum in beams:
            lp = next_logprobs(prompt + tokens)
            values, ids = lp.topk(2 * width)
            for v, t in zip(values.tolist(), ids.tolist()):
                if t == eos:
                    finished.append((tokens + [t] if include_stop else tokens, "stop", cum + v))
                else:
                    grown.append((tokens + [t], cum + v))
        grown.sort(key=lambda b: b[1], reverse=True)
        beams = grown[:width]
        if len(finished) >= width and early_stopping != "never":
            worst = sorted(map(score, finished), reverse=True)[width - 1]
            now = beams[0][1] / (len(prompt) + len(beams[0][0])) ** length_penalty
            if early_stopping is True or worst >= now:
                return sorted(finished, key=score, reverse=True)[:width]
    pool = finished + [(tokens, "length", cum) for tokens, cum in beams]
    return sorted(pool, key=score, reverse=True)[:width]


def positions_of(lp: torch.Tensor, width: int) -> PositionLogprobs:
    """What the engine reports for one position asked for ``2 * width`` logprobs."""
    values, ids = lp.topk(2 * width)
    return {int(t): Logprob(float(v), rank) for rank, (v, t) in
            enumerate(zip(values.tolist(), ids.tolist()), start=1)}


def run_search(next_logprobs: NextLogprobs, prompt: list[int], params: BeamSearchParams,
               eos: int | None) -> BeamSearch:
    search = BeamSearch(prompt, params, [] if eos is None else [eos])
    while not search.done:
        search.advance([positions_of(next_logprobs(p), params.beam_width)
                        for p in search.step_prompts()])
    return search


def random_model(seed: int, vocab: int = 10, eos_boost: float = 1.0) -> NextLogprobs:
    """A deterministic random next-token distribution per sequence (EOS = token 0)."""
    def next_logprobs(seq: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((seed, *seq)) & 0xFFFFFFFF)
        logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5
        logits[0] += eos_boost
        return logits.log_softmax(-1)
    return next_logprobs


def summary(search: BeamSearch) -> list[tuple[list[int], str, float]]:
    return [(b.tokens, b.finish_reason, b.cum_logprob) for b in search.best()]


def assert_same(ours, ref) -> None:
    assert [(t, r) for t, r, _ in ours] == [(t, r) for t, r, _ in ref]
    for (_, _, a), (_, _, b) in zip(ours, ref):
        assert a == pytest.approx(b, abs=1e-9)


# --- the ranking ---------------------------------------------------------------------------------


def _scripted(script: list[PositionLogprobs]) -> Callable[[list[int]], PositionLogprobs]:
    return lambda seq: script[len(seq) - 2]


@pytest.mark.parametrize("include_stop", [False, True])
def test_length_penalty_ranks_finished_and_open_sequences(include_stop):
    """A short EOS-ended sequence against a longer open one: the length penalty (over prompt +
    generated tokens, EOS not counted) decides which wins, and "never" stops as soon as nothing
    can change the result."""
    script = [  # one beam (width 1: the top 2 tokens of each position); EOS is token 0
        {0: Logprob(-1.0, 1), 5: Logprob(-1.2, 2)},
        {6: Logprob(-0.1, 1), 0: Logprob(-3.0, 2)},
        {8: Logprob(-0.2, 1), 0: Logprob(-5.0, 2)},
    ]
    step = _scripted(script)
    prompt = [7, 7]
    for lp, winner, reason, steps in [(0.0, [], "stop", 1), (1.0, [5, 6, 8], "length", 3),
                                      (2.0, [5, 6, 8], "length", 3)]:
        params = BeamSearchParams(beam_width=1, max_tokens=3, length_penalty=lp,
                                  include_stop_str_in_output=include_stop)
        search = BeamSearch(prompt, params, [0])
        while not search.done:
            search.advance([step(p) for p in search.step_prompts()])
        (best,) = search.sequences(None)
        expected = winner + ([0] if include_stop and reason == "stop" else [])
        assert (best.output_token_ids, best.finish_reason) == (expected, reason), lp
        assert search.steps == steps
        seq_len = len(prompt) + len(winner)
        assert best.score == pytest.approx(best.cum_logprob / seq_len ** lp)
        assert best.tokens == prompt + expected


def test_search_matches_the_reference_loop():
    """Random models with frequent EOS: every width, length, penalty and EOS handling gives the
    reference loop's sequences, in order; "never" stops early in some cases and that never
    changes the result."""
    rng = random.Random(0)
    early = 0
    for trial in range(300):
        width = rng.randint(1, 4)
        params = BeamSearchParams(beam_width=width, max_tokens=rng.randint(1, 6),
                                  length_penalty=rng.choice([-0.5, 0.0, 0.7, 1.0, 2.5]),
                                  include_stop_str_in_output=rng.random() < 0.5)
        model = random_model(trial, eos_boost=rng.choice([0.0, 1.5, 3.0]))
        prompt = [rng.randrange(1, 10) for _ in range(rng.randint(1, 4))]
        search = run_search(model, prompt, params, eos=0)
        early += search.stopped_early
        ref = reference_beam_search(model, prompt, width, params.max_tokens, 0,
                                    params.length_penalty, params.include_stop_str_in_output)
        assert_same(summary(search), ref)
    assert early > 10


@pytest.mark.parametrize("mode", [True, False])
def test_early_stopping_modes_match_the_reference(mode):
    rng = random.Random(1)
    stopped = 0
    for trial in range(150):
        width = rng.randint(1, 3)
        params = BeamSearchParams(beam_width=width, max_tokens=6, early_stopping=mode,
                                  length_penalty=rng.choice([0.5, 1.0, 2.0]))
        model = random_model(1000 + trial, eos_boost=2.0)
        search = run_search(model, [3, 4], params, eos=0)
        stopped += search.stopped_early
        ref = reference_beam_search(model, [3, 4], width, 6, 0, params.length_penalty,
                                    early_stopping=mode)
        assert_same(summary(search), ref)
    assert stopped > 10


def test_ignore_eos_and_params_are_checked():
    model = random_model(5, eos_boost=4.0)
    search = run_search(model, [1], BeamSearchParams(beam_width=2, max_tokens=4,
                                                     ignore_eos=True), eos=0)
    assert all(len(b.tokens) == 4 and b.finish_reason == "length" for b in search.best())
    assert any(0 in b.tokens for b in search.best())  # EOS was just another token
    for bad, param in [(dict(beam_width=0), "beam_width"), (dict(beam_width=11), "beam_width"),
                       (dict(max_tokens=0), "max_tokens"), (dict(early_stopping="soon"),
                                                            "early_stopping"),
                       (dict(length_penalty=math.nan), "length_penalty"),
                       (dict(length_penalty=1e300), "length_penalty"),
                       (dict(temperature=-1.0), "temperature")]:
        with pytest.raises(ValueError) as info:
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
        assert info.value.param == param


# --- against Hugging Face transformers -----------------------------------------------------------

PROMPTS = [[5, 17, 42, 9], [100, 3, 250, 7, 7, 30, 1], list(range(40, 60))]


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    folder, hf = tiny_models["llama"]
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, max_model_len=256,
              dtype="float32")
    yield folder, hf, llm
    llm.shutdown()


@torch.no_grad()
def test_beams_match_hf_transformers(tiny_llama):
    """The returned beams (order, tokens and cumulative log-probabilities) equal HF's
    ``generate(num_beams=w, num_return_sequences=w, do_sample=False, length_penalty=lp)``.

    HF and vLLM differ in when a search may stop (``early_stopping``), in the length the penalty
    divides by (HF: generated tokens; vLLM: prompt + generated) and in which EOS candidates
    count as finished. The comparison runs where both definitions agree: no EOS (HF without an
    eos token, tidal with ``ignore_eos``) and a fixed ``max_tokens``, so every finished sequence
    is equally long and both rank by cumulative log-probability whatever the length penalty.
    (EOS handling and the penalty proper are checked against the reference loop above and
    below.)
    """
    from transformers import GenerationConfig

    _, hf, llm = tiny_llama
    max_tokens = 8
    differs_from_greedy = 0
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True), use_tqdm=False)
    for width, lp in [(2, 0.6), (3, 1.7), (4, 2.0)]:
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                         ignore_eos=True, length_penalty=lp))
        for prompt, out, g in zip(PROMPTS, outs, greedy):
            config = GenerationConfig(num_beams=width, num_return_sequences=width,
                                      max_new_tokens=max_tokens, do_sample=False,
                                      length_penalty=lp, early_stopping="never",
                                      eos_token_id=None, pad_token_id=0, bos_token_id=None,
                                      return_dict_in_generate=True, output_scores=True)
            ref = hf.generate(torch.tensor([prompt]), generation_config=config)
            hf_tokens = [s[len(prompt):].tolist() for s in ref.sequences]
            assert [s.output_token_ids for s in out.sequences] == hf_tokens
            # HF's sequence score is sum_logprobs / generated_len ** lp.
            hf_cum = (ref.sequences_scores * max_tokens ** lp).tolist()
            assert [s.cum_logprob for s in out.sequences] == pytest.approx(hf_cum, abs=2e-3)
            assert all(s.finish_reason == "length" and s.tokens[:len(prompt)] == prompt
                       for s in out.sequences)
            differs_from_greedy += out.sequences[0].output_token_ids != g.outputs[0].token_ids
    assert differs_from_greedy >= 3, "beam search should find better sequences than greedy"


@pytest.fixture(scope="module")
def eos_llama(tiny_llama, tmp_path_factory):
    """The same weights with a frequent token as EOS (so beams end at different lengths)."""
    folder, hf, llm = tiny_llama
    with torch.no_grad():
        lp = hf(torch.tensor([PROMPTS[0]])).logits[0, -1].log_softmax(-1)
    eos = int(lp.topk(2).indices[1])  # the runner-up of the first step
    copy = tmp_path_factory.mktemp("tiny-llama-eos")
    for f in folder.iterdir():
        if f.is_file():
            shutil.copy(f, copy / f.name)
    for name in ("config.json", "generation_config.json"):
        path = copy / name
        if path.is_file():
            cfg = json.loads(path.read_text())
            cfg["eos_token_id"] = eos
            path.write_text(json.dumps(cfg))
    llm2 = LLM(str(copy), skip_tokenizer_init=True, num_kv_blocks=256, max_model_len=256,
              dtype="float32")
    assert llm2.config.model.eos_token_ids == (eos,)
    yield hf, llm2, eos
    llm2.shutdown()


@torch.no_grad()
def test_eos_and_length_penalty_match_the_reference_on_hf_logits(eos_llama):
    """With EOS in play, tidal's beams equal the reference loop run on HF's own
    log-probabilities; the length penalty changes which sequence wins."""
    hf, llm, eos = eos_llama

    def next_logprobs(seq: list[int]) -> torch.Tensor:
        return hf(torch.tensor([seq])).logits[0, -1].double().log_softmax(-1)

    winners = {}
    for lp in (0.3, 3.0):
        for include_stop in (False, True):
            params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=lp,
                                      include_stop_str_in_output=include_stop)
            (out,) = llm.beam_search([PROMPTS[0]], params)
            ref = reference_beam_search(next_logprobs, PROMPTS[0], 3, 6, eos, lp, include_stop)
            assert [(s.output_token_ids, s.finish_reason) for s in out.sequences] == \
                [(t, r) for t, r, _ in ref]
            assert [s.cum_logprob for s in out.sequences] == \
                pytest.approx([c for _, _, c in ref], abs=2e-3)
            winners[lp] = out.sequences[0].finish_reason
    assert winners == {0.3: "stop", 3.0: "length"}


def test_prompt_forms_and_cache_salt(tiny_llama):
    _, _, llm = tiny_llama
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    (plain,) = llm.beam_search([PROMPTS[2]], params)
    runs = [llm.beam_search({"prompt_token_ids": PROMPTS[2], "cache_salt": salt}, params)[0]
            for salt in ("s1", "s1", "s2")]
    for out in runs:
        assert [s.tokens for s in out.sequences] == [s.tokens for s in plain.sequences]
    # A salt shares the prefix cache (one full 16-token block of the 20-token prompt) only with
    # requests of the same salt.
    assert [out.num_cached_tokens for out in runs] == [0, 16, 0]
    with pytest.raises(ValueError, match="multi_modal_data"):
        llm.beam_search([{"prompt_token_ids": [1, 2], "multi_modal_data": {}}], params)


# --- AsyncLLM ------------------------------------------------------------------------------------


def test_async_beam_search_and_abort(tiny_llama):
    folder, _, llm = tiny_llama
    engine = AsyncLLM.from_engine_args(
        EngineArgs(model=str(folder), num_kv_blocks=256, max_model_len=256, dtype="float32"),
        mode="thread", skip_tokenizer_init=True)
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True, length_penalty=0.7,
                              logprobs=2)
    expected = llm.beam_search(PROMPTS, params)

    async def main():
        outs = []
        for i, prompt in enumerate(PROMPTS):
            got = [o async for o in engine.beam_search({"prompt_token_ids": prompt}, params,
                                                       f"beam-{i}")]
            assert len(got) == 1 and got[0].finished
            outs.append(got[0])
        # A long search, aborted after a few steps: it ends by itself, its beams "abort".
        long = BeamSearchParams(beam_width=2, max_tokens=200, ignore_eos=True)

        async def consume():
            return [o async for o in engine.beam_search(PROMPTS[0], long, "doomed")]

        task = asyncio.create_task(consume())
        while "doomed" not in engine.beam_searches or engine.beam_searches["doomed"].num_steps < 3:
            await asyncio.sleep(0.005)
        await engine.abort("doomed")
        aborted = await task
        stats = await engine.get_kv_stats()
        return outs, aborted, stats

    try:
        outs, aborted, stats = asyncio.run(main())
    finally:
        engine.shutdown()
    for out, exp in zip(outs, expected):
        assert [c.token_ids for c in out.outputs] == [s.output_token_ids for s in exp.sequences]
        assert [c.cumulative_logprob for c in out.outputs] == \
            pytest.approx([s.cum_logprob for s in exp.sequences], abs=1e-4)
        for c in out.outputs:  # each position: the chosen token and the top 2
            assert len(c.logprobs) == len(c.token_ids)
            for tok, pos in zip(c.token_ids, c.logprobs):
                assert tok in pos and sum(lp.rank <= 2 for lp in pos.values()) == 2
    (final,) = aborted
    assert {c.finish_reason for c in final.outputs} == {"abort"}
    assert 2 <= len(final.outputs[0].token_ids) < 200
    assert stats.num_free_blocks == stats.num_blocks


# --- the OpenAI server ---------------------------------------------------------------------------

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    return generation_server()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                              timeout=120)


@pytest.mark.slow
def test_server_beam_search_matches_llm(server, smollm2_llm):
    """``use_beam_search`` through the official client returns the offline ``LLM``'s best beams
    (completions: width ``best_of``, ``n`` of them; chat: width ``n``)."""
    prompt = "The capital of France is"
    messages = [{"role": "user", "content": "Name a colour."}]

    async def go():
        async with _client(server) as c:
            cmpl = await c.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, n=2, best_of=3, temperature=0,
                logprobs=2, extra_body={"use_beam_search": True, "length_penalty": 0.8})
            chat = await c.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=5, n=2,
                extra_body={"use_beam_search": True, "early_stopping": True})
            return cmpl, chat

    cmpl, chat = asyncio.run(go())
    (ref,) = smollm2_llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=6,
                                                              length_penalty=0.8))
    assert [(ch.index, ch.text, ch.finish_reason) for ch in cmpl.choices] == \
        [(k, s.output_text, s.finish_reason) for k, s in enumerate(ref.sequences[:2])]
    assert cmpl.usage.completion_tokens == sum(len(s.output_token_ids) for s in ref.sequences[:2])
    for ch, s in zip(cmpl.choices, ref.sequences):
        lp = ch.logprobs
        assert len(lp.tokens) == len(s.output_token_ids) and "".join(lp.tokens) == ch.text
        if s.finish_reason == "length":
            assert sum(lp.token_logprobs) == pytest.approx(s.cum_logprob, abs=1e-2)
        else:  # the cumulative logprob counts the EOS token, which is not returned
            assert sum(lp.token_logprobs) > s.cum_logprob + 1e-3
        assert all(len(top) <= 3 for top in lp.top_logprobs)
    ids = apply_chat_template(smollm2_llm.get_tokenizer(), messages)
    (ref,) = smollm2_llm.beam_search({"prompt_token_ids": ids},
                                     BeamSearchParams(beam_width=2, max_tokens=5,
                                                      early_stopping=True))
    assert [(ch.message.content, ch.finish_reason) for ch in chat.choices] == \
        [(s.output_text, s.finish_reason) for s in ref.sequences]
    assert chat.usage.prompt_tokens == len(ids)


@pytest.mark.slow
def test_server_beam_search_truncates_the_prompt(server):
    """``truncate_prompt_tokens`` holds under beam search too: the searched prompt is the last
    k tokens (completions and chat)."""
    async def go():
        async with _client(server) as c:
            cmpl = await c.completions.create(
                model=MODEL, prompt="The capital of France is", max_tokens=2, best_of=2,
                temperature=0, extra_body={"use_beam_search": True,
                                           "truncate_prompt_tokens": 3})
            chat = await c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                max_tokens=2, n=2, extra_body={"use_beam_search": True,
                                               "truncate_prompt_tokens": 4})
            return cmpl, chat

    cmpl, chat = asyncio.run(go())
    assert cmpl.usage.prompt_tokens == 3 and chat.usage.prompt_tokens == 4


@pytest.mark.slow
@pytest.mark.parametrize("extra, param", [
    (dict(stream=True), "stream"),
    (dict(n=3, best_of=2), "n"),
    (dict(best_of=11), "best_of"),
    (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(length_penalty=1e300), "length_penalty"),
    (dict(top_p=0.5), "top_p"),
    (dict(stop=["\n"]), "stop"),
    (dict(echo=True, logprobs=1), "echo"),
    (dict(use_beam_search=False, best_of=3), "best_of"),
])
def test_server_beam_search_rejects_what_it_cannot_do(server, extra, param):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "use_beam_search": True, **extra}

    async def go():
        async with _client(server) as c:
            with pytest.raises(openai.BadRequestError) as info:
                await c.completions.create(**{k: body.pop(k) for k in ("model", "prompt")},
                                           extra_body=body)
            return info.value

    err = asyncio.run(go())
    assert err.body["param"] == param
