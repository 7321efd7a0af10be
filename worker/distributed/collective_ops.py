"""Tensor-parallel all-reduce as a torch custom op (``tidal::all_reduce``) for the compiled model.

Dynamo cannot trace into the engine's own collectives (shared-memory segments, the one-shot
symmetric-memory path, NCCL calls through a ProcessGroup object), so under
``--compilation-config`` mode 3 ``ParallelGroup.all_reduce`` emits this opaque op instead: the
graph carries the group's registered name (a string constant, so a warm start's plan rebuilds
it), the fake implementation gives Inductor the output's shape, and at run time the op calls the
group's eager all-reduce, whatever path that takes. The op is out of place (a custom op's output
may not alias its input): it sums a copy.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# name -> ParallelGroup, weakly: a group left behind must not outlive its process group's
# teardown (a gloo group destroyed at interpreter exit aborts the process).
_GROUPS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(group: Any) -> str:
    """A process-unique name for ``group`` that the op resolves back to it: its global ranks
    and how many groups of those ranks this process made before it. Deterministic (a worker
    builds its groups in one order), so the name saved in a compiled piece finds the same
    group in the next process that loads the piece from the compile cache."""
    ranks = ",".join(map(str, group.ranks))
    k = 0
    while f"{ranks}#{k}" in _GROUPS:  # (the lowest free: a group re-made after a close
        k += 1                       # gets its predecessor's name back)
    name = f"{ranks}#{k}"
    _GROUPS[name] = group
    return name


def unregister(name: str) -> None:
    """The group closed: its name resolves to nothing (and may be given again; so it is
    once the group is garbage)."""
    _GROUPS.pop(name, None)


@torch.library.custom_op("tidal::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    target = _GROUPS.get(group)
    if target is None:
        raise RuntimeError(f"tidal::all_reduce: no parallel group named {group!r} in this "
                           "process (a compiled graph from another process's plan?)")
    return target.eager_all_reduce(x.clone())


@all_reduce.register_fake
def _(x: torch.Tensor, group: str) -> torch.Tensor:
    return torch.empty_like(x)
