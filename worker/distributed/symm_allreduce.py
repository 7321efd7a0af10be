"""One-shot all-reduce over PyTorch symmetric memory, for the small tensors of decode steps.

Tensor parallelism all-reduces one hidden state per token twice a layer. For a batch-1 decode
step that is an 8 KiB tensor, where NCCL's ring protocol costs ~17 µs per call on 2×H200 and a
one-shot reduction (every rank copies its input into a buffer its peers can read over NVLink,
then each sums all of them) ~7 µs, measured in CUDA graphs by ``tools/bench_allreduce_symm.py``.
It uses plain peer-to-peer loads: no NVLink multicast (which shared hosts must keep off).

Larger tensors (prefill) keep NCCL: a one-shot reduction reads every peer's whole input, so its
cost grows with the tensor where NCCL's ring does not. Two buffers are used in turn, so a rank
that starts its next all-reduce cannot overwrite a buffer a slower peer is still reading (the
next call's barrier needs that peer to have finished the previous one). The one exception is a
captured graph with an odd number of all-reduces, whose replays meet the same buffer twice in a
row across the step boundary; the LM head, sampling and the next step's inputs lie between.

For 16-bit tensors up to 256 Ki elements (64 rows of 4096) a third path comes first: the
all-reduce in which each value is its own signal (``lamport_allreduce``; one NVLink crossing,
no barrier).

Each path is used only where it wins: at start-up every rank times all of them on a
decode-sized tensor, and the ranks agree (over the CPU group) to keep a path only if it was
faster on all of them. ``KernelConfig.symm_allreduce`` off (``TIDAL_SYMM_ALLREDUCE=0``)
turns both off (NCCL only), ``lamport_allreduce`` "off" (``TIDAL_LAMPORT_ALLREDUCE=0``) only the
signal-free one ("force" keeps it without timing, for tests); any failure to set one up on
any rank drops it on every rank, with one warning.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# Tensors up to this size take the one-shot path (256 tokens of a 4096-wide bf16 hidden state).
MAX_BYTES = 2 << 20  # KernelConfig.symm_allreduce_max_bytes
_SUPPORTED_WORLD_SIZES = (2, 4, 8)
# The dtypes the symmetric-memory reduction kernels are built for.
_DTYPES = (torch.bfloat16, torch.float32)


class SymmAllReduce:
    def __init__(self, group: Any, device: torch.device, max_bytes: int = MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self._buffers = []
        for _ in range(2):
            buf = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(buf, self.group_name)
            self._buffers.append(buf)
        self._next = 0
        self._op = torch.ops.symm_mem.one_shot_all_reduce_copy_out
        # Set by make_symm_allreduce: the signal-free path for small 16-bit tensors (tried
        # first), and whether the one-shot path is used at all (it can lose to NCCL where the
        # signal-free one does not).
        self.lamport: Any = None
        self.one_shot = True

    def applies(self, x: torch.Tensor) -> bool:
        if self.lamport is not None and self.lamport.applies(x):
            return True
        return (self.one_shot and x.dtype in _DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, as a new tensor (check ``applies`` first)."""
        lamport = self.lamport
        if lamport is not None and lamport.applies(x):
            return lamport(x)
        return self.one_shot_sum(x)

    def one_shot_sum(self, x: torch.Tensor) -> torch.Tensor:
        nbytes = x.numel() * x.element_size()
        buf = self._buffers[self._next]
        # Alternate at capture time too: the graph records both buffers in turn.
        self._next ^= 1
        staging = buf[:nbytes].view(x.dtype).view(x.shape)
        out = torch.empty_like(x)
        self._op(staging, x, "sum", self.group_name, out)
        return out


