"""Process groups of one parallel dimension (tensor or pipeline), passed to the layers that need
them. A single-process group does nothing; multi-process groups wrap torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = None  # torch.distributed ProcessGroup (NCCL on GPUs, gloo on CPU)
    cpu_group: Any = None  # gloo, for control messages and CPU tensors
    ranks: tuple[int, ...] = (0,)  # global ranks in this group, by group rank

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)


def single_group() -> ParallelGroup:
    return ParallelGroup()
