"""The fused MoE layer on one GPU: the Triton path against a per-expert loop of torch matmuls,
batch-1 weight bandwidth, a CUDA-graph capture check, and a launch-config sweep (issue 22);
the direct small-batch path against the grouped one, and a sweep of its launch shapes.

    python tools/bench_moe.py --out moe.json                  # both shapes, T in 1 8 64 256 2048
    python tools/bench_moe.py --shapes qwen3-30b-a3b --tokens 1 64 --tune
    python tools/bench_moe.py --shapes qwen3-30b-a3b --tokens 1 2 4 --paths direct grouped \
        --tune-direct --out moe_direct.json

Per (shape, T): ``FusedMoE.forward`` (routing + Triton kernels), timed as replays of a CUDA graph
over ``--copies`` layers with their own weights (so weights come from HBM, not L2, and launch
gaps don't count); the torch baseline (``moe_torch``: tokens sorted by expert, one matmul pair
per routed expert) timed eagerly, as it syncs to read the expert counts; the speed-up; the bytes
of the routed experts' weights over the Triton time (GB/s, the batch-1 bandwidth) and the
active TFLOP/s. Random router logits spread tokens over experts about evenly.

``--tune`` times each GEMM alone over a small grid of launch configs per (shape, T) and prints
the best as ``TUNED`` entries for ``worker/ops/moe_configs.py``. ``--tune-grid full`` sweeps
more (slow: every config compiles).

``--paths`` times the expert op alone (``triton_moe.fused_moe`` on routing computed once, no
router kernel), forced down each named path, as graph replays over the copies: ``direct``
(``triton_moe_gemv``, with programmatic dependent launch where the GPU has it), ``direct-nopdl``
(the same without), ``grouped`` (align + grouped GEMMs + sum) and ``auto`` (what
``moe_configs.use_direct`` picks). Per path: microseconds, the routed experts' weight bytes
over that time (GB/s, the number to hold against the HBM peak: ``--peak-gbps`` prints the
fraction), and the error against ``moe_torch``; the direct path also times its two kernels
alone. Each point says which path the rule picks and which was fastest: evidence for
``DIRECT_MAX_PAIRS`` / ``DIRECT_MAX_DUPLICATE``. ``--fp8`` runs these (and ``--tune-direct``) on
e4m3 weights with per-row scales instead of bf16.

``--tune-direct`` sweeps the direct path's two kernels alone (``--tune-direct-grid small|full``)
for each T with at most ``--direct-max-pairs`` pairs, and prints the best as ``TUNED_DIRECT``
entries (or ``configure_direct(configs=...)`` arguments) for ``worker/ops/moe_configs.py``,
with the whole op's time under the best shapes against the default rule's.
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
from tidal.worker.ops import moe_configs, moe_torch, triton_moe, triton_moe_gemv
from tidal.worker.ops.moe_configs import (DirectConfig, GemmConfig, GemvShape, MoeConfig,
                                          get_config, m_bucket)

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
    if moe_configs.use_direct(t, e, k):  # the layer took the direct path, not that config
        row["path"] = "direct"
        row["config"] = {"direct": moe_configs.direct_config(
            t, h, i, k, layer.w13.element_size()).as_tuple()}
    else:
        row["path"] = "grouped"
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


# --- the direct path against the grouped one ---------------------------------------------------

PATH_CHOICES = ("direct", "direct-nopdl", "grouped", "auto")


def expert_weights(layers: list[FusedMoE], fp8: bool) -> list[tuple[torch.Tensor, ...]]:
    """``(w13, w2, w13_scale, w2_scale)`` per layer: its bf16 weights, or e4m3 ones quantized
    per expert and row (``fp8_torch.quantize_rows``) with their float32 scales."""
    if not fp8:
        return [(lay.w13, lay.w2, None, None) for lay in layers]
    from tidal.worker.ops import fp8_torch

    out = []
    for lay in layers:
        e, n13, h = lay.w13.shape
        i = lay.w2.shape[2]
        q13, s13 = fp8_torch.quantize_rows(lay.w13.detach().reshape(-1, h))
        q2, s2 = fp8_torch.quantize_rows(lay.w2.detach().reshape(-1, i))
        out.append((q13.view(e, n13, h), q2.view(e, h, i), s13.view(e, n13), s2.view(e, h)))
    return out


def _op(path: str, x: torch.Tensor, w: tuple[torch.Tensor, ...], weights: torch.Tensor,
        ids: torch.Tensor, direct_config: DirectConfig | None = None) -> Callable[[], Any]:
    w13, w2, s13, s2 = w
    if path == "direct-nopdl":
        return lambda: triton_moe_gemv.fused_moe_direct(x, w13, w2, weights, ids, direct_config,
                                                        s13, s2, pdl=False)
    forced = None if path == "auto" else path
    return lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2,
                                        path=forced, direct_config=direct_config)


def _routed_bytes(ids: torch.Tensor, e: int, h: int, i: int, elem: int) -> tuple[int, int]:
    """(bytes of the distinct routed experts' weights, of one expert per pair)."""
    flat = ids.reshape(-1)
    routed = int(torch.unique(flat[flat < e]).numel())
    return routed * 3 * h * i * elem, int((flat < e).sum()) * 3 * h * i * elem


def path_point(layers: list[FusedMoE], ws: list[tuple[torch.Tensor, ...]], t: int, reps: int,
               paths: list[str], max_pairs: int, peak_gbps: float | None) -> dict[str, Any]:
    layer = layers[0]
    e, h, i, k = layer.num_experts, layer.hidden_size, layer.shard_size, layer.routing.top_k
    x = torch.randn(t, h, device=DEVICE, dtype=layer.w13.dtype)
    weights, ids = select_experts(torch.randn(t, e, device=DEVICE), layer.routing)
    elem = ws[0][0].element_size()
    useful, per_pair = _routed_bytes(ids, e, h, i, elem)
    row: dict[str, Any] = {"tokens": t, "pairs": t * k, "routed_bytes": useful,
                           "pair_bytes": per_pair, "rule_picks": "direct"
                           if moe_configs.use_direct(t, e, k) else "grouped",
                           "direct_config": moe_configs.direct_config(t, h, i, k,
                                                                      elem).as_tuple()}
    w0 = ws[0]
    want = moe_torch.fused_moe(x, w0[0], w0[1], weights, ids, w0[2], w0[3]).double()
    for path in paths:
        if path.startswith("direct") and t * k > max_pairs:
            row[path] = {"skipped": f"{t * k} pairs > --direct-max-pairs {max_pairs}"}
            continue
        ms = graph_ms([_op(path, x, w, weights, ids) for w in ws], reps)
        got = _op(path, x, w0, weights, ids)().double()
        res: dict[str, Any] = {"us": ms * 1e3, "weight_gbps": useful / ms / 1e6,
                               "rel_err": ((got - want).norm() / want.norm()).item()}
        if peak_gbps:
            res["hbm_fraction"] = res["weight_gbps"] / peak_gbps
        if path == "direct":
            res.update(_direct_kernels_alone(x, ws, weights, ids, t, h, i, k))
        row[path] = res
    timed = {p: row[p]["us"] for p in paths if "us" in row.get(p, {})}
    if timed:
        row["fastest"] = min(timed, key=timed.get)
    return row


def _direct_kernels_alone(x: torch.Tensor, ws: list[tuple[torch.Tensor, ...]],
                          weights: torch.Tensor, ids: torch.Tensor, t: int, h: int, i: int,
                          k: int, config: DirectConfig | None = None) -> dict[str, float]:
    """Each direct kernel's own time (graph replays over the copies, no PDL)."""
    cfg = config or moe_configs.direct_config(t, h, i, k, ws[0][0].element_size())
    fid, fw = triton_moe_gemv.flat_routing(ids, weights)
    act = torch.randn(t * k, i, device=DEVICE, dtype=x.dtype)
    out = torch.empty(t, h, device=DEVICE, dtype=x.dtype)
    a_ms = graph_ms([lambda w=w: triton_moe_gemv.gate_up(x, w[0], fid, act, cfg.w13, w[2])
                     for w in ws], 20)
    b_ms = graph_ms([lambda w=w: triton_moe_gemv.down(act, w[1], fid, fw, out, cfg.w2, w[3])
                     for w in ws], 20)
    return {"gate_up_us": a_ms * 1e3, "down_us": b_ms * 1e3}


def _pow2s(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def _direct_grid(k: int, elem: int, gated: bool, full: bool) -> list[GemvShape]:
    """Launch shapes to try for a K of ``k``: chunks from 256 bytes of a row up to the whole
    (padded) row or 8 KiB, rows per program 1 to 8 (16 with ``full``), 2 to 8 warps."""
    top = min(1 << max(0, k - 1).bit_length(), 8192 // elem)
    ks = _pow2s(min(max(16, 256 // elem), top), top)
    if not full:
        ks = ks[-3:]
    rows = (1, 2, 4, 8, 16) if full else ((2, 4, 8) if gated else (1, 2, 4, 8))
    warps = (2, 4, 8) if full else (4, 8)
    shapes = []
    for bn, bk, nw in itertools.product(rows, ks, warps):
        tile = bn * bk * (2 if gated else 1) * elem
        if tile > 64 << 10 or bn * bk < 32 * nw:  # registers; a warp with nothing to load
            continue
        shapes.append(GemvShape(bn, bk, nw))
    return shapes


def tune_direct_point(layers: list[FusedMoE], ws: list[tuple[torch.Tensor, ...]], t: int,
                      reps: int, full: bool) -> dict[str, Any]:
    """The fastest launch shape of each direct kernel alone, then the whole op under the best
    pair against the default rule's."""
    layer = layers[0]
    e, h, i, k = layer.num_experts, layer.hidden_size, layer.shard_size, layer.routing.top_k
    elem = ws[0][0].element_size()
    x = torch.randn(t, h, device=DEVICE, dtype=layer.w13.dtype)
    weights, ids = select_experts(torch.randn(t, e, device=DEVICE), layer.routing)
    fid, fw = triton_moe_gemv.flat_routing(ids, weights)
    act = torch.randn(t * k, i, device=DEVICE, dtype=x.dtype)
    out = torch.empty(t, h, device=DEVICE, dtype=x.dtype)
    best: dict[str, tuple[float, GemvShape]] = {}
    for which in ("w13", "w2"):
        for shape in _direct_grid(h if which == "w13" else i, elem, which == "w13", full):
            if which == "w13":
                calls = [lambda w=w, s=shape: triton_moe_gemv.gate_up(x, w[0], fid, act, s, w[2])
                         for w in ws]
            else:
                calls = [lambda w=w, s=shape: triton_moe_gemv.down(act, w[1], fid, fw, out, s,
                                                                    w[3]) for w in ws]
            try:
                ms = graph_ms(calls, reps)
            except Exception as exc:  # a shape the GPU can't run (registers, ...)
                print(f"    skip direct {which} {shape}: {type(exc).__name__}", file=sys.stderr)
                continue
            if which not in best or ms < best[which][0]:
                best[which] = (ms, shape)
    if len(best) != 2:
        return {"tokens": t, "error": "no shape ran"}
    tuned = DirectConfig(best["w13"][1], best["w2"][1])
    default = moe_configs.default_direct_config(t, h, i, k, elem)
    op = {name: graph_ms([_op("direct", x, w, weights, ids, cfg) for w in ws], reps) * 1e3
          for name, cfg in (("tuned", tuned), ("default", default))}
    useful, _ = _routed_bytes(ids, e, h, i, elem)
    print(f"  T={t} direct: gate/up {best['w13'][0] * 1e3:.1f} us {best['w13'][1]}, down "
          f"{best['w2'][0] * 1e3:.1f} us {best['w2'][1]}; op {op['tuned']:.1f} us tuned, "
          f"{op['default']:.1f} us default ({useful / op['tuned'] / 1e3:.0f} GB/s)",
          file=sys.stderr)
    return {"tokens": t, "key": [h, i, k, t, elem], "config": tuned.as_tuple(),
            "default": default.as_tuple(), "gate_up_us": best["w13"][0] * 1e3,
            "down_us": best["w2"][0] * 1e3, "op_us": op["tuned"], "op_default_us": op["default"],
            "weight_gbps": useful / op["tuned"] / 1e3}


def _print_path_row(row: dict[str, Any], paths: list[str]) -> None:
    parts = []
    for p in paths:
        r = row.get(p, {})
        if "us" in r:
            extra = (f" [{r['gate_up_us']:.1f}+{r['down_us']:.1f} alone]"
                     if "gate_up_us" in r else "")
            frac = f" {r['hbm_fraction']:.2f} of peak" if "hbm_fraction" in r else ""
            parts.append(f"{p} {r['us']:7.1f} us {r['weight_gbps']:5.0f} GB/s{frac}{extra} "
                         f"err {r['rel_err']:.0e}")
        elif r:
            parts.append(f"{p} skipped")
    print(f"  T={row['tokens']:4d} ({row['pairs']} pairs): " + "; ".join(parts)
          + f"  | the rule picks {row['rule_picks']}" + (f", fastest {row['fastest']}"
                                               if "fastest" in row else ""), file=sys.stderr)


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
    ap.add_argument("--paths", nargs="+", choices=PATH_CHOICES, default=None,
                    help="time the expert op down each of these paths per T (this file's "
                         "docstring says what each is)")
    ap.add_argument("--tune-direct", action="store_true",
                    help="sweep the direct path's launch shapes; print TUNED_DIRECT entries")
    ap.add_argument("--tune-direct-grid", choices=("small", "full"), default="small")
    ap.add_argument("--direct-max-pairs", type=int, default=64,
                    help="skip the direct path (and its sweep) above this many pairs")
    ap.add_argument("--fp8", action="store_true",
                    help="--paths / --tune-direct on e4m3 weights with per-row scales")
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="HBM peak (e.g. 3350 for an H100 SXM): print each path's fraction")
    ap.add_argument("--skip-layer", action="store_true",
                    help="only --paths / --tune(-direct): no layer timing or graph check")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "dtype": "bfloat16",
                              "shapes": {}}
    tuned: dict[tuple[int, int, int, int], dict] = {}
    tuned_direct: dict[tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}
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
        for t in ns.tokens if not ns.skip_layer else ():
            row = bench_point(layers, t, ns.reps, not ns.no_loop)
            shape_out["points"].append(row)
            print(f"  T={t:5d}: triton {row['triton_ms'] * 1e3:9.1f} us ({row['path']})"
                  + (f"  torch loop {row['torch_loop_ms'] * 1e3:9.1f} us  "
                     f"x{row['speedup']:.2f}  err {row['rel_err']:.1e}" if "speedup" in row
                     else "")
                  + f"  routed weights {row['weight_gbps']:.0f} GB/s  {row['tflops']:.1f} TFLOP/s",
                  file=sys.stderr)
        # T = 1 takes the direct path by default, 64 the grouped one.
        for t in (1, 64) if not ns.skip_layer else ():
            check = graph_check(layers[0], t)
            shape_out["graph_check"].append(check)
            print(f"  graph check T={t}: {'ok' if check['replay_equals_eager'] else 'FAILED'}",
                  file=sys.stderr)
        if ns.paths or ns.tune_direct:
            ws = expert_weights(layers, ns.fp8)
            shape_out["weights"] = "fp8_e4m3" if ns.fp8 else "bfloat16"
        if ns.paths:
            print(f"  paths ({shape_out['weights']} weights; the expert op alone, "
                  f"routing excluded):", file=sys.stderr)
            shape_out["paths"] = []
            for t in ns.tokens:
                row = path_point(layers, ws, t, ns.reps, ns.paths, ns.direct_max_pairs,
                                 ns.peak_gbps)
                shape_out["paths"].append(row)
                _print_path_row(row, ns.paths)
        if ns.tune_direct:
            shape_out["tune_direct"] = []
            for t in ns.tokens:
                if t * k > ns.direct_max_pairs:
                    continue
                tr = tune_direct_point(layers, ws, t, ns.reps, ns.tune_direct_grid == "full")
                shape_out["tune_direct"].append(tr)
                if "config" in tr:
                    tuned_direct[tuple(tr["key"])] = tr["config"]
        if ns.paths or ns.tune_direct:
            del ws
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
    if tuned_direct:
        print("# paste into TUNED_DIRECT in worker/ops/moe_configs.py, keyed (H, I, top_k, T, "
              "weight element bytes) -> ((gate/up block_n, block_k, warps), (down ...)), or "
              "pass as moe_configs.configure_direct(configs={...}):")
        for key, dcfg in sorted(tuned_direct.items()):
            print(f"    {key}: {dcfg!r},")
        result["tuned_direct"] = [[list(key), [list(c) for c in dcfg]]
                                  for key, dcfg in sorted(tuned_direct.items())]
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    failed = any(not c["replay_equals_eager"] for s in result["shapes"].values()
                 for c in s["graph_check"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
