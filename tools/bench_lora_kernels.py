"""The per-token LoRA kernels (shrink + expand, what decode steps replay in CUDA graphs) at
Llama-3.1-8B's four LoRA'd linears, for a few batch sizes: the shrink with its inputs split in
slices summed atomically (the default for small batches) against one program per token and
output block reading all of A (``split_k=1``, the kernel before), and the tokens grouped by
adapter in tiles (``grouped``: the segmented kernels through a permutation, what
``lora_grouped_min_tokens`` turns on), and both with their outputs in a scratch buffer zeroed
once per step (``*_scratch``: what engine steps run), each captured in a CUDA graph and
replayed (issue 24: a batch-1 decode step with an adapter cost 2.6x the base's).

    python tools/bench_lora_kernels.py --out lora_kernels.json     # a GPU

``--one-row``: instead, batch-1 decode's four linears of every layer (32 by default, each its
own weights, the whole chain captured in one graph): (a) the base model's fused norm + GEMV
paths, (b) with an adapter, the shrink / expand kernels after each linear (the norm apart,
SiLU-and-mul apart), (c) the one-row LoRA path (the shrink of partial sums, norming the row,
then the GEMV adding the expand before its epilogue); the per-step overhead of (b) and (c) over
(a), and each variant's kernels per layer.

    python tools/bench_lora_kernels.py --one-row --out lora_one_row.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_name, dump  # noqa: E402
from tidal.worker.lora.grouping import TILE, group_tokens, max_tiles  # noqa: E402
from tidal.worker.lora.layers import LoRASegments  # noqa: E402
from tidal.worker.ops import triton_lora  # noqa: E402

LLAMA8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
           "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def time_graph(fn, replays: int, calls: int = 20) -> float:
    """µs per call of ``fn``, ``calls`` calls captured in one CUDA graph, replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def grouped_segments(slots: torch.Tensor, num_slots: int) -> LoRASegments:
    """The grouped decode layout of ``slots`` (lora/grouping.py), in fixed tables sized as a
    CUDA graph of this batch would have them."""
    perm, starts, lengths, tile_slots = group_tokens(slots.cpu().numpy(), TILE)
    num = max_tiles(len(slots), num_slots, TILE)
    table = torch.zeros(3, num, dtype=torch.int32)
    k = len(starts)
    table[0, :k], table[1, :k] = torch.from_numpy(starts), torch.from_numpy(lengths)
    table[2, :k] = torch.from_numpy(tile_slots)
    table = table.to(slots.device)
    return LoRASegments(table[0], table[1], table[2], num, TILE,
                        perm=torch.from_numpy(perm.astype("int32")).to(slots.device))


