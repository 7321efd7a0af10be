"""Prometheus metrics of one server, in vLLM V1's shape: every family vLLM's
``PrometheusStatLogger`` registers for a server without speculative decoding, LoRA or a KV
connector has the same name after the prefix, the same type, labels and buckets here, so vLLM's
dashboards and alerts work unchanged with ``--metrics-prefix vllm`` (default prefix: ``tidal``).

Where the figures come from (vLLM's split: the engine reports state and counters, the frontend
measures requests):

* Engine state and counters (running / waiting, KV usage, preemptions, generated tokens,
  prefix-cache lookups, tokens per step) arrive with each step's ``SchedulerStats``.
* Per-request figures come from the step's ``StepRecord``, which the output processor fills:
  TTFT and end-to-end latency on this process's clock; queue / prefill / decode / inference
  times on the engine's clock (the engine sends when a request was queued and first scheduled
  with its first output; the steps' timestamps give its first and last tokens). Prompt tokens
  are counted as vLLM counts them: a sequence's whole prompt when its first token comes, split
  by source (computed here, or found in the prefix cache).
* As in vLLM, each of a request's ``n`` sequences counts as a request (success, token and
  latency histograms); ``request_params_n`` and ``request_max_num_generation_tokens`` are
  observed once per request. Unlike vLLM, TTFT and inter-token latency are observed once per
  request and step (the ``n`` sequences share them).

The external prefix cache counters are the KV connector's (the host KV tier's hits, from
``SchedulerStats.kv_connector_*``), with tidal's ``kv_connector_stored_tokens`` beside them.
Families that stay at zero until tidal has the feature behind them: the multi-modal cache
counters, ``prompt_tokens_by_source`` for
``external_kv_transfer`` and ``prompt_tokens_recomputed`` (the prefix cache never supplies a
prompt's last token). ``engine_sleep_state`` always shows an awake engine (no sleep mode).
``time_per_output_token_seconds`` (deprecated by vLLM 0.11 for ``inter_token_latency_seconds``,
still read by older dashboards) is rendered as a copy of the latter.

Mixture-of-experts models add tidal's expert-load histogram, from ``SchedulerStats.moe_*``
(the workers' device counters, ``worker/layers/expert_load``): ``moe_expert_load_tokens``
per expert and, with expert parallelism, ``moe_ep_rank_load_tokens`` per EP rank.

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
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric

from tidal.engine_core import envs
from tidal.engine_core.protocol import SchedulerStats
from tidal.frontend.output_processor import StepRecord

if TYPE_CHECKING:
    from tidal.engine_core.config import EngineConfig

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "tidal"
_PREFIX_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

# vLLM's buckets, verbatim (its loggers.py).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                            40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_COMPILE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0,
                    5.0, 10.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
_LABELS = ("model_name", "engine")
# Rendered under another name too: (family, its deprecated vLLM name).
_ALIASES = (("inter_token_latency_seconds", "time_per_output_token_seconds"),)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a Prometheus metric name (``{prefix}:{family}``)."""
    if not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"the metrics prefix must be letters, digits and underscores, not "
                         f"starting with a digit (e.g. 'vllm'); got {prefix!r}")
    return prefix


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


def cache_config_info(config: EngineConfig) -> dict[str, str]:
    """``cache_config_info``'s labels: vLLM's names for what tidal's cache config has (the
    prefix-hash seed stays out: it is what keeps block hashes unguessable)."""
    cache = config.cache
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": "auto",  # the model's dtype
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization),
        "kv_cache_memory_bytes": str(cache.kv_cache_memory_bytes),
        "num_gpu_blocks": str(cache.num_blocks),
        "prefix_caching_hash_algo": "sha256",
    }


def multiprocess_dir() -> str | None:
    """The shared folder of multiprocess mode, if this process runs in it."""
    return envs.prometheus_multiproc_dir() or None


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


