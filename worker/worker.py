"""One worker: a device, a model replica (or shard) and its KV cache, driven step by step.

The in-process executor calls it directly; worker processes wrap it in a loop that reads the
broadcast queue.
"""

from __future__ import annotations

import logging
import time

import torch

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.protocol import ModelRunnerOutput, SchedulerOutput
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        self.tp = tp
        self.pp = pp
        if config.runner.device == "cuda":
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            if config.runner.cpu_threads is not None:
                # Several engines or processes sharing few cores slow down badly when each
                # runs a full OpenMP team (spin-waiting threads); this caps the team.
                torch.set_num_threads(config.runner.cpu_threads)
        torch.manual_seed(config.model.seed)
        if config.model.task == "embed":
            from tidal.worker.pooling_runner import PoolingRunner

            self.runner = PoolingRunner(config, self.device)
        else:
            self.runner = ModelRunner(config, self.device, tp, pp)

    @property
    def is_output_rank(self) -> bool:
        """Only one rank replies to a step: the first tensor-parallel rank of the last stage."""
        tp_first = self.tp is None or self.tp.is_first
        pp_last = self.pp is None or self.pp.is_last
        return tp_first and pp_last

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        start = time.perf_counter()
        self.runner.init_kv_cache(num_blocks)
        logger.info("rank %d: allocated %d KV blocks in %.2f s", self.rank, num_blocks,
                    time.perf_counter() - start)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        out = self.runner.execute_model(so)
        return out if self.is_output_rank else None

    def shutdown(self) -> None:
        self.runner.kv_caches = []
        self.runner.model = None
