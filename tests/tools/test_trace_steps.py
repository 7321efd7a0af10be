"""tools/trace_steps.py on a small synthetic Chrome trace: the device timeline's charges add up
to its span (overlapping kernels charged once, gaps as idle), and the host's CUDA API calls
are counted and timed per step."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import trace_steps  # noqa: E402


def _kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
            "args": {"device": 0}}


def _api(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {}}


def test_timeline_and_host_calls(tmp_path):
    events = [
        # step 1: a GEMM, then attention overlapping its tail by 2 us, then a 5 us gap
        _kernel("nvjet_sm90_gemm", 0, 10), _kernel("_paged_attention_kernel", 8, 6),
        # step 2: a norm after the gap
        _kernel("_add_rms_norm_row_kernel", 19, 1),
        _api("cudaGraphLaunch", 0, 30), _api("cudaMemcpyAsync", 1, 2),
        _api("cudaMemcpyAsync", 20, 4), _api("cudaEventSynchronize", 25, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3},  # not an API call
    ]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    r = trace_steps.analyse(path, steps=2)
    assert r["span_us"] == 20
    assert r["idle_us_per_step"] == 2.5  # the 5 us gap over two steps
    cats = r["by_category_us_per_step"]
    assert cats["gemm"] == 5.0 and cats["attention"] == 2.0 and cats["norm"] == 0.5
    assert sum(cats.values()) + r["idle_us_per_step"] == r["per_step_us"]
    api = r["host_api"]
    assert api["calls_per_step"] == 2.0
    calls = api["by_call"]
    assert list(calls)[0] == "cudaEventSynchronize"  # most time first
    assert calls["cudaMemcpyAsync"] == {"calls_per_step": 1.0, "us_per_step": 3.0}
    assert calls["cudaGraphLaunch"] == {"calls_per_step": 0.5, "us_per_step": 15.0}
