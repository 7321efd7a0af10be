"""tools/bench_compile.py: the PASS / MISS verdicts against issue 25's targets (worked out by
hand). The tool's ``--smoke`` run (a cold Inductor compile in a fresh process) takes minutes on
two cores, so CI checks only the verdicts; the README's torch.compile section says how to run
it."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_compile  # noqa: E402


def _leg(tps: float) -> dict:
    return {"tokens_per_s": tps}


def test_verdicts_against_the_targets():
    result = {"runs": {"eager": {"decode": _leg(100.0), "mixed": _leg(200.0)},
                       "compiled": {"decode": _leg(110.0), "mixed": _leg(230.0)},
                       "compiled_full": {"decode": _leg(130.0), "mixed": _leg(210.0)}},
              "startup": {"off": {"ready_s": 10.0}, "warm": {"ready_s": 12.5}}}
    v = bench_compile.verdicts(result)
    # The faster compiled engine of each leg against eager.
    assert (v["decode_speedup"]["value"], v["decode_speedup"]["verdict"]) == (1.3, "PASS")
    assert (v["mixed_speedup"]["value"], v["mixed_speedup"]["verdict"]) == (1.15, "PASS")
    assert (v["warm_over_off"]["value"], v["warm_over_off"]["verdict"]) == (1.25, "MISS")
    # Legs that did not run are not measured, never passed.
    # A piecewise engine counts too, and every engine's ratio is listed.
    result["runs"]["compiled_piecewise"] = {"decode": _leg(90.0), "mixed": _leg(260.0)}
    assert bench_compile.verdicts(result)["mixed_speedup"]["value"] == 1.3
    ratios = bench_compile.speedups(result)
    assert ratios["compiled_piecewise/mixed"] == 1.3 and ratios["compiled/decode"] == 1.1
    missing = bench_compile.verdicts({"runs": {"eager": {"decode": _leg(1.0)}}})
    assert {t["verdict"] for t in missing.values()} == {"n/a"}


def test_engines_per_device():
    cpu, gpu = bench_compile.engines("cpu"), bench_compile.engines("cuda")
    assert cpu["compiled"]["mode"] == 3 and cpu["compiled_full"] is None
    assert gpu["compiled_full"] == {"mode": 3, "cudagraph_mode": "FULL"}
    assert cpu["compiled_piecewise"] is None and cpu["compiled_full_and_piecewise"] is None
    assert gpu["compiled_piecewise"] == {"mode": 3, "cudagraph_mode": "PIECEWISE"}
    assert gpu["compiled_full_and_piecewise"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    # Every GPU engine's compilation config is one the engine accepts.
    from tidal.engine_core.compilation_config import build_compilation_config

    assert cpu["compiled_custom_ops"] is None
    cc = build_compilation_config(gpu["compiled_custom_ops"])
    assert cc.custom_ops and cc.cudagraph_mode == "FULL_AND_PIECEWISE"
    for raw in gpu.values():
        if raw is not None:
            build_compilation_config({k: v for k, v in raw.items() if k != "_llm_kwargs"})
