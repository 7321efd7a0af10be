"""Where the GPU time of a decode step goes, from a torch-profiler Chrome trace.

    python tools/trace_steps.py trace_rank0.json [--steps N] [--json out.json] [--strip-to DIR]

Kernel sums mislead once kernels overlap (programmatic dependent launch starts a kernel while its
predecessor drains), so this walks the device timeline in start order and charges each kernel
only the time by which it pushes the timeline's end further out; a stretch with no kernel
running is charged to "idle" (the GPU waiting on the host or on another rank's launch). The
charges add up to the traced span exactly. Divided by ``--steps`` (the decode steps traced) they
give a per-step breakdown by kernel category and the kernels that cost the most. The host's CUDA
API calls in the trace (launches, copies, event records, synchronizations) are counted and timed
per step too: what the engine thread pays to feed the device.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

# First match wins; a name none of these catch is "other".
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern, re.IGNORECASE))
    for name, pattern in (
        ("all_reduce", r"lamport|all_reduce|allreduce|one_shot|sum_parts"),
        ("all_gather", r"allgather|all_gather"),
        ("nccl_other", r"nccl"),
        ("gemv", r"_gemv_kernel"),
        ("rope_kv_write", r"qk_norm_rope|rotary|rope|write_kv|reshape_and_cache"),
        ("attention", r"attention|attn|_merge|flash|split_kv"),
        ("argmax_sampling", r"argmax|sampl|softmax|topk|top_k|multinomial|exponential"),
        ("gemm", r"gemm|cutlass|nvjet|sm90_xmma|cublas|ampere_|sm80_"),
        ("norm", r"rms_norm|layer_norm|_norm_"),
        ("copy_fill", r"memcpy|memset|copy|fill|elementwise|index|gather|cat|where|vectorized"),
    )
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if pattern.search(name):
            return cat
    return "other"


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def load_host_calls(path: Path) -> list[dict[str, Any]]:
    """The host's CUDA runtime / driver API calls in the trace (launches, copies, event
    records, synchronizations): what the engine thread pays per step to feed the device."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events
            if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")]


