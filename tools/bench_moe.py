"""The fused MoE layer on one GPU: the Triton path against a per-expert loop of torch matmuls,
batch-1 weight bandwidth, a CUDA-graph capture check, and a launch-config sweep (issue 22).

    python tools/bench_moe.py --out moe.json                  # both shapes, T in 1 8 64 256 2048
    python tools/bench_moe.py --shapes qwen3-30b-a3b --tokens 1 64 --tune

Per (shape, T): ``FusedMoE.forward`` (routing + Triton kernels), timed as replays of a CUDA graph
over ``--copies`` layers with their own weights (so weights come from HBM, not L2, and launch
gaps don't count); the torch baseline (``moe_torch``: tokens sorted by expert, one matmul pair
per routed expert) timed eagerly, as it syncs to read the expert counts; the speed-up; the bytes
of the routed experts' weights over the Triton time (GB/s, the batch-1 bandwidth) and the
active TFLOP/s. Random router logits spread tokens over experts about evenly.

``--tune`` times each GEMM alone over a small grid of launch configs per (shape, T) and prints
the best as ``TUNED`` entries for ``worker/ops/moe_configs.py``. ``--tune-grid full`` sweeps
more (slow: every config compiles).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

from tidal.engine_core.kernel_config import KernelConfig
from tidal.worker.kernel_policy import building, kernels_for
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig, select_experts
from tidal.worker.ops import moe_torch, triton_moe
from tidal.worker.ops.moe_configs import GemmConfig, MoeConfig, get_config, m_bucket

# (experts, top_k, hidden, intermediate) of the released checkpoints.
SHAPES: dict[str, tuple[int, int, int, int]] = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
}
DEVICE = "cuda"  # a CPU smoke run under the Triton interpreter swaps it (and the timers)


def _events_ms(run: Callable[[], None], reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def graph_ms(calls: list[Callable[[], Any]], reps: int) -> float:
    """Median ms per call over ``reps`` replays of one graph holding ``calls``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # compile and warm the allocator outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(_events_ms(graph.replay, reps)) / len(calls)


def eager_ms(calls: list[Callable[[], Any]], reps: int) -> float:
    for c in calls:
        c()
    torch.cuda.synchronize()

    def run() -> None:
        for c in calls:
            c()

    return statistics.median(_events_ms(run, reps)) / len(calls)


def make_layers(shape: tuple[int, int, int, int], copies: int,
                dtype: torch.dtype) -> list[FusedMoE]:
    e, k, h, i = shape
    # ops="triton": the Triton MoE path without building the CUDA extension first.
    kernels = kernels_for(torch.device(DEVICE), KernelConfig(ops="triton"))
    layers = []
    with building(kernels):
        for _ in range(copies):
            layer = FusedMoE(e, h, i, RoutingConfig(top_k=k), dtype).to(DEVICE)
            layer.w13.data.normal_(0, h ** -0.5)
            layer.w2.data.normal_(0, i ** -0.5)
            layers.append(layer)
    return layers


