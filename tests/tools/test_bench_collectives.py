"""tools/bench_collectives.py: sizes parse as the issue writes them, and one small ``ops`` run
(2 spawned ranks, gloo and shared memory) yields a row per operation with both timings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_collectives  # noqa: E402


def test_sizes_and_call_counts():
    assert [bench_collectives.parse_size(s) for s in ("4K", "16m", "1M", "512")] == \
        [4096, 16 << 20, 1 << 20, 512]
    # Many calls for small sizes, still a median's worth at 16 MiB.
    assert bench_collectives.iterations(4096) == 400
    assert bench_collectives.iterations(16 << 20) == 15


@pytest.mark.slow
def test_ops_run_times_both_backends():
    rows = bench_collectives.bench_ops([4096], rounds=1)
    assert sorted(r["op"] for r in rows) == sorted(bench_collectives.OPS)
    for r in rows:
        assert r["bytes"] == 4096 and r["gloo_us"] > 0 and r["shm_us"] > 0, r
        assert r["gloo_calls"] == r["shm_calls"] == bench_collectives.iterations(4096)
        assert r["speedup"] == pytest.approx(r["gloo_us"] / r["shm_us"], rel=0.01)
