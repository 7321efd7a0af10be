"""A log line every few seconds while the engine is busy: load, KV usage, throughput, the
prefix-cache hit rate over recent lookups, how long steps took, and the garbage collector's
pauses (when a ``GcPauses`` is attached): where a slow token usually comes from."""

from __future__ import annotations

import logging
import time
from collections import deque

from tidal.engine_core.gc_control import GcPauses
from tidal.engine_core.protocol import SchedulerStats, add_per_pos

logger = logging.getLogger(__name__)


def spec_decode_line(drafts: int, draft_tokens: int, accepted: int,
                     per_pos: list[int], off_batch_size: int = 0, off_acceptance: int = 0
                     ) -> str:
    """Speculative decoding's acceptance, as vLLM prints it: mean acceptance length counts the
    target's own token of each verify step (1 + accepted / drafts); and the steps whose drafts
    the off-switch dropped, by reason."""
    if drafts:
        rate = 100.0 * accepted / draft_tokens if draft_tokens else 0.0
        per = ", ".join(f"{n / drafts:.3f}" for n in per_pos)
        line = (f"speculative decoding: mean acceptance length {1 + accepted / drafts:.2f}, "
                f"acceptance rate {rate:.1f}%, accepted {accepted} of {draft_tokens} draft "
                f"tokens in {drafts} drafts, per-position acceptance [{per}]")
    else:
        line = "speculative decoding: no drafts verified"
    if off_batch_size or off_acceptance:
        line += (f", drafting off for {off_batch_size} steps (batch size) and "
                 f"{off_acceptance} steps (acceptance)")
    return line


def kv_connector_line(queries: int, hits: int, stores: int) -> str:
    """The KV connector's counters (the host tier's hits and stores), in tokens."""
    rate = 100.0 * hits / queries if queries else 0.0
    return (f"KV connector: external prefix cache hit rate {rate:.1f}% ({hits} of {queries} "
            f"queried tokens loaded), {stores} tokens stored")


class StatsLogger:
    def __init__(self, interval_s: float = 5.0, window: int = 1000,
                 enabled: bool = True) -> None:
        self.enabled = enabled  # False: --disable-log-stats (nothing counted, nothing logged)
        self.interval_s = interval_s
        self.gc_pauses: GcPauses | None = None
        self._last_log = time.monotonic()
        self._prompt = 0
        self._generated = 0
        self._preempted = 0
        self._steps = 0
        self._step_s = 0.0
        self._step_max_s = 0.0
        # (queried, hit) tokens of the most recent lookups, for a recent hit rate.
        self._lookups: deque[tuple[int, int]] = deque(maxlen=window)
        # Speculative decoding since the last line: drafts, draft tokens, accepted, per position.
        self._spec = [0, 0, 0]
        self._spec_per_pos: list[int] = []
        self._spec_off = [0, 0]  # steps off by (batch size, acceptance)
        self._kv_connector = [0, 0, 0]  # queried, hit, stored tokens since the last line

    def record(self, stats: SchedulerStats, step_s: float = 0.0) -> None:
        if not self.enabled:
            return
        if stats.spec_num_drafts:
            self._spec[0] += stats.spec_num_drafts
            self._spec[1] += stats.spec_num_draft_tokens
            self._spec[2] += stats.spec_num_accepted_tokens
            self._spec_per_pos = add_per_pos(self._spec_per_pos, stats.spec_accepted_per_pos)
        if stats.spec_off_steps_batch_size or stats.spec_off_steps_acceptance:
            self._spec_off[0] += stats.spec_off_steps_batch_size
            self._spec_off[1] += stats.spec_off_steps_acceptance
        if stats.kv_connector_queries or stats.kv_connector_stores:
            kv = self._kv_connector
            kv[0] += stats.kv_connector_queries
            kv[1] += stats.kv_connector_hits
            kv[2] += stats.kv_connector_stores
        self._prompt += stats.num_prompt_tokens
        self._generated += stats.num_generation_tokens
        self._preempted += stats.num_preemptions
        self._steps += 1
        self._step_s += step_s
        if step_s > self._step_max_s:
            self._step_max_s = step_s
        if stats.prefix_cache_queries:
            self._lookups.append((stats.prefix_cache_queries, stats.prefix_cache_hits))
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval_s:
            return
        busy = stats.num_running or stats.num_waiting or self._prompt or self._generated
        gc_count, gc_s, gc_max_s = self.gc_pauses.take() if self.gc_pauses else (0, 0.0, 0.0)
        if busy:
            queried = sum(q for q, _ in self._lookups)
            hit_rate = 100.0 * sum(h for _, h in self._lookups) / queried if queried else 0.0
            logger.info(
                "running: %d, waiting: %d, KV cache usage: %.1f%%, prompt: %.1f tok/s, "
                "generation: %.1f tok/s, preemptions: %d, prefix cache hit rate: %.1f%%, "
                "steps: %d (mean %.2f ms, max %.2f ms), GC: %d collections (%.1f ms, max "
                "%.1f ms)",
                stats.num_running, stats.num_waiting, 100.0 * stats.kv_cache_usage,
                self._prompt / elapsed, self._generated / elapsed, self._preempted, hit_rate,
                self._steps, 1e3 * self._step_s / max(1, self._steps), 1e3 * self._step_max_s,
                gc_count, 1e3 * gc_s, 1e3 * gc_max_s)
            if stats.kv_cache_usage_groups:
                logger.info("KV cache usage per group: %s", ", ".join(
                    f"{g}: {100.0 * u:.1f}%" for g, u in enumerate(stats.kv_cache_usage_groups)))
            if self._spec[0] or self._spec_off[0] or self._spec_off[1]:
                logger.info("%s", spec_decode_line(*self._spec, self._spec_per_pos,
                                                   *self._spec_off))
            if self._kv_connector[0] or self._kv_connector[2]:
                logger.info("%s", kv_connector_line(*self._kv_connector))
        self._last_log = now
        self._kv_connector = [0, 0, 0]
        self._spec = [0, 0, 0]
        self._spec_per_pos = []
        self._spec_off = [0, 0]
        self._prompt = self._generated = self._preempted = self._steps = 0
        self._step_s = self._step_max_s = 0.0
