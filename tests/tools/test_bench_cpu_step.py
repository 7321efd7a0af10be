"""tools/bench_cpu_step.py on a few requests: the structured mode keeps every request under
its grammar through the timed steps and times the grammar phases, and the frontend's output
processing is timed for either output kind. Its figures are not checked (speed lives in the
tool's own runs)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_cpu_step  # noqa: E402


def test_structured_final_only_run(qwen3_tokenizer, tmp_path):
    folder = tmp_path / "tok"
    qwen3_tokenizer.save_pretrained(str(folder))
    out = tmp_path / "r.json"
    assert bench_cpu_step.main([
        "--batch", "4", "--prompt", "16", "--steps", "4", "--repeats", "1", "--modes", "async",
        "--tokenizer", str(folder), "--structured", "--output-kind", "final_only",
        "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["structured"] and run["output_kind"] == "final_only"
    phases = run["breakdown_ms_per_step"]
    assert {"grammar: begin_fill", "grammar: advance", "grammar: sample_deferred"} <= set(phases)
    assert run["frontend_output_processing_ms_per_step"]["n"] == 1
