"""EngineCore: owns the scheduler and the executor, and runs one step at a time.

It is used in-process (``LLM``, tests) and inside the EngineCore process (see ``core_proc``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.executor import Executor, create_executor
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.validation import validate_request

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        start = time.perf_counter()
        self.executor = executor if executor is not None else create_executor(config)
        num_blocks = self.executor.determine_num_blocks()
        self.config = config.with_num_blocks(num_blocks)
        self.executor.init_kv_cache(num_blocks)
        self.scheduler = Scheduler(self.config)
        self._eos = frozenset(config.model.eos_token_ids)
        logger.info("EngineCore ready in %.2f s: %d KV blocks x %d tokens, max_model_len %d",
                    time.perf_counter() - start, num_blocks, config.cache.block_size,
                    config.model.max_model_len)

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
        return self.scheduler.has_unfinished()

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once; returns the new outputs (possibly none)."""
        if not self.scheduler.has_unfinished():
            return EngineCoreOutputs(timestamp=time.monotonic())
        sched = self.scheduler.schedule()
        outputs: list[EngineCoreOutput]
        if sched.total_num_scheduled_tokens == 0 and not sched.finished_req_ids:
            outputs = []
        else:
            result = self.executor.execute_model(sched)
            outputs = self.scheduler.update_from_output(sched, result)
        n_gen = sum(len(o.new_token_ids) for o in outputs)
        return EngineCoreOutputs(
            outputs=outputs,
            timestamp=time.monotonic(),
            scheduler_stats=self.scheduler.make_stats(n_gen),
        )

    def shutdown(self) -> None:
        self.executor.shutdown()
