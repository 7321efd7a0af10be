"""The cross-engine group of expert parallelism: the workers that hold the same tensor-parallel
rank in every data-parallel engine (one per engine), which exchange their tokens in every MoE
layer (``layers/moe_ep``).

Each engine's workers already form their own torch.distributed world, so this group is built
outside it: process groups made directly over the DP ranks' rendezvous store (the launcher's
loopback ``TCPStore``, ``frontend/dp_engines.py``), under a prefix of their own so they never
meet the lockstep group's keys or another TP rank's group. A gloo group carries the per-step
token counts (host integers: no device round trip); the tensors go over NCCL on GPUs and
over the same gloo group on CPUs. Gloo has no reduce-scatter of one flat tensor, so there the
combine is an all-reduce and each rank keeps its slice.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# The engines load their models before they meet here: allow for the slowest (a rank that
# dies meanwhile ends them all: whoever started them watches their processes).
_RENDEZVOUS_S = 600.0
# A collective waits this long for the slowest rank's step (a vanished rank fails it sooner).
_COLLECTIVE_S = 1800.0


class Pending:
    """A collective in flight and its input, kept alive until ``wait`` returns."""

    __slots__ = ("work", "_input")

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work = work
        self._input: torch.Tensor | None = tensor

    def wait(self) -> None:
        self.work.wait()
        self._input = None


class DPExpertGroup:
    """Data-parallel rank ``dp_rank`` of ``dp_size`` among the workers of tensor rank
    ``tp_rank``; collective to create (every engine's worker of that TP rank at start-up)."""

    def __init__(self, dp_rank: int, dp_size: int, tp_rank: int, port: int,
                 device: torch.device) -> None:
        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        if not port:
            raise RuntimeError("expert parallelism across data-parallel engines: no rendezvous "
                               "store port (the engines are started by frontend/dp_engines.py, "
                               "which serves it with --data-parallel-lockstep)")
        self.rank = dp_rank
        self.size = dp_size
        self.device = device
        store = TCPStore("127.0.0.1", port, None, False,
                         timeout=datetime.timedelta(seconds=_RENDEZVOUS_S))
        prefix = PrefixStore(f"tidal/ep/tp{tp_rank}/", store)
        options = ProcessGroupGloo._Options()
        options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        options._timeout = datetime.timedelta(seconds=_COLLECTIVE_S)
        self.cpu_group: Any = ProcessGroupGloo(PrefixStore("gloo/", prefix), dp_rank, dp_size,
                                               options)
        self.device_group: Any = self.cpu_group
        if device.type == "cuda":
            from torch.distributed import ProcessGroupNCCL

            # (A backend made directly, as torch's new_group makes its own.)
            nccl_options = ProcessGroupNCCL.Options()
            nccl_options.is_high_priority_stream = False
            nccl_options._timeout = datetime.timedelta(seconds=_COLLECTIVE_S)
            nccl_options.group_name = f"tidal_ep_tp{tp_rank}"
            self.device_group = ProcessGroupNCCL(PrefixStore("nccl/", prefix), dp_rank,
                                                 dp_size, nccl_options)
        self._counts = torch.zeros(dp_size, dtype=torch.int64)
        logger.info("expert parallel: joined the %d data-parallel engines' group of tensor "
                    "rank %d as rank %d (%s)", dp_size, tp_rank, dp_rank,
                    "nccl" if device.type == "cuda" else "gloo")

    @property
    def closed(self) -> bool:
        return self.cpu_group is None

    def close(self) -> None:
        """Shut the group's process groups down and drop them (with them the connection to the
        rendezvous store); collective-free, so a rank may close while its peers are gone."""
        groups = [] if self.cpu_group is None else [self.cpu_group]
        if self.device_group is not None and self.device_group is not self.cpu_group:
            groups.insert(0, self.device_group)
        self.cpu_group = self.device_group = None
        for group in groups:
            stop = getattr(group, "shutdown", None) or getattr(group, "abort", None)
            if stop is None:
                continue
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown: dropped anyway
                logger.debug("expert parallel: closing %s: %s", type(group).__name__, exc)
        if groups:
            logger.debug("expert parallel: left the data-parallel engines' group as rank %d",
                         self.rank)

    def token_counts(self, tokens: int) -> list[int]:
        """Every rank's token count this step (one small gloo all-reduce)."""
        import torch.distributed as dist

        counts = self._counts
        counts.zero_()
        counts[self.rank] = tokens
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self.cpu_group.allreduce([counts], options).wait()
        return counts.tolist()

    def sum_floats(self, values: list[float]) -> list[float]:
        """``values`` summed element-wise over the ranks (one gloo all-reduce; every rank
        passes as many)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self.cpu_group.allreduce([t], options).wait()
        return t.tolist()

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [n, ...]`` (the same shape on each) stacked: ``[size * n, ...]``."""
        out, work = self.start_all_gather(x)
        work.wait()
        return out

    def start_all_gather(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``all_gather`` begun: its output, valid once the returned work's ``wait()`` returns
        (keep ``x`` unchanged until then)."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        return out, Pending(self.device_group._allgather_base(out, x), x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Rank r's rows ``[r * n, (r + 1) * n)`` of ``x [size * n, ...]`` summed over ranks."""
        out, work = self.start_reduce_scatter(x)
        work.wait()
        return out

    def start_reduce_scatter(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``reduce_scatter`` begun, as ``start_all_gather`` (``x`` may be overwritten)."""
        import torch.distributed as dist

        n = x.shape[0] // self.size
        if self.device.type != "cuda":
            options = dist.AllreduceOptions()
            options.reduceOp = dist.ReduceOp.SUM
            work = self.cpu_group.allreduce([x], options)
            return x[self.rank * n:(self.rank + 1) * n], work
        out = x.new_empty((n, *x.shape[1:]))
        options = dist.ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.SUM
        return out, Pending(self.device_group._reduce_scatter_base(out, x, options), x)

    def pair_counts(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` (rank r's: how many rows it sends to each rank) as the matrix
        ``[sender][receiver]`` (one small gloo all-reduce)."""
        import torch.distributed as dist

        matrix = torch.zeros(self.size, self.size, dtype=torch.int64)
        matrix[self.rank] = torch.tensor(row, dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        self.cpu_group.allreduce([matrix], options).wait()
        return matrix.tolist()

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """``x``'s rows split by ``send`` (``send[r]`` rows to rank r, in rank order), and the
        rows every rank sends here, ``recv[r]`` from rank r, in rank order."""
        import torch.distributed as dist

        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        # (Zero rows either way still joins the collective: every rank runs it.)
        self.device_group.alltoall_base(out, x, recv, send, dist.AllToAllOptions()).wait()
        return out
