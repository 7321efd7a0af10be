"""The signal-free all-reduce (``worker/distributed/lamport_allreduce.py``) across two real GPUs:
exactly NCCL's sum for bf16 and fp16 tensors from one element to the 256 Ki limit, eagerly with
one rank deliberately late, and as the 64 all-reduces of a decode step captured in a CUDA graph
and replayed with new inputs; the decode-step form that also adds the residual and returns the
norm's sums of squares, in turn with plain calls; the all-gather of the LM head's logits through
the same buffers, against NCCL's. Also runs the start-up choice between the
paths and reports it."""

from __future__ import annotations

import time

import pytest
import torch
from gpu_ranks import join_world, replayed, run_ranks

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs: the all-reduce runs between GPUs", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton: the all-reduce kernel is written in it")

SIZES = [4096, 1, 4095, 65536, 12288, 512, 4096 * 64, 4096 * 3]


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from tidal.worker.distributed.lamport_allreduce import LamportAllReduce
    from tidal.worker.distributed.symm_allreduce import make_symm_allreduce

    device, cpu = join_world(rank, world, port)
    failures: list[str] = []
    lam = LamportAllReduce(dist.group.WORLD.group_name, rank, world, device)
    dist.barrier(group=cpu)  # every buffer armed before anyone writes
    gen = torch.Generator(device=device).manual_seed(10 + rank)

    def nccl(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y)
        return y

    def nccl_gather(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((world, *x.shape), dtype=x.dtype, device=device)
        dist.all_gather_into_tensor(out, x.contiguous())
        return torch.where(out == 0, torch.zeros_like(out), out)  # -0 travels as +0

    for i in range(4):
        for dtype in (torch.bfloat16, torch.float16):
            for n in SIZES:
                x = torch.randn(n, generator=gen, device=device).to(dtype)
                if rank == (i + n) % world:
                    time.sleep(0.005)  # one rank late: the other must wait, not read stale data
                got = lam(x)
                if not torch.equal(got, nccl(x)):
                    failures.append(f"eager round {i} {dtype} n={n}")
                if n <= 65536:  # gathers in turn with the sums, on the same buffers
                    x[: n // 2] = -0.0
                    if not torch.equal(lam.all_gather(x), nccl_gather(x)):
                        failures.append(f"eager gather round {i} {dtype} n={n}")

    # A decode step's worth, captured once: 64 all-reduces of one row (two sizes in turn).
    xs = [torch.randn(4096 * (1 + k % 2), generator=gen, device=device).to(torch.bfloat16)
          for k in range(64)]
    for x in xs:
        lam(x)  # warm (compiled), and the same calls on both ranks
    def refill(inputs: list[torch.Tensor]) -> None:
        for x in inputs:
            x.copy_(torch.randn(x.shape, generator=gen, device=device).to(torch.bfloat16))

    for i, outs in replayed(lambda: [lam(x) for x in xs], lambda: refill(xs), rank, world, 5):
        for k, (x, out) in enumerate(zip(xs, outs)):
            if not torch.equal(out, nccl(x)):
                failures.append(f"graph replay {i} call {k}")
                break
    if not bool((lam._buf == -32768).all()):
        failures.append("buffers not re-armed after the last call")

    # The decode-step form: rows deferred to the next norm (sum + residual and the norm's
    # sums of squares in one kernel), in turn with plain all-reduces on the same buffers,
    # eagerly and replayed from a graph.
    rows = [torch.randn(1, 4096, generator=gen, device=device).to(torch.bfloat16)
            for _ in range(8)]
    res = torch.randn(1, 4096, generator=gen, device=device).to(torch.bfloat16)
    logits = torch.randn(1, 64128, generator=gen, device=device).to(torch.bfloat16)

    def step() -> list[torch.Tensor]:
        outs = []
        for k, x in enumerate(rows):
            pending = lam.defer(x)
            if pending is None:
                raise AssertionError("a 4096-wide bf16 row was not deferred")
            h, ss = pending.reduce_add_stats(res)
            # (the statistics' buffer serves every row of this width: the GEMV reads it next)
            outs += [h, ss.clone(), lam(x[:, : 100 * (k + 1)])]
        return outs + [lam.all_gather(logits)]  # the LM head's vocabulary slices

    def check(outs: list[torch.Tensor], label: str) -> None:
        for k, x in enumerate(rows):
            h, ss, plain = outs[3 * k: 3 * k + 3]
            want = nccl(x) + res
            if not torch.equal(h, want):
                failures.append(f"{label}: row {k} sum + residual")
            sq = want.float().pow(2).view(8, 512).sum(1)
            if ss.shape != (8,) or not torch.allclose(ss, sq, rtol=1e-5):
                failures.append(f"{label}: row {k} sums of squares")
            if not torch.equal(plain, nccl(x[:, : 100 * (k + 1)])):
                failures.append(f"{label}: plain all-reduce after row {k}")
        if not torch.equal(outs[-1], nccl_gather(logits)):
            failures.append(f"{label}: logits all-gather")

    check(step(), "eager")
    for i, outs in replayed(step, lambda: refill(rows + [logits]), rank, world, 3):
        check(outs, f"graph replay {i}")

    # The start-up choice the engine makes (timing decides; reported, not asserted).
    comm = make_symm_allreduce(dist.group.WORLD, cpu, world, device)
    chosen = ("none" if comm is None else
              "lamport" if comm.lamport is not None else "one-shot")
    if comm is not None:
        x = torch.randn(4096, generator=gen, device=device).to(torch.bfloat16)
        if not torch.equal(comm(x), nccl(x)):
            failures.append(f"chosen path {chosen}: wrong sum")
    results.put((rank, (failures, chosen)))
    dist.barrier(group=cpu)
    dist.destroy_process_group()


def test_lamport_allreduce_across_two_gpus(monkeypatch) -> None:
    got = run_ranks(_rank, 2, monkeypatch)
    print("start-up choice per rank:", {r: c for r, (_, c) in got.items()})
    assert {r: f for r, (f, _) in got.items()} == {0: [], 1: []}, got
    assert got[0][1] == got[1][1], "the ranks chose different all-reduce paths"
