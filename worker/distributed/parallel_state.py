"""Process groups of one parallel dimension (tensor or pipeline), passed to the layers that need
them. A single-process group does nothing; multi-process groups wrap torch.distributed.

Every worker joins one torch.distributed world (NCCL on GPUs, gloo on CPU) and, per parallel
dimension, a *device group* (the world's backend: collectives on model tensors) and a *CPU group*
(always gloo: small control tensors such as the pipeline's shape headers, and barriers, without
a device round trip). CPU workers of one host (the multiprocess executor) instead run every
collective and send/recv of their groups over one shared-memory segment per group
(``shm_collectives``; ``--cpu-collectives``, default shm there), gloo only setting it up.
Ranks are laid out tensor-parallel first::

    global rank = pp_rank * tp_size + tp_rank

so a tensor-parallel group is ``tp_size`` consecutive ranks (one pipeline stage) and a
pipeline group is the ranks with the same ``tp_rank``, one per stage.

Rendezvous: rank 0 hosts a ``TCPStore`` on port 0 of its host (the kernel picks a free port, so
there is never a fixed port and two engines can share a host) and reports the port to the
executor, which hands it to the other ranks (`serve_store`, `init_distributed`). The store
listens on that host's address only: loopback for the multiprocess executor, the head node's
address for Ray.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from tidal.engine_core import envs
from tidal.engine_core.kernel_config import KernelConfig

logger = logging.getLogger(__name__)

# How long a rank waits for the others at start-up (store connect, group creation). Steps
# themselves are never waited on with this: a rank that dies is noticed by the executor.
RENDEZVOUS_TIMEOUT = datetime.timedelta(seconds=300)
# Connections the store's listener queues: every rank connects at once at start-up.
_STORE_BACKLOG = 512


@dataclass(slots=True, weakref_slot=True)  # (weakly named by ``collective_ops``)
class ParallelGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = None  # torch.distributed ProcessGroup (NCCL on GPUs, gloo on CPU)
    cpu_group: Any = None  # gloo, for control messages and CPU tensors
    ranks: tuple[int, ...] = (0,)  # global ranks in this group, by group rank
    # One-shot all-reduce for small CUDA tensors (``symm_allreduce``); None: NCCL only.
    fast_all_reduce: Any = None
    # All-reduce fused into batch-1 decode GEMVs (``push_allreduce``), set after the model loads.
    push_all_reduce: Any = None
    # Every collective and send/recv over shared memory (``shm_collectives.ShmCollectives``)
    # when the group's ranks are CPU processes of this host; None: torch.distributed.
    shm: Any = None
    # The name ``tidal::all_reduce`` finds this group by in a compiled graph (``collective_ops``).
    name: str = ""

    def __post_init__(self) -> None:
        if self.world_size > 1 and not self.name:
            from tidal.worker.distributed import collective_ops

            self.name = collective_ops.register(self)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def next_rank(self) -> int:
        """Group rank of the next member (wraps around)."""
        return (self.rank + 1) % self.world_size

    @property
    def prev_rank(self) -> int:
        """Group rank of the previous member (wraps around)."""
        return (self.rank - 1) % self.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group: in place (returns ``x``), or, for a small CUDA tensor with the
        one-shot path on, a new tensor. Use the return value. Inside a Dynamo trace (the
        compiled model) it is the opaque ``tidal::all_reduce`` op, out of place."""
        if self.world_size == 1:
            return x
        if torch.compiler.is_compiling():
            return torch.ops.tidal.all_reduce(x, self.name)
        return self.eager_all_reduce(x)

    def eager_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """``all_reduce`` outside a trace, on a group of more than one rank."""
        if self.shm is not None:
            return self.shm.all_reduce(x)
        fast = self.fast_all_reduce
        if fast is not None and fast.applies(x):
            return fast(x)
        torch.distributed.all_reduce(x, group=self.device_group)
        return x

    def defer_all_reduce(self, x: torch.Tensor) -> Any:
        """The sum of one row ``x`` over the group, as a ``PendingSum`` that the next norm
        finishes (``Kernels.rms_norm_linear``) where the signal-free all-reduce takes ``x``, else
        as ``all_reduce`` returns it."""
        lamport = getattr(self.fast_all_reduce, "lamport", None)
        if self.world_size > 1 and lamport is not None:
            pending = lamport.defer(x)
            if pending is not None:
                return pending
        return self.all_reduce(x)

    def begin_step(self) -> None:
        """A forward pass starts: the fused all-reduce hands out its slots from the first."""
        if self.push_all_reduce is not None:
            self.push_all_reduce.begin_step()

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in group-rank order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        dim = dim % x.dim()
        # One flat gather into a single buffer (no list of per-rank tensors), then, unless the
        # gathered dimension is the first, one copy into place.
        lamport = getattr(self.fast_all_reduce, "lamport", None)
        if lamport is not None and lamport.applies(x):
            out = lamport.all_gather(x).view(self.world_size * x.shape[0], *x.shape[1:])
        else:
            out = torch.empty((self.world_size * x.shape[0], *x.shape[1:]), dtype=x.dtype,
                              device=x.device)
            if self.shm is not None:
                self.shm.all_gather_into(out, x)
            else:
                _all_gather_flat(out, x, group=self.device_group)
        if dim == 0:
            return out
        return (out.view(self.world_size, *x.shape).movedim(0, dim)
                .reshape(*x.shape[:dim], self.world_size * x.shape[dim], *x.shape[dim + 1:]))

    def broadcast(self, x: torch.Tensor, src: int = 0, cpu: bool = False) -> torch.Tensor:
        """``x`` of group rank ``src`` copied into ``x`` on every rank (returns ``x``)."""
        if self.world_size == 1:
            return x
        if self.shm is not None:
            return self.shm.broadcast(x, src)
        torch.distributed.broadcast(x, src=self.ranks[src], group=self._group(cpu))
        return x

    def send(self, x: torch.Tensor, dst: int, cpu: bool = False) -> Any:
        """Start sending ``x`` to group rank ``dst``; returns the work handle. Keep ``x`` alive
        and unchanged until ``wait()`` on it returns."""
        if self.shm is not None:
            return self.shm.send(x, dst)  # what the mailbox cannot take yet goes at wait()
        return torch.distributed.isend(x, dst=self.ranks[dst], group=self._group(cpu))

    def recv(self, x: torch.Tensor, src: int, cpu: bool = False) -> torch.Tensor:
        """Receive into ``x`` from group rank ``src`` (blocks until it arrived; on NCCL, until
        the receive is ordered on the current stream). Returns ``x``."""
        if self.shm is not None:
            return self.shm.recv(x, src)
        torch.distributed.recv(x, src=self.ranks[src], group=self._group(cpu))
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.shm is not None:
                self.shm.barrier()
            else:
                torch.distributed.barrier(group=self.cpu_group)

    def close(self) -> None:
        """Leave the shared-memory group, if any (peers waiting on this rank then fail)."""
        if self.shm is not None:
            self.shm.close()
        if self.name:
            from tidal.worker.distributed import collective_ops

            collective_ops.unregister(self.name)

    def _group(self, cpu: bool) -> Any:
        group = self.cpu_group if cpu else self.device_group
        if group is None:
            raise RuntimeError("this parallel group has no process group (world size "
                               f"{self.world_size}, ranks {self.ranks})")
        return group


