"""The output processor on scripted engine steps (no engine): a consumer that falls behind gets
the text of several steps in one output, in order and complete; ``stream_interval`` spaces the
outputs of a stream; FINAL_ONLY waits for the end; ``abort`` ends a stream; an engine death
reaches every waiting consumer."""

from __future__ import annotations

import asyncio

import pytest

from tidal.engine_core.protocol import EngineCoreOutput, FinishReason, OutputBatch
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.async_llm import EngineDeadError
from tidal.frontend.detokenizer import create_detokenizer
from tidal.frontend.output_processor import OutputCollector, OutputProcessor

PROMPT = [1, 2, 3]


def _params(kind: OutputKind = OutputKind.DELTA, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=64, output_kind=kind, **kw)


def _step(*rows: tuple[str, list[int]], finished: dict[str, FinishReason] | None = None
          ) -> OutputBatch:
    outs = []
    for rid, ids in rows:
        reason = (finished or {}).get(rid)
        outs.append(EngineCoreOutput(rid, ids, finish_reason=reason))
    return OutputBatch.pack(outs)


def _texts(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_a_consumer_behind_gets_several_steps_in_one_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    proc = OutputProcessor(tok)
    collector = OutputCollector()
    proc.add_request("r", None, PROMPT, _params(), collector=collector)

    async def main():
        got = []
        # Three steps arrive before the consumer runs: one output with all three.
        for t in ids[:3]:
            proc.process_outputs(_step(("r", [t])))
        got.append(collector.take())
        # Then one step per read: one token each.
        for t in ids[3:-1]:
            proc.process_outputs(_step(("r", [t])))
            got.append(await collector.get())
        proc.process_outputs(_step(("r", ids[-1:]), finished={"r": FinishReason.LENGTH}))
        got.append(await collector.get())
        assert collector.take() == []
        return got

    got = asyncio.run(main())
    assert [len(g) for g in got] == [1] * len(got)
    outs = [g[0] for g in got]
    assert outs[0].outputs[0].token_ids == ids[:3]
    assert all(len(o.outputs[0].token_ids) == 1 for o in outs[1:])
    assert "".join(o.outputs[0].text for o in outs) == _texts(tok, ids)
    assert outs[0].outputs[0].text == _texts(tok, ids[:3])
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].outputs[0].finish_reason == "length"
    assert len(proc) == 0


def test_several_requests_share_one_collector_in_order():
    proc = OutputProcessor(None)
    collector = OutputCollector()
    for rid in ("a", "b"):
        proc.add_request(rid, None, PROMPT, _params(), collector=collector)
    proc.process_outputs(_step(("b", [7]), ("a", [5])))
    proc.process_outputs(_step(("a", [6]), ("b", [8])))
    outs = collector.take()
    # Ready order is first-news order; each request's tokens complete and in order.
    assert [(o.request_id, o.outputs[0].token_ids) for o in outs] == [("b", [7, 8]),
                                                                      ("a", [5, 6])]


