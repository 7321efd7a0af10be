"""``OutputBatch``: one step's outputs packed into columns for the frontend, and back."""

from __future__ import annotations

import numpy as np

from tidal.engine_core.protocol import (
    EngineCoreOutput,
    FinishReason,
    LogprobsArrays,
    OutputBatch,
    SchedulerStats,
)
from tidal.engine_core.serial import Decoder, Encoder


def _lp(rows: int) -> LogprobsArrays:
    return LogprobsArrays(np.arange(rows * 2, dtype=np.int32).reshape(rows, 2),
                          np.zeros((rows, 2), np.float32), np.ones(rows, np.int32))


def test_a_plain_decode_step_is_one_token_column():
    outs = [EngineCoreOutput(f"r{i}", [10 + i]) for i in range(300)]
    batch = OutputBatch.pack(outs, 1.5, SchedulerStats(3, 1, 0.25))
    assert batch.token_counts is None and batch.details == []
    assert batch.token_ids.dtype == np.int32 and batch.token_ids.tolist() == list(range(10, 310))
    frames = Encoder().encode(batch)
    assert len(frames) == 2  # the message, and the token column as its own frame
    back = Decoder(OutputBatch).decode(frames)
    assert back.req_ids == batch.req_ids and back.unpack() == outs
    assert back.scheduler_stats == SchedulerStats(3, 1, 0.25) and back.timestamp == 1.5


def test_details_travel_apart_and_merge_back():
    outs = [
        EngineCoreOutput("a", [1, 2, 3]),  # several tokens (speculative decoding, a resumed step)
        EngineCoreOutput("b", [4], new_logprobs=_lp(1), finish_reason=FinishReason.STOP,
                         stop_reason=4, num_cached_tokens=16),
        EngineCoreOutput("c", [], error="worker failed", finish_reason=FinishReason.ERROR),
        EngineCoreOutput("d", [5, 6]),
        EngineCoreOutput("e", [], new_prompt_logprobs=_lp(3), prompt_logprobs_start=1),
    ]
    batch = OutputBatch.pack(outs)
    assert batch.req_ids == ["a", "b", "d"]
    assert batch.token_counts.tolist() == [3, 1, 2] and batch.num_tokens == 6
    assert [d.request_id for d in batch.details] == ["b", "c", "e"]
    assert all(d.new_token_ids == [] for d in batch.details)
    assert outs[1].new_token_ids == [4]  # packing copies, the engine's outputs stay as they were
    back = Decoder(OutputBatch).decode(Encoder().encode(batch)).unpack()
    order = {o.request_id: o for o in back}
    assert [o.request_id for o in back] == ["a", "b", "d", "c", "e"]
    for out in outs:
        got = order[out.request_id]
        assert got.new_token_ids == out.new_token_ids
        assert (got.finish_reason, got.stop_reason, got.error, got.num_cached_tokens) == \
            (out.finish_reason, out.stop_reason, out.error, out.num_cached_tokens)
    np.testing.assert_array_equal(order["b"].new_logprobs.token_ids, outs[1].new_logprobs.token_ids)
    assert order["e"].prompt_logprobs_start == 1


def test_an_empty_step_packs_to_nothing():
    batch = OutputBatch.pack([])
    assert batch.req_ids == [] and batch.token_ids is None and batch.unpack() == []
