"""``AsyncLLM`` over an EngineCore process: concurrency with cancellation, output kinds, n > 1,
and (with the real SmolLM2) UTF-8-safe streaming and stop strings across token boundaries."""

from __future__ import annotations

import asyncio
import random
import threading

import psutil
import pytest

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.control import GetKVStats, KVStats, Ping, Pong
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend import async_llm as async_llm_module
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.mp_client import MPAsyncClient


@pytest.fixture(scope="module")
def tiny_llm(tiny_models):
    folder, _ = tiny_models["qwen3"]
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(folder), num_kv_blocks=1024, max_num_seqs=128, cpu_threads=1),
        skip_tokenizer_init=True)
    assert isinstance(llm.client, MPAsyncClient)
    engine = psutil.Process(llm.client.conn.engine_pid)
    tree = [engine, *engine.children(recursive=True)]
    yield llm
    llm.shutdown()
    _, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left behind after shutdown(): {alive}"
    assert llm.client.conn.proc.exitcode == 0


@pytest.fixture(scope="module")
def smol(smollm2_path):
    # 512 MiB of KV (11k tokens: the 8k context) for short prompts: the 2 GiB CPU default
    # costs start-up time.
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(smollm2_path), max_num_seqs=8,
                                               cpu_threads=1, kv_cache_memory_bytes=512 << 20))
    yield llm
    llm.shutdown()


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams, rid: str):
    """All outputs of one request."""
    return [out async for out in llm.generate(prompt, params, rid)]


