"""``/metrics`` has vLLM V1's metric families (the list below is written out from vLLM's
``vllm/v1/metrics/loggers.py``: names after the prefix, types, labels, buckets), under
``--metrics-prefix vllm`` and the default ``tidal``; and their values move as the requests
sent say they must (token counters and histograms, ``n``, phases, prefix-cache hits)."""

from __future__ import annotations

import asyncio
import math
import re
import urllib.request

import pytest

from server_harness import API_KEY, SMALL_ENGINE, generation_server, require_smollm2, \
    shared_server

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 1024  # SMALL_ENGINE's

# vLLM V1's families on a server without speculative decoding, LoRA or a KV connector:
# name -> (type, labels besides model_name and engine). From vLLM's PrometheusStatLogger.
VLLM_V1_FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "num_requests_running": ("gauge", ()),
    "num_requests_waiting": ("gauge", ()),
    "engine_sleep_state": ("gauge", ("sleep_state",)),
    "kv_cache_usage_perc": ("gauge", ()),
    "prefix_cache_queries": ("counter", ()),
    "prefix_cache_hits": ("counter", ()),
    "external_prefix_cache_queries": ("counter", ()),
    "external_prefix_cache_hits": ("counter", ()),
    "mm_cache_queries": ("counter", ()),
    "mm_cache_hits": ("counter", ()),
    "num_preemptions": ("counter", ()),
    "prompt_tokens": ("counter", ()),
    "prompt_tokens_by_source": ("counter", ("source",)),
    "prompt_tokens_cached": ("counter", ()),
    "prompt_tokens_recomputed": ("counter", ()),
    "generation_tokens": ("counter", ()),
    "request_success": ("counter", ("finished_reason",)),
    "request_prompt_tokens": ("histogram", ()),
    "request_generation_tokens": ("histogram", ()),
    "iteration_tokens_total": ("histogram", ()),
    "request_max_num_generation_tokens": ("histogram", ()),
    "request_params_n": ("histogram", ()),
    "request_params_max_tokens": ("histogram", ()),
    "time_to_first_token_seconds": ("histogram", ()),
    "inter_token_latency_seconds": ("histogram", ()),
    "request_time_per_output_token_seconds": ("histogram", ()),
    "e2e_request_latency_seconds": ("histogram", ()),
    "request_queue_time_seconds": ("histogram", ()),
    "request_inference_time_seconds": ("histogram", ()),
    "request_prefill_time_seconds": ("histogram", ()),
    "request_decode_time_seconds": ("histogram", ()),
    "request_prefill_kv_computed_tokens": ("histogram", ()),
}
# Labelled by the cache config (and engine), without model_name, as vLLM's.
CACHE_CONFIG_INFO = "cache_config_info"
# Deprecated by vLLM 0.11 (hidden from 0.12); kept: older dashboards plot it.
DEPRECATED = {"time_per_output_token_seconds": "histogram"}
# tidal's own.
TIDAL_EXTRAS = {"http_request_errors": "counter", "kv_cache_group_usage_perc": "gauge",
                "tool_call_parse_failures": "counter",
                "structured_output_compile_seconds": "histogram",
                "structured_output_requests": "counter",
                "kv_connector_stored_tokens": "counter"}
# Pending, feature absent in tidal (vLLM registers them only with the feature on): they must
# not be exposed until the feature is there.
PENDING = {
    "spec_decode_num_drafts": "counter",  # speculative decoding
    "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "spec_decode_num_accepted_tokens_per_pos": "counter",
    "lora_requests_info": "gauge",  # LoRA
    "corrupted_requests": "counter",  # NaN-in-logits detection
    "kv_block_lifetime_seconds": "histogram",  # KV residency sampling
    "kv_block_idle_before_evict_seconds": "histogram",
    "kv_block_reuse_gap_seconds": "histogram",
}

_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # 1-2-5 up to max_model_len 1024
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0]
BUCKETS = {
    "request_prompt_tokens": _TOKEN_BUCKETS,
    "request_generation_tokens": _TOKEN_BUCKETS,
    "request_max_num_generation_tokens": _TOKEN_BUCKETS,
    "request_params_max_tokens": _TOKEN_BUCKETS,
    "request_prefill_kv_computed_tokens": _TOKEN_BUCKETS,
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_params_n": [1, 2, 5, 10, 20],
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                                    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
                                    640.0, 2560.0],
    "inter_token_latency_seconds": _ITL_BUCKETS,
    "time_per_output_token_seconds": _ITL_BUCKETS,
    "request_time_per_output_token_seconds": _ITL_BUCKETS,
    "e2e_request_latency_seconds": _LATENCY_BUCKETS,
    "request_queue_time_seconds": _LATENCY_BUCKETS,
    "request_inference_time_seconds": _LATENCY_BUCKETS,
    "request_prefill_time_seconds": _LATENCY_BUCKETS,
    "request_decode_time_seconds": _LATENCY_BUCKETS,
}

