"""Block-wise FP8 linears against per-row FP8 and bf16, per weight (GPU).

For each projection of a model shape (default Llama-3.1-8B: q/k/v, o, gate/up, down) and each
row count, microseconds per call of:
- ``bf16``: ``F.linear`` (cuBLAS; at one row the engine runs its own GEMV instead, faster);
- ``fp8_row``: the per-row FP8 path the engine runs (one row: the FP8 GEMV, weight-only;
  2-8 rows: the few-row tensor-core GEMV; more: the Triton row quantizer then cuBLASLt);
- ``fp8_block``: ``triton_fp8_block`` with its default launch shape, and with each shape of
  ``--sweep`` (BLOCK_M, BLOCK_N, warps, stages), 128 x 128 blocks.
Each figure is the median over ``--iters`` replays of a CUDA graph of one call per weight copy
(at least four copies, more for weights smaller than twice the L2, so every call reads HBM),
divided by the calls: GPU time, no Python launch cost. Prints one JSON
object (``--out`` also writes it).

    . tools/gpu_imports.sh && python tools/bench_fp8_block.py --rows 1,8,64,256,2048
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from bench_common import device_name

SHAPES = {
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                     "down": (4096, 14336)},
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024),
                   "down": (1024, 3072)},
}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def timed(fn, iters: int, calls: int) -> float:
    """Median microseconds of one ``fn()`` call: ``calls`` calls (one per weight copy)
    captured in a CUDA graph, the graph replayed ``iters`` times under CUDA events (so no
    Python launch cost is counted, as in the engine's graphed decode)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # (allocations of the first call made outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8,64,256,2048")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", default="16,32,4,4;16,64,4,4;16,128,4,3;64,64,4,3;64,128,4,3;"
                    "128,128,8,3", help="block-GEMM launch shapes to time besides the default")
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU of compute capability >= 8.9", file=sys.stderr)
        return 2
    from tidal.worker.ops import fp8_scaled_mm, triton_decode, triton_fp8_quant, triton_gemv_rows
    from tidal.worker.ops import triton_fp8_block as tfb
    from tidal.worker.ops.fp8_block_torch import expand_block_scale, quantize_weight_blocks
    from tidal.worker.ops.fp8_torch import quantize_rows

    dev = torch.device("cuda")
    sweep = [tuple(int(v) for v in c.split(",")) for c in args.sweep.split(";") if c]
    l2 = 60 * 2**20
    result = {"bench": "fp8_block", "device": device_name(), "shape": args.shape,
              "block": [128, 128], "weights": {}}
    for name, (n, k) in SHAPES[args.shape].items():
        copies = max(4, -(-2 * l2 // (n * k)))
        w = torch.empty(n, k, device=dev).uniform_(-0.02, 0.02)
        bf16 = [w.to(torch.bfloat16) for _ in range(copies)]
        rq, rs = quantize_rows(w)
        row = [(rq.clone(), rs.clone()) for _ in range(copies)]
        bq, bs = quantize_weight_blocks(w, 128, 128)
        bs = expand_block_scale(bs, n, 128)
        block = [(bq.clone(), bs.clone()) for _ in range(copies)]
        del w
        per_rows = {}
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            it = {"i": 0}

            def pick(seq):
                it["i"] = (it["i"] + 1) % copies
                return seq[it["i"]]

            def run_row():
                q, s = pick(row)
                if m == 1:
                    return triton_decode.gemv(x, q, weight_scale=s)
                if 2 <= m <= 8:
                    return triton_gemv_rows.gemv_rows(x, q, None, weight_scale=s)
                xq, xs = triton_fp8_quant.quantize(x)
                return fp8_scaled_mm.mm_quantized(xq, xs, q, s, None, x.dtype)

            entry = {"bf16": timed(lambda: torch.nn.functional.linear(x, pick(bf16)),
                                   args.iters, copies),
                     "fp8_row": timed(run_row, args.iters, copies),
                     "fp8_block": timed(lambda: tfb.fp8_block_linear(x, *pick(block), 128),
                                        args.iters, copies),
                     "default_config": list(tfb._config(m))}
            for cfg in sweep:
                entry["block_" + "x".join(map(str, cfg))] = timed(
                    lambda cfg=cfg: tfb.fp8_block_linear(x, *pick(block), 128, config=cfg),
                    args.iters, copies)
            best = min((v, key) for key, v in entry.items()
                       if key.startswith("block_") and isinstance(v, float))
            entry["best_block"] = best[1]
            entry["weight_GBps_block_best"] = n * k / best[0] / 1e3
            per_rows[m] = {key: round(v, 2) if isinstance(v, float) else v
                           for key, v in entry.items()}
            progress(f"{name} {n}x{k} rows {m}: {per_rows[m]}")
        result["weights"][name] = {"n": n, "k": k, "rows": per_rows}
        bf16, row, block = [], [], []  # (freed before the next weight's copies)
        torch.cuda.empty_cache()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
