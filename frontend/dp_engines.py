"""The EngineCore processes of ``--data-parallel-size N``: started and stopped together.

Each rank is a whole engine (its own scheduler, KV cache and TP x PP workers) in a process of
its own, listening on its own ``ipc://`` handshake socket; its config differs from the others'
only in ``parallel.data_parallel_rank``, which its outputs carry (metrics label them) and its
log lines name (``EngineCore_DP1[pid]``). On a GPU, rank ``r`` sees the ``r``-th slice of the
visible devices (``CUDA_VISIBLE_DEVICES`` set in the rank's process before CUDA starts), so the
ranks never share a device. Every API server connects to every rank (``dp_client``).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec

from tidal.engine_core import envs
from tidal.engine_core.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DPEngine:
    """One rank's process and where it listens."""

    rank: int
    proc: BaseProcess
    address: str
    tmpdir: str
    # ``--data-parallel-lockstep``: the ranks' rendezvous store (a ``TCPStore`` this process
    # serves), held by every rank's entry so it lives until ``stop_dp_engines`` drops it.
    store: Any = None

    @property
    def name(self) -> str:
        return f"EngineCore DP rank {self.rank}"


def rank_config(config: EngineConfig, rank: int, port: int = 0) -> EngineConfig:
    """Rank ``rank``'s config; ``port``: the lockstep ranks' rendezvous store (loopback)."""
    parallel = msgspec.structs.replace(config.parallel, data_parallel_rank=rank,
                                       data_parallel_port=port)
    return msgspec.structs.replace(config, parallel=parallel)


def serve_rendezvous_store() -> Any:
    """The lockstep ranks' rendezvous store, served here on a loopback port the kernel picks:
    bound before any rank starts (no port another process could take meanwhile) and by a
    process that outlives the ranks (none of them is the one whose death takes it away)."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30))


def rank_devices(config: EngineConfig, visible: str | None = None,
                 device_count: int | None = None) -> list[str | None]:
    """Each rank's ``CUDA_VISIBLE_DEVICES`` (None everywhere on a CPU): consecutive slices of
    ``world_size`` devices out of those visible now. Raises ``ConfigError`` if too few."""
    dp = config.parallel.data_parallel_size
    if config.runner.device != "cuda":
        return [None] * dp
    if visible is None:
        visible = envs.cuda_visible_devices()
    if visible is not None:
        devices = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        if device_count is None:
            import torch

            device_count = torch.cuda.device_count()
        devices = [str(i) for i in range(device_count)]
    world = config.parallel.world_size
    if len(devices) < dp * world:
        raise ConfigError(f"--data-parallel-size {dp} x {world} GPU(s) per rank needs "
                          f"{dp * world} GPUs; {len(devices)} visible")
    return [",".join(devices[r * world:(r + 1) * world]) for r in range(dp)]


def run_dp_rank(config_bytes: bytes, listen: str, rank: int, devices: str | None) -> None:
    """Entry point of one rank's process (a ``multiprocessing`` target)."""
    if devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = devices  # before anything starts CUDA here
    from tidal.engine_core.core_proc import run_engine_core

    run_engine_core(config_bytes, listen, log_name=f"EngineCore_DP{rank}")


def start_dp_engines(config: EngineConfig) -> list[DPEngine]:
    """Start every rank's process (``spawn``); they load their models in parallel. The caller
    stops them with ``stop_dp_engines`` (also on failure: whatever started is returned only
    on success, so a failure here stops what it started itself)."""
    dp = config.parallel.data_parallel_size
    devices = rank_devices(config)
    ctx = multiprocessing.get_context("spawn")
    engines: list[DPEngine] = []
    store = serve_rendezvous_store() if config.parallel.data_parallel_lockstep else None
    port = 0 if store is None else store.port
    try:
        for rank in range(dp):
            tmpdir = tempfile.mkdtemp(prefix=f"tidal-dp{rank}-")
            address = f"ipc://{tmpdir}/engine.sock"
            config_bytes = msgspec.msgpack.encode(rank_config(config, rank, port))
            proc = ctx.Process(target=run_dp_rank, name=f"EngineCore_DP{rank}", daemon=False,
                               args=(config_bytes, address, rank, devices[rank]))
            try:
                proc.start()
            except BaseException:
                shutil.rmtree(tmpdir, ignore_errors=True)
                raise
            engines.append(DPEngine(rank, proc, address, tmpdir, store))
    except BaseException:
        stop_dp_engines(engines, 0.0)
        raise
    logger.info("started %d data-parallel EngineCores (pids %s)", dp,
                ", ".join(str(e.proc.pid) for e in engines))
    return engines


def stop_dp_engines(engines: list[DPEngine], grace_s: float) -> None:
    """SIGTERM to every rank, SIGKILL to any still running after ``grace_s`` (all ranks
    stop at once, so their graces overlap); removes their folders and, once every process is
    gone, stops serving the lockstep ranks' store."""
    deadline = time.monotonic() + grace_s
    for engine in engines:
        if engine.proc.is_alive():
            engine.proc.terminate()
    for engine in engines:
        engine.proc.join(max(0.0, deadline - time.monotonic()))
        if engine.proc.is_alive():
            logger.warning("%s (pid %s) did not stop in %.0f s; killing it", engine.name,
                           engine.proc.pid, grace_s)
            engine.proc.kill()
            engine.proc.join()
        shutil.rmtree(engine.tmpdir, ignore_errors=True)
    for engine in engines:
        engine.store = None  # the last reference: its server stops (no rank left to serve)
