"""One spawned process per GPU, each joined to an NCCL world, for the tests that need several
real GPUs: ``run_ranks`` starts them and collects what each put on the queue; ``replayed``
replays a captured step with one rank late in turn."""

from __future__ import annotations

import socket
import time
from typing import Any, Callable, Iterator

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_world(rank: int, world: int, port: int) -> tuple[torch.device, Any]:
    """In a rank's process: bind its GPU, join the NCCL world; returns (device, gloo group)."""
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=device)
    return device, dist.new_group(backend="gloo")


def run_ranks(target: Callable[..., None], world: int, monkeypatch: Any,
              env: dict[str, str] | None = None, timeout: float = 300) -> dict[int, Any]:
    """``target(rank, world, port, queue)`` in ``world`` processes; each puts ``(rank, result)``
    once. Returns ``{rank: result}``; every process must exit cleanly. The children inherit
    ``env`` and NVLink multicast switched off (shared hosts must keep it off)."""
    for name, value in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                        **(env or {})}.items():
        monkeypatch.setenv(name, value)
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=timeout) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


def replayed(fn: Callable[[], Any], refill: Callable[[], None], rank: int, world: int,
             rounds: int, lag_s: float = 0.005) -> Iterator[tuple[int, Any]]:
    """In a rank's process: captures ``fn()`` in a CUDA graph, then replays it ``rounds`` times,
    calling ``refill()`` (new inputs) before each, with one rank ``lag_s`` late in turn (the
    others must wait for it, not read stale data); yields (round, fn's outputs) after each."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    for i in range(rounds):
        refill()
        if rank == i % world:
            time.sleep(lag_s)
        graph.replay()
        torch.cuda.synchronize()
        yield i, outs
