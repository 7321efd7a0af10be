"""A log line every few seconds while the engine is busy: load, KV usage, throughput and the
prefix-cache hit rate over recent lookups."""

from __future__ import annotations

import logging
import time
from collections import deque

from tidal.engine_core.protocol import SchedulerStats

logger = logging.getLogger(__name__)


class StatsLogger:
    def __init__(self, interval_s: float = 5.0, window: int = 1000) -> None:
        self.interval_s = interval_s
        self._last_log = time.monotonic()
        self._prompt = 0
        self._generated = 0
        self._preempted = 0
        # (queried, hit) tokens of the most recent lookups, for a recent hit rate.
        self._lookups: deque[tuple[int, int]] = deque(maxlen=window)

    def record(self, stats: SchedulerStats) -> None:
        self._prompt += stats.num_prompt_tokens
        self._generated += stats.num_generation_tokens
        self._preempted += stats.num_preemptions
        if stats.prefix_cache_queries:
            self._lookups.append((stats.prefix_cache_queries, stats.prefix_cache_hits))
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        busy = stats.num_running or stats.num_waiting or self._prompt or self._generated
        if busy:
            queried = sum(q for q, _ in self._lookups)
            hit_rate = 100.0 * sum(h for _, h in self._lookups) / queried if queried else 0.0
            logger.info(
                "running: %d, waiting: %d, KV cache usage: %.1f%%, prompt: %.1f tok/s, "
                "generation: %.1f tok/s, preemptions: %d, prefix cache hit rate: %.1f%%",
                stats.num_running, stats.num_waiting, 100.0 * stats.kv_cache_usage,
                self._prompt / elapsed, self._generated / elapsed, self._preempted, hit_rate)
        self._last_log = now
        self._prompt = self._generated = self._preempted = 0
