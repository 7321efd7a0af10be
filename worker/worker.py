"""One worker: a device, a model replica (or shard) and its KV cache, driven step by step.

The in-process executor calls it directly; worker processes (``worker_proc``) and Ray actors wrap
it in a loop that reads the executor's messages.

Pipeline parallelism: every stage gets every step's scheduler output. A stage after the first
first receives the previous stage's hidden states and residuals (`PipeReceiver`), runs its
layers, and a stage before the last sends its own on (`PipeSender`). Sends are asynchronous, so
a stage moves on to the next step while the transfer completes, which is what keeps several
steps in flight through the pipeline.

Start-up phases (model load, KV profiling, KV allocation, graph capture, warm-up) are timed
and logged in one format (``engine_core.startup_log``); the worker is *ready* once the warm-up
has run, and from then on the JIT compile watcher (``ops.jit_watch``) reports every Triton
compile as a WARNING (``compile_stats`` counts them).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from tidal.engine_core import envs
from tidal.engine_core.compilation_config import describe as describe_compilation
from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import CompileStats
from tidal.engine_core.protocol import SchedulerOutput
from tidal.engine_core.startup_log import StartupLog
from tidal.worker.distributed.hetero_groups import recv_through_host, send_through_host
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.kernel_policy import log_policy
from tidal.worker.layers.moe_ep import DBO_MEASURE
from tidal.worker.model_runner import IntermediateTensors, ModelRunner, SampleLater
from tidal.worker.ops.jit_watch import JIT_WATCH
from tidal.worker.warmup import WarmupReport, warm_up

logger = logging.getLogger(__name__)


def _import_compiler(device_type: str) -> None:
    """Import what compiling the model will (``worker/compilation``), on a side thread, and
    do what loading a cached piece does once per process. On a 2-core CPU a warm start loaded
    its 3 pieces in 1.6 s, almost all of it the first piece's: imports under ``compile_fx``
    (0.8 s), the hash of torch's sources that keys Inductor's cache (0.15 s) and, on a CPU,
    the probe of its vector instruction set with the C++ compiler (0.9 s, partly overlapping
    the rest); done here, the loads took 0.17 s."""
    try:
        import torch._dynamo  # noqa: F401
        from torch._inductor import compile_fx, standalone_compile  # noqa: F401
        from torch._inductor.codecache import torch_key

        torch_key()
        if device_type == "cpu":
            from torch._inductor.cpu_vec_isa import pick_vec_isa

            pick_vec_isa()
    except Exception:  # noqa: BLE001 - the compile phase imports them again and reports
        logger.debug("importing Dynamo / Inductor ahead of the compile phase failed",
                     exc_info=True)


class PipeSender:
    """Sends a stage's ``IntermediateTensors`` to the same tensor-parallel rank of the next
    stage: a 2-int header on the CPU group (row count, residual or not; 0 rows: nothing follows,
    the step had no tokens here), then the tensors on the device group."""

    def __init__(self, pp: ParallelGroup) -> None:
        self.pp = pp
        # Work handles and the tensors they read, kept alive until the transfer completes.
        self._inflight: list[tuple[Any, torch.Tensor]] = []

    def send(self, inter: IntermediateTensors | None) -> None:
        self.wait()
        self._send(inter)
        if self.pp.shm is not None:
            # Shared-memory sends move only while this rank waits on the group: every piece
            # goes into the next stage's mailbox now (that stage empties it without this one),
            # or it could wait for a piece while this rank waits for a step that needs its
            # output (a 300 s hang once the mailbox filled up with two steps in flight).
            self.wait()

    def _send(self, inter: IntermediateTensors | None) -> None:
        dst = self.pp.rank + 1
        rows = 0 if inter is None else int(inter.hidden.shape[0])
        has_residual = int(inter is not None and inter.residual is not None)
        header = torch.tensor([rows, has_residual], dtype=torch.int64)
        self._inflight.append((self.pp.send(header, dst, cpu=True), header))
        if inter is None or rows == 0:
            return
        tensors = [inter.hidden] + ([inter.residual] if inter.residual is not None else [])
        for t in tensors:
            t = t.contiguous()
            if self.pp.device_group is None:  # stages on different devices: via host memory
                self._inflight.append(send_through_host(self.pp, t, dst))
                continue
            work = self.pp.send(t, dst)
            if t.is_cuda:
                # NCCL: wait() only orders this stream after the send (the CPU goes on), so the
                # next step cannot overwrite a buffer still being sent (static graph outputs).
                work.wait()
            else:
                self._inflight.append((work, t))

    def wait(self) -> None:
        for work, _ in self._inflight:
            work.wait()
        self._inflight.clear()


class PipeReceiver:
    def __init__(self, pp: ParallelGroup, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.pp = pp
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device

    def recv(self) -> IntermediateTensors | None:
        src = self.pp.rank - 1
        header = self.pp.recv(torch.empty(2, dtype=torch.int64), src, cpu=True)
        rows, has_residual = (int(v) for v in header.tolist())
        if rows == 0:
            return None
        shape = (rows, self.hidden_size)
        hidden = self._recv(shape, src)
        residual = self._recv(shape, src) if has_residual else None
        return IntermediateTensors(hidden, residual)

    def _recv(self, shape: tuple[int, int], src: int) -> torch.Tensor:
        if self.pp.device_group is None:  # stages on different devices: via host memory
            return recv_through_host(self.pp, shape, self.dtype, self.device, src)
        return self.pp.recv(torch.empty(shape, dtype=self.dtype, device=self.device), src)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.tp = tp
        self.pp = pp
        self.startup = StartupLog(f"rank {rank}", logger)
        self.ready = False
        self.warmup: WarmupReport | None = None  # what the start-up warm-up ran
        self._jit_on = False  # a compile watcher runs in this process
        self._jit_base = 0  # the watcher's count when this worker started
        self._jit_startup = 0  # compiles between this worker's start and its ready
        self._jit_zero = 0  # the watcher's after-ready count when this worker became ready
        # Dynamo and Inductor are imported while the model loads, not when the compile phase
        # needs them: on a 2-core CPU they were 2.7 s of a warm compiled start's 3.8 s extra.
        self._compiler_import: threading.Thread | None = None
        if config.runner.compilation.enabled:
            self._compiler_import = threading.Thread(
                target=_import_compiler, args=(config.runner.device,), daemon=True,
                name="tidal-compiler-import")
            self._compiler_import.start()
        if config.runner.device == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            self._watch_compiles()
        else:
            self.device = torch.device("cpu")
            if config.runner.cpu_threads is not None:
                # Several engines or processes sharing few cores slow down badly when each
                # runs a full OpenMP team (spin-waiting threads); this caps the team.
                torch.set_num_threads(config.runner.cpu_threads)
        torch.manual_seed(config.model.seed)
        if config.model.task == "embed":
            if (tp is not None and tp.world_size > 1) or (pp is not None and pp.world_size > 1):
                raise ValueError("embedding models run on a single worker (no tensor or "
                                 "pipeline parallelism)")
            from tidal.worker.pooling_runner import PoolingRunner

            self.runner = PoolingRunner(config, self.device)
        else:
            self.runner = ModelRunner(config, self.device, tp, pp)
            # The resolved kernel policy, one line per choice (with why where one is off).
            log_policy(self.runner.kernel_policy, rank)
            logger.info("rank %d compilation: %s", rank,
                        describe_compilation(config.runner.compilation, config.runner.device))
        multi_stage = pp is not None and pp.world_size > 1
        self._sender = PipeSender(pp) if multi_stage and not pp.is_last else None
        self._receiver: PipeReceiver | None = None
        if multi_stage and not pp.is_first:
            from tidal.worker.loader.model_loader import torch_dtype

            self._receiver = PipeReceiver(pp, config.model.arch.hidden_size,
                                          torch_dtype(config.model.dtype), self.device)

    @property
    def is_output_rank(self) -> bool:
        """Only one rank replies to a step: the first tensor-parallel rank of the last stage."""
        tp_first = self.tp is None or self.tp.is_first
        pp_last = self.pp is None or self.pp.is_last
        return tp_first and pp_last

    def _watch_compiles(self) -> None:
        """Before anything compiles: keep Triton's kernels in tidal's cache folder (a second
        start loads them) and count the compiles."""
        from tidal.worker.ops.kernel_cache import use_tidal_triton_cache

        cache = use_tidal_triton_cache()
        self._jit_on = JIT_WATCH.install()
        self._jit_base = JIT_WATCH.count
        logger.info("rank %d: Triton kernel cache %s; JIT compile watcher %s", self.rank,
                    cache.describe(), f"on ({JIT_WATCH.api})" if self._jit_on else "off")

    def _compiles_since(self, count: int) -> str:
        if not self._jit_on:
            return ""
        return f"; {JIT_WATCH.count - count} JIT compiles"

    def load_model(self) -> None:
        # Start-up work (here and below), whatever other engine in this process is serving.
        with JIT_WATCH.warming(), self.startup.phase("model load") as note:
            self.runner.load_model()
            model = self.runner.model
            assert model is not None
            size = sum(p.numel() * p.element_size() for p in model.parameters())
            note.detail = f"{type(model).__name__}, {size / 2**30:.2f} GiB"

    def determine_num_blocks(self) -> int:
        seen = JIT_WATCH.count
        with JIT_WATCH.warming(), self.startup.phase("kv profile") as note:
            n = self.runner.determine_num_blocks()
            note.detail = f"{n} blocks" + self._compiles_since(seen)
        return n

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache, capture the decode graphs, warm up (``warmup``); the worker is
        ready after it."""
        runner = self.runner
        with JIT_WATCH.warming():
            with self.startup.phase("kv allocate") as note:
                if isinstance(runner, ModelRunner):
                    size = runner.allocate_kv_cache(num_blocks)
                    note.detail = (f"{num_blocks} blocks, {size / 2**30:.2f} GiB, "
                                   f"{str(runner.kv_dtype).removeprefix('torch.')}")
                else:
                    runner.init_kv_cache(num_blocks)
                    note.detail = f"{num_blocks} blocks (bookkeeping only)"
            if isinstance(runner, ModelRunner) and runner.config.runner.compilation.enabled:
                if self._compiler_import is not None:
                    # (What the side thread had left of its imports when compiling starts.)
                    with self.startup.phase("compiler imports"):
                        self._compiler_import.join()
                        self._compiler_import = None
                # (Cold: Dynamo's trace and Inductor; warm: the trace and the cache's loads.)
                with self.startup.phase("compile") as note:
                    note.detail = runner.compile_model() or ""
            if isinstance(runner, ModelRunner):
                seen = JIT_WATCH.count
                with self.startup.phase("graph capture") as note:
                    reason = runner.graphs_off_reason()
                    if reason is None and runner.capture_graphs_if_enabled():
                        note.detail = self._graphs_detail()
                    elif reason is None and runner.graphs_wait_for_engines():
                        note.detail = ("decode graphs after warm-up, once the data-parallel "
                                       "engines meet (the experts' exchange is inside them)")
                    else:
                        note.detail = f"none, decode steps run eagerly: {reason}"
                    piecewise = runner.capture_piecewise_graphs()
                    if piecewise is not None:  # (cudagraph_mode PIECEWISE / FULL_AND_...)
                        note.detail = (f"{note.detail}; " if reason is None else "") + piecewise
                    note.detail += self._compiles_since(seen)
            seen = JIT_WATCH.count
            with self.startup.phase("warm-up") as note:
                if envs.warmup_enabled():
                    self.warmup = warm_up(self, num_blocks)
                    note.detail = self.warmup.describe()
                else:
                    note.detail = "off (TIDAL_WARMUP=0): the first requests compile instead"
                note.detail += self._compiles_since(seen)
        if isinstance(runner, ModelRunner) and runner.ep is not None:
            # Start-up's forwards ran on this engine alone; serving ones meet the other DP
            # engines' (layers/moe_ep).
            runner.ep.activate()
            if runner.ep.active and runner.ep.dbo_threshold == DBO_MEASURE:
                # (Before the decode graphs: they hold the overlap from the threshold.)
                with JIT_WATCH.warming(), self.startup.phase("dual batch overlap") as note:
                    measured = runner.ep.calibrate_dbo(
                        runner.config.scheduler.max_num_batched_tokens)
                    note.detail = "" if measured is None else measured.describe()
            if runner.graphs_wait_for_engines():
                with JIT_WATCH.warming(), \
                        self.startup.phase("exchange graph capture") as note:
                    runner.capture_exchange_graphs()
                    note.detail = self._graphs_detail()
        if isinstance(runner, ModelRunner) and runner.expert_load is not None:
            runner.expert_load.reset()  # (/metrics counts serving's routing, not start-up's)
        self._mark_ready()

    def _graphs_detail(self) -> str:
        graphs = self.runner.graphs
        if graphs is None:
            return "none"
        return (f"{len(graphs)} graphs, decode batches {graphs.sizes[0]}..{graphs.sizes[-1]}, "
                f"{graphs.pool_size()}")

    def _mark_ready(self) -> None:
        self.ready = True
        if self._jit_on:
            self._jit_startup = JIT_WATCH.count - self._jit_base
            self._jit_zero = JIT_WATCH.mark_ready()
            logger.info("rank %d: ready after %d JIT compiles; a compile from now on is logged "
                        "as a warning", self.rank, self._jit_startup)

    def compile_stats(self) -> CompileStats:
        """This worker's Triton JIT compiles: at start-up, and since it became ready."""
        if not self._jit_on:
            return CompileStats(ready=self.ready)
        if not self.ready:
            return CompileStats(active=True, startup=JIT_WATCH.count - self._jit_base)
        n, kept = JIT_WATCH.after_ready_since(self._jit_zero)
        return CompileStats(active=True, ready=True, startup=self._jit_startup, after_ready=n,
                            kernels=[e.describe() for e in kept])

    def execute_model(self, so: SchedulerOutput, defer_sample: bool = False) -> Any:
        """Run one step. Returns the runner's output on the output rank (a ``ModelRunnerOutput``
        or an object whose ``get_output()`` gives it), None on every other rank.
        ``defer_sample`` (no pipeline stages): a sampling step comes back as a ``SampleLater``
        for ``finish_sample``, on every rank (each samples its own copy of the tokens)."""
        if self._receiver is not None:
            inter = self._receiver.recv()
            out = self.runner.execute_model(so, inter) if inter is not None else \
                self.runner.execute_model(so)
        else:
            # (Only a generating runner is asked to defer: the pooling one never samples.)
            out = (self.runner.execute_model(so, defer_sample=True) if defer_sample
                   else self.runner.execute_model(so))
        if self._sender is not None:
            # A stage with no tokens this step (nothing scheduled it could run) returns a plain
            # output; the next stage is still told, so it never waits for tensors.
            self._sender.send(out if isinstance(out, IntermediateTensors) else None)
            return None
        return out if self.is_output_rank or isinstance(out, SampleLater) else None

    def finish_sample(self, later: Any, grammar_req_ids: list[str],
                      grammar_bitmask: Any) -> Any:
        """Sample a step ``execute_model(defer_sample=True)`` launched, under these masks."""
        return self.runner.finish_sample(later, grammar_req_ids, grammar_bitmask)

    def sample_lazily(self, later: Any, masks: Any) -> Any:
        """``ModelRunner.sample_lazily``: sampled before the next step's device work."""
        return self.runner.sample_lazily(later, masks)

    def launch_due(self) -> None:
        self.runner.launch_due()

    def grammar_buffer(self, rows: int) -> Any:
        """Host memory for the next ``finish_sample``'s masks (``ModelRunner.grammar_buffer``)."""
        return self.runner.grammar_buffer(rows)

    def grammar_uploader(self) -> Any:
        """``ModelRunner.grammar_uploader``."""
        return self.runner.grammar_uploader()

    def shutdown(self) -> None:
        if self.ready and self._jit_on:
            JIT_WATCH.release()
            self._jit_on = False
        if self._sender is not None:
            try:
                self._sender.wait()
            except Exception:  # noqa: BLE001 - the next stage may be gone already
                logger.debug("rank %d: pending pipeline send failed at shutdown", self.rank)
        self.runner.release()
