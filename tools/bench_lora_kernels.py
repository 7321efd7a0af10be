"""The per-token LoRA kernels (shrink + expand, what decode steps replay in CUDA graphs) at
Llama-3.1-8B's four LoRA'd linears, for a few batch sizes: the shrink with its inputs split in
slices summed atomically (the default for small batches) against one program per token and
output block reading all of A (``split_k=1``, the kernel before), and the tokens grouped by
adapter in tiles (``grouped``: the segmented kernels through a permutation, what
``lora_grouped_min_tokens`` turns on), each captured in a CUDA graph and replayed (issue 24: a
batch-1 decode step with an adapter cost 2.6x the base's).

    python tools/bench_lora_kernels.py --out lora_kernels.json     # a GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_name, dump  # noqa: E402
from tidal.worker.lora.grouping import TILE, group_tokens, max_tiles  # noqa: E402
from tidal.worker.lora.layers import LoRASegments  # noqa: E402
from tidal.worker.ops import triton_lora  # noqa: E402

LLAMA8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
           "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


def time_graph(fn, replays: int) -> float:
    """µs per call of ``fn``, 20 calls captured in one CUDA graph, replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * 20)


def grouped_segments(slots: torch.Tensor, num_slots: int) -> LoRASegments:
    """The grouped decode layout of ``slots`` (lora/grouping.py), in fixed tables sized as a
    CUDA graph of this batch would have them."""
    perm, starts, lengths, tile_slots = group_tokens(slots.cpu().numpy(), TILE)
    num = max_tiles(len(slots), num_slots, TILE)
    table = torch.zeros(3, num, dtype=torch.int32)
    k = len(starts)
    table[0, :k], table[1, :k] = torch.from_numpy(starts), torch.from_numpy(lengths)
    table[2, :k] = torch.from_numpy(tile_slots)
    table = table.to(slots.device)
    return LoRASegments(table[0], table[1], table[2], num, TILE,
                        perm=torch.from_numpy(perm.astype("int32")).to(slots.device))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    totals: dict[str, dict[str, float]] = {}
    for t in (int(v) for v in args.batches.split(",")):
        for name, (in_f, sizes) in LLAMA8B.items():
            s, r = len(sizes), args.rank
            a = torch.randn(args.slots, s * r, in_f, device=dev, dtype=torch.bfloat16) * 0.02
            b = torch.randn(args.slots, sum(sizes), r, device=dev, dtype=torch.bfloat16) * 0.02
            x = torch.randn(t, in_f, device=dev, dtype=torch.bfloat16)
            y = torch.zeros(t, sum(sizes), device=dev, dtype=torch.bfloat16)
            slots = torch.arange(t, device=dev, dtype=torch.int32) % min(8, args.slots)
            offsets = tuple(sum(sizes[:i]) for i in range(s))
            row = {"batch": t, "linear": name, "in": in_f, "out": sum(sizes)}
            grouped = grouped_segments(slots, args.slots)
            for label, split, segs in (("split", None, None), ("one_program", 1, None),
                                       ("grouped", None, grouped)):
                def step(split=split, segs=segs):
                    xa = triton_lora.lora_shrink(x, a, slots, segs, split_k=split)
                    triton_lora.lora_expand(y, xa, b, slots, offsets, r, segs)
                row[f"{label}_us"] = round(time_graph(step, args.replays), 2)
                # (The per-layer sum over the four linears, then x 32 layers.)
                totals.setdefault(str(t), {}).setdefault(label, 0.0)
                totals[str(t)][label] += row[f"{label}_us"]
            rows.append(row)
            print(row, flush=True)
    result = {"device": device_name(), "rank": args.rank, "slots": args.slots,
              "per_linear": rows,
              "llama8b_step_ms": {t: {k: round(v * 32 / 1e3, 3) for k, v in d.items()}
                                  for t, d in totals.items()}}
    dump(result, args.out)


if __name__ == "__main__":
    main()
