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
"""

from __future__ import annotations

from typing import Any

import torch

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


def make_lamport(group: Any, rank: int, world: int,
                 device: torch.device) -> tuple[LamportAllReduce | None, str]:
    """This rank's instance, or None and why (not collective: the caller agrees over ranks)."""
    try:
        return LamportAllReduce(group.group_name, rank, world, device), ""
    except Exception as exc:  # noqa: BLE001 - any failure means the other paths
        return None, f"{type(exc).__name__}: {exc}"
