"""The tensor-parallel all-reduce of a batch-1 decode step, fused into the GEMVs around it.

A row-parallel projection (o_proj, down_proj) leaves each rank a partial hidden state that a
separate all-reduce kernel would sum. Here the projection's GEMV stores its output rows straight
into every rank's buffer over NVLink (a slot per call site, a row per rank), and the GEMV that
consumes the sum, the next q/k/v or gate/up projection with its RMSNorm prologue, sums the rows
as it reads its input. No all-reduce kernel runs.

Protocol (kernels in ``ops/triton_decode.py``: ``_push_rows``, ``_wait_parts``, ``_rearm``),
signal-free as in ``lamport_allreduce``: every element of a slot holds a sentinel (negative
zero; a value that is negative zero is pushed as positive zero) until its rank's value lands.
A producer program stores its rows to all ranks and is done: no flag, counter or fence. A
consumer waits for its predecessor kernel (the producer) as every decode kernel does, then polls
its own slot until no sentinel is left. It then sums the rows in rank order in
float32 (every rank gets the same bits) and puts the sentinel back into the slot of the call
before. A slot is re-armed by the consumer of the next call, when its own consumer has
certainly finished, and a peer writes into it again ``num_slots`` calls later. With three or
more slots that is after the re-arm: a peer at call ``i`` has passed call ``i - 1``, which
needed this rank's rows of ``i - 1``, which this rank pushed only after its consumer of
``i - 2`` had completed. Slots are handed out in call order from the start of each forward pass
(``begin_step``), and every tensor-parallel rank makes the same calls.

Measured on 2×H200 (Llama-3.1-8B shape, bf16, batch-1 decode, ``tools/results/
tp_h200x2_deferred_replies.json``): 2.91 ms per TP=2 step with the fusion against 2.60 ms with
the separate signal-free all-reduce kernel. The all-reduce kernels' 0.19 ms per step are gone,
but the consumer GEMVs take 0.50 ms longer: every one of their programs (up to ~1,800) polls the
whole partial-sum row from L2 before it can start. A variant whose consumer skipped the
dependent-launch wait (the rows being their own signal) took 3.05 ms: its programs spun while
the producer still ran, and it needed an aliasing argument that only holds when a consumer's
predecessor is its own producer. An earlier version with a done-counter and release/acquire
flags measured 3.43 against 3.25 ms on 4×H200. Since the norm's statistics come from the
summing kernel (``PushedRows.reduce_add_stats``: ``sum_parts`` with the residual, then a GEMV
that reads one finished row) it measured 2.398 against 2.390 ms for the separate signal-free
all-reduce doing the same: moving the stores into the producer saves nothing once the consumer
GEMVs no longer poll. So it is off unless ``KernelConfig.push_allreduce``
(``TIDAL_PUSH_ALLREDUCE=1``), which turns it on for 16-bit hidden states of up to ``PARTS_MAX_K`` wherever symmetric memory
works. Everything else, and any consumer that cannot take pushed rows (``PushedRows.wait``),
keeps working.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from tidal.worker.distributed.pending_sum import PendingSum
from tidal.worker.ops.kernels import Kernels

logger = logging.getLogger(__name__)

MIN_SLOTS = 3  # see the reuse argument above


@dataclass(slots=True)
class PushedRows(PendingSum):
    """Each rank's partial rows sit in slot ``slot`` of every rank's buffer: the next GEMV sums
    them as it reads its input (``parts``), or ``wait()`` does."""

    comm: PushAllReduce
    slot: int
    like_: torch.Tensor  # [1, hidden]: the result's dtype and device (not its value)

    @property
    def like(self) -> torch.Tensor:
        return self.like_

    def parts(self) -> Any:
        return self.comm.parts(self.slot)

    def wait(self) -> torch.Tensor:
        from tidal.worker.ops import triton_decode

        return triton_decode.sum_parts(self.parts()).view(self.like_.shape)

    def reduce_add_stats(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if residual.dtype != self.like_.dtype or residual.numel() != self.like_.numel():
            return None
        return self.comm.reduce_add_stats(self.slot, residual)


class PushAllReduce:
    """Buffers and slot bookkeeping of one tensor-parallel group (see the module doc)."""

    def __init__(self, group: Any, rank: int, world: int, device: torch.device,
                 dtype: torch.dtype, hidden: int, num_slots: int,
                 kernels: Kernels | None = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from tidal.worker.ops import triton_decode

        if kernels is None:  # outside a worker (tests): this device's default policy
            from tidal.worker.kernel_policy import kernels_for

            kernels = kernels_for(device)
        self._gemv_applies = kernels.gemv_applies

        if dtype not in triton_decode.PUSH_DTYPES:
            raise ValueError(f"the fused all-reduce moves 16-bit floats, not {dtype}")
        num_slots = max(MIN_SLOTS, num_slots)
        self.rank, self.world, self.hidden, self.dtype = rank, world, hidden, dtype
        self.num_slots = num_slots
        buf = symm_mem.empty(num_slots * world * hidden, dtype=torch.int16, device=device)
        handle = symm_mem.rendezvous(buf, group.group_name)
        self._buf = buf  # keeps the mapping alive
        buf.fill_(triton_decode.SENTINEL)
        self.data = buf.view(dtype).view(num_slots, world, hidden)
        self.data_ptrs = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64,
                                      device=device)
        self._like = torch.empty((1, hidden), dtype=dtype, device=device)
        # The norm statistics of a summed row: one partial per sum_parts program, zero-padded
        # to a power of two (the padding is never written).
        blocks = -(-hidden // triton_decode.SUM_PARTS_BLOCK)
        self._sum_squares = torch.zeros(1 << (blocks - 1).bit_length(), dtype=torch.float32,
                                        device=device)
        self._next = 0
        # Built once: the per-call host work is then a list lookup and the launch.
        self._push = [triton_decode.PushArgs(self.data_ptrs, (s * world + rank) * hidden, world)
                      for s in range(num_slots)]
        self._parts = [triton_decode.PartsArgs(self.data[s], self.data[s - 1].view(-1))
                       for s in range(num_slots)]

    def begin_step(self) -> None:
        """Hand out slots from the first again: call at the start of every forward pass."""
        self._next = 0

    def applies(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (self._next < self.num_slots and x.dtype == self.dtype
                and weight.shape[0] == self.hidden and self._gemv_applies(x, weight))

    def gemv(self, x: torch.Tensor, weight: torch.Tensor,
             weight_scale: torch.Tensor | None = None) -> PushedRows:
        """``x @ weight.T``, pushed to every rank for summing; check ``applies`` first. An
        FP8 ``weight`` comes with its ``weight_scale`` (``triton_decode.gemv``)."""
        from tidal.worker.ops import triton_decode

        slot = self._next
        self._next += 1
        triton_decode.gemv(x, weight, push=self._push[slot], weight_scale=weight_scale)
        return PushedRows(self, slot, self._like)

    def parts(self, slot: int) -> Any:
        return self._parts[slot]

    def reduce_add_stats(self, slot: int, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(the sum of slot + residual, its sums of squares)`` for ``gemv(norm_ss=...)``."""
        from tidal.worker.ops import triton_decode

        h = triton_decode.sum_parts(self._parts[slot], residual, self._sum_squares)
        return h.view(residual.shape), self._sum_squares


