"""The few-row GEMV (``worker/ops/triton_gemv_rows.py``) against cuBLAS, per weight shape and
row count, with a sweep of launch shapes: microseconds per call, the weight bytes' rate, and
the launch shape ``gemv_rows`` picks (``ROWS_CONFIGS`` or the default) and the best of the
sweep for each case (for ``ROWS_CONFIGS``).

    python tools/bench_gemv_rows.py --shape llama-3.1-8b --rows 2 4 8 --out rows.json   # a GPU

Each case cycles through copies of its weight that together exceed the L2 cache (every call
reads its weight from memory, as a decode step does): 50 calls captured in a CUDA graph (device
time, as in a decode step's graph), timed with CUDA events, the median of 5 replays. The
kernel's output is checked against the float64 product first (a wrong launch shape fails the
run, not the table).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_common import device_name, dump  # noqa: E402

SHAPES = {  # (N outputs of the weight, K, gated): a model's decode projections and LM head
    "llama-3.1-8b": [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True),
                     (4096, 14336, False), (128256, 4096, False)],
    # A 1B draft model's (Llama-3.2-1B) and the EAGLE-3 head's of Llama-3.1-8B (fc over three
    # hidden states, q/k/v over two, its own LM head over the draft vocabulary).
    "llama-3.2-1b": [(3072, 2048, False), (2048, 2048, False), (16384, 2048, True),
                     (2048, 8192, False), (128256, 2048, False)],
    "eagle3-llama-3.1-8b": [(4096, 12288, False), (6144, 8192, False), (32000, 4096, False)],
    "qwen3-0.6b": [(4096, 1024, False), (1024, 2048, False), (6144, 1024, True),
                   (1024, 3072, False), (151936, 1024, False)],
}
# The tensor-core kernel's (BLOCK_N, BLOCK_K, num_warps, num_stages)
SWEEP = [(bn, bk, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512),
                                                              (3, 5))]
# ... and split over K (a fifth element: programs per tile)
SPLIT_SWEEP = [(bn, bk, 4, st, sp) for bn, bk, st, sp in itertools.product(
    (32, 64), (128, 256), (3, 4), (2, 4))]
# The elementwise kernel's (``FmaLaunch``: BLOCK_N, BLOCK_K, num_warps, prefetch)
FMA_SWEEP = list(itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8), (1, 2)))


def _time(fn, copies: int, calls: int = 50, repeats: int = 5) -> float:
    """Median microseconds per call of ``fn(i)`` over copies i in turn: the calls captured in a
    CUDA graph (the device time alone, not the launch overhead of the Python wrappers)."""
    for i in range(copies):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(calls):
            fn(c % copies)
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(out)


def _kind(label: tuple) -> str:
    """A sweep label's kernel: the tensor-core one (whole K or split), or the elementwise."""
    return "fma" if label[0] == "FmaLaunch" else "split" if len(label[1]) == 5 else "dot"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--sweep", choices=("dot", "fma", "both"), default="both",
                   help="which kernel's launch shapes to sweep (dot: also split over K)")
    p.add_argument("--pdl", choices=("off", "on", "both"), default="off",
                   help="the tensor-core kernel's programmatic dependent launch (PDL_DOT)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from tidal.worker.ops import torch_ops
    from tidal.worker.ops import triton_decode as td
    from tidal.worker.ops import triton_gemv_rows as tr
    from tidal.worker.ops.triton_gemv_rows import FmaLaunch, gemv_rows

    pdl_modes = {"off": [False], "on": [True], "both": [False, True]}[args.pdl]

    sweep: list[tuple] = []
    if args.sweep in ("dot", "both"):
        sweep += SWEEP + SPLIT_SWEEP
    if args.sweep in ("fma", "both"):
        sweep += [FmaLaunch(*c) for c in FMA_SWEEP]

    dev = torch.device("cuda")
    dt = torch.bfloat16
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    results = []
    for n, k, gated in SHAPES[args.shape]:
        nbytes = n * k * 2
        copies = max(2, -(-4 * l2 // nbytes))
        ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
        act = "silu" if gated else None
        # The one-row GEMV on the same weights: the rate a weight-bound product can reach.
        x1 = torch.randn(1, k, device=dev, dtype=dt)
        one_row = _time(lambda i: td.gemv(x1, ws[i], silu=gated), copies)
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=dt)

            def cublas(i: int) -> torch.Tensor:
                y = F.linear(x, ws[i])
                return torch_ops.silu_and_mul(y) if gated else y

            ref = F.linear(x.double(), ws[0].double())
            if gated:
                g, u = ref.chunk(2, dim=-1)
                ref = g * torch.sigmoid(g) * u
            base = _time(cublas, copies)
            best = None
            timed = []
            for cfg, pdl in itertools.product(sweep, pdl_modes):
                if pdl and isinstance(cfg, FmaLaunch):
                    continue  # (PDL_DOT is the tensor-core kernel's; this one follows policy)
                tr.PDL_DOT = pdl
                try:
                    out = gemv_rows(x, ws[0], act=act, config=cfg)
                except triton.runtime.errors.OutOfResources:
                    continue  # its pipeline stages exceed the shared memory
                err = float((out.double() - ref).norm() / ref.norm())
                assert err < 1.5e-2, f"{(n, k, gated)} rows {m} config {cfg}: error {err:.3g}"
                t = _time(lambda i, cfg=cfg: gemv_rows(x, ws[i], act=act, config=cfg), copies)
                label = (type(cfg).__name__, tuple(cfg), "pdl" if pdl else "")
                timed.append((t, label))
                if best is None or t < best[1]:
                    best = (label, t)
            tr.PDL_DOT = False
            tuned = _time(lambda i: gemv_rows(x, ws[i], act=act), copies)
            row = {"n": n, "k": k, "gated": gated, "rows": m, "cublas_us": round(base, 2),
                   "one_row_gemv_us": round(one_row, 2),
                   "gemv_rows_us": round(tuned, 2), "speedup": round(base / tuned, 3),
                   "best_us": round(best[1], 2), "best_config": best[0],
                   "weight_gb_s_best": round(nbytes / best[1] / 1e3, 1),
                   "top": [(round(t, 2), *c) for t, c in sorted(timed, key=lambda r: r[0])[:6]],
                   # Each kernel's own best (the elementwise one's too where it lost).
                   "best_by_kernel": {kind: min(((round(t, 2), *c) for t, c in timed
                                                 if _kind(c) == kind), default=None)
                                      for kind in ("dot", "split", "fma")}}
            print(row, flush=True)
            results.append(row)
        ws.clear()
        torch.cuda.empty_cache()
    dump({"device": device_name(), "shape": args.shape, "cases": results}, args.out)


if __name__ == "__main__":
    main()