# torch 2.13 renamed all_gather_into_tensor (same arguments); older ones only have the old name.
_all_gather_flat = getattr(torch.distributed, "all_gather_single", None) or \
    torch.distributed.all_gather_into_tensor


def single_group() -> ParallelGroup:
    return ParallelGroup()


def rank_layout(rank: int, tp_size: int) -> tuple[int, int]:
    """(tp_rank, pp_rank) of a global rank."""
    return rank % tp_size, rank // tp_size


def serve_store(host: str) -> Any:
    """Rank 0: host the rendezvous store on a free port of ``host`` (read it from ``.port``),
    listening there only. Keep the returned object alive while the process group is in use.

    torch's TCPStore listens on every interface whatever host it is given (it binds the
    wildcard address), and anyone who reaches the store can join or disturb the group. So
    the listening socket is made here, bound to ``host`` alone (127.0.0.1 for one host; the
    head node's address for Ray), and handed over: the store owns it from then on.
    """
    listener = _listen(host)
    port = listener.getsockname()[1]
    fd = listener.detach()  # the store closes it
    try:
        return torch.distributed.TCPStore(host, port, None, True, timeout=RENDEZVOUS_TIMEOUT,
                                          wait_for_workers=False, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def _gloo_on_loopback(host: str) -> None:
    """Gloo's connections between ranks listen on the address this host's name resolves to,
    often one the network reaches; with a loopback rendezvous (every rank on this host) they
    use the loopback interface instead, unless the user chose one (``GLOO_SOCKET_IFNAME``,
    read when a gloo group is created)."""
    if envs.gloo_socket_ifname() is not None or not _is_loopback(host):
        return
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name  # this worker process's own environment
            return


def _is_loopback(host: str) -> bool:
    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback
                   for info in socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM))
    except (OSError, ValueError):
        return False