@dataclass(slots=True)
class _Families:
    """The registered families (label children are made per engine, in ``_EngineSeries``)."""

    running: Gauge
    waiting: Gauge
    sleep_state: Gauge
    kv_usage: Gauge
    kv_group_usage: Gauge  # per KV group (label ``group``), models with several only
    prefix_queries: Counter
    prefix_hits: Counter
    external_prefix_queries: Counter
    external_prefix_hits: Counter
    kv_connector_stored: Counter  # tidal's: tokens the KV connector saved (the host tier's)
    mm_queries: Counter
    mm_hits: Counter
    preemptions: Counter
    prompt_tokens: Counter
    prompt_by_source: Counter
    prompt_cached: Counter
    prompt_recomputed: Counter
    generation_tokens: Counter
    success: Counter
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    iteration_tokens: Histogram
    max_num_generation_tokens: Histogram
    params_n: Histogram
    params_max_tokens: Histogram
    ttft: Histogram
    itl: Histogram
    request_tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    inference_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    prefill_kv_computed: Histogram


@dataclass(slots=True)
class _EngineSeries:
    """One engine's children of every family (label values: model name, engine index)."""

    running: Gauge
    waiting: Gauge
    kv_usage: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    external_prefix_queries: Counter
    external_prefix_hits: Counter
    kv_connector_stored: Counter
    preemptions: Counter
    prompt_tokens: Counter
    prompt_by_source: dict[str, Counter]
    prompt_cached: Counter
    generation_tokens: Counter
    success: dict[str, Counter]
    request_prompt_tokens: Histogram
    request_generation_tokens: Histogram
    iteration_tokens: Histogram
    max_num_generation_tokens: Histogram
    params_n: Histogram
    params_max_tokens: Histogram
    ttft: Histogram
    itl: Histogram
    request_tpot: Histogram
    e2e: Histogram
    queue_time: Histogram
    inference_time: Histogram
    prefill_time: Histogram
    decode_time: Histogram
    prefill_kv_computed: Histogram

    @classmethod
    def bind(cls, f: _Families, model: str, engine: str) -> _EngineSeries:
        for state in SLEEP_STATES:  # no sleep mode: always awake
            f.sleep_state.labels(model, engine, state).set(1 if state == "awake" else 0)
        # Families nothing feeds yet still show a zero series, as vLLM's do.
        for family in (f.mm_queries, f.mm_hits, f.prompt_recomputed):
            family.labels(model, engine)
        # Every other series is its family's child of the same name, labelled (model, engine).
        keyed = {"prompt_by_source", "success"}
        plain = {name: getattr(f, name).labels(model, engine)
                 for name in cls.__dataclass_fields__ if name not in keyed}
        return cls(**plain,
                   prompt_by_source={s: f.prompt_by_source.labels(model, engine, s)
                                     for s in PROMPT_SOURCES},
                   success={r: f.success.labels(model, engine, r) for r in FINISH_REASONS})


