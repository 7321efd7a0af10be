"""Executors run the workers of one engine. The in-process executor holds a single worker in
the EngineCore's own process (CPU, tests, one GPU without process isolation)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import CompileStats
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class PendingOutput(Protocol):
    """A step's result that may still be computing (e.g. on the GPU)."""

    def result(self) -> ModelRunnerOutput: ...


class Deferred:
    """A step result produced in this process; ``result()`` waits for the device if the model
    runner handed back an output still being copied (anything with ``get_output()``)."""

    __slots__ = ("_value",)

    def __init__(self, value: Any) -> None:
        self._value = value

    def result(self) -> ModelRunnerOutput:
        get = getattr(self._value, "get_output", None)
        return get() if get is not None else self._value

    def replace(self, value: Any) -> None:
        self._value = value


class Executor(Protocol):
    # Steps that may be in flight at once: 1 runs steps one by one; more lets the EngineCore
    # schedule step N+1 while step N runs (async scheduling, pipeline stages).
    max_concurrent_batches: int

    def determine_num_blocks(self) -> int: ...

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache on every worker, capture CUDA graphs and warm up: when this
        returns, serving compiles nothing more (``tidal.worker.warmup``)."""
        ...

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        """The step's ``ModelRunnerOutput``, or with ``non_block`` a ``PendingOutput``."""
        ...

    def compile_stats(self) -> CompileStats:
        """Triton JIT compiles of the workers (summed), for ``control.GetCompileStats``."""
        ...

    # Optional (the EngineCore checks with getattr): ``supports_deferred_sample = True`` with
    # ``execute_model(so, non_block, defer_sample)``, ``finish_sample(pending, ids, mask)`` and
    # ``grammar_buffer(rows)`` (host memory to fill the masks into), so grammar masks are
    # filled while the step runs; and, a worker in this process (UniprocExecutor),
    # ``sample_lazily(pending, masks)`` / ``launch_due()``, so they are filled while the next
    # step is prepared too, and ``grammar_uploader()``, so they are copied to the device as
    # soon as they are filled.

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from tidal.worker.worker import Worker

        self.worker = Worker(config)
        self.worker.load_model()
        self.max_concurrent_batches = config.max_concurrent_batches

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, so: SchedulerOutput, non_block: bool = False,
                      defer_sample: bool = False) -> Any:
        out = Deferred(self.worker.execute_model(so, defer_sample=defer_sample))
        return out if non_block else out.result()

    # The worker runs in this process: a step's sampling can wait for grammar masks that the
    # EngineCore fills while the device runs the step's forward pass.
    supports_deferred_sample = True

    def finish_sample(self, pending: Deferred, grammar_req_ids: list[str],
                      grammar_bitmask: Any) -> None:
        """Sample the step ``execute_model(..., defer_sample=True)`` returned as ``pending``
        (a no-op for a step that had nothing to sample)."""
        from tidal.worker.model_runner import SampleLater

        later = pending._value
        if isinstance(later, SampleLater):
            pending.replace(self.worker.finish_sample(later, grammar_req_ids, grammar_bitmask))

    def sample_lazily(self, pending: Deferred,
                      masks: Callable[[], tuple[list[str], Any]]) -> None:
        """``finish_sample`` with the masks ``masks()`` returns, called once they are needed:
        just before the next step's device work (``ModelRunner.sample_lazily``), so the next
        step is scheduled and prepared while they are filled."""
        from tidal.worker.model_runner import SampleLater

        later = pending._value
        if isinstance(later, SampleLater):
            pending.replace(self.worker.sample_lazily(later, masks))

    def launch_due(self) -> None:
        """Sample now a step ``sample_lazily`` left for later (before a call that is not a
        step reaches the worker)."""
        self.worker.launch_due()

    def grammar_buffer(self, rows: int) -> Any:
        """An int32 [rows, words] host array (pinned on a GPU) for the next ``finish_sample``'s
        masks: filled in place, it is copied to the device with no host copy first."""
        return self.worker.grammar_buffer(rows)

    def grammar_uploader(self) -> Any:
        """A function that starts the copy of the buffer ``grammar_buffer`` just handed out
        to the device, for the filler to call once it is filled (None: the copy is made when
        the step is sampled)."""
        return self.worker.grammar_uploader()

    def compile_stats(self) -> CompileStats:
        return self.worker.compile_stats()

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.worker.shutdown()


def create_executor(config: EngineConfig) -> Executor:
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        return UniprocExecutor(config)
    if backend == "mp":
        from tidal.engine_core.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "ray":
        from tidal.engine_core.ray_executor import RayExecutor

        return RayExecutor(config)
    raise ValueError(f"unknown executor backend {backend!r}")