def _listen(host: str) -> socket.socket:
    """A TCP socket listening on a free port of ``host`` (IPv4 or IPv6, as the host is)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address)
        sock.listen(_STORE_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def init_distributed(*, rank: int, tp_size: int, pp_size: int, host: str, port: int,
                     device: torch.device, store: Any = None,
                     kernels: KernelConfig | None = None,
                     cpu_collectives: str = "gloo",
                     mixed: bool = False,
                     tp_devices: tuple[str, ...] = (),
                     gpu_backend: str = "nccl") -> tuple[ParallelGroup, ParallelGroup]:
    """Join the world (rank 0 passes the store it serves; others connect to ``host:port``) and
    build the tensor- and pipeline-parallel groups of ``rank``. Collective: every rank calls it
    with the same sizes (and the same ``kernels``, whose all-reduce choices apply; None: the
    defaults). ``cpu_collectives`` "shm": the groups of these CPU ranks (all on this host)
    communicate over shared memory (``shm_collectives``); "gloo": over torch.distributed.
    ``mixed``: the pipeline stages run on different devices (``hetero_groups``): a gloo world,
    and a pipeline group with no device group (its tensors cross through host memory).
    ``tp_devices`` (``--tp-devices``, with ``mixed``): each tensor rank's device; the tensor
    group's device group is then ``gpu_backend`` (NCCL) over its GPU ranks only and its
    collectives the hierarchical ones (``hier_allreduce``)."""
    if cpu_collectives not in ("shm", "gloo"):
        raise ValueError(f"cpu_collectives must be shm or gloo, got {cpu_collectives!r}")
    if cpu_collectives == "shm" and device.type != "cpu" and not mixed:
        raise ValueError("shared-memory collectives are for CPU workers; "
                         f"this one runs on {device.type}")
    world = tp_size * pp_size
    dist = torch.distributed
    if store is None:
        store = dist.TCPStore(host, port, None, False, timeout=RENDEZVOUS_TIMEOUT)
    _gloo_on_loopback(host)
    from tidal.engine_core.plugins.platform import platform_for

    backend = platform_for(device.type).dist_backend  # nccl on CUDA, gloo on the CPU
    if mixed:
        backend = "gloo"  # CPU ranks in an NCCL group deadlock its start-up
    kwargs: dict[str, Any] = {}
    if device.type == "cuda" and not mixed:
        kwargs["device_id"] = device  # binds the communicator to this GPU up front
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=RENDEZVOUS_TIMEOUT, **kwargs)
    tp_rank, pp_rank = rank_layout(rank, tp_size)
    tp_ranks = [[s * tp_size + t for t in range(tp_size)] for s in range(pp_size)]
    pp_ranks = [[s * tp_size + t for s in range(pp_size)] for t in range(tp_size)]
    # new_group is collective over the whole world: every rank creates every group, in the same
    # order, and keeps only its own.
    tp = _make_groups(tp_ranks, rank, backend, world)
    pp = _make_groups(pp_ranks, rank, backend, world)
    if mixed:
        pp.device_group = None  # only GPU ranks could share one (hetero_groups)
    hier = None
    if tp_devices and tp.world_size > 1:
        from tidal.worker.distributed.hier_allreduce import make_hierarchical

        # (Before the shared-memory set-up below: new_group is collective over the world.)
        tp.device_group, hier = make_hierarchical(tp, tp_devices, gpu_backend, None)
    if tp.world_size > 1 and hier is None:
        from tidal.worker.distributed.symm_allreduce import make_symm_allreduce

        kc = kernels or KernelConfig()
        tp.fast_all_reduce = make_symm_allreduce(
            tp.device_group, tp.cpu_group, tp.world_size, device, enabled=kc.symm_allreduce,
            lamport=kc.lamport_allreduce, max_bytes=kc.symm_allreduce_max_bytes)
    logger.info("rank %d joined the %s world of %d (tp rank %d/%d, pp rank %d/%d)", rank,
                backend, world, tp_rank, tp_size, pp_rank, pp_size)
    if (device.type == "cpu" or mixed) and world > 1:
        # (A mixed layout's groups carry host tensors only: the GPU ranks map the segment too.)
        if cpu_collectives == "shm":
            from tidal.worker.distributed.shm_collectives import ShmCollectives

            # Every rank sets up its tensor group, then its pipeline group: the same order
            # within each group, so the set-ups' gloo rendezvous never cross.
            for group in (tp, pp):
                if group.world_size > 1:
                    group.shm = ShmCollectives.create(group.cpu_group, group.rank, group.ranks)
        if hier is not None:
            from tidal.worker.distributed.hier_allreduce import GlooHost

            # The tensor group's host side (step 3 of the all-reduce) is what a CPU group's
            # collectives would be; the group routes every collective through ``hier``.
            hier.host = tp.shm if tp.shm is not None else GlooHost(tp.cpu_group, tp.ranks)
            tp.shm = hier
        logger.info("rank %d: CPU collectives over %s", rank,
                    "shared memory" if cpu_collectives == "shm" else "gloo")
    return tp, pp


def _make_groups(all_ranks: list[list[int]], rank: int, backend: str,
                 world: int) -> ParallelGroup:
    mine = ParallelGroup(rank=0, world_size=1, ranks=(rank,))
    for ranks in all_ranks:
        if len(ranks) == 1:
            continue  # a group of one never communicates: no process group to create
        if len(ranks) == world:
            # The whole world: reuse the default group for the device, and for the CPU too when
            # the default group already is gloo.
            device_group = torch.distributed.group.WORLD
            cpu_group = (device_group if backend == "gloo"
                         else torch.distributed.new_group(ranks, backend="gloo"))
        else:
            device_group = torch.distributed.new_group(ranks, backend=backend)
            cpu_group = (device_group if backend == "gloo"
                         else torch.distributed.new_group(ranks, backend="gloo"))
        if rank in ranks:
            mine = ParallelGroup(rank=ranks.index(rank), world_size=len(ranks),
                                 device_group=device_group, cpu_group=cpu_group,
                                 ranks=tuple(ranks))
    return mine


def destroy_distributed(*groups: ParallelGroup | None) -> None:
    """Leave ``groups``' shared-memory segments, then the torch.distributed world."""
    for group in groups:
        if group is not None:
            group.close()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
