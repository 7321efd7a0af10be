"""``tidal::all_reduce`` (worker/distributed/collective_ops.py): the op a compiled model's trace
holds in place of a group's all-reduce."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.distributed import collective_ops
from tidal.worker.distributed.parallel_state import ParallelGroup


class _Doubling(ParallelGroup):
    """A stand-in group of two ranks whose peer holds the same tensor: the sum doubles."""

    def eager_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)


def test_names_are_deterministic_and_resolve_back():
    a = _Doubling(rank=0, world_size=2, ranks=(40, 41))
    b = _Doubling(rank=0, world_size=2, ranks=(40, 41))  # same ranks, a second group
    assert (a.name, b.name) == ("40,41#0", "40,41#1")
    assert ParallelGroup().name == ""  # one rank: nothing to reduce, no name
    a.close()  # a group re-made after a close gets the same name (a cached piece holds it)
    with pytest.raises(RuntimeError, match="no parallel group named"):
        collective_ops.all_reduce(torch.ones(1), "40,41#0")
    assert _Doubling(rank=0, world_size=2, ranks=(40, 41)).name == "40,41#0"


def test_the_op_sums_out_of_place_and_traces_as_one_node():
    group = _Doubling(rank=0, world_size=2, ranks=(50, 51))
    x = torch.arange(4.0)
    y = torch.ops.tidal.all_reduce(x, group.name)
    assert torch.equal(y, torch.arange(4.0) * 2) and torch.equal(x, torch.arange(4.0))

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    fn = torch.compile(lambda t: group.all_reduce(t + 1) * 3, backend=backend, fullgraph=True)
    assert torch.equal(fn(x), (x + 1) * 2 * 3)
    assert [t for t in seen if t.startswith("tidal.")] == ["tidal.all_reduce"]


def test_an_unknown_group_is_named():
    with pytest.raises(RuntimeError, match="no parallel group named"):
        collective_ops.all_reduce(torch.ones(2), "nobody#0")
