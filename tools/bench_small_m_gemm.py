"""cuBLAS matmul time against the row count M for one decoder layer's weights, the question
behind padding small mixed steps (speculative verify steps: k + 1 rows per request): is a
4-row step as cheap as a 1-row one, and how much does padding it to 64 rows cost?

    python tools/bench_small_m_gemm.py --shape llama-3.1-8b [--rows 1,4,8,16,32,64]

Times each weight's ``x @ W.T`` (bf16) in a CUDA graph of 20 replays, median of 10; prints the
layer's achieved bandwidth (weight bytes / time) per M.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench_common import SHAPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cfg = SHAPES[args.shape]
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    dev = torch.device("cuda")
    weights = {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d),
               "gate_up": (2 * inter, h), "down": (h, inter)}
    ws = {n: torch.randn(s, dtype=torch.bfloat16, device=dev) for n, s in weights.items()}
    layer_bytes = sum(w.numel() * 2 for w in ws.values())
    out = {"device": torch.cuda.get_device_name(), "shape": args.shape, "rows": {}}
    for m in (int(r) for r in args.rows.split(",")):
        xs = {n: torch.randn(m, w.shape[1], dtype=torch.bfloat16, device=dev)
              for n, w in ws.items()}

        def layer():
            for n, w in ws.items():
                torch.nn.functional.linear(xs[n], w)

        layer()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(20):
                layer()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(True), torch.cuda.Event(True)
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 20)
        ms = statistics.median(times)
        out["rows"][m] = {"layer_ms": ms, "gb_s": layer_bytes / ms / 1e6}
        print(f"M={m:3d}: {ms * 1e3:8.1f} us per layer, {layer_bytes / ms / 1e6:7.0f} GB/s",
              flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
