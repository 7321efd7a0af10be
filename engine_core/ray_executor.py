"""The Ray executor (``--distributed-executor-backend ray``): workers as Ray actors, for more than
one machine. On one host the multiprocess executor stays the default (its shared-memory ring
is faster than Ray's object transport).

Cluster. If this process is not connected to Ray yet, it joins the cluster named by
``RAY_ADDRESS`` or started on this machine with ``ray start --head`` (``address="auto"``), and
otherwise starts a local one sized to hold every rank; a cluster it started is stopped again at
shutdown, one it only joined is left running.

Placement. One placement-group bundle per rank: ``{"GPU": 1}`` on GPUs, ``{"CPU": 1}`` on a CPU
cluster, packed onto as few nodes as possible. Ranks are numbered node by node (the node of this
process first), so each tensor-parallel group sits on one node wherever the cluster allows.
Each actor sees every GPU the group holds on its node (``CUDA_VISIBLE_DEVICES``) and picks its
own by local rank, so NCCL can use peer-to-peer paths between them.

Same worker code, same wire types. Each actor wraps the ``WorkerProc`` that worker processes run;
the rendezvous is the same (rank 0 serves the store on a free port of its node). A request is
the same msgspec-encoded frames a worker process would read from the ring, put in Ray's object
store once per step and handed to every actor; the output rank returns its reply's frames.
Ray runs an actor's calls one at a time in the order this process submitted them, so ranks see
steps in order, and a pipeline stage can start step N+1 while the next stage works on step N.

Failure. Any rank's call that fails (``RayActorError`` when the actor process died, the
worker's exception otherwise) raises `WorkerDiedError`/`WorkerError`; every wait on a step
looks at all ranks' calls of that step, at least every ``_POLL_S``. While idle, ``check_health``
pings every actor. Shutdown kills every actor and removes the placement group, so no actor
outlives the engine.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import msgspec
import numpy as np

from tidal.engine_core import envs
from tidal.engine_core.config import ConfigError, EngineConfig
from tidal.engine_core.control import CompileStats, GetCompileStats
from tidal.engine_core.multiproc_executor import WorkerDiedError, WorkerError
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput
from tidal.engine_core.serial import Decoder, Encoder
from tidal.worker.worker_proc import (
    Done,
    ExecuteModel,
    FinishSample,
    Failed,
    GetNumBlocks,
    InitKVCache,
    NumBlocks,
    Profile,
    ProfileSummary,
    StepResult,
    WorkerArgs,
    WorkerReply,
    WorkerRequest,
    format_exception,
)

logger = logging.getLogger(__name__)

_POLL_S = 0.1
_PLACEMENT_TIMEOUT_S = 120.0
_PING_TIMEOUT_S = 10.0


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install "
                          "'tidal[ray]' (or pip install 'ray>=2.10')") from exc
    return ray


class RayWorkerActor:
    """The body of one rank's actor (made a Ray actor class with ``ray.remote`` at run time,
    so importing this module does not need Ray)."""

    def __init__(self) -> None:
        self.proc: Any = None
        self.store: Any = None
        self._encoder = Encoder()
        self._decoder: Decoder[WorkerRequest] = Decoder(WorkerRequest)

    def node_info(self) -> tuple[str, list[int], int]:
        """(node IP, GPU ids Ray gave this actor, pid)."""
        import ray

        return ray.util.get_node_ip_address(), [int(g) for g in ray.get_gpu_ids()], os.getpid()

    def serve_store(self, host: str) -> int:
        from tidal.worker.distributed.parallel_state import serve_store

        self.store = serve_store(host)
        return int(self.store.port)

    def init_worker(self, args_bytes: bytes, port: int) -> None:
        from tidal.worker.worker_proc import WorkerProc

        args = msgspec.msgpack.decode(args_bytes, type=WorkerArgs)
        for key, value in args.env.items():
            os.environ[key] = value  # before torch touches a device
        logging.basicConfig(level=logging.INFO)
        self.proc = WorkerProc(args, port, self.store)

    def handle(self, frames: list[bytes]) -> list[bytes] | None:
        try:
            out = self.proc.handle(self._decoder.decode(frames))
        except Exception as exc:  # noqa: BLE001 - fatal for the engine; it gets the reason
            logging.getLogger(__name__).exception("rank %d: request failed", self.proc.rank)
            out = Failed(format_exception(exc))
        if out is None:
            return None
        return [bytes(f) for f in self._encoder.encode(out)]

    def ping(self) -> int:
        return os.getpid()


def _iface_of(ip: str) -> str | None:
    """The network interface holding ``ip`` (for gloo, which otherwise trusts the hostname)."""
    import socket

    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family in (socket.AF_INET, socket.AF_INET6) and a.address == ip
               for a in addrs):
            return name
    return None


class _RayPending:
    __slots__ = ("_executor", "_refs", "_sample_refs")

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        self._executor = executor
        self._refs = refs
        self._sample_refs: list[Any] | None = None  # the `FinishSample` call of a deferred step

    def result(self) -> ModelRunnerOutput:
        executor = self._executor
        reply = executor._wait_all(self._refs)[executor.output_rank]
        if self._sample_refs is not None:
            # A step that sampled answers from `FinishSample`; one with nothing to sample
            # already did from `ExecuteModel`.
            sampled = executor._wait_all(self._sample_refs)[executor.output_rank]
            if sampled is not None:
                reply = sampled
        if not isinstance(reply, StepResult):
            raise WorkerError(f"output rank: expected a step result, got {type(reply).__name__}")
        return reply.output


class RayExecutor:
    def __init__(self, config: EngineConfig) -> None:
        ray = _import_ray()
        self._ray = ray
        par = config.parallel
        self.config = config
        self.world_size = par.world_size
        self.tp_size = par.tensor_parallel_size
        self.pp_size = par.pipeline_parallel_size
        self.max_concurrent_batches = config.max_concurrent_batches
        self.output_rank = par.output_rank
        self._encoder = Encoder()
        self._decoder: Decoder[WorkerReply] = Decoder(WorkerReply)
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._nodes: list[str] = []
        self._pg: Any = None
        self._owns_ray = False
        self._closed = False
        self._failure: WorkerError | None = None
        start = time.perf_counter()
        try:
            self._connect()
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray worker actor(s) ready in %.2f s on node(s) %s (tp=%d, pp=%d)",
                    self.world_size, time.perf_counter() - start, sorted(set(self._nodes)),
                    self.tp_size, self.pp_size)

    # --- start-up -----------------------------------------------------------------------------

    def _connect(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        try:
            ray.init(address="auto", log_to_driver=True)
            logger.info("joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
        except ConnectionError:
            # No cluster to join: start one here, with room for every CPU rank even on a
            # machine with fewer cores (ranks of a CPU test cluster mostly wait on each other).
            cpus = max(os.cpu_count() or 1, self.world_size + 1)
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
            logger.info("started a local Ray cluster (%d CPUs)", cpus)
        self._owns_ray = True

    def _start_actors(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.config.runner.device == "cuda"
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)],
                                   strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=_PLACEMENT_TIMEOUT_S)
        if not ready:
            raise WorkerError(f"Ray could not place {self.world_size} bundle(s) of {bundle} "
                              f"within {_PLACEMENT_TIMEOUT_S:.0f} s; cluster resources: "
                              f"{ray.cluster_resources()}")
        actor_cls = ray.remote(RayWorkerActor)
        actors = []
        for i in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=i)
            opts: dict[str, Any] = {"scheduling_strategy": strategy, "max_restarts": 0,
                                    "max_task_retries": 0}
            opts.update({"num_gpus": 1, "num_cpus": 0} if gpu else {"num_cpus": 1})
            actors.append(actor_cls.options(**opts).remote())
        infos = ray.get([a.node_info.remote() for a in actors])
        # Ranks node by node, this process's node first, GPUs in order within a node.
        here = ray.util.get_node_ip_address()
        order = sorted(range(len(actors)), key=lambda i: (
            infos[i][0] != here, infos[i][0], infos[i][1], i))
        self._actors = [actors[i] for i in order]
        infos = [infos[i] for i in order]
        self._nodes = [ip for ip, _, _ in infos]
        self._pids = [pid for _, _, pid in infos]
        gpus_on: dict[str, list[int]] = {}
        for ip, ids, _ in infos:
            gpus_on.setdefault(ip, []).extend(ids)
        store_host = self._nodes[0]
        port = ray.get(self._actors[0].serve_store.remote(store_host))
        inits = []
        local_seen: dict[str, int] = {}
        for rank, (ip, ids, _) in enumerate(infos):
            env: dict[str, str] = {}
            if gpu:
                node_gpus = sorted(gpus_on[ip])
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in node_gpus)
                local_rank = node_gpus.index(ids[0])
            else:
                local_rank = local_seen.get(ip, 0)
                local_seen[ip] = local_rank + 1
            iface = _iface_of(ip) if ip == here else None
            gloo_ifname = envs.gloo_socket_ifname()
            if gloo_ifname is not None:
                env["GLOO_SOCKET_IFNAME"] = gloo_ifname
            elif iface is not None:
                env["GLOO_SOCKET_IFNAME"] = iface
            # Actors do not inherit this process's environment.
            env.update(envs.forwarded(("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                       "NVSHMEM_DISABLE_NVLS", "TIDAL_LOG_LEVEL")))
            args = WorkerArgs(config=self.config, rank=rank, local_rank=local_rank,
                              store_host=store_host, env=env)
            inits.append(self._actors[rank].init_worker.remote(msgspec.msgpack.encode(args),
                                                               port))
        self._wait_all(inits, decode=False)

    # --- the Executor interface ---------------------------------------------------------------

    def determine_num_blocks(self) -> int:
        replies = self._call(GetNumBlocks())
        counts = [self._expect(r, NumBlocks, i).num_blocks for i, r in enumerate(replies)]
        logger.info("KV blocks per rank: %s; using %d", counts, min(counts))
        return min(counts)

    def init_kv_cache(self, num_blocks: int) -> None:
        for i, r in enumerate(self._call(InitKVCache(num_blocks))):
            self._expect(r, Done, i)

    def execute_model(self, so: SchedulerOutput, non_block: bool = False,
                      defer_sample: bool = False) -> Any:
        pending = _RayPending(self, self._submit(ExecuteModel(so, defer_sample)))
        return pending if non_block else pending.result()

    @property
    def supports_deferred_sample(self) -> bool:
        """Grammar masks filled while the step runs, sent to the actors behind it
        (`FinishSample`), as the multiprocess executor does; not with pipeline stages."""
        return self.config.parallel.pipeline_parallel_size == 1

    def finish_sample(self, pending: _RayPending, grammar_req_ids: list[str],
                      grammar_bitmask: np.ndarray | None) -> None:
        """Sample the step ``execute_model(..., defer_sample=True)`` launched (each actor runs
        its calls in order: this one after the step's)."""
        pending._sample_refs = self._submit(FinishSample(grammar_req_ids, grammar_bitmask))

    def grammar_buffer(self, rows: int) -> np.ndarray:
        return np.empty((rows, (self.config.model.vocab_size + 31) // 32), dtype=np.int32)

    def check_health(self) -> None:
        if self._failure is not None:
            raise self._failure
        self._wait_all([a.ping.remote() for a in self._actors], decode=False,
                       timeout=_PING_TIMEOUT_S)

    def compile_stats(self) -> CompileStats:
        """Triton JIT compiles of every rank, summed."""
        total = CompileStats(ready=True)
        for i, r in enumerate(self._call(GetCompileStats())):
            total = total.merge(self._expect(r, CompileStats, i))
        return total

    def profile(self, start: bool, trace_dir: str = "") -> list[ProfileSummary]:
        replies = self._call(Profile(start, trace_dir))
        if start:
            return []
        return [self._expect(r, ProfileSummary, i) for i, r in enumerate(replies)]

    @property
    def worker_pids(self) -> list[int]:
        return list(self._pids)

    # --- calls --------------------------------------------------------------------------------

    def _submit(self, msg: WorkerRequest) -> list[Any]:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise WorkerError("the executor is shut down")
        frames = self._ray.put([bytes(f) for f in self._encoder.encode(msg)])
        return [a.handle.remote(frames) for a in self._actors]

    def _call(self, msg: WorkerRequest) -> list[WorkerReply | None]:
        return self._wait_all(self._submit(msg))

    def _expect(self, reply: WorkerReply | None, kind: type, rank: int) -> Any:
        if not isinstance(reply, kind):
            raise WorkerError(f"rank {rank}: expected {kind.__name__}, got "
                              f"{type(reply).__name__}")
        return reply

    def _wait_all(self, refs: list[Any], decode: bool = True,
                  timeout: float | None = None) -> list[Any]:
        """Every rank's result of one call, in rank order; the first failure raises."""
        ray = self._ray
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        remaining = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while remaining:
            if self._failure is not None:
                raise self._failure
            ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=_POLL_S)
            for ref in ready:
                rank = index[ref]
                results[rank] = self._get(ref, rank, decode)
            if deadline is not None and remaining and time.monotonic() > deadline:
                ranks = sorted(index[r] for r in remaining)
                self._fail(WorkerDiedError(f"Ray worker rank(s) {ranks} did not answer within "
                                           f"{timeout} s"))
        return results

    def _get(self, ref: Any, rank: int, decode: bool) -> Any:
        ray = self._ray
        try:
            value = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            self._fail(WorkerDiedError(f"Ray worker rank {rank} (pid {self._pid(rank)}) died: "
                                       f"{type(exc).__name__}: {str(exc).splitlines()[0]}"))
        except ray.exceptions.RayError as exc:
            self._fail(WorkerError(f"Ray worker rank {rank} (pid {self._pid(rank)}) failed: "
                                   f"{str(exc).splitlines()[0]}"))
        if not decode or value is None:
            return value
        reply = self._decoder.decode(value)
        if isinstance(reply, Failed):
            self._fail(WorkerError(f"Ray worker rank {rank} (pid {self._pid(rank)}) failed: "
                                   f"{reply.error}"))
        return reply

    def _pid(self, rank: int) -> int | str:
        return self._pids[rank] if rank < len(self._pids) else "?"

    def _fail(self, err: WorkerError) -> None:
        if self._failure is None:
            self._failure = err
            logger.error("%s", err)
        raise self._failure

    # --- shutdown -----------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        for actor in self._actors:
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self._actors = []
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster may be gone
                logger.debug("could not remove the placement group", exc_info=True)
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        logger.info("Ray workers stopped")
