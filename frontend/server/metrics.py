"""Prometheus metrics of one server (``tidal:`` prefix, one registry per server).

Per-step engine state (running / waiting requests, KV usage, token counts, preemptions) comes
from ``AsyncLLM.add_stat_observer``; per-request latencies from ``RequestOutput.metrics``
(monotonic times the output processor stamps as outputs arrive). ``request_success`` counts
finished sequences (each of a request's ``n``) by finish reason.

The gauges hold the engine's latest report: an engine that goes idle right after an abort sends
no further report, so the server zeroes running/waiting itself when nothing is in flight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.outputs import RequestOutput

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST


@dataclass(slots=True)
class _Timing:
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._timings: dict[str, _Timing] = {}
        labels = ["model_name"]
        r = self.registry
        m = self.model_name
        self.running = Gauge("tidal:num_requests_running", "Sequences in the running batch.",
                             labels, registry=r).labels(m)
        self.waiting = Gauge("tidal:num_requests_waiting", "Sequences waiting to be scheduled.",
                             labels, registry=r).labels(m)
        self.kv_usage = Gauge("tidal:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full).",
                              labels, registry=r).labels(m)
        self.prompt_tokens = Counter("tidal:prompt_tokens", "Prompt tokens computed (prefill).",
                                     labels, registry=r).labels(m)
        self.generation_tokens = Counter("tidal:generation_tokens", "Tokens generated.",
                                         labels, registry=r).labels(m)
        self.preemptions = Counter("tidal:num_preemptions", "Sequences preempted.",
                                   labels, registry=r).labels(m)
        self.prefix_queries = Counter("tidal:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.",
                                      labels, registry=r).labels(m)
        self.prefix_hits = Counter("tidal:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache.",
                                   labels, registry=r).labels(m)
        self.ttft = Histogram("tidal:time_to_first_token_seconds",
                              "Time from arrival to the first token.", labels,
                              buckets=_TTFT_BUCKETS, registry=r).labels(m)
        self.itl = Histogram("tidal:inter_token_latency_seconds",
                             "Time between successive outputs of a request.", labels,
                             buckets=_ITL_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("tidal:e2e_request_latency_seconds",
                             "Time from arrival to the last output.", labels,
                             buckets=_E2E_BUCKETS, registry=r).labels(m)
        success = Counter("tidal:request_success", "Finished sequences by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.success = {reason: success.labels(m, reason) for reason in FINISH_REASONS}
        self.http_errors = Counter("tidal:http_request_errors",
                                   "Requests answered with an error, by status.",
                                   labels + ["status"], registry=r)

    # --- engine observer (called once per engine step; keep it cheap) -------------------------

    def observe_step(self, stats: SchedulerStats | None, outputs: list[RequestOutput]) -> None:
        if stats is not None:
            self.running.set(stats.num_running)
            self.waiting.set(stats.num_waiting)
            self.kv_usage.set(stats.kv_cache_usage)
            if stats.num_prompt_tokens:
                self.prompt_tokens.inc(stats.num_prompt_tokens)
            if stats.num_generation_tokens:
                self.generation_tokens.inc(stats.num_generation_tokens)
            if stats.num_preemptions:
                self.preemptions.inc(stats.num_preemptions)
            if stats.prefix_cache_queries:
                self.prefix_queries.inc(stats.prefix_cache_queries)
            if stats.prefix_cache_hits:
                self.prefix_hits.inc(stats.prefix_cache_hits)
        for out in outputs:
            if isinstance(out, RequestOutput):
                self._observe_output(out)

    def _observe_output(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None:
            return
        timing = self._timings.get(out.request_id)
        if timing is None:
            timing = self._timings[out.request_id] = _Timing()
            if m.first_token_time is not None:
                self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        if m.last_token_time is not None:
            if timing.last_token_time is not None and m.last_token_time > timing.last_token_time:
                self.itl.observe(m.last_token_time - timing.last_token_time)
            timing.last_token_time = m.last_token_time
        for c in out.outputs:
            if c.finish_reason is not None:
                counter = self.success.get(c.finish_reason)
                if counter is not None:
                    counter.inc()
        if out.finished:
            end = m.finished_time or m.last_token_time
            if end is not None:
                self.e2e.observe(max(0.0, end - m.arrival_time))
            self._timings.pop(out.request_id, None)

    # --- server side ---------------------------------------------------------------------------

    def request_gone(self, engine_ids: list[str], aborted_sequences: int) -> None:
        """An API request is done; ``aborted_sequences`` of it never finished in the engine
        (client gone, drain timeout) and count as aborted."""
        if aborted_sequences:
            self.success["abort"].inc(aborted_sequences)
        for rid in engine_ids:
            self._timings.pop(rid, None)

    def engine_idle(self) -> None:
        self.running.set(0)
        self.waiting.set(0)

    def error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
