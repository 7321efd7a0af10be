"""Which all-reduce path a tensor takes (``worker/distributed/symm_allreduce.py`` and
``lamport_allreduce.py``), on CPU: the paths themselves need GPUs and are tested in
``test_lamport_allreduce_gpu.py`` and ``test_kernels_allreduce.py``; here the objects are built
without their buffers and the kernels replaced by recorders."""

from __future__ import annotations

import torch

from tidal.worker.distributed.lamport_allreduce import LamportAllReduce
from tidal.worker.distributed.symm_allreduce import SymmAllReduce


def _lamport(row_elems: int) -> LamportAllReduce:
    lam = object.__new__(LamportAllReduce)
    lam.row_elems = row_elems
    return lam


def test_lamport_takes_only_16_bit_contiguous_tensors_within_its_rows() -> None:
    lam = _lamport(64)
    assert lam.applies(torch.ones(4, 16, dtype=torch.bfloat16))
    assert lam.applies(torch.ones(64, dtype=torch.float16))
    # float32 would need a 32-bit sentinel; the buffers hold 16-bit ones.
    assert not lam.applies(torch.ones(8, dtype=torch.float32))
    assert not lam.applies(torch.ones(65, dtype=torch.bfloat16))
    assert not lam.applies(torch.ones(0, dtype=torch.bfloat16))
    assert not lam.applies(torch.ones(8, 8, dtype=torch.bfloat16).t())


class _Recorder:
    def __init__(self, limit: int) -> None:
        self.limit, self.calls = limit, 0

    def applies(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * 3


def _symm(lamport, one_shot: bool, max_bytes: int) -> tuple[SymmAllReduce, list[int]]:
    comm = object.__new__(SymmAllReduce)
    comm.lamport, comm.one_shot, comm.max_bytes = lamport, one_shot, max_bytes
    one_shot_calls: list[int] = []

    def fake_one_shot(x: torch.Tensor) -> torch.Tensor:
        one_shot_calls.append(x.numel())
        return x * 2

    comm.one_shot_sum = fake_one_shot
    return comm, one_shot_calls


def test_small_tensors_take_lamport_then_one_shot_then_nccl() -> None:
    lam = _Recorder(limit=8)
    comm, one_shot = _symm(lam, one_shot=True, max_bytes=64)
    small, medium, large = torch.ones(8), torch.ones(16), torch.ones(32)
    assert torch.equal(comm(small), small * 3) and lam.calls == 1 and one_shot == []
    assert comm.applies(medium) and torch.equal(comm(medium), medium * 2) and one_shot == [16]
    assert not comm.applies(large)  # 128 bytes: NCCL's
    # 64-bit tensors never take the one-shot path (not among its kernel's dtypes).
    comm, _ = _symm(None, one_shot=True, max_bytes=64)
    assert comm.applies(torch.ones(4)) and not comm.applies(torch.ones(4, dtype=torch.float64))


def test_without_the_one_shot_path_only_lamport_sized_tensors_apply() -> None:
    lam = _Recorder(limit=8)
    comm, one_shot = _symm(lam, one_shot=False, max_bytes=1 << 20)
    assert comm.applies(torch.ones(8)) and not comm.applies(torch.ones(9))
    comm, one_shot = _symm(None, one_shot=True, max_bytes=1 << 20)
    assert comm.applies(torch.ones(9)) and torch.equal(comm(torch.ones(9)), torch.full((9,), 2.0))
    assert one_shot == [9]