def make_symm_allreduce(device_group: Any, cpu_group: Any, world_size: int,
                        device: torch.device, *, enabled: bool = True, lamport: str = "on",
                        max_bytes: int = MAX_BYTES) -> SymmAllReduce | None:
    """The one-shot all-reduce for a device group, or None (NCCL only). Collective over the
    group: every member calls it, and all of them get one or all get None. ``enabled``,
    ``lamport`` ("on" | "off" | "force") and ``max_bytes``: the worker's ``KernelPolicy``."""
    if device.type != "cuda" or world_size not in _SUPPORTED_WORLD_SIZES or not enabled:
        return None
    comm, error = None, ""
    try:
        comm = SymmAllReduce(device_group, device, max_bytes)
    except Exception as exc:  # noqa: BLE001 - any failure means NCCL, agreed below
        error = f"{type(exc).__name__}: {exc}"
    if not agree(comm is not None, cpu_group):
        if error:
            logger.warning("symmetric-memory all-reduce unavailable (%s); using NCCL only", error)
        return None
    assert comm is not None
    if lamport != "off":
        from tidal.worker.distributed.lamport_allreduce import make_lamport

        signal_free, error = make_lamport(device_group,
                                          torch.distributed.get_rank(device_group), world_size,
                                          device)
        if agree(signal_free is not None, cpu_group):
            comm.lamport = signal_free
        elif error:
            logger.warning("signal-free all-reduce unavailable (%s); not using it", error)
    # Where peers are reached over PCIe rather than NVLink these paths can lose to NCCL: time
    # them on a decode-sized tensor and keep each only if it wins everywhere.
    us = _time_paths(comm, device_group, device)
    if (comm.lamport is not None and lamport != "force"
            and not agree(us["lamport"] < min(us["one_shot"], us["nccl"]), cpu_group)):
        comm.lamport = None
    comm.one_shot = agree(us["one_shot"] < us["nccl"], cpu_group)
    timing = ", ".join(f"{k} {v:.1f}" for k, v in us.items())
    if comm.lamport is None and not comm.one_shot:
        logger.info("tensor-parallel all-reduce: NCCL (us for 8 KiB on this rank: %s)", timing)
        return None
    logger.info("tensor-parallel all-reduce: %s%s, NCCL above (us for 8 KiB on this rank: %s)",
                "signal-free up to 512 KiB of 16-bit values, " if comm.lamport is not None else "",
                f"one-shot symmetric memory up to {comm.max_bytes >> 10} KiB" if comm.one_shot
                else "no one-shot", timing)
    return comm


def agree(mine: bool, cpu_group: Any) -> bool:
    """True on every rank if ``mine`` is true on every rank."""
    flag = torch.tensor([int(mine)], dtype=torch.int32)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=cpu_group)
    return bool(flag.item())


def _time_paths(comm: SymmAllReduce, device_group: Any, device: torch.device,
                iters: int = 32) -> dict[str, float]:
    """Microseconds per all-reduce of a [1, 4096] bf16 tensor on each path, replayed from a
    CUDA graph as decode steps run (eagerly, a Triton launch's host cost would hide the GPU
    time), or eagerly if capture fails. Every rank runs the same sequence."""
    x = torch.ones(1, 4096, dtype=torch.bfloat16, device=device)

    def timed(fn) -> float:
        for _ in range(3):
            fn()  # compiles, and NCCL's communicator must exist before a capture
        torch.cuda.synchronize(device)
        graph = None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(iters):
                    fn()
            run = graph.replay
        except Exception as exc:  # noqa: BLE001 - eager timing is still a comparison
            logger.debug("all-reduce timing without a graph (%s)", exc)
            graph = None

            def run() -> None:
                for _ in range(iters):
                    fn()
        run()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        del graph
        return start.elapsed_time(end) * 1000 / iters

    us = {}
    if comm.lamport is not None:
        us["lamport"] = timed(lambda: comm.lamport(x))
    us["one_shot"] = timed(lambda: comm.one_shot_sum(x))
    us["nccl"] = timed(lambda: torch.distributed.all_reduce(x, group=device_group))
    return us
