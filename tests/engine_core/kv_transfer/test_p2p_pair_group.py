"""How a pair spreads a batch of tensors over its NCCL communicators (p2p_pair_group.py)."""

from __future__ import annotations

import torch

from tidal.engine_core.kv_transfer.p2p_pair_group import PairGroup


class _Work:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def is_completed(self) -> bool:
        return True

    def wait(self, *args) -> bool:
        self.log.append(("wait", self.name))
        return True


class _Group:
    """Records the ops queued on one communicator, in order."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.ops = name, log, []

    def send(self, tensors, peer, tag):
        self.ops.append(int(tensors[0][0]))
        return _Work(self.log, f"{self.name}:{len(self.ops)}")

    recv = send


def test_a_batch_goes_round_robin_and_each_side_pairs_up_in_order():
    log: list = []
    groups = [_Group("a", log), _Group("b", log)]
    pair = PairGroup("nccl", 0, groups, 5.0, torch.device("cpu"))
    work = pair.start_sends([torch.tensor([i]) for i in range(5)])
    assert groups[0].ops == [0, 2, 4] and groups[1].ops == [1, 3]
    # The consumer's side posts the same tensors' receives on the same communicators.
    other = [_Group("c", log), _Group("d", log)]
    PairGroup("nccl", 1, other, 5.0, torch.device("cpu")).start_recvs(
        [torch.tensor([i]) for i in range(5)])
    assert [g.ops for g in other] == [g.ops for g in groups]
    # One work for the batch: each communicator's last op (each runs its ops in order).
    pair.finish(work, "send")
    assert sorted(log) == [("wait", "a:3"), ("wait", "b:2")]


def test_one_communicator_queues_op_after_op():
    log: list = []
    group = _Group("a", log)
    pair = PairGroup("nccl", 0, [group], 5.0, torch.device("cpu"))
    pair.finish(pair.start_sends([torch.tensor([i]) for i in range(3)]), "send")
    assert group.ops == [0, 1, 2] and log == [("wait", "a:3")]
