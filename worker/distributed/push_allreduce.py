"""The tensor-parallel all-reduce of a batch-1 decode step, fused into the GEMVs around it.

A row-parallel projection (o_proj, down_proj) leaves each rank a partial hidden state that a
separate all-reduce kernel would sum. Here the projection's GEMV pushes its output rows straight
into every rank's buffer over NVLink (a slot per call site, a row per rank), and the GEMV that
consumes the sum, the next q/k/v or gate/up projection with its RMSNorm prologue, waits for the
peers' signal and adds the rows as it reads its input. Per all-reduce that saves a kernel launch
and drain and the barrier round trip of the one-shot path, and a rank that runs ahead stalls
only in the consumer that needs the data.

Protocol (kernels in ``ops/triton_decode.py``: ``_push_rows``, ``_wait_parts``): every producer
program stores its rows to all ranks, then counts itself done (acq_rel, system scope); the last
one increments flag ``slot`` on each peer (release, system scope) and adds ``world - 1`` to this
rank's ``expect[slot]``. A consumer spins (acquire, system scope) until its ``flag[slot]`` reaches
``expect[slot]``. Producers never wait, so nothing can deadlock while every rank runs the same
sequence of calls (they all run the same steps). Slots are handed out in call order from the
start of each forward pass (``begin_step``), one per row-parallel call, so a slot is written again
only a step later, after its consumer on every rank has passed a later slot's wait.

It is off unless ``TIDAL_PUSH_ALLREDUCE=1``: on 4×H200 (Llama-3.1-8B shape, batch-1 decode) it
measured slower than the separate one-shot all-reduce, 3.43 vs 3.25 ms per step at TP=2 and
2.55 vs 2.36 ms at TP=4 (``tools/results/tp_h200x4_decode_kernels.json``). The likely cost is
the system-scope fence every producer program pays before it counts itself done, on the
critical path of each of the 64 all-reduces; per-program flags that the consumer checks (one
release per program, no counter) are the next thing to try. Since then the default for these
sizes became the signal-free all-reduce (``lamport_allreduce``, 2.9 ms per TP=2 step on
2×H200), which has neither fence nor flag; this fusion was not re-measured against it.

When on, it applies where the one-shot symmetric-memory all-reduce was chosen (peers reachable
by fast P2P), for one-row inputs of the GEMV kernel. Everything else, and any consumer that
cannot take pushed rows (``PendingSum.wait``), keeps working.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FLAG_BYTES = 4096  # flags region at the start of the symmetric buffer (up to 1024 slots)


@dataclass(slots=True)
class PendingSum:
    """The output of a row-parallel GEMV whose all-reduce is still in flight: each rank's
    partial rows sit in slot ``slot`` of every rank's buffer. Pass it to
    ``ops.rms_norm_linear`` (which sums while reading) or call ``wait()`` for the tensor."""

    comm: PushAllReduce
    slot: int
    like: torch.Tensor  # a [1, hidden] tensor with the result's dtype and device (not its value)

    def parts(self) -> Any:
        return self.comm.parts(self.slot)

    def wait(self) -> torch.Tensor:
        from tidal.worker.ops import triton_decode

        return triton_decode.sum_parts(self.parts()).view(self.like.shape)


class PushAllReduce:
    """Buffers, flags and slot bookkeeping of one tensor-parallel group (see the module doc)."""

    def __init__(self, group: Any, rank: int, world: int, device: torch.device,
                 dtype: torch.dtype, hidden: int, num_slots: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        if num_slots * 4 > _FLAG_BYTES:
            raise ValueError(f"{num_slots} slots do not fit the flag region")
        self.rank, self.world, self.hidden, self.dtype = rank, world, hidden, dtype
        self.num_slots = num_slots
        elem = torch.empty(0, dtype=dtype).element_size()
        buf = symm_mem.empty(_FLAG_BYTES + num_slots * world * hidden * elem, dtype=torch.uint8,
                             device=device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        bases = [int(p) for p in handle.buffer_ptrs]
        self._buf = buf  # keeps the mapping alive
        self.flags = buf[:_FLAG_BYTES].view(torch.int32)
        self.data = buf[_FLAG_BYTES:].view(dtype).view(num_slots, world, hidden)
        self.flag_ptrs = torch.tensor(bases, dtype=torch.int64, device=device)
        self.data_ptrs = torch.tensor([b + _FLAG_BYTES for b in bases], dtype=torch.int64,
                                      device=device)
        self.counts = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.expect = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self.flags.zero_()
        self._like = torch.empty((1, hidden), dtype=dtype, device=device)
        self._next = 0
        # Built once: the per-call host work is then a list lookup and the launch.
        from tidal.worker.ops import triton_decode

        self._push = [triton_decode.PushArgs(
            data_ptrs=self.data_ptrs, flag_ptrs=self.flag_ptrs, count=self.counts[s:s + 1],
            expect=self.expect[s:s + 1], offset=(s * world + rank) * hidden, slot=s, rank=rank,
            world=world) for s in range(num_slots)]
        self._parts = [triton_decode.PartsArgs(self.data[s], self.flags[s:s + 1],
                                               self.expect[s:s + 1]) for s in range(num_slots)]

    def begin_step(self) -> None:
        """Hand out slots from the first again: call at the start of every forward pass."""
        self._next = 0

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        from tidal.worker import ops

        return (self._next < self.num_slots and x.dtype == self.dtype
                and weight.shape[0] == self.hidden and ops.gemv_applies(x, weight))

    def gemv(self, x: torch.Tensor, weight: torch.Tensor) -> PendingSum:
        """``x @ weight.T``, pushed to every rank for summing; check ``applies`` first."""
        from tidal.worker.ops import triton_decode

        slot = self._next
        self._next += 1
        triton_decode.gemv(x, weight, push=self._push[slot])
        return PendingSum(self, slot, self._like)

    def parts(self, slot: int) -> Any:
        return self._parts[slot]


def make_push_all_reduce(tp: Any, device: torch.device, dtype: torch.dtype, hidden: int,
                         num_slots: int) -> PushAllReduce | None:
    """The fused all-reduce for tensor-parallel group ``tp``, or None. Collective over the
    group: every member calls it after loading the same model; all get one or all get None."""
    from tidal.worker.distributed.symm_allreduce import agree

    if tp.world_size == 1:
        return None  # nothing to reduce, and no group to agree over
    wanted = (device.type == "cuda" and tp.fast_all_reduce is not None
              and dtype in _DTYPES and os.environ.get("TIDAL_PUSH_ALLREDUCE", "0") == "1"
              and 0 < num_slots * 4 <= _FLAG_BYTES)
    if not agree(wanted, tp.cpu_group):
        return None
    comm, error = None, ""
    try:
        comm = PushAllReduce(tp.device_group, tp.rank, tp.world_size, device, dtype, hidden,
                             num_slots)
        torch.cuda.synchronize(device)  # flags zeroed everywhere before any peer signals
    except Exception as exc:  # noqa: BLE001 - any failure means the unfused path, agreed below
        error = f"{type(exc).__name__}: {exc}"
    if not agree(comm is not None, tp.cpu_group):
        if error:
            logger.warning("fused decode all-reduce unavailable (%s); using the separate one",
                           error)
        return None
    logger.info("tensor-parallel decode: all-reduce fused into the batch-1 GEMVs (%d slots)",
                num_slots)
    return comm