_SAMPLE = re.compile(r'^([^{\s]+)(?:\{(.*)\})? (\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(family -> type from the ``# TYPE`` lines, counters without ``_total``; samples)."""
    types: dict[str, str] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name.removesuffix("_total") if kind == "counter" else name] = kind
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, line
            samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")),
                            float(m.group(3))))
    return types, samples


def value(samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for n, lab, v in samples
               if n == name and all(lab.get(k) == x for k, x in labels.items()))


def check_families(text: str, prefix: str) -> None:
    types, samples = parse(text)
    ours = {n.removeprefix(prefix + ":"): t for n, t in types.items()
            if n.startswith(prefix + ":")}
    assert {n: t for n, t in types.items() if not n.startswith(prefix + ":")} == {}
    for name, (kind, extra) in VLLM_V1_FAMILIES.items():
        assert ours.get(name) == kind, f"{prefix}:{name} should be a {kind}"
        full = f"{prefix}:{name}"
        series = [lab for n, lab, _ in samples if n.startswith(full)
                  and n[len(full):] in ("", "_total", "_bucket", "_count", "_sum")]
        assert series, f"{full} has no series"
        for lab in series:
            assert set(lab) - {"le"} == {"model_name", "engine", *extra}, (full, lab)
            assert lab["model_name"] == MODEL and lab["engine"] == "0"
    for name, bounds in BUCKETS.items():
        les = sorted({float(lab["le"]) for n, lab, _ in samples
                      if n == f"{prefix}:{name}_bucket"})
        assert les == [*map(float, bounds), math.inf], name
    assert ours.get(CACHE_CONFIG_INFO) == "gauge"
    (info,) = [lab for n, lab, _ in samples if n == f"{prefix}:{CACHE_CONFIG_INFO}"]
    assert info["engine"] == "0" and info["block_size"] == "16"
    assert info["enable_prefix_caching"] == "True" and int(info["num_gpu_blocks"]) > 0
    assert "model_name" not in info and not any("seed" in k for k in info)
    for name, kind in DEPRECATED.items():
        assert ours.get(name) == kind
    expected = {*VLLM_V1_FAMILIES, CACHE_CONFIG_INFO, *DEPRECATED, *TIDAL_EXTRAS}
    assert set(ours) <= expected, f"families vLLM has not: {set(ours) - expected}"
    assert not set(ours) & set(PENDING)
    # Engine state gauges: one series each (per engine), the engine awake.
    assert value(samples, f"{prefix}:engine_sleep_state", sleep_state="awake") == 1.0
    assert len([s for s in samples if s[0] == f"{prefix}:num_requests_running"]) == 1


# --- without a server ------------------------------------------------------------------------


