"""Collectives of a tensor-parallel group whose ranks mix GPUs and CPU processes
(``--tp-devices cuda,cpu``): the hierarchical all-reduce, and all-gather / broadcast through
host memory.

Two groups: ``device_group`` holds the GPU ranks only (NCCL; a CPU rank in an NCCL group
deadlocks its start-up, so it never joins one; None with fewer than two GPU ranks) and the
*host side* holds every rank (the group's shared-memory collectives, or its gloo
``cpu_group`` with ``--cpu-collectives gloo``). An all-reduce runs in four steps:

1. the GPU ranks reduce onto their leader (the first GPU rank) over NCCL (skipped with one);
2. the leader copies that sum into a pinned host buffer, on a copy stream of its own, and waits
   on the copy's event;
3. every rank all-reduces on the host side: the leader enters the GPU sum, each other GPU rank
   enters zeros, each CPU rank its own tensor (which already lives in host memory);
4. each GPU rank copies the host result back to its device.

Why zeros rather than a smaller group of the leader and the CPU ranks: the host side is then
the tensor group's own (one shared-memory segment, set up like any CPU group's), and step 4
needs no NCCL broadcast, since every GPU rank already holds the sum on the host. ``x + 0 == x``
exactly in IEEE arithmetic, so the zeros change no bit of the result, which therefore is
``(sum over GPU ranks, NCCL's order) + the CPU ranks`` in the host side's order (gloo's ring,
which the shared-memory all-reduce copies). It equals the plain all-reduce up to that
association: bit-exact with one GPU rank, within float rounding with more
(tests/worker/distributed/test_hier_allreduce.py).

Every rank gets the same bytes, so replicated activations stay identical across devices.
Nothing here can run inside a CUDA graph (the host waits on the copies): mixed ranks run
eagerly (``EngineArgs.create_config``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)


class GlooHost:
    """The host side over a gloo group (``--cpu-collectives gloo``), with the shared-memory
    collectives' interface. ``ranks``: the group's global ranks, by group rank."""

    def __init__(self, cpu_group: Any, ranks: tuple[int, ...]) -> None:
        self.group = cpu_group
        self.ranks = ranks

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        torch.distributed.broadcast(x, src=self.ranks[src], group=self.group)
        return x

    def barrier(self) -> None:
        torch.distributed.barrier(group=self.group)

    def close(self) -> None:
        pass


class HierarchicalCollectives:
    """A mixed tensor group's collectives, in the place of ``ParallelGroup.shm`` (the same
    methods, so ``ParallelGroup`` routes every tensor collective here). ``gpu_ranks``: the
    group ranks on GPUs, in order (the first is the leader); ``device_group``: their NCCL
    group (None with fewer than two); ``host``: the host side over every rank. Whether this
    rank plays a GPU rank follows ``gpu_ranks``, not the tensor's device, so CPU tests can play
    both roles with a gloo ``device_group``."""

    def __init__(self, rank: int, world: int, gpu_ranks: tuple[int, ...], device_group: Any,
                 host: Any) -> None:
        if len(gpu_ranks) > 1 and rank in gpu_ranks and device_group is None:
            raise ValueError(f"{len(gpu_ranks)} GPU ranks need a device group")
        self.rank = rank
        self.world = world
        self.gpu_ranks = gpu_ranks
        self.device_group = device_group if len(gpu_ranks) > 1 else None
        self.host = host
        self.is_gpu = rank in gpu_ranks
        self.is_leader = bool(gpu_ranks) and rank == gpu_ranks[0]
        # The leader's global rank in the device group (its first member: new_group sorts).
        self._leader = (torch.distributed.get_global_rank(self.device_group, 0)
                        if self.device_group is not None and self.is_gpu else 0)
        self._staging: dict[torch.dtype, torch.Tensor] = {}  # grown on demand, pinned on CUDA
        self._copy_stream: Any = None
        self._d2h: Any = None
        self._h2d: Any = None  # the last copy out of the staging buffer (reused next call)

    # --- the four steps -------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (returns ``x``)."""
        if not self.is_gpu:
            if x.device.type != "cpu":
                raise ValueError(f"a CPU rank's all-reduce got a {x.device.type} tensor")
            return self.host.all_reduce(x)
        if self.device_group is not None:  # step 1
            torch.distributed.reduce(x, dst=self._leader, group=self.device_group)
        buf = self._buffer(x)
        if self.is_leader:  # step 2
            self._to_host(x, buf)
        else:
            buf.zero_()  # (the leader entered this rank's share in step 1)
        self.host.all_reduce(buf)  # step 3
        self._from_host(buf, x)  # step 4
        return x

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` laid end to end in ``out`` (on ``x``'s device), in group-rank
        order; through host memory (the vocab-parallel logits: once a step)."""
        hx = x.to("cpu") if x.device.type != "cpu" else x
        hout = out if out.device.type == "cpu" else torch.empty(out.shape, dtype=out.dtype)
        self.host.all_gather_into(hout, hx)
        if hout is not out:
            out.copy_(hout)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of group rank ``src`` copied into ``x`` on every rank (returns ``x``)."""
        if x.device.type == "cpu":
            return self.host.broadcast(x, src)
        hx = self.host.broadcast(x.to("cpu"), src)
        if self.rank != src:
            x.copy_(hx)
        return x

    def barrier(self) -> None:
        self.host.barrier()

    def close(self) -> None:
        self.host.close()

    def send(self, x: torch.Tensor, dst: int) -> Any:
        raise RuntimeError("a tensor group mixing devices has no point-to-point sends")

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        raise RuntimeError("a tensor group mixing devices has no point-to-point receives")

    # --- host staging ---------------------------------------------------------------------

    def _buffer(self, x: torch.Tensor) -> torch.Tensor:
        """A host tensor shaped like ``x`` (the staging buffer, grown to the largest seen)."""
        if self._h2d is not None:
            self._h2d.synchronize()  # the previous call's copy back has read the buffer
        n = x.numel()
        flat = self._staging.get(x.dtype)
        if flat is None or flat.numel() < n:
            # (A normal tensor even when the first call runs under inference mode, so calls
            # outside it may write it too.)
            with torch.inference_mode(False):
                flat = torch.empty(n, dtype=x.dtype, pin_memory=x.device.type == "cuda")
            self._staging[x.dtype] = flat
        return flat[:n].view(x.shape)

    def _to_host(self, x: torch.Tensor, buf: torch.Tensor) -> None:
        if x.device.type != "cuda":
            buf.copy_(x)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(x.device)
            self._d2h = torch.cuda.Event()
            self._h2d = torch.cuda.Event()
        stream = self._copy_stream
        # (The copy stream starts once ``x`` is computed; compute already queued behind it on
        # the main stream goes on meanwhile.)
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            buf.copy_(x, non_blocking=True)
            self._d2h.record(stream)
        self._d2h.synchronize()

    def _from_host(self, buf: torch.Tensor, x: torch.Tensor) -> None:
        if x.device.type != "cuda":
            x.copy_(buf)
            return
        if self._h2d is None:
            self._h2d = torch.cuda.Event()
        x.copy_(buf, non_blocking=True)  # on the main stream: what reads ``x`` comes after
        self._h2d.record(torch.cuda.current_stream(x.device))


def make_hierarchical(group: Any, tp_devices: tuple[str, ...], backend: str, host: Any
                      ) -> tuple[Any, HierarchicalCollectives]:
    """(the NCCL group of the GPU ranks or None, the collectives) for tensor group ``group``
    (a ``ParallelGroup``) whose ranks run on ``tp_devices`` (by group rank). Collective over
    the whole world: ``new_group`` is, so every rank calls it, CPU ranks too (they are not
    members: no NCCL communicator starts in them). ``backend``: the GPU ranks' (nccl; gloo
    where tests play GPU ranks on a CPU)."""
    gpu_ranks = tuple(r for r, d in enumerate(tp_devices) if d == "cuda")
    device_group = None
    if len(gpu_ranks) > 1:
        members = [group.ranks[r] for r in gpu_ranks]
        device_group = torch.distributed.new_group(members, backend=backend)
        if group.rank not in gpu_ranks:
            device_group = None
    coll = HierarchicalCollectives(group.rank, group.world_size, gpu_ranks, device_group, host)
    logger.info("tensor rank %d (%s): hierarchical all-reduce, GPU ranks %s, %d CPU rank(s)",
                group.rank, tp_devices[group.rank], list(gpu_ranks),
                len(tp_devices) - len(gpu_ranks))
    return device_group, coll
