"""What one NCCL pair between two processes moves per second, by how the bytes are cut into
operations (issue 27's P2P KV pull: why its sends are queued one by one, not grouped).

    python tools/bench_nccl_p2p_ops.py > ops.json      # 2 GPUs of one host

Two processes (GPU 0 sends, GPU 1 receives; each sees only its own GPU, as two ``tidal serve``
instances do), one two-rank ``ProcessGroupNCCL`` built on a TCPStore. 1 GiB goes over as one
operation, as N operations queued one after another (``queued_N``), as N operations in one
NCCL group call (``grouped_N``), and as a pipelined gather -> send -> receive -> scatter of
512 scattered KV blocks of 32 Llama-8B-shaped layers (``pipelined_lpcK``: K layers a chunk,
three staging buffers a side). Prints GB/s of each (the best of 4 timed runs after a warm-up).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
import socket

import torch
import torch.distributed as dist

GiB = 1 << 30

def main(rank, port):
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupNCCL(store, rank, 2)
    dev = torch.device("cuda:0")
    peer = 1 - rank
    buf = torch.empty(GiB, dtype=torch.uint8, device=dev)
    res = {}
    def run(name, fn, reps=4):
        ts = []
        for r in range(reps + 1):
            torch.cuda.synchronize()
            store.set(f"{name}|{r}|{rank}", "1"); store.wait([f"{name}|{r}|{peer}"])
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if r:
                ts.append(time.perf_counter() - t0)
        res[name] = round(GiB / min(ts) / 1e9, 1)
    def ops(n, grouped):
        size = GiB // n
        parts = [buf[i * size:(i + 1) * size] for i in range(n)]
        def f():
            if grouped:
                pg._start_coalescing()
            w = None
            for p in parts:
                w = pg.send([p], peer, 0) if rank == 0 else pg.recv([p], peer, 0)
            if grouped:
                w = pg._end_coalescing()
            if w is not None:
                w.wait()
        return f
    for n in (1, 4, 8, 16, 64):
        run(f"queued_{n}", ops(n, False))
    for n in (8, 64):
        try:
            run(f"grouped_{n}", ops(n, True))
        except Exception as e:
            res[f"grouped_{n}"] = str(e)[:200]
    # KV-like: 32 layers [2, 600 blocks, 16, 8, 128] bf16; pull 512 blocks (scattered ids)
    layers = [torch.randn(2, 600, 16, 8, 128, device=dev).to(torch.bfloat16) for _ in range(32)]
    ids = torch.randperm(600, device=dev)[:512]
    per_layer = 2 * 512 * 16 * 8 * 128 * 2
    for lpc in (2, 4, 8):  # layers per chunk
        nchunks = 32 // lpc
        ring = [torch.empty(per_layer * lpc, dtype=torch.uint8, device=dev) for _ in range(3)]
        def f():
            works = [None] * len(ring)
            for c in range(nchunks):
                slot = c % len(ring)
                if works[slot] is not None:
                    works[slot].wait()  # stream waits for the previous op on this slot
                flat = ring[slot]
                if rank == 0:
                    for j in range(lpc):
                        dst = flat[j * per_layer:(j + 1) * per_layer].view(torch.bfloat16).view(2, 512, 16, 8, 128)
                        torch.index_select(layers[c * lpc + j], 1, ids, out=dst)
                    works[slot] = pg.send([flat], peer, 0)
                else:
                    w = pg.recv([flat], peer, 0)
                    w.wait()
                    for j in range(lpc):
                        src = flat[j * per_layer:(j + 1) * per_layer].view(torch.bfloat16).view(2, 512, 16, 8, 128)
                        layers[c * lpc + j].index_copy_(1, ids, src)
                    works[slot] = None
        run(f"pipelined_lpc{lpc}", f)
    if rank == 1:
        print(json.dumps(res), flush=True)

if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(int(sys.argv[1]), int(sys.argv[2]))
    else:
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        ps = [subprocess.Popen([sys.executable, __file__, str(r), str(port)],
                               env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(r))) for r in (0, 1)]
        for p in ps:
            p.wait(timeout=150)
