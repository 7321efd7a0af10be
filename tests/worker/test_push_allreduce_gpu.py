"""The all-reduce fused into the batch-1 GEMVs (``worker/distributed/push_allreduce.py``) across
two real GPUs: every rank pushes its row-parallel rows over NVLink and each rank's consumer, the
norm + residual GEMV or ``PendingSum.wait``, must see exactly NCCL's sum of the plain GEMVs'
rows (two bf16 partials summed once in float32 round the same as NCCL's sum). Many slots over
many steps, eagerly and replayed from a CUDA graph, with the ranks deliberately out of step."""

from __future__ import annotations

import time

import pytest
import torch
from gpu_ranks import join_world, replayed, run_ranks

pytestmark = pytest.mark.gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs: the fused all-reduce runs between GPUs",
                allow_module_level=True)
pytest.importorskip("triton", reason="needs triton: the fused all-reduce kernels are written in it")

HIDDEN, K_IN, N_NEXT, SLOTS, STEPS = 4096, 2048, 1536, 6, 12


def _rank(rank: int, world: int, port: int, results) -> None:
    import torch.distributed as dist

    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.distributed.parallel_state import ParallelGroup
    from tidal.worker.distributed.push_allreduce import make_push_all_reduce
    from tidal.worker.distributed.symm_allreduce import SymmAllReduce
    from tidal.worker.kernel_policy import kernels_for
    from tidal.worker.ops import triton_decode as td

    device, cpu = join_world(rank, world, port)
    tp = ParallelGroup(rank=rank, world_size=world, device_group=dist.group.WORLD,
                       cpu_group=cpu, ranks=tuple(range(world)))
    # Forced on: whether P2P beats NCCL on this host is the start-up check's business.
    tp.fast_all_reduce = SymmAllReduce(dist.group.WORLD, device)
    ops = kernels_for(device, KernelConfig(ops="triton"))  # a GPU worker's fused ops
    # The fusion is opt-in (KernelConfig.push_allreduce).
    push = make_push_all_reduce(tp, device, torch.bfloat16, HIDDEN, SLOTS, enabled=True,
                                kernels=ops)
    assert push is not None, "the fused all-reduce did not set up"
    gen = torch.Generator(device=device).manual_seed(100 + rank)
    shared = torch.Generator(device=device).manual_seed(7)  # the same on every rank

    def rnd(g, *shape, scale=1.0):
        return (torch.randn(shape, device=device, generator=g) * scale).to(torch.bfloat16)

    ws = [rnd(gen, HIDDEN, K_IN, scale=0.05) for _ in range(SLOTS)]
    w_next, nw = rnd(shared, N_NEXT, HIDDEN, scale=0.05), rnd(shared, HIDDEN) + 1
    xs = [rnd(gen, 1, K_IN) for _ in range(SLOTS)]
    residual = rnd(shared, 1, HIDDEN)

    def step():
        """Slots in order, as a decode step: odd slots summed by a norm GEMV, even by wait()."""
        tp.begin_step()
        outs = []
        for s in range(SLOTS):
            pending = tp.push_all_reduce.gemv(xs[s], ws[s])
            if s % 2:
                outs.append(ops.rms_norm_linear(pending, residual, nw, 1e-6, w_next))
            else:
                outs.append((pending.wait(),))
        return outs

    def reference():
        outs = []
        for s in range(SLOTS):
            y = td.gemv(xs[s], ws[s])[0]
            dist.all_reduce(y)
            outs.append(ops.rms_norm_linear(y, residual, nw, 1e-6, w_next) if s % 2 else (y,))
        return outs

    def same(a, b) -> bool:
        return all(torch.equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))

    tp.push_all_reduce = push
    failures = []
    for i in range(STEPS):
        for x in xs:
            x.copy_(rnd(gen, 1, K_IN))
        if rank == i % world:
            time.sleep(0.01)  # one rank late: the consumers must wait, not read stale rows
        got = step()
        torch.cuda.synchronize()
        if not same(got, reference()):
            failures.append(f"eager step {i}")
    step()  # warm, then capture

    def refill() -> None:
        for x in xs:
            x.copy_(rnd(gen, 1, K_IN))

    for i, captured in replayed(step, refill, rank, world, STEPS, lag_s=0.01):
        if not same(captured, reference()):
            failures.append(f"graph replay {i}")
    results.put((rank, failures))
    dist.destroy_process_group()


def test_fused_allreduce_across_two_gpus(monkeypatch) -> None:
    got = run_ranks(_rank, 2, monkeypatch)
    assert got == {0: [], 1: []}, got
