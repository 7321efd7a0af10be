"""EngineCore: owns the scheduler and the executor, and runs one step at a time.

It is used in-process (``LLM``, tests) and inside the EngineCore process (see ``core_proc``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from tidal.engine_core import control
from tidal.engine_core.config import EngineConfig
from tidal.engine_core.executor import Deferred, Executor, create_executor
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.startup_log import StartupLog
from tidal.engine_core.stats_logger import StatsLogger
from tidal.engine_core.validation import validate_request

logger = logging.getLogger(__name__)


class NoopExecutor:
    """Runs no model: every request that completes its tokens in a step samples one fixed token.

    Selected with ``distributed_executor_backend="noop"``; it measures the engine's own overhead
    (scheduling, transport, detokenization) without a model (``tools/bench_overhead.py``).
    """

    def __init__(self, config: EngineConfig) -> None:
        eos = set(config.model.eos_token_ids)
        self.token = next(t for t in range(config.model.vocab_size) if t not in eos)
        self.num_blocks = config.cache.num_blocks or 4096
        self._lengths: dict[str, int] = {}  # req_id -> tokens the request holds

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        return None

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        out = self._execute(so)
        return Deferred(out) if non_block else out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        lengths = self._lengths
        for rid in so.finished_req_ids:
            lengths.pop(rid, None)
        for r in so.new_reqs:
            lengths[r.req_id] = len(r.prompt_token_ids) + len(r.output_token_ids)
        # Batch order: the cached requests, then the new ones.
        computed = so.cached_reqs.num_computed_tokens + [r.num_computed_tokens
                                                         for r in so.new_reqs]
        out = ModelRunnerOutput()
        for rid, c, n in zip(so.req_ids, computed, so.num_scheduled_tokens):
            if c + n >= lengths.get(rid, 0):
                out.req_ids.append(rid)
                out.sampled_token_ids.append([self.token])
                lengths[rid] = lengths.get(rid, 0) + 1
        return out

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._lengths.clear()


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        # Phases in the workers' format (engine_core.startup_log); each rank logs its own
        # (model load, KV profile and allocation, graph capture, warm-up) inside these.
        self.startup = StartupLog("engine", logger)
        start = time.perf_counter()
        if executor is None:
            noop = config.parallel.distributed_executor_backend == "noop"
            executor = NoopExecutor(config) if noop else create_executor(config)
        self.executor = executor
        self.startup.record("executor", time.perf_counter() - start,
                            label=f"executor {type(executor).__name__} up (model loaded)")
        with self.startup.phase("kv profile") as note:
            num_blocks = self.executor.determine_num_blocks()
            note.detail = f"{num_blocks} blocks"
        self.config = config.with_num_blocks(num_blocks)
        with self.startup.phase("kv init") as note:
            # Returns once every worker allocated its KV cache, captured its graphs and warmed
            # up: from here on serving compiles nothing (control.GetCompileStats checks).
            self.executor.init_kv_cache(num_blocks)
            note.detail = "KV cache allocated, graphs captured, warmed up on every worker"
        self.scheduler = Scheduler(self.config)
        self._eos = frozenset(config.model.eos_token_ids)
        self.stats_logger = StatsLogger()
        # Steps launched but not yet collected: (scheduler output, result or pending result).
        self.max_inflight = max(1, getattr(self.executor, "max_concurrent_batches", 1))
        self.batch_queue: deque[tuple[SchedulerOutput, Any]] = deque()
        # Everything built so far (model, tokenizer tables, caches) lives as long as the engine:
        # take it out of the garbage collector's generations, or every full collection walks it
        # (about 0.2 ms per step at batch 256 on a small CPU).
        gc.collect()
        gc.freeze()
        detail = (f"{num_blocks} KV blocks x {config.cache.block_size} tokens, "
                  f"max_model_len {config.model.max_model_len}")
        compile_stats = getattr(self.executor, "compile_stats", None)  # not without workers
        if compile_stats is not None:
            stats = compile_stats()
            if stats.active:
                detail += f"; {stats.startup} JIT compiles at start-up, none expected after"
        self.startup.record("ready", time.perf_counter() - start, detail,
                            label="EngineCore ready")

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Raises ``RequestValidationError`` (a ValueError) if it is invalid,
        and ValueError if its id is already in use; nothing is queued then."""
        validate_request(req.prompt_token_ids, req.sampling_params, self.config)
        self.scheduler.add_request(
            Request.from_engine_request(req, self.config.model.max_model_len, self._eos)
        )

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once; returns the new outputs (possibly none).

        With a batch queue (async scheduling, pipeline parallelism) the next step is scheduled
        and launched before the oldest one's results are collected, so scheduling overlaps the
        model's work; results still arrive in order.
        """
        start = time.perf_counter()
        outputs: list[EngineCoreOutput] = []
        launched = False
        if len(self.batch_queue) < self.max_inflight and self.scheduler.has_unfinished():
            sched = self.scheduler.schedule()
            if sched.total_num_scheduled_tokens:
                pending = (self.executor.execute_model(sched, non_block=True)
                           if self.max_inflight > 1 else self.executor.execute_model(sched))
                self.batch_queue.append((sched, pending))
                launched = True
        if self.batch_queue and (len(self.batch_queue) >= self.max_inflight or not launched):
            sched, pending = self.batch_queue.popleft()
            result = pending.result() if self.max_inflight > 1 else pending
            outputs = self.scheduler.update_from_output(sched, result)
        stats = self.scheduler.make_stats()  # counts the tokens update_from_output appended
        self.stats_logger.record(stats, time.perf_counter() - start)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(),
                                 scheduler_stats=stats)

    def handle_control(self, call: control.ControlCall) -> control.ControlResult:
        """Run a typed control call (``tidal.engine_core.control``) between two steps."""
        return control.execute(self, call)

    def shutdown(self) -> None:
        self.executor.shutdown()
