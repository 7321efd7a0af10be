"""The Triton MLA decode kernel (``worker/ops/triton_mla.py``) alone on one GPU: how fast it reads
a batch's paged latent cache (issue 22: DeepSeek-V2-Lite, batch 256 at 4k context).

    python tools/bench_mla.py --out mla.json                     # batch 1 32 256, ctx 1024 4096
    python tools/bench_mla.py --batch 256 --ctx 4096 --splits 1 2 4    # sweep the split count

Per (batch, context): the latent cache of every request (``kv_lora_rank + rope`` values per
token, bf16, pages scattered over the pool), one absorbed query row per request and head; the
kernel checked against the torch reference (``mla_torch``) on a few requests, then timed as
replays of a CUDA graph over ``--caches`` separate caches (so small ones come from HBM, not L2;
the capture is also the graph-safety check). Reported: microseconds per call, the bytes read
(cache rows, queries, outputs) over that time, and that rate against the HBM bandwidth measured
in the same run (a 2 GiB device copy). ``splits`` 0 is the engine's own choice.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import device_name, dump, measure_ceilings  # noqa: E402
from gpu_kernel_check import time_calls  # noqa: E402

L2_FLUSH_BYTES = 256 << 20  # several times H100/H200's L2


def _case(batch: int, ctx: int, heads: int, rank: int, rope: int, page: int,
          dtype: torch.dtype, gen: torch.Generator) -> dict[str, torch.Tensor]:
    blocks_per_req = -(-ctx // page)
    num_blocks = batch * blocks_per_req
    cache = torch.randn(num_blocks, page, rank + rope, device="cuda", dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).to("cuda")
    table = order.view(batch, blocks_per_req).to(torch.int32)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, rank + rope, device="cuda", dtype=dtype)
    return {"cache": cache, "table": table, "lens": lens, "q": q}


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from tidal.worker.ops import mla_torch, triton_mla  # imports triton: GPU machines only

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[ns.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    ceilings = measure_ceilings()
    hbm = ceilings["hbm_GBps"]
    scale = (128 + ns.rope) ** -0.5  # V2's qk_nope_head_dim 128 (the value changes no timing)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch in ns.batch:
        for ctx in ns.ctx:
            cache_bytes = batch * ctx * (ns.rank + ns.rope) * elem
            copies = max(1, min(8, math.ceil(L2_FLUSH_BYTES / cache_bytes)))
            cases = [_case(batch, ctx, ns.heads, ns.rank, ns.rope, ns.page, dtype, gen)
                     for _ in range(copies)]
            c0 = cases[0]
            check = min(batch, 4)
            want = mla_torch.mla_decode(c0["q"][:check], c0["cache"], c0["table"][:check],
                                        c0["lens"][:check], scale, ns.rank)
            got = triton_mla.mla_decode(c0["q"], c0["cache"], c0["table"], c0["lens"], scale,
                                        ns.rank)[:check]
            err = (got.float() - want.float()).abs().max().item()
            moved = cache_bytes + batch * ns.heads * (2 * ns.rank + ns.rope) * elem
            for splits in ns.splits:
                calls = [
                    (lambda c=c, s=splits: triton_mla.mla_decode(
                        c["q"], c["cache"], c["table"], c["lens"], scale, ns.rank,
                        num_splits=s or None))
                    for c in cases]
                t = time_calls(calls, ns.reps)
                gbps = moved / (t["ms"] * 1e-3) / 1e9
                row = {"batch": batch, "ctx": ctx, "splits": splits, "copies": copies,
                       "us": round(t["ms"] * 1e3, 2), "mode": t["mode"],
                       "bytes": moved, "GBps": round(gbps, 1),
                       "of_hbm": round(gbps / hbm, 3) if hbm else None,
                       "max_abs_err": err}
                rows.append(row)
                print(f"batch {batch:4d} ctx {ctx:6d} splits {splits or 'auto':>4}: "
                      f"{row['us']:9.2f} us  {row['GBps']:7.1f} GB/s  "
                      f"({100 * (row['of_hbm'] or 0):.0f}% of HBM)  err {err:.2e}",
                      file=sys.stderr)
            del cases
            torch.cuda.empty_cache()
    return {"bench": "mla_decode", "device": device_name(), "dtype": ns.dtype,
            "heads": ns.heads, "kv_lora_rank": ns.rank, "rope_dim": ns.rope, "page": ns.page,
            "ceilings": ceilings, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--heads", type=int, default=16, help="heads per rank (V2-Lite: 16)")
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim")
    p.add_argument("--page", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--splits", type=int, nargs="+", default=[0],
                   help="split counts to time (0: the engine's choice)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    ns = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_mla needs a CUDA GPU")
    dump(run(ns), ns.out)


if __name__ == "__main__":
    main()
