"""Mask fills on the fill thread (``fill_thread.FillThread``, ``StructuredOutputManager.
begin_fill``): the masks equal the engine thread's own fill for every kind of row (under a
grammar, thinking freely, one matcher alone), the engine thread runs Python while a fill is
under way, and a fill's error reaches the engine thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tidal.engine_core.sampling_params import StructuredOutputsParams
from tidal.engine_core.structured_output.fill_thread import FillThread

RX = r"[a-z]{2,5}-[0-9]{1,3}"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_job_runs_on_the_thread_and_its_error_comes_back():
    pool = FillThread()
    try:
        seen = []
        job = pool.submit(lambda x: seen.append((x, threading.current_thread().name)), 7)
        assert job.wait() >= 0.0
        assert seen == [(7, "tidal-mask-fill")]

        def broken() -> None:
            raise ValueError("no mask")

        with pytest.raises(ValueError, match="no mask"):
            pool.submit(broken).wait()
        assert pool.submit(seen.clear).wait() >= 0.0 and not seen  # still serving
        thread = pool._thread
    finally:
        pool.shutdown()
    assert thread is not None and not thread.is_alive()


def test_submit_returns_while_the_job_still_runs():
    """The engine thread goes on at once: a job that holds no GIL (here: waiting on an event,
    as a native fill does) has started, not finished, when ``submit`` returns."""
    pool = FillThread()
    release = threading.Event()
    try:
        start = time.perf_counter()
        job = pool.submit(release.wait, 10)
        assert time.perf_counter() - start < 5 and not job.done
        release.set()
        job.wait()
    finally:
        release.set()
        pool.shutdown()


def test_background_fill_equals_the_engine_threads(manager, qwen3_tokenizer, admit):
    tok = qwen3_tokenizer
    think = tok.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    admit(manager, "rx", [1, 2, 3], structured_outputs=StructuredOutputsParams(regex=RX))
    admit(manager, "js", [1, 2, 3], structured_outputs=StructuredOutputsParams(json=SCHEMA))
    # Thinking: its row is all ones, the grammar's rows filled apart (the partial path).
    admit(manager, "th", think, structured_outputs=StructuredOutputsParams(json=SCHEMA),
          reasoning_first=True)
    try:
        assert manager.states["rx"].matcher.consume_tokens(
            tok.encode("ab", add_special_tokens=False))
        for ids in (["rx", "js"], ["rx", "th", "js"], ["th"], ["js"]):
            fills = len(manager.stats.fills)
            want = manager.fill_bitmask(ids)
            out = np.zeros_like(want)
            got = manager.begin_fill(ids, out).wait()
            assert got is out
            np.testing.assert_array_equal(got, want)
            assert len(manager.stats.fills) == fills + 2 * (ids != ["th"])
        assert (manager.fill_bitmask(["th"]) == -1).all()
    finally:
        manager.drop(["rx", "js", "th"])


@pytest.mark.parametrize("setting,expect", [("100", 100e-6), ("0", None), ("1e9", None)])
def test_fill_thread_lowers_the_switch_interval(monkeypatch, setting, expect):
    """The first fill thread lowers the process's GIL switch interval to
    $TIDAL_GRAMMAR_SWITCH_INTERVAL_US (never raises it; 0 leaves it), so a job gets the GIL
    back soon after each native call while the engine thread runs Python."""
    import sys

    before = sys.getswitchinterval()
    monkeypatch.setenv("TIDAL_GRAMMAR_SWITCH_INTERVAL_US", setting)
    pool = FillThread()
    try:
        sys.setswitchinterval(0.005)
        pool.submit(lambda: None).wait()
        now = sys.getswitchinterval()
        assert now == pytest.approx(0.005 if expect is None else expect, rel=0.01)
    finally:
        pool.shutdown()
        sys.setswitchinterval(before)


def test_time_to_first_mask_and_its_parts(manager, admit):
    """A request's first fill records its time to first mask once, with its parts in order:
    arrival <= admission (compiled, handed to the scheduler) <= mask filled <= mask read."""
    stats = manager.stats
    for q in (stats.first_mask_s, stats.admit_s, stats.first_filled_s):
        q.clear()
    admit(manager, "t1", [1, 2, 3], structured_outputs=StructuredOutputsParams(regex=RX))
    try:
        time.sleep(0.02)  # (admitted well before its first fill)
        manager.begin_fill(["t1"]).wait()
        manager.begin_fill(["t1"]).wait()  # not its first: nothing more recorded
        assert len(stats.first_mask_s) == len(stats.admit_s) == len(stats.first_filled_s) == 1
        admitted, filled, read = stats.admit_s[0], stats.first_filled_s[0], stats.first_mask_s[0]
        assert 0.0 <= admitted <= filled <= read
        assert filled - admitted >= 0.02
    finally:
        manager.drop(["t1"])