def make_push_all_reduce(tp: Any, device: torch.device, dtype: torch.dtype, hidden: int,
                         num_slots: int, *, enabled: bool = False,
                         kernels: Kernels | None = None) -> PushAllReduce | None:
    """The fused all-reduce for tensor-parallel group ``tp``, or None. Collective over the
    group: every member calls it after loading the same model; all get one or all get None.
    ``enabled``: the worker's ``KernelPolicy`` (``push_allreduce``); ``kernels``: its ops."""
    from tidal.worker.distributed.symm_allreduce import agree

    if tp.world_size == 1:
        return None  # nothing to reduce, and no group to agree over
    # Opt-in: slower than the separate signal-free all-reduce (module doc).
    wanted = (device.type == "cuda" and tp.fast_all_reduce is not None and num_slots > 0
              and enabled)
    if wanted:  # (the kernels' module imports triton: not before a GPU is in play)
        from tidal.worker.ops.triton_decode import PARTS_MAX_K, PUSH_DTYPES

        wanted = dtype in PUSH_DTYPES and hidden <= PARTS_MAX_K
    if not agree(wanted, tp.cpu_group):
        return None
    comm, error = None, ""
    try:
        comm = PushAllReduce(tp.device_group, tp.rank, tp.world_size, device, dtype, hidden,
                             num_slots, kernels)
        torch.cuda.synchronize(device)  # every slot armed before any peer can push (agree)
    except Exception as exc:  # noqa: BLE001 - any failure means the unfused path, agreed below
        error = f"{type(exc).__name__}: {exc}"
    if not agree(comm is not None, tp.cpu_group):
        if error:
            logger.warning("fused decode all-reduce unavailable (%s); using the separate one",
                           error)
        return None
    logger.info("tensor-parallel decode: all-reduce fused into the batch-1 GEMVs (%d slots)",
                comm.num_slots)
    return comm
