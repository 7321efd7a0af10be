"""tools/bench_disagg.py: the PASS / MISS verdicts against issue 27's disaggregated targets
(worked out by hand) and a ``--smoke --skip-serving`` run of its transfer leg on the CPU (the
serving leg starts four processes: run by hand, ``--smoke``)."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_disagg  # noqa: E402


def test_verdicts_against_the_targets():
    v = bench_disagg.verdicts({
        "transfer": {"ratio": 0.79},
        "serving": {"colocated": {"itl_p99_ms": 40.0},
                    "disaggregated": {"itl_p99_ms": 20.0}}})
    assert v["transfer_vs_copy"]["verdict"] == "MISS"
    assert v["itl_p99_ratio"]["value"] == 0.5
    assert v["itl_p99_ratio"]["verdict"] == "PASS"
    assert {t["verdict"] for t in bench_disagg.verdicts({}).values()} == {"n/a"}


def test_transfer_smoke_moves_the_bytes_in_chunks():
    args = bench_disagg.build_parser().parse_args(["--smoke", "--skip-serving"])
    result = bench_disagg.run(args)
    tr = result["transfer"]
    # tiny shape: 2 layers x 16 blocks of 16 tokens x 2 KV heads x 64 x (K, V) x bf16.
    assert tr["bytes"] == 2 * 16 * 16 * 2 * 64 * 2 * 2
    assert tr["pull_GBps"] > 0 and tr["copy_GBps"] > 0
    # Where a pull's host time goes, in order (ms from its start).
    ph = tr["pull_phases_ms"]
    assert 0 < ph["first_reply"] <= ph["posted"] <= ph["landed"]
    # ... and the producer's, from the chunk's arrival there.
    assert 0 < ph["producer_header"] <= ph["producer_posted"]
    assert result["verdicts"]["itl_p99_ratio"]["verdict"] == "n/a"