def bench_point(layers: list[FusedMoE], t: int, reps: int, loop: bool) -> dict[str, Any]:
    layer = layers[0]
    e, h, i, k = layer.num_experts, layer.hidden_size, layer.shard_size, layer.routing.top_k
    dtype = layer.w13.dtype
    x = torch.randn(t, h, device=DEVICE, dtype=dtype)
    logits = torch.randn(t, e, device=DEVICE)
    ms = graph_ms([lambda lay=lay: lay(x, logits) for lay in layers], reps)
    weights, ids = select_experts(logits, layer.routing)
    routed = int(torch.unique(ids).numel())
    expert_bytes = 3 * h * i * layer.w13.element_size()
    row: dict[str, Any] = {
        "tokens": t, "triton_ms": ms, "routed_experts": routed,
        "weight_gbps": routed * expert_bytes / ms / 1e6,
        "tflops": 2 * t * k * 3 * h * i / ms / 1e9,
        "config": get_config(t, e, h, i, k).as_dict(),
    }
    if loop:
        ref = [lambda lay=lay: moe_torch.fused_moe(x, lay.w13, lay.w2, weights, ids)
               for lay in layers]
        row["torch_loop_ms"] = eager_ms(ref, max(3, reps // 4))
        row["speedup"] = row["torch_loop_ms"] / ms
        got = layer(x, logits).double()
        want = moe_torch.fused_moe(x, layer.w13, layer.w2, weights, ids).double()
        row["rel_err"] = ((got - want).norm() / want.norm()).item()
    return row


def graph_check(layer: FusedMoE, t: int) -> dict[str, Any]:
    """Capture the layer's forward, replay it on new inputs, compare with an eager call."""
    h, e = layer.hidden_size, layer.num_experts
    x = torch.randn(t, h, device=DEVICE, dtype=layer.w13.dtype)
    logits = torch.randn(t, e, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    want = layer(x, logits)
    ok = bool(torch.equal(out, want))
    return {"tokens": t, "replay_equals_eager": ok,
            "max_abs_diff": (out.float() - want.float()).abs().max().item()}


def _grid(full: bool) -> list[GemmConfig]:
    if full:
        axes = ((32, 64, 128, 256), (32, 64, 128), (1, 8, 16), (4, 8), (2, 3, 4, 5))
    else:
        axes = ((64, 128), (64, 128), (1, 8), (4, 8), (3, 4))
    return [GemmConfig(*c) for c in itertools.product(*axes)]


def tune_point(layer: FusedMoE, t: int, reps: int, full: bool) -> dict[str, Any]:
    """The fastest launch config of each GEMM, per block_m; the best block_m overall."""
    e, h, i, k = layer.num_experts, layer.hidden_size, layer.shard_size, layer.routing.top_k
    dtype = layer.w13.dtype
    x = torch.randn(t, h, device=DEVICE, dtype=dtype)
    weights, ids = select_experts(torch.randn(t, e, device=DEVICE), layer.routing)
    flat_w = weights.reshape(-1).float()
    act = torch.randn(t * k, i, device=DEVICE, dtype=dtype)
    out = torch.empty(t * k, h, device=DEVICE, dtype=torch.float32)
    per_expert = t * k / e
    block_ms = [bm for bm in (16, 32, 64, 128) if bm <= max(16, 4 * per_expert)] if not full \
        else [16, 32, 64, 128]
    best: tuple[float, MoeConfig] | None = None
    for bm in block_ms:
        sorted_ids, expert_ids, post = triton_moe.align(ids, e, bm)
        chosen = []
        for which in ("w13", "w2"):
            fastest: tuple[float, GemmConfig] | None = None
            for cfg in _grid(full):
                if which == "w13":
                    def call(cfg=cfg):
                        triton_moe._gemm(x, layer.w13, act, None, sorted_ids, expert_ids, post,
                                         i, k, True, bm, cfg)
                else:
                    def call(cfg=cfg):
                        triton_moe._gemm(act, layer.w2, out, flat_w, sorted_ids, expert_ids,
                                         post, h, 1, False, bm, cfg)
                try:
                    ms = graph_ms([call], reps)
                except Exception as exc:  # a config the GPU can't run (shared memory, ...)
                    print(f"    skip {which} bm={bm} {cfg}: {type(exc).__name__}",
                          file=sys.stderr)
                    continue
                if fastest is None or ms < fastest[0]:
                    fastest = (ms, cfg)
            if fastest is None:
                break
            chosen.append(fastest)
        if len(chosen) != 2:
            continue
        total = chosen[0][0] + chosen[1][0]
        print(f"  T={t} block_m={bm}: w13 {chosen[0][0] * 1e3:.1f} us {chosen[0][1]}, "
              f"w2 {chosen[1][0] * 1e3:.1f} us {chosen[1][1]}", file=sys.stderr)
        if best is None or total < best[0]:
            best = (total, MoeConfig(bm, chosen[0][1], chosen[1][1]))
    if best is None:
        return {"tokens": t, "error": "no config ran"}
    default = get_config(t, e, h, i, k)
    return {"tokens": t, "bucket": m_bucket(t), "gemm_ms": best[0],
            "config": best[1].as_dict(), "default": default.as_dict()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b"],
                    choices=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64, 256, 2048])
    ap.add_argument("--copies", type=int, default=0,
                    help="layers with their own weights per timed graph (0: as many as fit "
                         "in 4 GiB, at least 1, at most 8)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-loop", action="store_true", help="skip the torch baseline")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--tune-grid", choices=("small", "full"), default="small")
    ap.add_argument("--tp", type=int, default=1,
                    help="shard the intermediate size as one of this many ranks would")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16",
                              "shapes": {}}
    tuned: dict[tuple[int, int, int, int], dict] = {}
    for name in ns.shapes:
        e, k, h, i = SHAPES[name]
        i //= ns.tp
        layer_bytes = 3 * e * h * i * 2
        copies = ns.copies or max(1, min(8, (4 << 30) // layer_bytes))
        layers = make_layers((e, k, h, i), copies, dtype)
        print(f"== {name}: E={e} top-{k} H={h} I={i} ({layer_bytes / 2**30:.2f} GiB/layer, "
              f"{copies} copies)", file=sys.stderr)
        shape_out: dict[str, Any] = {"experts": e, "top_k": k, "hidden": h, "intermediate": i,
                                     "copies": copies, "points": [], "graph_check": []}
        for t in ns.tokens:
            row = bench_point(layers, t, ns.reps, not ns.no_loop)
            shape_out["points"].append(row)
            print(f"  T={t:5d}: triton {row['triton_ms'] * 1e3:9.1f} us"
                  + (f"  torch loop {row['torch_loop_ms'] * 1e3:9.1f} us  "
                     f"x{row['speedup']:.2f}  err {row['rel_err']:.1e}" if "speedup" in row
                     else "")
                  + f"  routed weights {row['weight_gbps']:.0f} GB/s  {row['tflops']:.1f} TFLOP/s",
                  file=sys.stderr)
        for t in (1, 64):
            check = graph_check(layers[0], t)
            shape_out["graph_check"].append(check)
            print(f"  graph check T={t}: {'ok' if check['replay_equals_eager'] else 'FAILED'}",
                  file=sys.stderr)
        if ns.tune:
            shape_out["tune"] = []
            for t in ns.tokens:
                tr = tune_point(layers[0], t, ns.reps, ns.tune_grid == "full")
                shape_out["tune"].append(tr)
                if "config" in tr:
                    tuned[(e, h, i, tr["bucket"])] = tr["config"]
        result["shapes"][name] = shape_out
        del layers
        torch.cuda.empty_cache()
    if tuned:
        print("# paste into TUNED in worker/ops/moe_configs.py:")
        for key, cfg in sorted(tuned.items()):
            print(f"    {key}: {cfg!r},")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    failed = any(not c["replay_equals_eager"] for s in result["shapes"].values()
                 for c in s["graph_check"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
