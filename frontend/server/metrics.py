"""Prometheus metrics of one server (``tidal:`` prefix).

Per-step engine state (running / waiting requests, KV usage) and engine counters (tokens,
preemptions, prefix-cache lookups) come from ``AsyncLLM.add_stat_observer`` with the step's
``SchedulerStats``; per-request latencies (TTFT, inter-token, end-to-end) and finish reasons from
the step's ``StepRecord``, which the output processor fills as outputs arrive.
``request_success`` counts finished sequences (each of a request's ``n``) by finish reason.

With several API server processes (``--api-server-count``) every process writes its values to
files in ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode) and ``/metrics``
in any of them renders the sum over all: frontend counters and histograms add up, the engine's
gauges show the most recent report (``mostrecent``), and the engine sends each step's counters to
one frontend only, so they too are counted once.

Single process: the gauges hold the engine's latest report; an engine in a thread sends none when
it goes idle, so the server zeroes running/waiting itself when nothing is in flight.
"""

from __future__ import annotations

import logging
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.output_processor import StepRecord

logger = logging.getLogger(__name__)

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")

CONTENT_TYPE = CONTENT_TYPE_LATEST


def multiprocess_dir() -> str | None:
    """The shared folder of multiprocess mode, if this process runs in it."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def observe_many(hist: Histogram, values: list[float]) -> None:
    """``hist.observe(v)`` for every value, one increment per bucket touched instead of one
    lock round per value (a step brings one inter-token latency per running request)."""
    # prometheus_client's own fields; any other version takes the plain loop.
    if len(values) < 4 or not all(hasattr(hist, a) for a in ("_buckets", "_upper_bounds",
                                                             "_sum")):
        for v in values:
            hist.observe(v)
        return
    counts: dict[int, int] = {}
    bounds = hist._upper_bounds
    for v in values:
        i = 0
        while v > bounds[i]:  # the last bound is +Inf
            i += 1
        counts[i] = counts.get(i, 0) + 1
    hist._sum.inc(sum(values))
    for i, k in counts.items():
        hist._buckets[i].inc(k)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.multiprocess = multiprocess_dir() is not None
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        m = self.model_name
        # Engine state: one engine, whichever process reported it last.
        mode = "mostrecent"
        self.running = Gauge("tidal:num_requests_running", "Sequences in the running batch.",
                             labels, registry=r, multiprocess_mode=mode).labels(m)
        self.waiting = Gauge("tidal:num_requests_waiting", "Sequences waiting to be scheduled.",
                             labels, registry=r, multiprocess_mode=mode).labels(m)
        self.kv_usage = Gauge("tidal:kv_cache_usage_perc",
                              "Fraction of KV cache blocks in use (1 = full).",
                              labels, registry=r, multiprocess_mode=mode).labels(m)
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

    def observe_step(self, stats: SchedulerStats | None, record: StepRecord) -> None:
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
        if record.time_to_first_tokens:
            observe_many(self.ttft, record.time_to_first_tokens)
        if record.inter_token_latencies:
            observe_many(self.itl, record.inter_token_latencies)
        for done in record.finished:
            self.e2e.observe(done.e2e_latency)
            for reason in done.finish_reasons:
                counter = self.success.get(reason)
                if counter is not None:
                    counter.inc()

    # --- server side ---------------------------------------------------------------------------

    def request_gone(self, aborted_sequences: int) -> None:
        """An API request is done; ``aborted_sequences`` of it never finished in the engine
        (client gone, drain timeout) and count as aborted."""
        if aborted_sequences:
            self.success["abort"].inc(aborted_sequences)

    def engine_idle(self) -> None:
        """Nothing is in flight here; with several processes others may be busy, and the
        engine's own idle report sets the gauges."""
        if not self.multiprocess:
            self.running.set(0)
            self.waiting.set(0)

    def error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
