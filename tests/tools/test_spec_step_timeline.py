"""tools/spec_step_timeline.py: the recorder's wrapped calls (host times; on a machine without a
GPU, host-time stand-ins for the stream events) and the summary's device idle time before each
target forward, on hand-made call rows."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import spec_step_timeline as tl  # noqa: E402


def _row(name: str, host0: float, host1: float, dev0: float, dev1: float) -> dict:
    return {"name": name, "host0": host0, "host1": host1, "dev0": dev0, "dev1": dev1}


def test_idle_before_forward_and_per_call_table() -> None:
    rows = [
        _row("engine step", 0.0, 9.0, 0.0, 9.0),
        _row("target forward", 0.1, 0.2, 0.1, 5.0),
        _row("launch_verify", 0.3, 0.5, 5.0, 6.0),
        _row("engine step", 9.5, 20.0, 9.5, 20.0),
        # the stream had finished at 6.0; the host launched the next forward at 7.0
        _row("target forward", 7.0, 7.1, 7.0, 12.0),
        _row("launch_verify", 7.2, 7.4, 12.0, 13.0),
        _row("target forward", 13.0, 13.1, 13.0, 18.0),  # no gap: the stream was busy
    ]
    out = tl.summarize(sorted(rows, key=lambda r: r["host0"]), show_steps=1)
    assert out["steps"] == 2 and out["forwards"] == 3
    assert out["device_idle_before_forward_ms"] == 0.5  # median of 1.0 and 0.0
    assert abs(out["forward_to_forward_ms"] - 6.45) < 1e-9  # median of 6.9 and 6.0
    fwd = out["calls"]["target forward"]
    assert fwd["calls_per_step"] == 1.5
    assert abs(fwd["device_ms_per_call"] - (4.9 + 5.0 + 5.0) / 3) < 1e-9
    first = out["timeline"][0]  # from the middle forward on
    assert (first["name"], first["host0"]) == ("target forward", 7.0)


def test_recorder_wraps_and_orders_calls() -> None:
    class Thing:
        def work(self, n: int) -> int:
            return n + 1

    rec = tl.Recorder()
    rec.Event, rec.cuda = tl._HostEvent, False  # host stand-ins whatever the machine
    thing = Thing()
    rec.wrap(thing, "work", "work")
    assert thing.work(1) == 2  # recorded only once started
    rec.start()
    assert thing.work(2) == 3
    assert thing.work(3) == 4
    rows = rec.rows()
    assert [r["name"] for r in rows] == ["work", "work"]
    assert rows[0]["host0"] <= rows[0]["host1"] <= rows[1]["host0"]
    assert all(r["dev0"] <= r["dev1"] for r in rows)
    assert thing.work(4) == 5 and len(rec.rows()) == 2  # stopped by ``rows``
