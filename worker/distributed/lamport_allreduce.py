"""Tensor-parallel all-reduce of decode-sized 16-bit tensors in which each value is its own
signal (the kernel and its protocol: ``worker/ops/triton_allreduce.py``).

A batch-1 decode step of Llama-3.1-8B at TP=2 makes 64 all-reduces of 8 KiB. The one-shot
symmetric-memory reduction (``symm_allreduce``, ~6.5 µs each on 2×H200) runs a barrier round
trip and then loads from its peers. Here a rank writes its input straight into its peers'
buffers and reads only its own, so one NVLink crossing remains. The kernel also launches behind
the GEMV before it and lets the GEMV after it launch early (programmatic dependent launch),
which the PyTorch one-shot kernel does not.

Owned by ``SymmAllReduce``, which tries it first and keeps it only where it is faster than
both other paths on every rank (``TIDAL_LAMPORT_ALLREDUCE=0`` turns it off; 2.2 µs per 8 KiB
on 2×H200). It covers up to 256 Ki elements per call, a decode step of 64 sequences of a
4096-wide model; the buffers take 2 x world x 512 KiB per rank.

In a batch-1 decode step the row-parallel GEMV's partial row is not summed at once: it becomes
an ``UnreducedRow`` (``ParallelGroup.defer_all_reduce``), and the next ``Kernels.rms_norm_linear``
runs the all-reduce with the residual added and each chunk's sum of squares written out. The
GEMV after it then norms a finished row from eight numbers instead of reading the whole row in
every one of its programs (2.39 against 2.60 ms per TP=2 step of Llama-3.1-8B on 2×H200).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tidal.worker.distributed.pending_sum import PendingSum

# The sentinel is a 16-bit pattern: 32-bit tensors take the other paths.
DTYPES = (torch.bfloat16, torch.float16)


class LamportAllReduce:
    """Receive buffers (symmetric memory, ``[2, world, row_elems]`` int16 per rank) and the
    per-program call counters of one tensor-parallel group."""

    def __init__(self, group_name: str, rank: int, world: int, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from tidal.worker.ops import triton_allreduce as ta

        self._ta = ta
        self.rank, self.world = rank, world
        self.row_elems = ta.CHUNK * ta.MAX_PROGRAMS
        buf = symm_mem.empty(2 * world * self.row_elems, dtype=torch.int16, device=device)
        handle = symm_mem.rendezvous(buf, group_name)
        buf.fill_(ta.SENTINEL)
        self._buf = buf  # keeps the mapping alive
        self.ptrs = torch.tensor([int(p) for p in handle.buffer_ptrs], dtype=torch.int64,
                                 device=device)
        self.counts = torch.zeros(ta.MAX_PROGRAMS, dtype=torch.int32, device=device)
        # Sums of squares for the norm after a decode step's all-reduce: row c serves rows of
        # c chunks, so the zero padding up to a power of two is never written.
        self.sum_squares = torch.zeros((STATS_MAX_CHUNKS + 1, STATS_MAX_CHUNKS),
                                       dtype=torch.float32, device=device)
        # Every rank's buffer must hold the sentinel before any peer writes into it; the
        # caller's agreement over the CPU group after this is the barrier.
        torch.cuda.synchronize(device)

    def applies(self, x: torch.Tensor) -> bool:
        return (x.dtype in DTYPES and x.is_contiguous()
                and 0 < x.numel() <= self.row_elems)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, as a new tensor (check ``applies`` first)."""
        out = torch.empty_like(x)
        self._ta.lamport_all_reduce(x, out, self.ptrs, self.counts, self.rank, self.world,
                                    self.row_elems)
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked in rank order, ``[world, *x.shape]`` (check ``applies``
        first): the LM head's vocabulary slices of a decode step, in one NVLink crossing."""
        out = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        self._ta.lamport_all_gather(x, out, self.ptrs, self.counts, self.rank, self.world,
                                    self.row_elems)
        return out

    def defer(self, x: torch.Tensor) -> UnreducedRow | None:
        """``x`` (one row) as a ``PendingSum`` the next norm can finish, or None."""
        if (x.numel() != x.shape[-1] or not self.applies(x)
                or x.numel() > STATS_MAX_CHUNKS * self._ta.CHUNK):
            return None
        return UnreducedRow(self, x)

    def reduce_add_stats(self, x: torch.Tensor, residual: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sum of x + residual, its per-chunk sums of squares)``, zero-padded to a power of
        two, for ``triton_decode.gemv(norm_ss=...)``."""
        chunks = -(-x.numel() // self._ta.CHUNK)
        stats = self.sum_squares[chunks]
        out = torch.empty_like(x)
        self._ta.lamport_all_reduce(x, out, self.ptrs, self.counts, self.rank, self.world,
                                    self.row_elems, residual=residual, sum_squares=stats)
        return out, stats[: 1 << (chunks - 1).bit_length()]


STATS_MAX_CHUNKS = 16  # rows of up to 16 x CHUNK (8192) elements carry their norm statistics


@dataclass(slots=True)
class UnreducedRow(PendingSum):
    """This rank's partial row of a decode step's row-parallel GEMV, not yet all-reduced: the
    next ``rms_norm_linear`` runs the all-reduce with its residual add and the norm's sums of
    squares, so its GEMV reads one finished row."""

    comm: LamportAllReduce
    partial: torch.Tensor

    @property
    def like(self) -> torch.Tensor:
        return self.partial

    def wait(self) -> torch.Tensor:
        return self.comm(self.partial)

    def reduce_add_stats(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if (residual.dtype != self.partial.dtype or residual.shape != self.partial.shape
                or not residual.is_contiguous()):
            return None
        return self.comm.reduce_add_stats(self.partial, residual)


def make_lamport(group: Any, rank: int, world: int,
                 device: torch.device) -> tuple[LamportAllReduce | None, str]:
    """This rank's instance, or None and why (not collective: the caller agrees over ranks)."""
    try:
        return LamportAllReduce(group.group_name, rank, world, device), ""
    except Exception as exc:  # noqa: BLE001 - any failure means the other paths
        return None, f"{type(exc).__name__}: {exc}"
