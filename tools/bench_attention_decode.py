"""Decode attention alone, over launch plans: which split count, tile, warps and stages read a
batch's KV fastest for one head shape (issue 19: Gemma's 256-wide heads at batch 1).

    python tools/bench_attention_decode.py --heads 16 --kv-heads 8 --head-dim 256 --ctx 2048 \\
        --batch 1 --out attn_gemma2.json
    python tools/bench_attention_decode.py --heads 32 --kv-heads 8 --head-dim 128 --batch 256 \\
        --ctx 1024 --kv-dtype fp8 --splits 1 --tiles 64,128 --stages 2,3 --fp8-widen f16,f16_vt

Each timing replays a CUDA graph of the Triton paged attention (and its split merge) over
``--caches`` separate KV caches, so the KV comes from HBM and not from L2 and no launch gaps
count (as in a captured decode step), and reports microseconds per call and the KV read rate. The engine's own plan (``plan_triton_attention``) is the first
row; the best row is printed last.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernel_check import time_calls  # noqa: E402

from tidal.worker.ops import triton_attention_kernels as kernels  # noqa: E402
from tidal.worker.ops.attention_plan import plan_triton_attention  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    ap.add_argument("--softcap", type=float, default=0.0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",
                    help="fp8: e4m3 caches, as --kv-cache-dtype fp8 (scales 1)")
    ap.add_argument("--caches", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--splits", default="8,16,32,64")
    ap.add_argument("--tiles", default="32,64")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--fp8-widen", default="query",
                    help="FP8 caches: how tiles widen, comma-separated: query, f16, f16_vt")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    dev = torch.device("cuda")
    dt = torch.bfloat16
    b, h, hk, d, ctx, bs = ns.batch, ns.heads, ns.kv_heads, ns.head_dim, ns.ctx, ns.block_size
    blocks_per_seq = -(-ctx // bs)
    kv_dt = torch.float8_e4m3fn if ns.kv_dtype == "fp8" else dt
    caches = [torch.randn(2, b * blocks_per_seq, bs, hk, d, dtype=dt, device=dev).to(kv_dt)
              for _ in range(ns.caches)]
    block_table = torch.arange(b * blocks_per_seq, dtype=torch.int32,
                               device=dev).view(b, blocks_per_seq)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev)
    query = torch.randn(b, h, d, dtype=dt, device=dev)
    out = torch.empty_like(query)
    scale = d ** -0.5
    window = ns.window or None
    softcap = ns.softcap or None
    # K and V bytes per call
    read = min(ctx, ns.window or ctx) * hk * d * 2 * kv_dt.itemsize * b

    def timed(plan) -> float:
        calls = [lambda kv=kv: kernels.paged_attention(
            query, kv[0], kv[1], block_table, seq_lens, qsl, b, scale, out, plan,
            sliding_window=window, logits_soft_cap=softcap) for kv in caches]
        return time_calls(calls, ns.reps)["ms"] * 1e3

    base = plan_triton_attention(b, b, 1, h, hk, d, dt, dev, kv_dtype=kv_dt)
    rows = [{"plan": "engine", **dataclasses.asdict(base), "us": round(timed(base), 2)}]
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    widens = [x for x in ns.fp8_widen.split(",") if x]
    for splits, tile, warps, stages, widen in itertools.product(
            ints(ns.splits), ints(ns.tiles), ints(ns.warps), ints(ns.stages), widens):
        plan = dataclasses.replace(base, num_splits=splits, tile_n=tile, num_warps=warps,
                                   num_stages=stages, fp8_widen=widen)
        try:
            us = timed(plan)
        except Exception as exc:  # noqa: BLE001 - a plan the compiler refuses (registers)
            print(f"splits {splits} tile {tile} warps {warps} stages {stages}: {exc}")
            continue
        rows.append({"plan": "sweep", **dataclasses.asdict(plan), "us": round(us, 2)})
    for r in rows:
        r["GBps"] = round(read / (r["us"] * 1e-6) / 1e9, 1)
        print(f"{r['plan']:6s} splits {r['num_splits']:3d} tile {r['tile_n']:3d} "
              f"warps {r['num_warps']} stages {r['num_stages']} {r['fp8_widen']:8s}: "
              f"{r['us']:8.2f} us "
              f"{r['GBps']:8.1f} GB/s", flush=True)
    best = min(rows, key=lambda r: r["us"])
    print(f"best: {best}")
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(ns),
                       "kv_bytes_per_call": read, "rows": rows, "best": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
