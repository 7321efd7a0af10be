"""Launch shapes of the INT4 (W4A16) GEMV for the batch-1 decode of an AWQ / GPTQ model
(issue 23): each of a shape's projections, group 128, one activation row, under the split-K
kernel (what the engine ran before ``_w4a16_gemv_rows``), the whole-row kernel's default rule
and a sweep of its launch shapes, in CUDA graphs over enough weight copies to stream from HBM,
each launch shape's output first checked against the torch reference. Then the group-tiled
kernel (``_w4a16_gemv_groups``, the batch-1 default) under its rule and over its launch
shapes. Prints the best per projection and the ``GEMV_ROWS_CONFIGS`` / ``GEMV_GROUPS_CONFIGS``
entries to commit in ``worker/ops/triton_w4a16.py``.

    python tools/sweep_int4_gemv.py --shape llama8b --out int4_gemv.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

# (BLOCK_N, BLOCK_K, num_warps) of the whole-row kernel.
SWEEP = [(bn, bk, w) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for w in (1, 2, 4)
         if 2048 <= bn * bk <= 16384 and bn * bk // 8 >= 32 * w]  # fmt: skip
# (BLOCK_N, groups a chunk, num_warps, num_stages, prefetch, K splits) of the group-tiled kernel
# at group 128 (16 packed words a group): one warp of 16 to 64 rows (the fewest instructions a
# weight in its sm_90 SASS: the rows share each activation value), at most 64 words a thread
# (32 rows x 8 groups spills), K split for the narrow weights' grids; and two warps.
GROUPS_SWEEP = [(bn, gpc, w, 1, pf, sp) for w in (1, 2) for bn in (16, 32, 64)
                for gpc in (1, 2, 4) for pf in (False, True) for sp in (1, 2, 4, 8, 16)
                if 8 * 32 * w <= bn * gpc * 16 <= 64 * 32 * w
                and (w == 1 or (not pf and sp in (1, 4)))]  # fmt: skip
# Triton's software pipelining of the word loads (two stages) on the best one-warp shapes.
GROUPS_SWEEP += [(bn, gpc, 1, 2, False, sp) for bn, gpc in ((16, 2), (32, 2), (32, 4))
                 for sp in (2, 4, 8, 16)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import torch

    from gpu_kernel_check import DECODE1_GEMVS, time_calls
    from tidal.worker.ops import int4_torch
    from tidal.worker.ops import triton_w4a16 as w4

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama8b", help="prefix of gpu_kernel_check's GEMV names")
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--out", default=None)
    p.add_argument("--rows-only", action="store_true", help="skip the group-tiled kernel")
    p.add_argument("--groups-only", action="store_true",
                   help="of the whole-row kernel, time only its default rule")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dt, group = "cuda", torch.bfloat16, args.group
    results: list[dict[str, Any]] = []
    best: dict[str, Any] = {}
    for name, n, k, _kind in DECODE1_GEMVS:
        if not name.startswith(args.shape + "/"):
            continue
        ng = -(-k // group)
        nbytes = n * k // 2 + n * ng * 3  # packed weights, bf16 scales, uint8 zeros
        copies = max(2, min(48, math.ceil(256 * 2**20 / nbytes)))
        gen = torch.Generator(device=dev).manual_seed(n + k)
        weights = [(torch.randint(-2**31, 2**31 - 1, (n, k // 8), device=dev, dtype=torch.int32,
                                  generator=gen),
                    (torch.rand((n, ng), device=dev, generator=gen) * 0.02).to(dt),
                    torch.randint(0, 16, (n, ng), device=dev, dtype=torch.uint8, generator=gen))
                   for _ in range(copies)]  # fmt: skip
        x = torch.randn((1, k), device=dev, dtype=dt)
        rows: list[dict[str, Any]] = []
        # Every launch shape's output is checked against the torch reference (float32 from the
        # same dequantized weights) before it is timed: a wrong one is listed, never a winner.
        q0, s0, z0 = weights[0]
        ref = x.float() @ int4_torch.dequantize(q0, s0, z0, group, None, dt).float().t()
        ref_scale = float(ref.abs().amax().clamp_min(1.0))

        def timed(label: str, config: tuple | None) -> None:
            saved = (dict(w4.GEMV_ROWS_CONFIGS), w4.ROWS_MAX_GROUP,
                     dict(w4.GEMV_GROUPS_CONFIGS), w4.GROUPS_MAX_GROUP)
            try:
                w4.GEMV_ROWS_CONFIGS.clear()
                w4.GEMV_GROUPS_CONFIGS.clear()
                if not label.startswith("groups"):
                    w4.GROUPS_MAX_GROUP = 0  # the group-tiled kernel takes nothing
                if label == "split_k":
                    w4.ROWS_MAX_GROUP = 0  # nor the whole-row one
                elif label == "groups":
                    w4.GEMV_GROUPS_CONFIGS[(n, k, group)] = config
                elif config is not None and label == "rows":
                    w4.GEMV_ROWS_CONFIGS[(n, k, group)] = config
                used = (None if label == "split_k" else config if label == "groups"
                        else w4.gemv_groups_config(n, k, group, x.device)
                        if label == "groups_default" else w4.gemv_rows_config(n, k, group))
                err = float((w4.w4a16_linear(x, q0, s0, z0, group).float() - ref).abs().max())
                if err > 1e-2 * ref_scale:
                    rows.append({"kernel": label, "config": config,
                                 "error": f"wrong output: max error {err:.3g} of {ref_scale:.3g}"})
                    print(f"  {label} {config}: wrong output ({err:.3g} of {ref_scale:.3g})",
                          flush=True)
                    return
                t = time_calls([(lambda q=q, s=s, z=z: w4.w4a16_linear(x, q, s, z, group))
                                for q, s, z in weights])
            except Exception as exc:  # a launch shape that does not compile
                rows.append({"kernel": label, "config": config, "error": str(exc)[:200]})
                return
            finally:
                w4.GEMV_ROWS_CONFIGS.clear()
                w4.GEMV_ROWS_CONFIGS.update(saved[0])
                w4.ROWS_MAX_GROUP = saved[1]
                w4.GEMV_GROUPS_CONFIGS.clear()
                w4.GEMV_GROUPS_CONFIGS.update(saved[2])
                w4.GROUPS_MAX_GROUP = saved[3]
            rows.append({"kernel": label, "config": used, "ms": t["ms"],
                         "GBps": nbytes / t["ms"] / 1e6})

        timed("split_k", None)
        timed("rows_default", None)
        for c in [] if args.groups_only else SWEEP:
            if c[1] <= max(1024, 1 << (k - 1).bit_length()):
                timed("rows", c)
        if w4.groups_kernel_takes(group) and not args.rows_only:
            timed("groups_default", None)
            for c in GROUPS_SWEEP:
                timed("groups", c)
        ok = [r for r in rows if "ms" in r]
        top = min((r for r in ok if r["kernel"] == "rows" or r["kernel"] == "rows_default"),
                  key=lambda r: r["ms"])
        top_groups = min((r for r in ok if r["kernel"] == "groups"), key=lambda r: r["ms"],
                         default=None)
        old = next(r for r in ok if r["kernel"] == "split_k")
        default = next(r for r in ok if r["kernel"] == "rows_default")
        print(f"{name:18s} {n}x{k} g{group}: split-K {old['ms'] * 1e3:.1f} us "
              f"({old['GBps']:.0f} GB/s); rows default {default['config']} "
              f"{default['ms'] * 1e3:.1f} us; best {top['config']} {top['ms'] * 1e3:.1f} us "
              f"({top['GBps']:.0f} GB/s)", flush=True)
        best[name] = {"n": n, "k": k, "config": top["config"], "us": top["ms"] * 1e3,
                      "default_us": default["ms"] * 1e3, "split_k_us": old["ms"] * 1e3}
        if top_groups is not None:
            rule = next((r for r in ok if r["kernel"] == "groups_default"),
                        {"config": "failed", "ms": math.inf})
            print(f"{'':18s} group-tiled rule {rule['config']} {rule['ms'] * 1e3:.1f} us; best "
                  f"{top_groups['config']} {top_groups['ms'] * 1e3:.1f} us "
                  f"({top_groups['GBps']:.0f} GB/s)", flush=True)
            best[name]["groups_config"] = top_groups["config"]
            best[name]["groups_us"] = top_groups["ms"] * 1e3
            best[name]["groups_rule_config"] = rule["config"]
            best[name]["groups_rule_us"] = rule["ms"] * 1e3
        results.append({"gemv": name, "n": n, "k": k, "rows": rows})
        weights.clear()
        torch.cuda.empty_cache()
    print("GEMV_ROWS_CONFIGS entries:")
    for name, b in best.items():
        c = b["config"]
        print(f"    ({b['n']}, {b['k']}, {group}): ({c[0]}, {c[1]}, {c[2]}),"
              f"  # {name}: {b['default_us']:.1f} -> {b['us']:.1f} us")
    print("GEMV_GROUPS_CONFIGS entries (where 2 % or more faster than the rule):")
    for name, b in best.items():
        if b.get("groups_us", math.inf) < 0.98 * b.get("groups_rule_us", math.inf):
            print(f"    ({b['n']}, {b['k']}, {group}): {tuple(b['groups_config'])},"
                  f"  # {name}: {b['groups_rule_us']:.1f} -> {b['groups_us']:.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                              "group": group,
                                              "best": best, "sweep": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