class ServerMetrics:
    def __init__(self, model_name: str, max_model_len: int = 2048,
                 prefix: str = DEFAULT_PREFIX, cache_info: dict[str, str] | None = None,
                 speculative: bool = False, moe: bool = False) -> None:
        """``speculative``: the engine runs speculative decoding (its families exist only
        then, as vLLM's); ``moe``: the model is a mixture of experts (the expert-load
        families exist only then)."""
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.prefix = check_prefix(prefix)
        self.multiprocess = multiprocess_dir() is not None
        self.registry = CollectorRegistry()
        self._aliases = {f"{prefix}:{name}": f"{prefix}:{alias}" for name, alias in _ALIASES}
        r = self.registry
        labels = list(_LABELS)

        def gauge(name: str, doc: str, extra: Iterable[str] = ()) -> Gauge:
            # The engine's state: one engine, whichever process reported it last.
            return Gauge(f"{prefix}:{name}", doc, [*labels, *extra], registry=r,
                         multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, [*labels, *extra], registry=r)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(f"{prefix}:{name}", doc, labels, buckets=tuple(buckets),
                             registry=r)

        tokens = build_1_2_5_buckets(max_model_len)
        self._families = _Families(
            running=gauge("num_requests_running", "Number of requests in model execution "
                          "batches."),
            waiting=gauge("num_requests_waiting", "Number of requests waiting to be processed."),
            sleep_state=gauge("engine_sleep_state", "Engine sleep state; awake = 0 means engine "
                              "is sleeping; awake = 1 means engine is awake; weights_offloaded "
                              "= 1 means sleep level 1; discard_all = 1 means sleep level 2.",
                              ["sleep_state"]),
            kv_usage=gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            kv_group_usage=gauge("kv_cache_group_usage_perc", "Share of the KV-cache pool each "
                                 "KV group (layers of one attention type) holds; only for "
                                 "models with several. 1 means 100 percent.", ["group"]),
            prefix_queries=counter("prefix_cache_queries", "Prefix cache queries, in terms of "
                                   "number of queried tokens."),
            prefix_hits=counter("prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                "cached tokens."),
            external_prefix_queries=counter(
                "external_prefix_cache_queries", "External prefix cache queries from KV "
                "connector cross-instance cache sharing, in terms of number of queried tokens."),
            external_prefix_hits=counter(
                "external_prefix_cache_hits", "External prefix cache hits from KV connector "
                "cross-instance cache sharing, in terms of number of cached tokens."),
            kv_connector_stored=counter(
                "kv_connector_stored_tokens", "Tokens of KV cache blocks the KV connector saved "
                "out of the KV cache (the host-memory KV tier's stores of evicted blocks)."),
            mm_queries=counter("mm_cache_queries", "Multi-modal cache queries, in terms of "
                               "number of queried items."),
            mm_hits=counter("mm_cache_hits", "Multi-modal cache hits, in terms of number of "
                            "cached items."),
            preemptions=counter("num_preemptions", "Cumulative number of preemption from the "
                                "engine."),
            prompt_tokens=counter("prompt_tokens", "Number of prefill tokens processed."),
            prompt_by_source=counter("prompt_tokens_by_source", "Number of prompt tokens by "
                                     "source.", ["source"]),
            prompt_cached=counter("prompt_tokens_cached", "Number of cached prompt tokens "
                                  "(local + external)."),
            prompt_recomputed=counter("prompt_tokens_recomputed", "Number of cached tokens "
                                      "recomputed for forward pass."),
            generation_tokens=counter("generation_tokens", "Number of generation tokens "
                                      "processed."),
            success=counter("request_success", "Count of successfully processed requests.",
                            ["finished_reason"]),
            request_prompt_tokens=histogram("request_prompt_tokens", "Number of prefill tokens "
                                            "processed.", tokens),
            request_generation_tokens=histogram("request_generation_tokens", "Number of "
                                                "generation tokens processed.", tokens),
            iteration_tokens=histogram("iteration_tokens_total", "Histogram of number of tokens "
                                       "per engine_step.", _ITERATION_TOKEN_BUCKETS),
            max_num_generation_tokens=histogram(
                "request_max_num_generation_tokens", "Histogram of maximum number of requested "
                "generation tokens.", tokens),
            params_n=histogram("request_params_n", "Histogram of the n request parameter.",
                               _N_BUCKETS),
            params_max_tokens=histogram("request_params_max_tokens", "Histogram of the "
                                        "max_tokens request parameter.", tokens),
            ttft=histogram("time_to_first_token_seconds", "Histogram of time to first token in "
                           "seconds.", _TTFT_BUCKETS),
            itl=histogram("inter_token_latency_seconds", "Histogram of inter-token latency in "
                          "seconds.", _ITL_BUCKETS),
            request_tpot=histogram("request_time_per_output_token_seconds", "Histogram of "
                                   "time_per_output_token_seconds per request.", _ITL_BUCKETS),
            e2e=histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in "
                          "seconds.", _REQUEST_LATENCY_BUCKETS),
            queue_time=histogram("request_queue_time_seconds", "Histogram of time spent in "
                                 "WAITING phase for request.", _REQUEST_LATENCY_BUCKETS),
            inference_time=histogram("request_inference_time_seconds", "Histogram of time "
                                     "spent in RUNNING phase for request.",
                                     _REQUEST_LATENCY_BUCKETS),
            prefill_time=histogram("request_prefill_time_seconds", "Histogram of time spent in "
                                   "PREFILL phase for request.", _REQUEST_LATENCY_BUCKETS),
            decode_time=histogram("request_decode_time_seconds", "Histogram of time spent in "
                                  "DECODE phase for request.", _REQUEST_LATENCY_BUCKETS),
            prefill_kv_computed=histogram("request_prefill_kv_computed_tokens", "Histogram of "
                                          "new KV tokens computed during prefill (excluding "
                                          "cached tokens).", tokens),
        )
        self._engines: dict[int, _EngineSeries] = {}
        # An info metric (a gauge at 1), as vLLM emulates one; its labels are the config.
        info = dict(cache_info or {})
        self._cache_info = Gauge(f"{prefix}:cache_config_info",
                                 "Information of the LLMEngine CacheConfig",
                                 [*info, "engine"], registry=r, multiprocess_mode="mostrecent")
        self._cache_info_values = info
        self.http_errors = Counter(f"{prefix}:http_request_errors",
                                   "Requests answered with an error, by status.",
                                   ["model_name", "status"], registry=r)
        self.tool_parse_failures = Counter(
            f"{prefix}:tool_call_parse_failures",
            "Tool-call sections of outputs that did not parse (returned as content).",
            ["model_name"], registry=r)
        # Structured outputs (engine_core/structured_output): compiles and requests by kind,
        # each by the grammar backend that compiled it (guidance | xgrammar).
        self.grammar_compile = Histogram(
            f"{prefix}:structured_output_compile_seconds",
            "Time to compile a structured-output grammar (off the engine loop), by backend.",
            ["model_name", "backend"], buckets=_COMPILE_BUCKETS, registry=r)
        self.structured_requests = Counter(
            f"{prefix}:structured_output_requests",
            "Constrained requests, by kind (json, json_object, regex, choice, grammar, "
            "structural_tag) and grammar backend.",
            ["model_name", "kind", "backend"], registry=r)
        # Speculative decoding (vLLM's spec_decode_* counters; acceptance rate = accepted /
        # draft tokens, mean acceptance length = 1 + accepted / drafts).
        self.speculative = speculative
        if speculative:
            self.spec_drafts = counter("spec_decode_num_drafts",
                                       "Number of spec decoding drafts.")
            self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                             "Number of draft tokens.")
            self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                         "Number of accepted tokens.")
            self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                                 "Accepted tokens per draft position.",
                                                 ["position"])
            self.spec_off_steps = counter(
                "spec_decode_off_steps",
                "Steps whose drafts were not verified (speculation switched off), by reason: "
                "batch_size (too many running requests) or acceptance (too few accepted to "
                "pay for verifying).", ["reason"])
        # Mixture of experts: the expert-load histogram (tidal's; vLLM keeps its expert loads
        # inside EPLB). Routings are tokens x top-k, summed over the MoE layers; with expert
        # parallelism each EP rank holds a contiguous range of experts, summed per rank too.
        self.moe = moe
        if moe:
            self.expert_load = counter(
                "moe_expert_load_tokens", "Tokens routed to each expert (a token counts once "
                "per expert of its top-k, summed over the MoE layers).", ["expert"])
            self.ep_rank_load = counter(
                "moe_ep_rank_load_tokens", "Tokens routed to the experts each expert-parallel "
                "rank holds (--enable-expert-parallel), summed over the MoE layers.",
                ["ep_rank"])
        self._series(0)

    @classmethod
    def from_config(cls, config: EngineConfig, prefix: str = DEFAULT_PREFIX) -> ServerMetrics:
        return cls(config.model.served_model_name, config.model.max_model_len, prefix,
                   cache_config_info(config), speculative=config.speculative is not None,
                   moe=bool(config.model.arch.num_experts))

    def _series(self, engine: int) -> _EngineSeries:
        series = self._engines.get(engine)
        if series is None:
            label = str(engine)
            series = _EngineSeries.bind(self._families, self.model_name, label)
            self._cache_info.labels(**self._cache_info_values, engine=label).set(1)
            self._engines[engine] = series
        return series

    # --- engine observer (called once per engine step; keep it cheap) -------------------------

    def _observe_spec(self, stats: SchedulerStats, engine: str) -> None:
        model = self.model_name
        self.spec_drafts.labels(model, engine).inc(stats.spec_num_drafts)
        self.spec_draft_tokens.labels(model, engine).inc(stats.spec_num_draft_tokens)
        self.spec_accepted.labels(model, engine).inc(stats.spec_num_accepted_tokens)
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            self.spec_accepted_per_pos.labels(model, engine, str(pos)).inc(n)
        if stats.spec_off_steps_batch_size:
            self.spec_off_steps.labels(model, engine, "batch_size").inc(
                stats.spec_off_steps_batch_size)
        if stats.spec_off_steps_acceptance:
            self.spec_off_steps.labels(model, engine, "acceptance").inc(
                stats.spec_off_steps_acceptance)

    def _observe_expert_load(self, stats: SchedulerStats, engine: str) -> None:
        model = self.model_name
        load = stats.moe_expert_load
        for expert, n in enumerate(load):
            if n > 0:
                self.expert_load.labels(model, engine, str(expert)).inc(n)
        ranks = stats.moe_ep_ranks
        if ranks > 1 and len(load) % ranks == 0:
            per = len(load) // ranks
            for rank in range(ranks):
                n = sum(load[rank * per:(rank + 1) * per])
                if n > 0:
                    self.ep_rank_load.labels(model, engine, str(rank)).inc(n)

    def observe_step(self, stats: SchedulerStats | None, record: StepRecord) -> None:
        e = self._series(record.engine_index)
        if stats is not None:
            e.running.set(stats.num_running)
            e.waiting.set(stats.num_waiting)
            e.kv_usage.set(stats.kv_cache_usage)
            if stats.kv_cache_usage_groups:
                family = self._families.kv_group_usage
                engine = str(record.engine_index)
                for g, usage in enumerate(stats.kv_cache_usage_groups):
                    family.labels(self.model_name, engine, str(g)).set(usage)
            if stats.num_generation_tokens:
                e.generation_tokens.inc(stats.num_generation_tokens)
            if stats.num_preemptions:
                e.preemptions.inc(stats.num_preemptions)
            if stats.prefix_cache_queries:
                e.prefix_queries.inc(stats.prefix_cache_queries)
            if stats.prefix_cache_hits:
                e.prefix_hits.inc(stats.prefix_cache_hits)
            if stats.kv_connector_queries or stats.kv_connector_stores:
                e.external_prefix_queries.inc(stats.kv_connector_queries)
                e.external_prefix_hits.inc(stats.kv_connector_hits)
                e.kv_connector_stored.inc(stats.kv_connector_stores)
            for n in stats.iteration_tokens:
                e.iteration_tokens.observe(n)
            for backend, seconds in zip(stats.grammar_compile_backends,
                                        stats.grammar_compile_s, strict=True):
                self.grammar_compile.labels(self.model_name, backend).observe(seconds)
            for kind, backend in zip(stats.structured_requests,
                                     stats.structured_request_backends, strict=True):
                self.structured_requests.labels(self.model_name, kind, backend).inc()
            if self.speculative and (stats.spec_num_drafts or stats.spec_off_steps_batch_size
                                     or stats.spec_off_steps_acceptance):
                self._observe_spec(stats, str(record.engine_index))
            if self.moe and stats.moe_expert_load:
                self._observe_expert_load(stats, str(record.engine_index))
        if record.prompt_tokens:
            cached = record.cached_prompt_tokens
            e.prompt_tokens.inc(record.prompt_tokens)
            e.prompt_by_source["local_compute"].inc(record.prompt_tokens - cached)
            if cached:
                e.prompt_by_source["local_cache_hit"].inc(cached)
                e.prompt_cached.inc(cached)
        if record.time_to_first_tokens:
            observe_many(e.ttft, record.time_to_first_tokens)
        if record.inter_token_latencies:
            observe_many(e.itl, record.inter_token_latencies)
        for done in record.finished:
            e.params_n.observe(done.n)
            if done.sequences:
                e.max_num_generation_tokens.observe(
                    max(s.num_generation_tokens for s in done.sequences))
            # vLLM's servers always resolve max_tokens (to the rest of the context).
            max_tokens = done.max_tokens if done.max_tokens is not None \
                else max(0, self.max_model_len - done.num_prompt_tokens)
            for seq in done.sequences:
                counter = e.success.get(seq.finish_reason)
                if counter is not None:
                    counter.inc()
                e.e2e.observe(seq.e2e_latency)
                e.request_prompt_tokens.observe(done.num_prompt_tokens)
                e.request_generation_tokens.observe(seq.num_generation_tokens)
                e.prefill_kv_computed.observe(done.num_prompt_tokens - seq.num_cached_tokens)
                if max_tokens:
                    e.params_max_tokens.observe(max_tokens)
                if seq.decode_time is not None:
                    assert seq.queue_time is not None and seq.prefill_time is not None
                    assert seq.inference_time is not None
                    e.queue_time.observe(seq.queue_time)
                    e.prefill_time.observe(seq.prefill_time)
                    e.decode_time.observe(seq.decode_time)
                    e.inference_time.observe(seq.inference_time)
                    # As vLLM: the decode time over the tokens after the first (0 if none).
                    n = seq.num_generation_tokens - 1
                    e.request_tpot.observe(seq.decode_time / n if n > 0 else 0.0)

    # --- server side ---------------------------------------------------------------------------

    def aborted(self, engine: int, sequences: int) -> None:
        """``sequences`` aborted in engine ``engine`` (client gone, drain timeout): they never
        finish there, and count as aborted, on the rank they ran on."""
        self._series(engine).success["abort"].inc(sequences)

    def engine_idle(self) -> None:
        """Nothing is in flight here; with several processes others may be busy, and the
        engine's own idle report sets the gauges."""
        if not self.multiprocess:
            for e in self._engines.values():
                e.running.set(0)
                e.waiting.set(0)

    def error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def tool_parse_failed(self, count: int) -> None:
        self.tool_parse_failures.labels(self.model_name).inc(count)

    def render(self) -> bytes:
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(_Rendered(registry, self._aliases))
        return generate_latest(_Rendered(self.registry, self._aliases))


class _Rendered:
    """What ``/metrics`` shows of a registry: its families without the ``_created`` samples
    (multiprocess mode has none; one shape either way), plus the aliased families again under
    their deprecated names."""

    def __init__(self, source: CollectorRegistry, aliases: dict[str, str]) -> None:
        self.source = source
        self.aliases = aliases

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            created = family.name + "_created"
            family.samples = [s for s in family.samples if s.name != created]
            yield family
            alias = self.aliases.get(family.name)
            if alias is not None:
                copy = Metric(alias, family.documentation + " DEPRECATED: use "
                              f"{family.name} instead.", family.type)
                copy.samples = [s._replace(name=alias + s.name[len(family.name):])
                                for s in family.samples]
                yield copy
