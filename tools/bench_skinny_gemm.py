"""The few-row tensor-core product (``csrc/skinny_gemm.cu``) against the kernels the engine runs
today, per weight, row count and weight format: microseconds per call, the weight bytes'
rate, and every launch shape of the CUDA kernel (the best, and the one ``launch_shape``
picks).

    python tools/bench_skinny_gemm.py --shape llama-3.1-8b --formats bf16 fp8 int4 \
        --rows 1 4 --out skinny.json        # a GPU

What it compares against, per format: bf16 cuBLAS, the one-row Triton GEMV (one row) and the
few-row Triton GEMV (2-8 rows); FP8 the one-row / few-row Triton GEMVs (weight-only, e4m3
widened in registers); ``fp8_block`` (a scale per row and 128 inputs, the block-wise layout)
the Triton block GEMM (activations quantized per group; the kernel here is weight-only, so
the check's reference is the dequantized weight's product); INT4 (groups of 128) the Triton
W4A16 GEMVs the engine picks
(``triton_w4a16.w4a16_linear`` / ``w4a16_gated_gemv``). Gated weights (fused gate/up) are
timed with SiLU-and-mul, fused where the kernel fuses it.

Each case cycles through copies of its weight that together exceed the L2 cache four times,
50 calls in a CUDA graph, the median of 5 replays (``bench_gemv_rows._time``). Every kernel's
output is checked against a float64 product of the same dequantized weight first.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_name, dump  # noqa: E402
from bench_gemv_rows import SHAPES, _time  # noqa: E402

GROUP = 128


def _reference(x: torch.Tensor, w: torch.Tensor, gated: bool) -> torch.Tensor:
    y = F.linear(x.double(), w.double())
    if gated:
        g, u = y.chunk(2, dim=-1)
        y = g * torch.sigmoid(g) * u
    return y


def _weights(fmt: str, n_rows: int, k: int, copies: int, dev: torch.device):
    """``copies`` weights in ``fmt`` and, for the reference, the first one dequantized."""
    from tidal.worker.ops import fp8_block_torch as fbt
    from tidal.worker.ops import int4_torch

    out = []
    for _ in range(copies):
        w = torch.randn(n_rows, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        if fmt == "bf16":
            out.append({"w": w})
        elif fmt == "fp8":
            scale = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
            w_q = (w.float() / scale).to(torch.float8_e4m3fn)
            out.append({"w": w_q, "w_scale": scale})
        elif fmt == "fp8_block":
            w_q, scale = fbt.quantize_weight_blocks(w, 1, GROUP)
            out.append({"w": w_q, "scales": scale})
        else:
            qw, s, z = int4_torch.quantize_rtn(w, GROUP)
            out.append({"w": qw, "scales": s.to(torch.bfloat16), "zeros": z})
    first = out[0]
    if fmt == "bf16":
        dense = first["w"]
    elif fmt == "fp8":
        dense = first["w"].float() * first["w_scale"]
    elif fmt == "fp8_block":
        dense = fbt.dequantize_weight(first["w"], first["scales"], GROUP)
    else:
        dense = int4_torch.dequantize(first["w"], first["scales"], first["zeros"], GROUP,
                                      dtype=torch.bfloat16)
    return out, dense


def _baselines(fmt: str, rows: int, gated: bool):
    """(name, fn(x, weight dict)) of the kernels the engine runs for this case."""
    from tidal.worker.ops import torch_ops
    from tidal.worker.ops import triton_decode as td
    from tidal.worker.ops import triton_gemv_rows as tr
    from tidal.worker.ops import triton_w4a16 as w4

    act = "silu" if gated else None
    cases = []
    if fmt == "bf16":
        def cublas(x, d):
            y = F.linear(x, d["w"])
            return torch_ops.silu_and_mul(y) if gated else y
        cases.append(("cublas", cublas))
        if rows == 1:
            cases.append(("triton_gemv", lambda x, d: td.gemv(x, d["w"], silu=gated)[0]))
        else:
            cases.append(("triton_rows", lambda x, d: tr.gemv_rows(x, d["w"], act=act)))
    elif fmt == "fp8":
        if rows == 1:
            cases.append(("triton_gemv", lambda x, d: td.gemv(
                x, d["w"], silu=gated, weight_scale=d["w_scale"])[0]))
        cases.append(("triton_rows", lambda x, d: tr.gemv_rows(
            x, d["w"], act=act, weight_scale=d["w_scale"])))
    elif fmt == "fp8_block":
        from tidal.worker.ops import triton_fp8_block as tfb

        def block_gemm(x, d):  # what the engine runs without skinny_fp8_block
            y = tfb.fp8_block_linear(x, d["w"], d["scales"], GROUP, None)
            return torch_ops.silu_and_mul(y) if gated else y
        cases.append(("triton_fp8_block", block_gemm))
    else:
        def int4(x, d):
            if gated and w4.gated_gemv_applies(x, d["w"], GROUP, None):
                return w4.w4a16_gated_gemv(x, d["w"], d["scales"], d["zeros"], GROUP, "silu")
            y = w4.w4a16_linear(x, d["w"], d["scales"], d["zeros"], GROUP)
            return torch_ops.silu_and_mul(y) if gated else y
        cases.append(("triton_w4a16", int4))
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--formats", nargs="+", default=["bf16", "fp8", "int4"],
                   choices=("bf16", "fp8", "fp8_block", "int4"))
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--no-sweep", action="store_true", help="only the picked launch shape")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from tidal.worker.ops import cuda_ext
    from tidal.worker.ops import skinny_gemm as sk

    built = cuda_ext.build_result()
    print(f"extension: {built.error or 'ok'} ({built.seconds:.1f} s, cached={built.cached})",
          flush=True)
    dev = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    results = []
    for fmt in args.formats:
        for n, k, gated in SHAPES[args.shape]:
            n_rows = n  # SHAPES' N counts both halves of a gated weight
            per_byte = {"bf16": 2, "fp8": 1, "fp8_block": 1, "int4": 0.5}[fmt]
            nbytes = int(n_rows * k * per_byte)
            copies = max(2, -(-4 * l2 // nbytes))
            ws, dense = _weights(fmt, n_rows, k, copies, dev)
            act = "silu" if gated else None
            for m in args.rows:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                ref = _reference(x, dense, gated)
                row = {"format": fmt, "n": n, "k": k, "gated": gated, "rows": m,
                       "weight_mb": round(nbytes / 1e6, 2)}

                def check(name: str, out: torch.Tensor) -> None:
                    err = float((out.double() - ref).norm() / ref.norm())
                    # (The block GEMM also rounds the activations to e4m3: ~3 % rms.)
                    tol = 6e-2 if name == "triton_fp8_block" else 2e-2
                    assert err < tol, f"{fmt} {(n, k, gated)} rows {m} {name}: error {err:.3g}"

                for name, fn in _baselines(fmt, m, gated):
                    check(name, fn(x, ws[0]))
                    row[f"{name}_us"] = round(_time(lambda i, fn=fn: fn(x, ws[i]), copies), 2)

                def skinny(i: int, cfg=None) -> torch.Tensor:
                    d = ws[i]
                    return sk.skinny_gemm(x, d["w"], w_scale=d.get("w_scale"),
                                          scales=d.get("scales"), zeros=d.get("zeros"),
                                          group_size=GROUP, act=act, config=cfg)

                if not sk.supported(x, ws[0]["w"], GROUP, gated,
                                    fp8_groups=fmt == "fp8_block"):
                    row["skinny"] = "not supported"
                    print(row, flush=True)
                    results.append(row)
                    continue
                wfmt = sk.weight_format(ws[0]["w"], x)
                if fmt == "fp8_block":  # (as skinny_gemm decides, from the group scales)
                    wfmt = sk.FORMAT_FP8_GROUPS
                staged = (wfmt == sk.FORMAT_INT4 and sk.stages_activations(m, k, GROUP)
                          and os.environ.get("TIDAL_SKINNY_STAGED") != "0")
                picked = sk.launch_shape(n // 2 if gated else n, wfmt, gated, staged)
                check("skinny", skinny(0))
                row["skinny_us"] = round(_time(lambda i: skinny(i), copies), 2)
                row["skinny_picked"] = tuple(picked)
                if not args.no_sweep:
                    timed = []
                    for cfg in sorted(sk.BUILT):
                        if gated and cfg.tiles % 2:
                            continue
                        check(f"skinny {tuple(cfg)}", skinny(0, cfg))
                        timed.append((_time(lambda i, cfg=cfg: skinny(i, cfg), copies),
                                      tuple(cfg)))
                    timed.sort()
                    row["skinny_best_us"] = round(timed[0][0], 2)
                    row["skinny_best"] = timed[0][1]
                    row["skinny_top"] = [(round(t, 2), c) for t, c in timed[:5]]
                best = min(row.get("skinny_best_us", row["skinny_us"]), row["skinny_us"])
                row["skinny_gb_s"] = round(nbytes / best / 1e3, 1)
                base = [v for key, v in row.items() if key.endswith("_us")
                        and not key.startswith("skinny")]
                row["speedup_vs_best_baseline"] = round(min(base) / best, 3)
                print(row, flush=True)
                results.append(row)
            ws.clear()
            torch.cuda.empty_cache()
    dump({"device": device_name(), "shape": args.shape, "group_size": GROUP,
          "cases": results}, args.out)


if __name__ == "__main__":
    main()
