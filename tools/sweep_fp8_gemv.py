"""Launch shapes of the one-row GEMV with FP8 (e4m3) weights, for the batch-1 decode of a
model quantized with ``--quantization fp8`` (issue 23): each of a shape's GEMVs (with the norm
prologue and SiLU epilogue the engine fuses into it) under the default rule and every launch
shape of ``gpu_kernel_check.GEMV_SWEEP``, in CUDA graphs over enough weight copies to stream
from HBM. Prints the best per GEMV and the ``GEMV_CONFIGS`` entries (element size 1) to
commit in ``worker/ops/triton_decode.py``.

With ``--dot``, each GEMV is also timed on the few-row tensor-core kernel
(``triton_gemv_rows``, FP8 weights widened in registers) over its launch shapes, as the engine
would run each: the norm before it apart (``add_rms_norm_row``), where the elementwise GEMV
takes it as its prologue below ``NORM_APART_MIN_WEIGHTS``. Prints the ``FP8_ROWS_CONFIGS``
entries where that sequence beat the elementwise one's (with its table launch shape).

    python tools/sweep_fp8_gemv.py --shape llama8b --dot --out fp8_gemv.json

``--dot-rows 2,4,8`` times the tensor-core kernel at those row counts against the engine's
path for FP8 weights there without it (rows normed and quantized, cuBLASLt). (Stop 49's table
was measured when this baseline ran the norm and the quantization as two kernels, the
engine's one pass and the GEMM as three: q/k/v's and gate/up's baselines a launch too slow.)
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
    from tidal.worker.ops.kernels import NORM_APART_MIN_WEIGHTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama8b", help="prefix of gpu_kernel_check's GEMV names")
    p.add_argument("--dot", action="store_true",
                   help="also sweep the tensor-core kernel (FP8_ROWS_CONFIGS)")
    p.add_argument("--dot-rows", default="",
                   help="comma-separated row counts (2-8) at which to time the tensor-core "
                        "kernel against the engine's FP8 path for them (rows quantized, "
                        "cuBLASLt), e.g. 2,4,8")
    p.add_argument("--skip-fma-sweep", action="store_true",
                   help="time the elementwise GEMV at its table's launch shape only")
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

        apart = bool(kind) and n * k >= NORM_APART_MIN_WEIGHTS

        def call(w: Any, s: Any, c: tuple[int, ...] | None) -> None:
            # As the engine runs it: the norm apart before a large weight, else the prologue.
            if apart:
                h, _ = td.add_rms_norm_row(x, r, nw, 1e-6)
                td.gemv(h, w, silu=silu, config=c, weight_scale=s)
            else:
                td.gemv(x, w, norm_weight=nwv, residual=rv, eps=1e-6, silu=silu, config=c,
                        weight_scale=s)

        def timed(c: tuple[int, ...] | None) -> None:
            try:
                t = time_calls([(lambda w=w, s=s, c=c: call(w, s, c))
                                for w, s in zip(ws, ss)])
            except Exception as exc:  # a launch shape that does not compile
                rows.append({"config": c, "error": str(exc)[:200]})
                return
            rows.append({"config": list(default if c is None else c), "default": c is None,
                         "ms": t["ms"], "GBps": nbytes / t["ms"] / 1e6})

        # One-byte weights: the 16-bit sweep's shapes and twice as long K chunks; then the
        # five best with a second chunk fetched ahead.
        shapes = sorted({*GEMV_SWEEP, *((bn, 2 * bk, w) for bn, bk, w in GEMV_SWEEP)})
        for c in [None] + ([] if args.skip_fma_sweep else
                           [c for c in shapes if c[1] <= max(64, 1 << (k - 1).bit_length())]):
            timed(c)
        firsts = [] if args.skip_fma_sweep else sorted(
            (r for r in rows if "ms" in r), key=lambda r: r["ms"])[:5]
        for r in firsts:
            c = tuple(r["config"][:3])
            if 2 * c[1] <= k:
                timed((*c, 2))
        ok = [r for r in rows if "ms" in r]
        top = min(ok, key=lambda r: r["ms"])
        d = next(r for r in ok if r["default"])
        what = f"{n}x{k}{' silu' if silu else ''}{', norm apart' if apart else ''}"
        print(f"{name:18s} {what}: default {d['config']} "
              f"{d['ms'] * 1e3:.1f} us ({d['GBps']:.0f} GB/s); best {top['config']} "
              f"{top['ms'] * 1e3:.1f} us ({top['GBps']:.0f} GB/s)", flush=True)
        best[name] = {"n": n // 2 if silu else n, "k": k, "silu": silu, "config": top["config"],
                      "us": top["ms"] * 1e3, "default_us": d["ms"] * 1e3}
        case = {"gemv": name, "n": n, "k": k, "kind": kind, "rows": rows}
        if args.dot:
            case["dot"] = _dot_sweep(name, ws, ss, x, r, nw, kind, silu, time_calls, td)
            best[name]["dot"] = case["dot"]["summary"]
        for m in [int(v) for v in args.dot_rows.split(",") if v]:
            xm = torch.randn((m, k), device=dev, dtype=dt)
            rm = torch.randn((m, k), device=dev, dtype=dt)
            case[f"dot_rows{m}"] = _dot_rows_sweep(name, ws, ss, xm, rm, nw, kind, silu,
                                                   time_calls)
        results.append(case)
        del ws, ss
        torch.cuda.empty_cache()
    print("GEMV_CONFIGS entries (element size 1):")
    for name, b in best.items():
        c = b["config"]
        pre = c[3] if len(c) > 3 else 1
        print(f"    ({b['n']}, {b['k']}, {b['silu']}, 1): ({c[0]}, {c[1]}, {c[2]}, {pre}),"
              f"  # {name}: {b['default_us']:.1f} -> {b['us']:.1f} us")
    if args.dot:
        print("FP8_ROWS_CONFIGS entries (the tensor-core sequence faster than the engine's):")
        for name, b in best.items():
            sm = b.get("dot")
            if sm and sm["dot_us"] < sm["engine_us"]:
                print(f"    ({b['n']}, {b['k']}, {b['silu']}): {tuple(sm['config'])},"
                      f"  # {name}: {sm['engine_us']:.1f} -> {sm['dot_us']:.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                              "best": best, "sweep": results}, indent=1))
    return 0


DOT_SWEEP = [(bn, bk, 4, 3, sp) for bn in (32, 64, 128) for bk in (128, 256, 512)
             for sp in (1, 2, 4)] + [(128, 256, 8, 3, 1), (64, 256, 4, 4, 1), (128, 128, 4, 4, 1)]


def _engine_against_dot(engine: Any, dot: Any, ws: list, ss: list, configs: list,
                        time_calls: Any) -> tuple[float, list[dict[str, Any]], list[dict]]:
    """Microseconds per call of ``engine(w, s)`` and of ``dot(w, s, config)`` for each config,
    over the weight copies: (engine, every config's row, the timed ones fastest first)."""
    base = time_calls([(lambda w=w, s=s: engine(w, s)) for w, s in zip(ws, ss)])["ms"] * 1e3
    rows: list[dict[str, Any]] = []
    for c in configs:
        try:
            t = time_calls([(lambda w=w, s=s, c=c: dot(w, s, c)) for w, s in zip(ws, ss)])
        except Exception as exc:  # a launch shape that does not fit
            rows.append({"config": list(c), "error": str(exc)[:160]})
            continue
        rows.append({"config": list(c), "us": t["ms"] * 1e3})
    return base, rows, sorted((d for d in rows if "us" in d), key=lambda d: d["us"])


def _dot_sweep(name: str, ws: list, ss: list, x: Any, r: Any, nw: Any, kind: str, silu: bool,
               time_calls: Any, td: Any) -> dict[str, Any]:
    """The engine's sequence for this GEMV on the elementwise kernel against the same on the
    tensor-core kernel over ``DOT_SWEEP``: microseconds per call (norm included)."""
    from tidal.worker.ops import triton_gemv_rows as tr
    from tidal.worker.ops.kernels import NORM_APART_MIN_WEIGHTS

    act = "silu" if silu else None
    apart = bool(kind) and ws[0].numel() >= NORM_APART_MIN_WEIGHTS

    def engine(w: Any, s: Any) -> None:
        if apart:
            h, _ = td.add_rms_norm_row(x, r, nw, 1e-6)
            td.gemv(h, w, silu=silu, weight_scale=s)
        elif kind:
            td.gemv(x, w, norm_weight=nw, residual=r, eps=1e-6, silu=silu, weight_scale=s)
        else:
            td.gemv(x, w, weight_scale=s)

    def dot(w: Any, s: Any, c: tuple) -> None:
        h = td.add_rms_norm_row(x, r, nw, 1e-6)[0] if kind else x
        tr.gemv_rows(h, w, act=act, config=c, weight_scale=s)

    base, rows, ok = _engine_against_dot(engine, dot, ws, ss, DOT_SWEEP, time_calls)
    top = ok[0]
    print(f"{name:18s} engine (elementwise{', norm apart' if apart else ''}) {base:.1f} us; "
          f"tensor cores best {top['config']} {top['us']:.1f} us; next "
          f"{[(d['config'], round(d['us'], 1)) for d in ok[1:4]]}", flush=True)
    return {"summary": {"engine_us": base, "dot_us": top["us"], "config": top["config"],
                        "norm_apart": apart}, "rows": rows}


def _dot_rows_sweep(name: str, ws: list, ss: list, x: Any, r: Any, nw: Any, kind: str,
                    silu: bool, time_calls: Any) -> dict[str, Any]:
    """``x``'s rows (2 to 8) through the engine's ops without the few-row GEMV (the policy's
    ``gemv_rows`` off: one Triton pass adds, norms and quantizes the rows, cuBLASLt multiplies)
    against the norm and the tensor-core kernel."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for
    from tidal.worker.ops import triton_decode as td
    from tidal.worker.ops import triton_gemv_rows as tr

    ops = kernels_for(x.device, KernelConfig(ops="triton", gemv_rows=False))
    act = "silu" if silu else None

    def engine(w: Any, s: Any) -> None:
        if kind:
            ops.rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, silu=silu)
        else:
            ops.fp8_linear(x, w, s)

    def dot(w: Any, s: Any, c: tuple) -> None:
        h = td.add_rms_norm_rows(x, r, nw, 1e-6)[0] if kind else x
        tr.gemv_rows(h, w, act=act, config=c, weight_scale=s)

    base, rows, ok = _engine_against_dot(engine, dot, ws, ss,
                                         [c for c in DOT_SWEEP if c[1] <= 256], time_calls)
    m = x.shape[0]
    print(f"{name:18s} {m} rows: engine (rows quantized, cuBLASLt) {base:.1f} us; tensor cores "
          f"best {ok[0]['config']} {ok[0]['us']:.1f} us; next "
          f"{[(d['config'], round(d['us'], 1)) for d in ok[1:3]]}", flush=True)
    return {"rows": m, "engine_us": base, "dot_us": ok[0]["us"], "config": ok[0]["config"],
            "sweep": rows}


if __name__ == "__main__":
    sys.exit(main())