def test_100_concurrent_requests_with_10_cancelled(tiny_llm):
    """90 requests produce exactly what they produce alone while 10 others are cancelled
    mid-stream (5 by cancelling the consuming task, 5 with ``abort``, whose streams end with a
    last output of finish reason ``abort``); afterwards every KV block is free."""
    llm = tiny_llm
    rng = random.Random(0)
    vocab = llm.config.model.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(2, 24))] for _ in range(100)]
    doomed = set(range(5, 100, 10))

    def params(i: int) -> SamplingParams:
        if i in doomed:  # far too long to finish before it is cancelled
            return SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True,
                                  output_kind=OutputKind.DELTA)
        if i % 2:
            return SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=8,
                                  ignore_eos=True, output_kind=OutputKind.DELTA)
        return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                              output_kind=OutputKind.DELTA)

    async def main():
        started = {i: asyncio.Event() for i in doomed}

        finish: dict[int, str | None] = {}

        async def consume(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in llm.generate(prompts[i], params(i), f"req-{i}"):
                tokens.extend(out.outputs[0].token_ids)
                finish[i] = out.outputs[0].finish_reason
                if i in started and len(tokens) >= 2:
                    started[i].set()
            return tokens

        tasks = {i: asyncio.create_task(consume(i)) for i in range(100)}
        for n, i in enumerate(sorted(doomed)):
            await started[i].wait()
            if n % 2:
                tasks[i].cancel()
            else:
                await llm.abort(f"req-{i}")
        results = await asyncio.gather(*tasks.values(), return_exceptions=True)
        together = dict(zip(tasks, results))
        for n, i in enumerate(sorted(doomed)):
            if n % 2:
                assert isinstance(together[i], asyncio.CancelledError), together[i]
            else:  # aborted: the stream ended by itself, on an abort
                assert isinstance(together[i], list) and 2 <= len(together[i]) < 400
                assert finish[i] == "abort"
        alone = {}
        for i in range(100):
            if i not in doomed:
                outs = await _collect(llm, prompts[i], params(i), f"alone-{i}")
                alone[i] = [t for o in outs for t in o.outputs[0].token_ids]
        stats = await llm.get_kv_stats()
        return together, alone, stats

    together, alone, stats = asyncio.run(main())
    for i, tokens in alone.items():
        assert len(tokens) == 8
        assert together[i] == tokens, f"request {i} differs when run alone"
    assert stats == KVStats(llm.config.cache.num_blocks, llm.config.cache.num_blocks, 0, 0)


def test_output_kinds_agree_and_n_fans_in(tiny_llm):
    llm = tiny_llm
    prompt = [7, 8, 9, 10]

    def params(kind: OutputKind, n: int = 1) -> SamplingParams:
        return SamplingParams(n=n, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True,
                              output_kind=kind)

    async def main():
        delta = await _collect(llm, prompt, params(OutputKind.DELTA), "d")
        cumulative = await _collect(llm, prompt, params(OutputKind.CUMULATIVE), "c")
        final = await _collect(llm, prompt, params(OutputKind.FINAL_ONLY), "f")
        fan = await _collect(llm, prompt, params(OutputKind.FINAL_ONLY, n=3), "n3")
        fan_delta = await _collect(llm, prompt, params(OutputKind.DELTA, n=3), "n3d")
        pong = await llm.control(Ping())
        return delta, cumulative, final, fan, fan_delta, pong

    delta, cumulative, final, fan, fan_delta, pong = asyncio.run(main())
    streamed = [t for o in delta for t in o.outputs[0].token_ids]
    # One output per step, or several steps' tokens in one when the consumer fell behind.
    assert 1 <= len(delta) <= 10 and all(o.outputs[0].token_ids for o in delta)
    assert len(final) == 1 and final[0].finished
    assert streamed == cumulative[-1].outputs[0].token_ids == final[0].outputs[0].token_ids
    lengths = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lengths == sorted(set(lengths)) and lengths[-1] == 10
    assert all(later.outputs[0].token_ids[:len(o.outputs[0].token_ids)] == o.outputs[0].token_ids
               for o, later in zip(cumulative, cumulative[1:]))
    # n=3: one result holding three samples; sample 0 is the n=1 request's (same seed).
    (result,) = fan
    assert result.request_id == "n3" and [c.index for c in result.outputs] == [0, 1, 2]
    assert result.outputs[0].token_ids == streamed
    assert len({tuple(c.token_ids) for c in result.outputs}) == 3
    by_index: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for out in fan_delta:
        assert out.request_id == "n3d"
        for c in out.outputs:
            by_index[c.index].extend(c.token_ids)
    assert [by_index[i] for i in range(3)] == [c.token_ids for c in result.outputs]
    assert isinstance(pong, Pong) and pong.num_unfinished == 0


def test_stream_interval_gathers_tokens(tiny_models):
    """``stream_interval=3``: the first token at once, then outputs of at least three tokens
    (more if the consumer fell behind), the rest with the finish; nothing lost."""
    folder, _ = tiny_models["qwen3"]
    llm = AsyncLLM.from_engine_args(
        EngineArgs(model=str(folder), num_kv_blocks=256, max_num_seqs=8, cpu_threads=1),
        mode="thread", skip_tokenizer_init=True, stream_interval=3)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                output_kind=OutputKind.DELTA)
        outs = asyncio.run(_collect(llm, [5, 6, 7], params, "r"))
    finally:
        llm.shutdown()
    sizes = [len(o.outputs[0].token_ids) for o in outs]
    assert sum(sizes) == 10 and len(sizes) <= 4, sizes
    assert all(n >= 3 for n in sizes[1:-1]), sizes
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_async_llm_survives_successive_event_loops(tiny_llm):
    """Each ``asyncio.run`` is a new loop; the client rebinds its socket readers to it."""
    for _ in range(2):
        outs = asyncio.run(_collect(tiny_llm, [1, 2, 3], SamplingParams(
            temperature=0.0, max_tokens=3, ignore_eos=True), "again"))
        assert len(outs[-1].outputs[0].token_ids) == 3
        assert asyncio.run(tiny_llm.control(GetKVStats())).num_running == 0


# --- real text: SmolLM2 ----------------------------------------------------------------------------


def _utf8_cut(tokenizer, ids: list[int]) -> int:
    """The largest prefix length whose text ends on a whole character."""
    for n in range(len(ids), 0, -1):
        if "\ufffd" not in tokenizer.decode(ids[:n]):
            return n
    raise AssertionError("no prefix decodes cleanly")


@pytest.mark.parametrize("prompt", ["Here are some emojis: 😀😃😄😁",
                                    "日本の首都は東京です。中国の首都は"],
                         ids=["emoji", "cjk"])