def test_rendered_families_match_vllm_under_either_prefix():
    from tidal.frontend.server.metrics import ServerMetrics

    info = {"block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "64"}
    for prefix in ("vllm", "tidal"):
        metrics = ServerMetrics(MODEL, MAX_MODEL_LEN, prefix, info)
        check_families(metrics.render().decode(), prefix)


def test_phases_and_prompt_counts_come_from_the_engine_times():
    """Scripted engine steps (engine-clock timestamps) through the output processor into the
    metrics: each of the n sequences is timed from its own queue and schedule times, a
    rejected request counts as an error without phases, prompts count at their first token."""
    from tidal.engine_core.protocol import (
        EngineCoreOutput,
        FinishReason,
        OutputBatch,
        SchedulerStats,
    )
    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.frontend.output_processor import OutputProcessor
    from tidal.frontend.server.metrics import ServerMetrics

    proc = OutputProcessor(None)
    metrics = ServerMetrics(MODEL, MAX_MODEL_LEN, "vllm", {})
    proc.add_request("r", None, list(range(1, 21)), SamplingParams(max_tokens=3, n=2))
    proc.add_request("bad", None, [1, 2], SamplingParams(max_tokens=3))

    def step(ts: float, outs: list[EngineCoreOutput], stats: SchedulerStats | None = None):
        batch = OutputBatch.pack(outs, timestamp=ts, scheduler_stats=stats)
        metrics.observe_step(stats, proc.process_outputs(batch).record)

    # r#0: queued at 8, scheduled at 9, 16 prompt tokens cached, tokens at 10, 10.5, 12;
    # r#1: queued at 8, scheduled at 10, tokens at 10.5 and 12 (stopped); "bad" rejected.
    step(10.0, [EngineCoreOutput("r#0", [5], num_cached_tokens=16, queued_ts=8.0,
                                 scheduled_ts=9.0),
                EngineCoreOutput("bad", finish_reason=FinishReason.ERROR, error="no")],
         SchedulerStats(iteration_tokens=[4, 20]))
    step(10.5, [EngineCoreOutput("r#0", [6]),
                EngineCoreOutput("r#1", [5], queued_ts=8.0, scheduled_ts=10.0)])
    step(12.0, [EngineCoreOutput("r#0", [7], finish_reason=FinishReason.LENGTH),
                EngineCoreOutput("r#1", [6], finish_reason=FinishReason.STOP)])
    samples = parse(metrics.render().decode())[1]

    def v(name: str, **labels: str) -> float:
        return value(samples, "vllm:" + name, **labels)

    assert [v("request_success_total", finished_reason=r) for r in ("length", "stop", "error")] \
        == [1, 1, 1]
    for phase, total in (("queue", 1.0 + 2.0), ("prefill", 1.0 + 0.5), ("decode", 2.0 + 1.5),
                         ("inference", 3.0 + 2.0)):
        assert v(f"request_{phase}_time_seconds_count") == 2, phase
        assert v(f"request_{phase}_time_seconds_sum") == pytest.approx(total), phase
    assert v("request_time_per_output_token_seconds_sum") == pytest.approx(2.0 / 2 + 1.5 / 1)
    assert v("e2e_request_latency_seconds_count") == 3  # the rejected one too
    assert (v("prompt_tokens_total"), v("prompt_tokens_cached_total")) == (40, 16)
    assert v("prompt_tokens_by_source_total", source="local_compute") == 24
    assert v("request_prefill_kv_computed_tokens_sum") == (20 - 16) + 20 + 2
    assert (v("request_prompt_tokens_count"), v("request_prompt_tokens_sum")) == (3, 42)
    assert (v("iteration_tokens_total_count"), v("iteration_tokens_total_sum")) == (2, 24)
    assert (v("request_params_n_count"), v("request_params_n_sum")) == (2, 3)
    assert v("request_max_num_generation_tokens_sum") == 3
    assert v("request_params_max_tokens_sum") == 9
    assert v("time_to_first_token_seconds_count") == 1


def test_structured_series_are_by_kind_and_backend():
    """Compile times and constrained requests land in the series of the backend that
    compiled them, also when an undelivered report was folded into a later one."""
    from tidal.engine_core.protocol import SchedulerStats
    from tidal.frontend.output_processor import StepRecord
    from tidal.frontend.server.metrics import ServerMetrics

    metrics = ServerMetrics(MODEL, MAX_MODEL_LEN, "tidal", {})
    earlier = SchedulerStats(grammar_compile_s=[0.25, 2.0],
                             grammar_compile_backends=["xgrammar", "guidance"],
                             structured_requests=["json", "grammar"],
                             structured_request_backends=["xgrammar", "guidance"])
    later = SchedulerStats(grammar_compile_s=[0.5], grammar_compile_backends=["xgrammar"],
                           structured_requests=["json", "json", "structural_tag"],
                           structured_request_backends=["xgrammar", "guidance", "guidance"])
    later.add_counters(earlier)
    metrics.observe_step(later, StepRecord(engine_index=0))
    samples = parse(metrics.render().decode())[1]
    requests = {(lab["kind"], lab["backend"]): v for n, lab, v in samples
                if n == "tidal:structured_output_requests_total"}
    assert requests == {("json", "xgrammar"): 2, ("grammar", "guidance"): 1,
                        ("json", "guidance"): 1, ("structural_tag", "guidance"): 1}
    compiles = {lab["backend"]: v for n, lab, v in samples
                if n == "tidal:structured_output_compile_seconds_sum"}
    assert compiles == {"xgrammar": 0.75, "guidance": 2.0}
    assert value(samples, "tidal:structured_output_compile_seconds_bucket", backend="guidance",
                 le="1.0") == 0


def test_metrics_prefix_flag():
    from tidal.frontend.cli import _server_settings, build_parser

    def settings(*flags: str):
        return _server_settings(build_parser().parse_args(["serve", *flags]))

    assert settings().metrics_prefix == "tidal"
    assert settings("--metrics-prefix", "vllm").metrics_prefix == "vllm"
    for bad in ("", "1vllm", "vllm:x", "my-prefix"):
        with pytest.raises(SystemExit, match="--metrics-prefix"):
            settings("--metrics-prefix", bad)


# --- a live server ---------------------------------------------------------------------------


def _get_metrics(server) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        return resp.read().decode()


@pytest.fixture(scope="module")
def vllm_server():
    require_smollm2()
    return shared_server([*SMALL_ENGINE, "--metrics-prefix", "vllm"])


@pytest.mark.slow
def test_served_families_match_vllm(vllm_server):
    check_families(_get_metrics(vllm_server), "vllm")
    check_families(_get_metrics(generation_server()), "tidal")


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


@pytest.mark.slow
def test_values_follow_the_requests(vllm_server):
    """Three requests (one with n=2), all of 4 tokens: the counters and histograms move by
    exactly what they carried; a repeated prompt is served from the prefix cache and both the
    engine's and the frontend's counts say so; the phases add up."""
    first, second = _prompt(11, 37), _prompt(12, 50)
    gen = 4
    before = parse(_get_metrics(vllm_server))[1]

    async def go():
        async with openai.AsyncOpenAI(base_url=vllm_server.base_url, api_key=API_KEY,
                                      max_retries=0, timeout=120) as c:
            def one(prompt: list[int], n: int = 1):
                return c.completions.create(model=MODEL, prompt=prompt, max_tokens=gen, n=n,
                                            temperature=0, extra_body={"ignore_eos": True})
            outs = list(await asyncio.gather(one(first), one(second, n=2)))
            outs.append(await one(first))  # again, once the first is done: cached
            return outs

    outs = asyncio.run(go())
    assert [len(o.choices) for o in outs] == [1, 2, 1]
    assert all(ch.finish_reason == "length" for o in outs for ch in o.choices)
    assert [o.usage.completion_tokens for o in outs] == [gen, 2 * gen, gen]
    after = parse(_get_metrics(vllm_server))[1]

    def delta(name: str, **labels: str) -> float:
        return value(after, "vllm:" + name, **labels) - value(before, "vllm:" + name, **labels)

    seqs, requests = 4, 3
    prompt_tokens = 2 * len(first) + 2 * len(second)
    assert delta("request_success_total", finished_reason="length") == seqs
    assert delta("request_success_total") == seqs
    assert delta("prompt_tokens_total") == prompt_tokens
    assert delta("prefix_cache_queries_total") == prompt_tokens  # counted by the engine
    assert delta("generation_tokens_total") == seqs * gen
    assert delta("request_prompt_tokens_count") == seqs
    assert delta("request_prompt_tokens_sum") == prompt_tokens
    assert delta("request_generation_tokens_sum") == seqs * gen
    assert delta("request_params_n_count") == requests
    assert delta("request_params_n_sum") == 4
    assert delta("request_params_n_bucket", le="1.0") == 2
    assert delta("request_params_max_tokens_sum") == seqs * gen
    assert delta("request_max_num_generation_tokens_count") == requests
    assert delta("request_max_num_generation_tokens_sum") == requests * gen
    assert delta("num_preemptions_total") == 0

    # The repeated prompt's two full blocks (the last token is always computed), at least.
    cached = delta("prompt_tokens_cached_total")
    assert cached >= 32 and cached % 16 == 0
    assert delta("prefix_cache_hits_total") == cached  # the engine's count agrees
    assert delta("prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert delta("prompt_tokens_by_source_total", source="local_compute") == \
        prompt_tokens - cached
    assert delta("prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert delta("request_prefill_kv_computed_tokens_sum") == prompt_tokens - cached
    # Every step's scheduled tokens: each sequence's uncached prompt, then a token per decode.
    assert delta("iteration_tokens_total_sum") == prompt_tokens - cached + seqs * (gen - 1)

    assert delta("time_to_first_token_seconds_count") == requests  # the n share one
    for phase in ("e2e_request_latency", "request_queue_time", "request_prefill_time",
                  "request_decode_time", "request_inference_time",
                  "request_time_per_output_token"):
        assert delta(f"{phase}_seconds_count") == seqs, phase
    prefill = delta("request_prefill_time_seconds_sum")
    decode = delta("request_decode_time_seconds_sum")
    inference = delta("request_inference_time_seconds_sum")
    queue = delta("request_queue_time_seconds_sum")
    assert prefill > 0 and decode > 0 and queue >= 0
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert delta("request_time_per_output_token_seconds_sum") == \
        pytest.approx(decode / (gen - 1), abs=1e-6)
    # The frontend's end-to-end time holds the engine's queue and inference times.
    assert delta("e2e_request_latency_seconds_sum") >= queue + inference
