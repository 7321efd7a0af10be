"""All-reduce latency for tensor-parallel decode: NCCL against PyTorch symmetric-memory one-shot
(P2P loads, no NVLink multicast), eager and replayed from a CUDA graph, with a correctness check.

    python tools/bench_allreduce_symm.py [--gpus 2] [--hidden 4096] [--out result.json]

One process per GPU (spawn). Prints one JSON object: microseconds per all-reduce of a
[rows, hidden] bf16 tensor for each method and row count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast must stay off on shared hosts (see the device notes).
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

ROWS = (1, 8, 64, 256)
REPS = 100


def _graph_us(fn, reps: int) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(7):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


def _eager_us(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / reps


def worker(rank: int, world: int, port: int, hidden: int, q) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=dev)
    group = dist.group.WORLD
    out: dict = {"rows": {}}
    try:
        import torch.distributed._symmetric_memory as symm_mem

        max_rows = max(ROWS)
        buf = symm_mem.empty(max_rows * hidden, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(buf, group.group_name)
        symm_ok = True
    except Exception as exc:  # noqa: BLE001 - reported in the JSON
        out["symm_error"] = f"{type(exc).__name__}: {exc}"
        symm_ok = False
    gname = group.group_name
    for rows in ROWS:
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device=dev) * (rank + 1)
        res: dict = {}
        y = x.clone()
        res["nccl_eager_us"] = _eager_us(lambda: dist.all_reduce(y, group=group), REPS)
        res["nccl_graph_us"] = _graph_us(lambda: dist.all_reduce(y, group=group), REPS)
        if symm_ok:
            try:
                view = buf[:rows * hidden].view(rows, hidden)
                dst = torch.empty_like(x)

                def one_shot():
                    torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", gname, dst)

                ref = x.float().clone()
                dist.all_reduce(ref, group=group)
                one_shot()
                torch.cuda.synchronize()
                res["one_shot_max_err"] = float((dst.float() - ref).abs().max())
                res["one_shot_eager_us"] = _eager_us(one_shot, REPS)
                res["one_shot_graph_us"] = _graph_us(one_shot, REPS)
                # The result after graph replays must still be right.
                dst.zero_()
                one_shot()
                torch.cuda.synchronize()
                res["one_shot_max_err_after_graph"] = float((dst.float() - ref).abs().max())
            except Exception as exc:  # noqa: BLE001
                res["one_shot_error"] = f"{type(exc).__name__}: {exc}"
        out["rows"][rows] = res
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", default=None)
    ns = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, ns.gpus, port, ns.hidden, q))
             for r in range(ns.gpus)]
    for p in procs:
        p.start()
    result = {"benchmark": "allreduce_symm", "gpus": ns.gpus, "hidden": ns.hidden,
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              **q.get(timeout=300)}
    for p in procs:
        p.join(60)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    return 0 if all(p.exitcode == 0 for p in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
