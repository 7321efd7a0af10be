"""The output of a row-parallel GEMV in a batch-1 decode step whose tensor-parallel all-reduce
has not run yet. ``Kernels.rms_norm_linear`` completes it inside the norm before the next GEMV
when it can; anything else calls ``wait()``. Two kinds exist: rows already pushed to every rank
(``push_allreduce.PushedRows``) and a partial row the signal-free all-reduce will sum
(``lamport_allreduce.UnreducedRow``)."""

from __future__ import annotations

from typing import Any

import torch


class PendingSum:
    __slots__ = ()

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the result's shape, dtype and device (not its value)."""
        raise NotImplementedError

    def wait(self) -> torch.Tensor:
        """The finished sum."""
        raise NotImplementedError

    def parts(self) -> Any:
        """Pushed rows the next GEMV sums as it reads them (``triton_decode.PartsArgs``), or
        None."""
        return None

    def reduce_add_stats(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(sum + residual, its sums of squares)`` for ``gemv(norm_ss=...)``, or None where
        this kind cannot: then ``wait()``."""
        return None
