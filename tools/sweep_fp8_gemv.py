"""Launch shapes of the one-row GEMV with FP8 (e4m3) weights, for the batch-1 decode of a
model quantized with ``--quantization fp8`` (issue 23): each of a shape's GEMVs (with the norm
prologue and SiLU epilogue the engine fuses into it) under the default rule and every launch
shape of ``gpu_kernel_check.GEMV_SWEEP``, in CUDA graphs over enough weight copies to stream
from HBM. Prints the best per GEMV and the ``GEMV_CONFIGS`` entries (element size 1) to
commit in ``worker/ops/triton_decode.py``.

    python tools/sweep_fp8_gemv.py --shape llama8b --out fp8_gemv.json
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


def main(argv: list[str] | None = None) -> int:
    import torch

    from gpu_kernel_check import DECODE1_GEMVS, GEMV_SWEEP, time_calls
    from tidal.worker.ops import triton_decode as td
    from tidal.worker.ops.fp8_torch import quantize_rows

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama8b", help="prefix of gpu_kernel_check's GEMV names")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, dt = "cuda", torch.bfloat16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results: list[dict[str, Any]] = []
    best: dict[str, Any] = {}
    for name, n, k, kind in DECODE1_GEMVS:
        if not name.startswith(args.shape + "/"):
            continue
        silu = kind == "silu"
        nbytes = n * k
        copies = max(2, min(48, math.ceil(256 * 2**20 / nbytes)))
        ws, ss = [], []
        for _ in range(copies):
            q, s = quantize_rows(torch.randn((n, k), device=dev, dtype=torch.float32))
            ws.append(q)
            ss.append(s.reshape(-1).contiguous())
        x = torch.randn((1, k), device=dev, dtype=dt)
        r = torch.randn((1, k), device=dev, dtype=dt)
        nw = torch.randn(k, device=dev, dtype=dt)
        nwv, rv = (nw, r) if kind else (None, None)
        default = td.gemv_config(n // 2 if silu else n, k, silu, 1, sms)
        rows: list[dict[str, Any]] = []

        def timed(c: tuple[int, ...] | None) -> None:
            try:
                t = time_calls([(lambda w=w, s=s, c=c: td.gemv(
                    x, w, norm_weight=nwv, residual=rv, eps=1e-6, silu=silu, config=c,
                    weight_scale=s)) for w, s in zip(ws, ss)])
            except Exception as exc:  # a launch shape that does not compile
                rows.append({"config": c, "error": str(exc)[:200]})
                return
            rows.append({"config": list(default if c is None else c), "default": c is None,
                         "ms": t["ms"], "GBps": nbytes / t["ms"] / 1e6})

        # One-byte weights: the 16-bit sweep's shapes and twice as long K chunks; then the
        # five best with a second chunk fetched ahead.
        shapes = sorted({*GEMV_SWEEP, *((bn, 2 * bk, w) for bn, bk, w in GEMV_SWEEP)})
        for c in [None] + [c for c in shapes if c[1] <= max(64, 1 << (k - 1).bit_length())]:
            timed(c)
        firsts = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])[:5]
        for r in firsts:
            c = tuple(r["config"][:3])
            if 2 * c[1] <= k:
                timed((*c, 2))
        ok = [r for r in rows if "ms" in r]
        top = min(ok, key=lambda r: r["ms"])
        d = next(r for r in ok if r["default"])
        print(f"{name:18s} {n}x{k}{' silu' if silu else ''}: default {d['config']} "
              f"{d['ms'] * 1e3:.1f} us ({d['GBps']:.0f} GB/s); best {top['config']} "
              f"{top['ms'] * 1e3:.1f} us ({top['GBps']:.0f} GB/s)", flush=True)
        best[name] = {"n": n // 2 if silu else n, "k": k, "silu": silu, "config": top["config"],
                      "us": top["ms"] * 1e3, "default_us": d["ms"] * 1e3}
        results.append({"gemv": name, "n": n, "k": k, "kind": kind, "rows": rows})
        del ws, ss
        torch.cuda.empty_cache()
    print("GEMV_CONFIGS entries (element size 1):")
    for name, b in best.items():
        c = b["config"]
        pre = c[3] if len(c) > 3 else 1
        print(f"    ({b['n']}, {b['k']}, {b['silu']}, 1): ({c[0]}, {c[1]}, {c[2]}, {pre}),"
              f"  # {name}: {b['default_us']:.1f} -> {b['us']:.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                              "best": best, "sweep": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