def host_calls(calls: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """Per step: each API call's count and host time (microseconds), most time first.
    (Synchronizations' time is waiting, not work; the profiler inflates every call a little.)"""
    n = max(1, steps)
    count: dict[str, int] = defaultdict(int)
    spent: dict[str, float] = defaultdict(float)
    for e in calls:
        count[e["name"]] += 1
        spent[e["name"]] += float(e["dur"])
    order = sorted(spent, key=lambda k: -spent[k])
    return dict(calls_per_step=sum(count.values()) / n,
                by_call={k: dict(calls_per_step=round(count[k] / n, 2),
                                 us_per_step=round(spent[k] / n, 2)) for k in order[:15]})


def timeline(events: list[dict[str, Any]], steps: int,
             window_us: float | None = None) -> dict[str, Any]:
    """Per-step charges by category and by kernel name (microseconds), the span and idle.
    ``window_us``: only the last that many microseconds of the timeline (steady-state decode
    steps, without the prefill the trace starts with)."""
    if not events:
        return dict(kernels=0, error="no device events in the trace (was CUDA profiled?)")
    devices = {e.get("args", {}).get("device", 0) for e in events}
    if len(devices) > 1:  # one worker process owns one device; keep the busiest
        counts: dict[Any, int] = defaultdict(int)
        for e in events:
            counts[e.get("args", {}).get("device", 0)] += 1
        keep = max(counts, key=counts.__getitem__)
        events = [e for e in events if e.get("args", {}).get("device", 0) == keep]
    events = sorted(events, key=lambda e: (float(e["ts"]), float(e["dur"])))
    if window_us is not None:
        last = max(float(e["ts"]) + float(e["dur"]) for e in events)
        events = [e for e in events if float(e["ts"]) >= last - window_us]
    first = float(events[0]["ts"])
    frontier = first
    idle = 0.0
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    gaps: list[float] = []
    charges: list[float] = []
    for e in events:
        start, dur = float(e["ts"]), float(e["dur"])
        end = start + dur
        if start > frontier:
            idle += start - frontier
            gaps.append(start - frontier)
            frontier = start
        charge = max(0.0, end - frontier)
        charges.append(charge)
        frontier = max(frontier, end)
        name = e["name"]
        by_cat[category(name)] += charge
        by_name[name[:100]] += charge
        calls[name[:100]] += 1
    span = frontier - first
    n = max(1, steps)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:25]
    gaps.sort(reverse=True)
    return dict(
        kernels=len(events), steps=steps, span_us=span, per_step_us=span / n,
        idle_us_per_step=idle / n, busy_fraction=1.0 - idle / span if span else None,
        largest_gaps_us=[round(g, 1) for g in gaps[:10]],
        kernels_per_step=len(events) / n,
        by_category_us_per_step={k: round(v / n, 2)
                                 for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        top_kernels=[dict(name=k, us_per_step=round(v / n, 2), calls_per_step=calls[k] / n)
                     for k, v in top],
        layer=layer_profile(events, charges),
    )


def layer_profile(events: list[dict[str, Any]], charges: list[float], anchor: str = "rope",
                  length: int = 10) -> list[dict[str, Any]]:
    """The kernels of a typical decoder layer: for each run of ``length`` kernels that starts
    at a kernel whose name contains ``anchor``, each kernel's start and end relative to the
    anchor's start and the time it added to the timeline; medians over every such run whose
    names match the most common sequence. Shows where dependent launches start early and
    which kernel holds the critical path."""
    runs: dict[tuple[str, ...], list[list[tuple[float, float, float]]]] = defaultdict(list)
    for i, e in enumerate(events[: len(events) - length]):
        if anchor not in e["name"]:
            continue
        t0 = float(e["ts"])
        run = events[i : i + length]
        key = tuple(r["name"][:40] for r in run)
        runs[key].append([(float(r["ts"]) - t0, float(r["ts"]) + float(r["dur"]) - t0,
                           charges[i + j]) for j, r in enumerate(run)])
    if not runs:
        return []
    key, samples = max(runs.items(), key=lambda kv: len(kv[1]))

    def med(values: list[float]) -> float:
        values = sorted(values)
        return round(values[len(values) // 2], 2)

    return [dict(name=name, start_us=med([s[j][0] for s in samples]),
                 end_us=med([s[j][1] for s in samples]),
                 charge_us=med([s[j][2] for s in samples]), runs=len(samples))
            for j, name in enumerate(key)]


def strip(path: Path, dest: Path) -> Path:
    """A gzipped copy of the trace with only the device events and the host's CUDA API calls
    (a tenth of the size or less: what this script and a timeline viewer need)."""
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    keep = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset",
                                                   "cuda_runtime", "cuda_driver"):
            args = e.get("args", {})
            e["args"] = {k: args[k] for k in ("device", "stream", "correlation") if k in args}
            keep.append(e)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"{path.parent.name}_{path.stem}.json.gz"
    with gzip.open(out, "wt") as f:
        json.dump({"traceEvents": keep}, f)
    return out


def analyse(path: Path, steps: int, window_us: float | None = None) -> dict[str, Any]:
    result = timeline(load_events(path), steps, window_us)
    result["host_api"] = host_calls(load_host_calls(path), steps)
    result["trace"] = path.name
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=1, help="decode steps the trace covers")
    ap.add_argument("--window-us", type=float, default=None,
                    help="analyse only the last this many microseconds of the timeline")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--strip-to", type=Path, default=None,
                    help="also write a device-only gzipped copy of each trace to this folder")
    args = ap.parse_args()
    results = [analyse(p, args.steps, args.window_us) for p in args.traces]
    if args.strip_to:
        for p in args.traces:
            print("stripped:", strip(p, args.strip_to))
    for r in results:
        print(f"{r['trace']}: {r.get('per_step_us', 0):.1f} us/step, idle "
              f"{r.get('idle_us_per_step', 0):.1f}, {r.get('kernels_per_step', 0):.0f} kernels")
        for cat, us in r.get("by_category_us_per_step", {}).items():
            print(f"  {cat:16s} {us:9.1f}")
        api = r.get("host_api", {})
        print(f"  host API calls a step: {api.get('calls_per_step', 0):.0f}")
        for name, c in api.get("by_call", {}).items():
            print(f"    {name:32s} {c['calls_per_step']:7.1f} calls {c['us_per_step']:9.1f} us")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
