"""tools/bench_cpu_offload.py: a ``--smoke`` run on the CPU (tiny shape, dummy weights, the
offloader's CPU mode): both engines decode, every layer of the offloaded one streams from its
host buffer. Its figures mean nothing on a CPU; the target stays n/a."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_cpu_offload  # noqa: E402


def test_smoke_run_offloads_every_layer():
    args = bench_cpu_offload.build_parser().parse_args(["--smoke", "--steps", "2",
                                                        "--warmup", "0"])
    result = bench_cpu_offload.run(args)
    assert result["offloaded_layers"] == 2  # the tiny shape's two layers
    # tiny shape, one layer: q/k/v/o 128x(256+128+128) + 256x128, gate/up/down 3x128x256,
    # q/k norms 64 x 2, two layer norms 128 x 2; float32 (a CPU's dtype), each rounded up to
    # 256 bytes.
    per_layer = 4 * (128 * 512 + 256 * 128 + 3 * 128 * 256) + 2 * 256 + 2 * 512
    assert result["offloaded_bytes"] == 2 * per_layer
    assert result["all_gpu_step_ms"] > 0 and result["offload_step_ms"] > 0
    assert result["targets"]["ratio_to_bound"]["verdict"] == "n/a"
