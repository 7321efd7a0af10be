"""tools/bench_kv_offload.py: a ``--smoke --skip-decode`` run on the CPU (tiny shape, dummy
weights): the host hit really loads the evicted prefix (the engine's counters), and the copy leg
moves the prefix's bytes. Its figures mean nothing on a CPU; the targets stay n/a."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_kv_offload  # noqa: E402


def test_smoke_run_loads_the_evicted_prefix_from_host():
    args = bench_kv_offload.build_parser().parse_args(["--smoke", "--skip-decode",
                                                       "--repeats", "1"])
    result = bench_kv_offload.run(args)
    ttft = result["ttft"]
    prefix = result["prefix_len"]
    assert ttft["recompute"]["last"]["computed"] == prefix
    # Evicted from the pool by the filler, then all but its last block loaded from host.
    assert ttft["host_hit"]["last"]["pool_hits"] == 0
    assert ttft["host_hit"]["last"]["host_hits"] == prefix - 16
    assert ttft["host_hit"]["last"]["computed"] == 16
    assert ttft["pool_hit"]["last"]["pool_hits"] == prefix - 16
    # tiny shape: 2 layers x 16 blocks of 16 tokens x 2 KV heads x 64 x (K, V) x bf16.
    assert result["bandwidth"]["bytes"] == 2 * 16 * 16 * 2 * 64 * 2 * 2
    assert result["bandwidth"]["host_to_device_GBps"] > 0
    assert {t["verdict"] for t in result["targets"].values()} == {"n/a"}