@pytest.mark.parametrize("interval", [1, 3, 4])
def test_stream_interval_spaces_the_outputs(interval):
    proc = OutputProcessor(None, stream_interval=interval)
    collector = OutputCollector()
    proc.add_request("r", None, PROMPT, _params(), collector=collector)
    sizes = []
    for i in range(10):
        last = i == 9
        proc.process_outputs(_step(("r", [100 + i]),
                                   finished={"r": FinishReason.LENGTH} if last else None))
        for out in collector.take():  # a consumer that keeps up: reads after every step
            sizes.append(len(out.outputs[0].token_ids))
    # The first token at once, then every ``interval`` tokens, and the rest at the end.
    expected = [1] + [interval] * (9 // interval) + ([9 % interval] if 9 % interval else [])
    if interval == 1:
        expected = [1] * 10
    assert sizes == expected and sum(sizes) == 10


def test_final_only_waits_for_every_sample():
    proc = OutputProcessor(None)
    collector = OutputCollector()
    proc.add_request("r", None, PROMPT, _params(OutputKind.FINAL_ONLY, n=2), collector=collector)
    proc.process_outputs(_step(("r#0", [1]), ("r#1", [2])))
    proc.process_outputs(_step(("r#0", [3]), finished={"r#0": FinishReason.STOP}))
    assert collector.take() == []
    proc.process_outputs(_step(("r#1", [4]), finished={"r#1": FinishReason.LENGTH}))
    (out,) = collector.take()
    assert out.finished and [c.token_ids for c in out.outputs] == [[1, 3], [2, 4]]
    assert [c.finish_reason for c in out.outputs] == ["stop", "length"]


def test_final_only_text_is_decoded_once_at_the_end_and_equals_the_stream(
        smollm2_tokenizer, monkeypatch):
    tok = smollm2_tokenizer
    ids = tok.encode(" Streams 👍🏽 and 你好, decoded once.", add_special_tokens=False)
    other = tok.encode(" plain words" * len(ids), add_special_tokens=False)[:len(ids)]
    steps = [(ids[i:i + 2], other[i:i + 2]) for i in range(0, len(ids), 2)]

    def run(kind: OutputKind, **kw) -> list:
        proc = OutputProcessor(tok)
        proc.add_request("a", None, PROMPT, _params(kind, n=2, **kw))
        proc.add_request("b", None, PROMPT, _params(kind, **kw))
        outs = []
        for k, (chunk, chunk2) in enumerate(steps):
            end = FinishReason.LENGTH if k == len(steps) - 1 else None
            rows = [("a#0", chunk), ("a#1", chunk2), ("b", chunk)]
            outs += proc.process_outputs(_step(*rows, finished={r: end for r, _ in rows}
                                               if end else None)).request_outputs
        assert len(proc) == 0
        return outs

    streamed: dict[tuple[str, int], str] = {}
    for out in run(OutputKind.DELTA):
        for c in out.outputs:
            key = (out.request_id, c.index)
            streamed[key] = streamed.get(key, "") + c.text
    stepped = []
    real_update = type(create_detokenizer(tok)).update
    monkeypatch.setattr(type(create_detokenizer(tok)), "update",
                        lambda self, new: stepped.append(1) or real_update(self, new))
    finals = run(OutputKind.FINAL_ONLY)
    assert stepped == []  # not once per token: one decode as each sequence ends
    assert {(o.request_id, c.index): c.text for o in finals for c in o.outputs} == streamed
    assert streamed[("b", 0)] == tok.decode(ids)
    # With a stop string the text is needed as it comes: stepped, and cut at the stop.
    (stopped, _) = run(OutputKind.FINAL_ONLY, stop=["你好"])
    assert stepped and stopped.outputs[0].text == " Streams 👍🏽 and "
    assert stopped.outputs[0].finish_reason == "stop"


def test_final_only_text_at_abort_and_engine_death(smollm2_tokenizer):
    # Cut short inside a character: its held bytes are dropped, as the stream of a DELTA
    # request drops them (not decoded to U+FFFD as at a normal end).
    tok = smollm2_tokenizer
    ids = tok.encode(" Cut short 👍🏽", add_special_tokens=False)
    cut = next(k for k in range(len(ids), 0, -1) if tok.decode(ids[:k]).endswith("\ufffd"))
    ids = ids[:cut]

    def aborted(kind: OutputKind) -> str:
        proc = OutputProcessor(tok)
        collector = OutputCollector()
        proc.add_request("r", None, PROMPT, _params(kind), collector=collector)
        for t in ids:
            proc.process_outputs(_step(("r", [t])))
        proc.finish_aborted("r")
        outs = collector.take()
        assert outs[-1].outputs[0].finish_reason == "abort"
        return "".join(o.outputs[0].text for o in outs)

    streamed = aborted(OutputKind.DELTA)
    assert aborted(OutputKind.FINAL_ONLY) == streamed and "\ufffd" not in streamed
    assert streamed == tok.decode(ids).rstrip("\ufffd")
    proc = OutputProcessor(tok)
    proc.add_request("s", None, PROMPT, _params(OutputKind.FINAL_ONLY))
    proc.process_outputs(_step(("s", ids)))
    (dead,) = proc.fail_all(EngineDeadError("engine dead: test"))
    assert dead.outputs[0].text == streamed and dead.outputs[0].error


def test_abort_ends_the_stream_with_a_last_output():
    proc = OutputProcessor(None)
    collector = OutputCollector()
    proc.add_request("r", None, PROMPT, _params(), collector=collector)
    proc.process_outputs(_step(("r", [9])))
    assert proc.finish_aborted("r") == ["r"]
    (out,) = collector.take()
    assert out.finished and out.outputs[0].token_ids == [9]
    assert out.outputs[0].finish_reason == "abort"
    # Whatever the engine still sends for it is dropped.
    proc.process_outputs(_step(("r", [10])))
    assert collector.take() == [] and len(proc) == 0


def test_engine_death_reaches_a_waiting_consumer():
    proc = OutputProcessor(None)
    collector = OutputCollector()
    proc.add_request("r", None, PROMPT, _params(), collector=collector)

    async def main():
        waiter = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        proc.fail_all(EngineDeadError("engine dead: test"))
        with pytest.raises(EngineDeadError, match="test"):
            await waiter

    asyncio.run(main())


def test_step_record_times_first_tokens_and_gaps():
    proc = OutputProcessor(None)
    proc.add_request("r", None, PROMPT, _params(n=1), arrival_time=0.0)
    first = proc.process_outputs(_step(("r", [1]))).record
    second = proc.process_outputs(_step(("r", [2]), finished={"r": FinishReason.LENGTH})).record
    assert len(first.time_to_first_tokens) == 1 and not first.inter_token_latencies
    assert len(second.inter_token_latencies) == 1 and not second.time_to_first_tokens
    (done,) = second.finished
    assert done.finish_reasons == ["length"] and done.num_generation_tokens == 2


def test_the_samples_of_one_request_give_one_gap_per_step():
    proc = OutputProcessor(None)
    proc.add_request("r", None, PROMPT, _params(n=3), arrival_time=0.0)
    samples = [f"r#{i}" for i in range(3)]
    first = proc.process_outputs(_step(*[(s, [1]) for s in samples])).record
    second = proc.process_outputs(_step(*[(s, [2]) for s in samples])).record
    assert len(first.time_to_first_tokens) == 1 and first.inter_token_latencies == []
    assert len(second.inter_token_latencies) == 1 and second.inter_token_latencies[0] > 0
