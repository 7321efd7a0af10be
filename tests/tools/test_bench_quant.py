"""tools/bench_quant.py: the PASS / MISS verdicts against the issue's targets (worked out by
hand), and a ``--smoke`` run on the CPU (tiny random model, every engine built, measured and
shut down in turn)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_quant  # noqa: E402


def _run(b1: float | None = None, tput: float | None = None, mfu: float | None = None,
         kv: float | None = None) -> dict:
    r: dict = {}
    if b1 is not None:
        r["decode_b1"] = {"ms_per_step": {"median": b1}}
    if tput is not None:
        r["decode_batch"] = {"tokens_per_s": tput}
    if mfu is not None:
        r["prefill"] = {"MFU": {"median": mfu}}
    if kv is not None:
        r["decode_kv"] = {"tokens_per_s": kv}
    return r


def test_verdicts_against_the_targets():
    result = {"runs": {"bf16": _run(b1=10.0, tput=1000.0),
                       "fp8": _run(b1=5.9, tput=1400.0, mfu=0.55, kv=500.0),
                       "int4": _run(b1=4.1),
                       "fp8_kv": _run(tput=1600.0, kv=700.0)}}
    v = bench_quant.verdicts(result)
    assert v["decode_b1_fp8_ratio"]["value"] == 0.59
    assert v["decode_b1_fp8_ratio"]["verdict"] == "PASS"
    assert v["decode_b1_int4_ratio"]["value"] == 0.41
    assert v["decode_b1_int4_ratio"]["verdict"] == "MISS"
    assert v["decode_batch_fp8_speedup"]["value"] == 1.4
    assert v["decode_batch_fp8_speedup"]["verdict"] == "MISS"
    assert v["decode_batch_fp8_kv_speedup"]["value"] == 1.6
    assert v["decode_batch_fp8_kv_speedup"]["verdict"] == "PASS"
    assert v["prefill_fp8_mfu"]["verdict"] == "PASS"
    assert v["kv_fp8_speedup"]["value"] == 1.4 and v["kv_fp8_speedup"]["verdict"] == "PASS"
    # Legs that did not run are not measured, never passed.
    few = {"runs": {"bf16": {"decode_few": {"ms_per_step": {"median": 4.0}}},
                    "int4": {"decode_few": {"ms_per_step": {"median": 3.0}}}}}
    assert bench_quant.few_rows(few) == {"fp8": None, "int4": 0.75}
    missing = bench_quant.verdicts({"runs": {"bf16": _run(b1=10.0)},
                                    "int4_unavailable": "no", "kv_fp8_unavailable": "no"})
    assert {t["verdict"] for t in missing.values()} == {"n/a"}
    assert missing["decode_b1_int4_ratio"]["note"] == "int4: not available"


@pytest.mark.slow  # four engines in turn: ~15 s on two cores
def test_smoke_run_on_cpu(tmp_path, capsys):
    out = tmp_path / "quant.json"
    assert bench_quant.main(["--smoke", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    runs = r["runs"]
    for label in ("bf16", "fp8"):
        assert runs[label]["decode_b1"]["ms_per_step"]["median"] > 0
        assert runs[label]["decode_few"]["batch"] == 4  # the few-row leg
        assert runs[label]["decode_batch"]["batch"] == 8
        assert runs[label]["prefill"]["tokens"] == 2 * 64
    assert set(r["targets"]) == set(bench_quant.TARGETS)
    assert r["few_rows"]["batch"] == 4 and r["few_rows"]["step_vs_bf16"]["fp8"] > 0
    assert all(t["verdict"] in ("PASS", "MISS", "n/a") for t in r["targets"].values())
    # Each engine is either measured or says why it is missing.
    assert "int4" in runs or r["int4_unavailable"]
    if "fp8_kv" in runs:
        # FP8 KV: twice the KV tokens in the same memory, and the long-context leg of both.
        assert runs["fp8_kv"]["kv_tokens"] == 2 * runs["fp8"]["kv_tokens"]
        assert runs["fp8_kv"]["decode_batch"]["batch"] == 8
        assert runs["fp8_kv"]["decode_kv"]["tokens_per_s"] > 0
        assert runs["fp8"]["decode_kv"]["batch"] == runs["fp8_kv"]["decode_kv"]["batch"] == 4
    else:
        assert r["kv_fp8_unavailable"]
    text = capsys.readouterr().out
    assert "PASS" in text or "MISS" in text
