"""Executors run the workers of one engine. The in-process executor holds a single worker in
the EngineCore's own process (CPU, tests, one GPU without process isolation)."""

from __future__ import annotations

import logging
from typing import Protocol

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class Executor(Protocol):
    def determine_num_blocks(self) -> int: ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from tidal.worker.worker import Worker

        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.worker.init_kv_cache(num_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(so)
        assert out is not None
        return out

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
