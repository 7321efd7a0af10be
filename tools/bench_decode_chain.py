"""Where the attention part of a batch-1 decode layer spends its time, on one GPU.

    python tools/bench_decode_chain.py --out chain.json [--tp 1 2] [--ctx 128 1024]

Builds Llama-3.1-8B's per-rank attention chain (q/k/v GEMV, rotary + K/V write, split attention,
split merge, o GEMV) for ``--layers`` layers with their own weights and caches, captures it in a
CUDA graph with programmatic dependent launch, as the engine runs it, and reports:

- ``full_us_per_layer`` for the whole chain, ``no_attention_us_per_layer`` without attention
  (the o GEMV reads the rotated query instead) and ``gemv_only_us_per_layer`` without rotary
  too: the differences are what attention and rotary add to a layer;
- ``stamps_<mode>_us``: from ``%globaltimer`` stamps taken inside the kernels (``triton_probe``), medians
  over layers and replays, in microseconds relative to the moment the rotary kernel got past
  its dependent-launch wait: when each kernel's programs entered, got past the wait, had their
  query loaded, finished the math and issued their stores.

The ``light`` mode replaces the q/k/v GEMV by one over 64 inputs: the same chain behind a
producer that leaves HBM idle, to tell the attention kernel's own latency from what the GEMV's
traffic adds to its loads.

Variants change one setting for the whole chain (``--variants``): ``nopreload`` (attention
loads its first tile after the wait), ``fusedmerge`` (the last split program merges),
``stagesN`` / ``warps8`` / ``tile32`` (the attention plan's pipeline stages, warps, tile).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import time_cuda  # noqa: E402

D, HIDDEN, PAGE = 128, 4096, 16
LIGHT_K = 64  # the q/k/v GEMV's K in the 'light' mode: a producer that hardly loads HBM


def _layer_weights(tp: int, layers: int, ctx: int, dev: str) -> list[dict[str, Any]]:
    heads, kv = 32 // tp, 8 // tp
    gen = torch.Generator(device=dev).manual_seed(tp * 1000 + ctx)
    blocks = ctx // PAGE + 2
    out = []
    for _ in range(layers):
        cache = torch.randn((2, blocks, PAGE, kv, D), device=dev, generator=gen).to(torch.bfloat16)
        out.append(dict(
            qkv=(torch.randn(((heads + 2 * kv) * D, HIDDEN), device=dev, generator=gen) * 0.02)
            .to(torch.bfloat16),
            qkv_light=(torch.randn(((heads + 2 * kv) * D, LIGHT_K), device=dev, generator=gen)
                       * 0.1).to(torch.bfloat16),
            o=(torch.randn((HIDDEN, heads * D), device=dev, generator=gen) * 0.02)
            .to(torch.bfloat16),
            cache=cache))
    return out


def _chain(tp: int, ctx: int, layers: int, mode: str, stamps: dict[str, list] | None,
           dev: str, plan_changes: dict[str, Any]) -> Callable[[], None]:
    from tidal.worker.layers.rotary import build_cos_sin_cache
    from tidal.worker.ops import triton_attention_kernels as tak
    from tidal.worker.ops import triton_decode as td
    from tidal.worker.ops.attention_plan import plan_triton_attention
    from tidal.worker.ops.triton_probe import STAMPS

    heads, kv = 32 // tp, 8 // tp
    w = _layer_weights(tp, layers, ctx, dev)
    cs = build_cos_sin_cache(D, 8192, 5e5, None).to(dev)
    blocks = ctx // PAGE + 2
    block_table = torch.arange(blocks, dtype=torch.int32, device=dev)[None, :]
    seq_lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=dev)
    pos = torch.tensor([ctx - 1], device=dev)
    slot = torch.tensor([ctx - 1], dtype=torch.int64, device=dev)
    plan = dataclasses.replace(
        plan_triton_attention(1, 1, 1, heads, kv, D, torch.bfloat16, torch.device(dev)),
        **plan_changes)
    x0 = torch.randn((1, HIDDEN), device=dev).to(torch.bfloat16)
    progs = kv * plan.num_splits
    if stamps is not None:
        for key, n in (("rope", 1), ("attention", progs), ("merge", heads)):
            stamps[key] = [torch.zeros((n, STAMPS), dtype=torch.int64, device=dev)
                           for _ in range(layers)]

    def run() -> None:
        h = x0
        for i, lw in enumerate(w):
            if mode == "light":
                qkv, _ = td.gemv(h[:, :LIGHT_K], lw["qkv_light"])
            else:
                qkv, _ = td.gemv(h, lw["qkv"])
            if mode == "gemv_only":
                h, _ = td.gemv(qkv[:, : heads * D], lw["o"])
                continue
            q = td.qk_norm_rope_write_kv(
                qkv, pos, heads, kv, D, None, None, 1e-5, cs, lw["cache"], slot,
                times=stamps["rope"][i] if stamps else None)
            if mode == "no_attention":
                h, _ = td.gemv(q.view(1, -1), lw["o"])
                continue
            out = torch.empty_like(q)
            tak.paged_attention(
                q, lw["cache"][0], lw["cache"][1], block_table, seq_lens, qsl, 1, D**-0.5, out,
                plan, times=(stamps["attention"][i], stamps["merge"][i]) if stamps else None)
            h, _ = td.gemv(out.view(1, -1), lw["o"])

    return run


def _graph(run: Callable[[], None]) -> Callable[[], None]:
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()
    return g.replay


def _time_us(replay: Callable[[], None], layers: int, reps: int) -> dict[str, float]:
    per = [t * 1e6 / layers for t in time_cuda(replay, reps, warmup=1)]
    return dict(us=statistics.median(per), us_min=min(per), us_max=max(per))


def _stamp_summary(stamps: dict[str, list], replay: Callable[[], None], n: int) -> dict[str, Any]:
    """Medians over layers and replays, us relative to the rotary kernel's post-wait stamp."""
    rows: dict[str, list[float]] = {}
    ticks: set[int] = set()

    def add(key: str, val: float) -> None:
        rows.setdefault(key, []).append(val)

    for _ in range(n):
        replay()
        torch.cuda.synchronize()
        host = {k: [t.cpu() for t in v] for k, v in stamps.items()}
        for layer in range(len(host["rope"])):
            r, a, m = host["rope"][layer], host["attention"][layer], host["merge"][layer]
            t0 = int(r[0, 1])
            ticks.update(int(x) % 1000 for x in a[:, 1].tolist())

            def rel(x: torch.Tensor) -> float:
                return (float(x) - t0) / 1e3

            add("rope_entry", rel(r[0, 0]))
            add("rope_stores", rel(r[0, 4]))
            add("attention_first_entry", rel(a[:, 0].min()))
            add("attention_last_entry", rel(a[:, 0].max()))
            add("attention_first_past_wait", rel(a[:, 1].min()))
            add("attention_last_past_wait", rel(a[:, 1].max()))
            add("attention_last_query_loaded", rel(a[:, 2].max()))
            # Stamps a variant does not take stay 0: the preloaded tile landed and the newest
            # position reloaded into it (PRELOAD only); the merge kernel's (not with fusedmerge).
            for slot, key in ((5, "preload_landed"), (6, "newest_reloaded")):
                if bool((a[:, slot] > 0).any()):
                    add(f"attention_last_{key}", rel(a[:, slot].max()))
            add("attention_last_math_done", rel(a[:, 3].max()))
            add("attention_last_stores", rel(a[:, 4].max()))
            if bool((m[:, 1] > 0).all()):
                add("merge_first_entry", rel(m[:, 0].min()))
                add("merge_first_past_wait", rel(m[:, 1].min()))
                add("merge_last_past_wait", rel(m[:, 1].max()))
                add("merge_last_stores", rel(m[:, 4].max()))
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in rows.items()}
    # A coarse %globaltimer shows as stamps that are all whole microseconds.
    out["timer_sub_us_values_seen"] = len(ticks)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ctx", type=int, nargs="+", default=[128])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--stamp-replays", type=int, default=10)
    ap.add_argument("--variants", default="default,nopreload,fusedmerge")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode_chain: needs a CUDA GPU (the chain is Triton kernels with "
              "programmatic dependent launch)", file=sys.stderr)
        return 2
    from tidal.worker.ops import triton_attention_kernels as tak

    result: dict[str, Any] = dict(device=torch.cuda.get_device_name(), layers=args.layers,
                                  runs=[])
    defaults = (tak.PRELOAD, tak.FUSED_MERGE)
    for variant in args.variants.split(","):
        tak.PRELOAD, tak.FUSED_MERGE = defaults
        plan_changes: dict[str, Any] = {}
        if variant == "nopreload":
            tak.PRELOAD = False
        elif variant == "fusedmerge":
            tak.FUSED_MERGE = True
        elif variant.startswith("stages"):
            plan_changes["num_stages"] = int(variant[len("stages"):])
        elif variant == "warps8":
            plan_changes["num_warps"] = 8
        elif variant == "tile32":
            plan_changes["tile_n"] = 32
        elif variant != "default":
            raise SystemExit(f"unknown variant {variant!r}")
        for tp in args.tp:
            for ctx in args.ctx:
                row: dict[str, Any] = dict(variant=variant, tp=tp, ctx=ctx)
                modes = ("full",) if variant != "default" else (
                    "full", "no_attention", "gemv_only", "light")
                for mode in modes:
                    replay = _graph(_chain(tp, ctx, args.layers, mode, None, "cuda",
                                           plan_changes))
                    row[f"{mode}_us_per_layer"] = _time_us(replay, args.layers, args.reps)
                    del replay
                for mode in ("full", "light") if variant == "default" else ("full",):
                    stamps: dict[str, list] = {}
                    replay = _graph(_chain(tp, ctx, args.layers, mode, stamps, "cuda",
                                           plan_changes))
                    row[f"stamped_{mode}_us_per_layer"] = _time_us(replay, args.layers,
                                                                   args.reps)
                    row[f"stamps_{mode}_us"] = _stamp_summary(stamps, replay,
                                                              args.stamp_replays)
                    del replay, stamps
                torch.cuda.empty_cache()
                print(json.dumps(row), flush=True)
                result["runs"].append(row)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