def test_streaming_multibyte_text_never_splits_a_character(smol, prompt):
    tok = smol.get_tokenizer()

    async def main():
        probe = await _collect(smol, prompt, SamplingParams(
            temperature=0, max_tokens=24, output_kind=OutputKind.FINAL_ONLY), "probe")
        ids = probe[0].outputs[0].token_ids
        n = _utf8_cut(tok, ids)
        params = SamplingParams(temperature=0, max_tokens=n, output_kind=OutputKind.DELTA)
        deltas = await _collect(smol, prompt, params, "stream")
        final = await _collect(smol, prompt, SamplingParams(
            temperature=0, max_tokens=n, output_kind=OutputKind.FINAL_ONLY), "final")
        return ids[:n], deltas, final[0].outputs[0]

    ids, deltas, final = asyncio.run(main())
    # The test means something only if characters really span tokens here.
    assert any(tok.decode([t]) == "\ufffd" for t in ids), "no multi-byte character split"
    assert any(ord(ch) > 0x2E80 for ch in final.text), final.text
    texts = [d.outputs[0].text for d in deltas]
    assert all("\ufffd" not in t for t in texts), texts
    assert "".join(texts) == final.text == tok.decode(ids)
    assert any(t == "" for t in texts), "some deltas had to hold back partial characters"


_FULL_TEXT: dict[str, list] = {}


@pytest.mark.parametrize("stop", ["🍫", "**\n-"], ids=["emoji", "markup"])
@pytest.mark.parametrize("kind", [OutputKind.DELTA, OutputKind.FINAL_ONLY],
                         ids=["delta", "final"])
def test_stop_strings_spanning_tokens(smol, stop, kind):
    tok = smol.get_tokenizer()
    prompt = "List three fruit emojis:"

    async def main():
        if prompt not in _FULL_TEXT:  # greedy: the same for every parametrisation
            full = await _collect(smol, prompt, SamplingParams(
                temperature=0, max_tokens=24, output_kind=OutputKind.FINAL_ONLY), "full")
            _FULL_TEXT[prompt] = full
        full = _FULL_TEXT[prompt]
        outs = await _collect(smol, prompt, SamplingParams(
            temperature=0, max_tokens=200, stop=[stop], output_kind=kind), f"stop-{kind}")
        # Sent after the stop-string abort on the same socket, so the engine has already
        # dropped the request when it answers.
        stats = await smol.get_kv_stats()
        return full[0].outputs[0], outs, stats

    full, outs, stats = asyncio.run(main())
    # The stop string really spans several tokens of this output.
    pieces = [tok.decode([t]) for t in full.token_ids]
    assert stop in full.text and not any(stop in p for p in pieces)
    text = "".join(o.outputs[0].text for o in outs) if kind == OutputKind.DELTA \
        else outs[-1].outputs[0].text
    assert text == full.text[:full.text.index(stop)]
    assert all(stop not in o.outputs[0].text for o in outs)
    last = outs[-1].outputs[0]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks


def test_long_prompts_are_tokenized_off_the_event_loop(smol, monkeypatch):
    threads: list[str] = []
    original = async_llm_module.encode_prompt

    def recording(tokenizer, prompt):
        threads.append(threading.current_thread().name)
        return original(tokenizer, prompt)

    monkeypatch.setattr(async_llm_module, "encode_prompt", recording)

    async def main():
        short = await smol.tokenize("Hello there")
        long = await smol.tokenize("word " * 1000)
        return short, long

    short, long = asyncio.run(main())
    assert len(long) > 900 and len(short) < 10
    assert threads[0] == threading.main_thread().name
    assert threads[1].startswith("tidal-tokenize")


def test_offline_llm_runs_on_the_engine_process_client(tiny_models):
    """``LLM(multiprocess=True)`` drives the same engine process client; it gives what the
    in-process engine gives."""
    from tidal.frontend import LLM

    folder, _ = tiny_models["qwen3"]
    prompts = [[3, 4, 5], [9, 8, 7, 6, 5], [100]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, seed=3, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)]
    inproc = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, cpu_threads=1)
    expected = inproc.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), skip_tokenizer_init=True, multiprocess=True, num_kv_blocks=64,
              cpu_threads=1)
    try:
        got = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.call(GetKVStats())
    finally:
        llm.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in got] == \
        [[c.token_ids for c in o.outputs] for o in expected]
    lp_got, lp_exp = got[2].outputs[0].logprobs, expected[2].outputs[0].logprobs
    assert [sorted(p) for p in lp_got] == [sorted(p) for p in lp_exp]
    assert stats.num_free_blocks == stats.num_blocks == 64