def kernels_launched(fn) -> int:
    """GPU kernels (and copies) one eager call of ``fn`` runs."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())


def one_row(args: argparse.Namespace) -> dict:
    """Batch-1 decode's linears over ``args.layers`` layers: base, old LoRA path, new one."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for
    from tidal.worker.lora.layers import LoRAContext, LoRALayer

    dev, dt, eps, r = torch.device("cuda"), torch.bfloat16, 1e-5, args.rank
    kernels = kernels_for(dev, KernelConfig(ops="triton"))  # (no CUDA extension build)
    ctx = LoRAContext(8, dev)
    ctx.token_slots[0] = 0  # the token runs the adapter in slot 0
    hidden, q = LLAMA8B["o"][0], LLAMA8B["qkv"][1][0]
    layers = []
    for _ in range(args.layers):
        layer = {"nw1": torch.ones(hidden, device=dev, dtype=dt),
                 "nw2": torch.ones(hidden, device=dev, dtype=dt)}
        for name, (in_f, sizes) in LLAMA8B.items():
            layer[name] = torch.randn(sum(sizes), in_f, device=dev, dtype=dt) * in_f ** -0.5
            lora = LoRALayer(("p",) * len(sizes), sizes, in_f, args.slots, r, dt, dev, ctx,
                             kernels)
            lora.a.normal_(0, in_f ** -0.5)
            lora.b.normal_(0, 0.02)
            layer[f"{name}_lora"] = lora
        layers.append(layer)
    x0 = torch.randn(1, hidden, device=dev, dtype=dt)
    r0 = torch.randn(1, hidden, device=dev, dtype=dt)

    def base(layers=layers):
        x, res = x0, r0
        for L in layers:
            qkv, res = kernels.rms_norm_linear(x, res, L["nw1"], eps, L["qkv"])
            o = kernels.linear(qkv[:, :q], L["o"])
            act, res = kernels.rms_norm_linear(o, res, L["nw2"], eps, L["gate_up"], silu=True)
            x = kernels.linear(act, L["down"])

    def lora_old(layers=layers):  # NormLinear._norm_then_linear and LoRALayer.add
        x, res = x0, r0
        for L in layers:
            h, res = kernels.fused_add_rms_norm(x, res, L["nw1"], eps)
            qkv = L["qkv_lora"].add(h, kernels.linear(h, L["qkv"]))
            a = qkv[:, :q].contiguous()
            o = L["o_lora"].add(a, kernels.linear(a, L["o"]))
            h, res = kernels.fused_add_rms_norm(o, res, L["nw2"], eps)
            act = kernels.silu_and_mul(L["gate_up_lora"].add(h, kernels.linear(h, L["gate_up"])))
            x = L["down_lora"].add(act, kernels.linear(act, L["down"]))

    def lora_fused(layers=layers):  # LoRALayer.gemv, as the layers call it for one row
        x, res = x0, r0
        for L in layers:
            qkv, res = L["qkv_lora"].gemv(x, L["qkv"], norm_weight=L["nw1"], residual=res,
                                          eps=eps)
            o, _ = L["o_lora"].gemv(qkv[:, :q], L["o"])
            act, res = L["gate_up_lora"].gemv(o, L["gate_up"], norm_weight=L["nw2"],
                                              residual=res, eps=eps, act="silu")
            x, _ = L["down_lora"].gemv(act, L["down"])

    variants = {"base": base, "lora_old": lora_old, "lora_fused": lora_fused}
    per_layer = {k: kernels_launched(lambda fn=fn: fn(layers[:1])) for k, fn in variants.items()}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for order in (list(variants), list(variants)[::-1]):  # each twice, order swapped
        for k in order:
            times[k].append(time_graph(variants[k], args.replays, calls=1) / 1e3)
    step = {k: round(min(v), 4) for k, v in times.items()}
    return {"device": device_name(), "rank": r, "slots": args.slots, "layers": args.layers,
            "step_ms": step, "step_ms_each_run": {k: [round(t, 4) for t in v]
                                                  for k, v in times.items()},
            "overhead_ms": {k: round(step[k] - step["base"], 4)
                            for k in ("lora_old", "lora_fused")},
            "kernels_per_layer": per_layer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--one-row", action="store_true",
                   help="time batch-1 decode's linears over --layers layers: base, the "
                        "shrink / expand after the linears, the one-row LoRA path")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.one_row:
        dump(one_row(args), args.out)
        return
    dev = torch.device("cuda")
    rows = []
    totals: dict[str, dict[str, float]] = {}
    for t in (int(v) for v in args.batches.split(",")):
        for name, (in_f, sizes) in LLAMA8B.items():
            s, r = len(sizes), args.rank
            a = torch.randn(args.slots, s * r, in_f, device=dev, dtype=torch.bfloat16) * 0.02
            b = torch.randn(args.slots, sum(sizes), r, device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn(t, in_f, device=dev, dtype=torch.bfloat16)
            y = torch.zeros(t, sum(sizes), device=dev, dtype=torch.bfloat16)
            slots = torch.arange(t, device=dev, dtype=torch.int32) % min(8, args.slots)
            offsets = tuple(sum(sizes[:i]) for i in range(s))
            row = {"batch": t, "linear": name, "in": in_f, "out": sum(sizes)}
            grouped = grouped_segments(slots, args.slots)
            # (``*_scratch``: the shrink sums into a block of the step's scratch, zeroed once
            # per step for every layer, as LoRAContext hands it: no zeroing of its own, that
            # one zeroing left out. Never zeroed here: the sums grow over the replays, which
            # changes no timing.)
            scratch = torch.zeros(t, s * r, device=dev, dtype=torch.float32)
            for label, split, segs, out in (
                    ("split", None, None, None), ("one_program", 1, None, None),
                    ("grouped", None, grouped, None), ("split_scratch", None, None, scratch),
                    ("grouped_scratch", None, grouped, scratch)):
                def step(split=split, segs=segs, out=out):
                    xa = triton_lora.lora_shrink(x, a, slots, segs, split_k=split, out=out)
                    triton_lora.lora_expand(y, xa, b, slots, offsets, r, segs)
                row[f"{label}_us"] = round(time_graph(step, args.replays), 2)
                # (The per-layer sum over the four linears, then x 32 layers.)
                totals.setdefault(str(t), {}).setdefault(label, 0.0)
                totals[str(t)][label] += row[f"{label}_us"]
            rows.append(row)
            print(row, flush=True)
    result = {"device": device_name(), "rank": args.rank, "slots": args.slots,
              "per_linear": rows,
              "llama8b_step_ms": {t: {k: round(v * 32 / 1e3, 3) for k, v in d.items()}
                                  for t, d in totals.items()}}
    dump(result, args.out)


if __name__ == "__main__":
    main()
