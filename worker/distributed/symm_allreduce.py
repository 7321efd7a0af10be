"""One-shot all-reduce over PyTorch symmetric memory, for the small tensors of decode steps.

Tensor parallelism all-reduces one hidden state per token twice a layer. For a batch-1 decode
step that is an 8 KiB tensor, where NCCL's ring protocol costs ~17 µs per call on 2×H200 and a
one-shot reduction (every rank copies its input into a buffer its peers can read over NVLink,
then each sums all of them) ~7 µs, measured in CUDA graphs by ``tools/bench_allreduce_symm.py``.
It uses plain peer-to-peer loads: no NVLink multicast (which shared hosts must keep off).

Larger tensors (prefill) keep NCCL: a one-shot reduction reads every peer's whole input, so its
cost grows with the tensor where NCCL's ring does not. Two buffers are used in turn, so a rank
that starts its next all-reduce cannot overwrite a buffer a slower peer is still reading (the
next call's barrier needs that peer to have finished the previous one). The one exception is a
captured graph with an odd number of all-reduces, whose replays meet the same buffer twice in a
row across the step boundary; the LM head, sampling and the next step's inputs lie between.

It is used only where it wins: at start-up every rank times both paths on a decode-sized
tensor, and the ranks agree (over the CPU group) to use the one-shot path only if it was faster
on all of them. ``TIDAL_SYMM_ALLREDUCE=0`` turns it off; any failure to set it up on any rank
falls back to NCCL on every rank, with one warning.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Tensors up to this size take the one-shot path (256 tokens of a 4096-wide bf16 hidden state).
MAX_BYTES = int(os.environ.get("TIDAL_SYMM_ALLREDUCE_MAX_BYTES", str(2 << 20)))
_SUPPORTED_WORLD_SIZES = (2, 4, 8)
# The dtypes the symmetric-memory reduction kernels are built for.
_DTYPES = (torch.bfloat16, torch.float32)


class SymmAllReduce:
    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self._buffers = []
        for _ in range(2):
            buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self._buffers.append(buf)
        self._next = 0
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out

    def applies(self, x: torch.Tensor) -> bool:
        return (x.dtype in _DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, as a new tensor."""
        nbytes = x.numel() * x.element_size()
        buf = self._buffers[self._next]
        # Alternate at capture time too: the graph records both buffers in turn.
        self._next ^= 1
        staging = buf[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        self._op(staging, x, "sum", self.group_name, out)
        return out


def make_symm_allreduce(device_group: Any, cpu_group: Any, world_size: int,
                        device: torch.device) -> SymmAllReduce | None:
    """The one-shot all-reduce for a device group, or None (NCCL only). Collective over the
    group: every member calls it, and all of them get one or all get None."""
    if (device.type != "cuda" or world_size not in _SUPPORTED_WORLD_SIZES
            or os.environ.get("TIDAL_SYMM_ALLREDUCE", "1") == "0"):
        return None
    comm, error = None, ""
    try:
        comm = SymmAllReduce(device_group, device)
    except Exception as exc:  # noqa: BLE001 - any failure means NCCL, agreed below
        error = f"{type(exc).__name__}: {exc}"
    if not agree(comm is not None, cpu_group):
        if error:
            logger.warning("symmetric-memory all-reduce unavailable (%s); using NCCL only", error)
        return None
    assert comm is not None
    # Where peers are reached over PCIe rather than NVLink the one-shot path can lose to NCCL:
    # time both on a decode-sized tensor and keep the one-shot path only if it wins everywhere.
    one_shot_us, nccl_us = _time_both(comm, device_group, device)
    if not agree(one_shot_us < nccl_us, cpu_group):
        logger.info("tensor-parallel all-reduce: NCCL (one-shot %.1f us vs NCCL %.1f us on "
                    "this rank)", one_shot_us, nccl_us)
        return None
    logger.info("tensor-parallel all-reduce: one-shot over symmetric memory up to %d KiB "
                "(%.1f us vs NCCL %.1f us for 8 KiB on this rank), NCCL above",
                comm.max_bytes >> 10, one_shot_us, nccl_us)
    return comm


def agree(mine: bool, cpu_group: Any) -> bool:
    """True on every rank if ``mine`` is true on every rank."""
    flag = torch.tensor([int(mine)], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


def _time_both(comm: SymmAllReduce, device_group: Any, device: torch.device,
               iters: int = 50) -> tuple[float, float]:
    """Microseconds per all-reduce of a [1, 4096] bf16 tensor: one-shot, NCCL (eager, after a
    warm-up; every rank runs the same sequence)."""
    x = torch.ones(1, 4096, dtype=torch.bfloat16, device=device)

    def timed(fn) -> float:
        for _ in range(5):
            fn()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000 / iters

    one_shot = timed(lambda: comm(x))
    nccl = timed(lambda: torch.distributed.all_reduce(x, group=device_group))
    return one_shot, nccl
