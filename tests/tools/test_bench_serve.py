"""bench_serve's split of ITL gaps into those spanning a mixed prefill + decode step (another
request's first text arrived as the gap ended) and the rest, on hand-made timelines, and the
SSE reader recording when each text chunk arrived. No server is started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

from bench_serve import Result, _Stream, split_itl  # noqa: E402

MS = 1e-3


def _request(first: float, ends: list[float]) -> Result:
    """A request whose first text came at ``first`` s and later texts at ``ends``."""
    times = [first, *ends]
    return Result(ok=True, first_at=first, itl=[b - a for a, b in zip(times, times[1:])],
                  itl_at=list(ends))


def test_each_step_finishing_a_prompt_gives_one_value_per_decoding_request():
    # A decodes every 2 ms; B's prompt finishes in the step ending at 6 ms (its first text read
    # 0.2 ms after A's chunk, by another client process), C's in the step ending at 10 ms.
    a = _request(0.0, [2 * MS, 4 * MS, 6 * MS, 8 * MS, 10 * MS, 12 * MS])
    b = _request(6.2 * MS, [8.1 * MS, 10.1 * MS])
    c = _request(9.9 * MS, [12.0 * MS])
    arrival, rest = split_itl([a, b, c], window=0.5 * MS)
    # A: at B's and C's arrivals; B: at C's (its gap (8.1, 10.1], or the 1.9 ms one before).
    # A request's own first text marks none of its gaps.
    assert sorted(round(g / MS, 3) for g in arrival) == [2.0, 2.0, 2.0]
    # The rest: A's first and last gaps, C's only gap (each arrival takes two gaps).
    assert sorted(round(g / MS, 3) for g in rest) == [2.0, 2.0, 2.1]


def test_a_slow_launch_before_the_arrival_is_charged_to_it():
    # Async scheduling: the host launching a slow mixed step holds back the previous step's
    # output (A's gap ending at 9 ms), and the mixed step's own output follows 0.5 ms later.
    a = _request(0.0, [2 * MS, 4 * MS, 9 * MS, 9.5 * MS, 11.5 * MS])
    b = _request(9.6 * MS, [11.5 * MS])
    arrival, rest = split_itl([a, b], window=0.5 * MS)
    assert [round(g / MS, 3) for g in arrival] == [5.0]
    assert sorted(round(g / MS, 3) for g in rest) == [1.9, 2.0, 2.0, 2.0]


def test_the_window_bounds_the_skew():
    a = _request(0.0, [2 * MS, 4 * MS])
    late = _request(4.8 * MS, [6 * MS])  # read 0.8 ms after A's chunk
    arrival, _ = split_itl([a, late], window=0.5 * MS)
    assert arrival == []
    arrival, _ = split_itl([a, late], window=1.0 * MS)
    assert [round(g / MS, 3) for g in arrival] == [2.0]
    # Read 0.4 ms after A's chunk at 2 ms: the step that ended A's gap (0, 2], not (2, 5].
    early = _request(2.4 * MS, [6 * MS])
    arrival, rest = split_itl([_request(0.0, [2 * MS, 5 * MS]), early], window=0.5 * MS)
    assert [round(g / MS, 3) for g in arrival] == [2.0]
    assert 3.0 in [round(g / MS, 3) for g in rest]


def test_chunks_of_one_read_share_the_arrival():
    # Two steps' chunks in one read (a 0 gap): the arrival takes the long gap before them.
    a = _request(0.0, [2 * MS, 6 * MS, 6 * MS])
    b = _request(6.1 * MS, [8 * MS])
    arrival, rest = split_itl([a, b], window=0.5 * MS)
    assert [round(g / MS, 3) for g in arrival] == [4.0]
    assert sorted(round(g / MS, 3) for g in rest) == [0.0, 1.9]


def test_the_stream_records_when_each_text_chunk_arrived():
    result = Result(ok=False, send=1.0)
    stream = _Stream(result)
    chunk = b'data: {"choices": [{"index": 0, "text": "%s"}]}'
    stream.feed([chunk % b"a"], 1.5)
    stream.feed([chunk % b"", chunk % b"b"], 1.75)
    stream.feed([chunk % b"c", b"data: [DONE]"], 2.0)
    assert result.ttft == pytest.approx(0.5) and result.first_at == 1.5
    assert result.itl == pytest.approx([0.25, 0.25])
    assert result.itl_at == [1.75, 2.0]
    assert stream.done
