"""Prefix-cache benchmark (CPU or GPU).

1. Shared prefix: requests that share a long prefix (default 2,000 tokens) each add a short
   unique suffix; time-to-first-token with caching on vs off, and the engine's counters
   (prompt tokens computed, prefix hits) proving only suffixes are computed.
2. Zero hit rate: unique prompts, whole-run throughput with caching on vs off (the cost of
   hashing and bookkeeping when nothing is ever reused), alternating runs, medians.

Prints one JSON object and a table. Uses the default model unless --model is given.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import time

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def make_core(args: argparse.Namespace, caching: bool) -> EngineCore:
    eargs = EngineArgs(model=args.model, enable_prefix_caching=caching, load_format=args.load_format,
                       max_model_len=args.max_model_len, max_num_batched_tokens=args.budget,
                       cpu_threads=args.threads)
    return EngineCore(eargs.create_config())


def ttft(core: EngineCore, req: EngineCoreRequest) -> tuple[float, int, int]:
    """(seconds to the first token, prompt tokens computed, prefix-hit tokens) of one request."""
    start = time.perf_counter()
    core.add_request(req)
    first, computed, hits = None, 0, 0
    while core.has_unfinished_requests():
        out = core.step()
        computed += out.scheduler_stats.num_prompt_tokens
        hits += out.scheduler_stats.prefix_cache_hits
        if first is None and any(o.new_token_ids for o in out.outputs):
            first = time.perf_counter() - start
    return first or 0.0, computed, hits


def shared_prefix(args: argparse.Namespace, vocab: int) -> dict:
    rng = random.Random(0)
    prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
    params = SamplingParams(temperature=0, max_tokens=1)
    result = {}
    for caching in (False, True):
        progress(f"shared prefix, caching {'on' if caching else 'off'}: "
                 f"{args.repeats} requests of {args.prefix_len}+{args.suffix_len} tokens")
        core = make_core(args, caching)
        ttft(core, EngineCoreRequest("warm", prefix + [1, 2, 3], params))
        rows = [ttft(core, EngineCoreRequest(
            f"q{i}", prefix + [rng.randrange(100, vocab) for _ in range(args.suffix_len)],
            params)) for i in range(args.repeats)]
        result["on" if caching else "off"] = {
            "ttft_s_median": statistics.median(r[0] for r in rows),
            "ttft_s_all": [round(r[0], 4) for r in rows],
            "prompt_tokens_computed_per_request": [r[1] for r in rows],
            "prefix_hit_tokens_per_request": [r[2] for r in rows],
        }
        core.shutdown()
    result["ttft_speedup"] = result["off"]["ttft_s_median"] / max(result["on"]["ttft_s_median"],
                                                                  1e-9)
    return result


def zero_hit_throughput(args: argparse.Namespace, vocab: int) -> dict:
    cores = {c: make_core(args, c) for c in (False, True)}
    times: dict[bool, list[float]] = {False: [], True: []}
    n_tokens = 0
    for run in range(args.runs):
        for caching in ((False, True) if run % 2 == 0 else (True, False)):
            progress(f"zero hit rate, run {run + 1}/{args.runs}, caching "
                     f"{'on' if caching else 'off'}")
            core = cores[caching]
            rng = random.Random(1000 + run)  # same prompts for both settings in a run
            reqs = [EngineCoreRequest(
                f"{run}-{caching}-{i}",
                [rng.randrange(100, vocab) for _ in range(args.zero_prompt_len)],
                SamplingParams(temperature=0, max_tokens=args.zero_output_len, ignore_eos=True))
                for i in range(args.zero_requests)]
            if caching:
                core.scheduler.kv.reset_prefix_cache()
            start = time.perf_counter()
            for r in reqs:
                core.add_request(r)
            n_tokens = 0
            while core.has_unfinished_requests():
                out = core.step()
                n_tokens += out.scheduler_stats.num_prompt_tokens
                n_tokens += out.scheduler_stats.num_generation_tokens
            times[caching].append(time.perf_counter() - start)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    return {
        "tokens_per_run": n_tokens,
        "off_tok_s_median": n_tokens / off,
        "on_tok_s_median": n_tokens / on,
        "on_vs_off": off / on,
        "off_s_all": [round(t, 3) for t in times[False]],
        "on_s_all": [round(t, 3) for t in times[True]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--prefix-len", type=int, default=2000)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    p.add_argument("--threads", type=int, default=None, help="CPU worker threads")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--zero-requests", type=int, default=16)
    p.add_argument("--zero-prompt-len", type=int, default=128)
    p.add_argument("--zero-output-len", type=int, default=16)
    p.add_argument("--skip-zero-hit", action="store_true")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    probe = make_core(args, False)
    vocab = probe.config.model.vocab_size
    device = probe.config.runner.device
    name = probe.config.model.served_model_name
    probe.shutdown()
    report = {
        "benchmark": "prefix_cache",
        "model": name,
        "device": device if device != "cpu" else f"cpu ({platform.processor() or 'x86_64'})",
        "workload": {k: v for k, v in vars(args).items()},
        "shared_prefix": shared_prefix(args, vocab),
    }
    if not args.skip_zero_hit:
        report["zero_hit_rate"] = zero_hit_throughput(args, vocab)
    print(json.dumps(report, indent=2))
    sp = report["shared_prefix"]
    print(f"\n{'':28}{'caching off':>14}{'caching on':>14}")
    print(f"{'TTFT median (s)':28}{sp['off']['ttft_s_median']:>14.4f}"
          f"{sp['on']['ttft_s_median']:>14.4f}   speedup {sp['ttft_speedup']:.1f}x")
    print(f"{'prompt tokens computed':28}{sp['off']['prompt_tokens_computed_per_request'][0]:>14}"
          f"{sp['on']['prompt_tokens_computed_per_request'][0]:>14}")
    if "zero_hit_rate" in report:
        z = report["zero_hit_rate"]
        print(f"{'0% hits, tok/s (median)':28}{z['off_tok_s_median']:>14.1f}"
              f"{z['on_tok_s_median']:>14.1f}   on/off {z['on_vs_off']:.3f}")


if __name__ == "__main__":
    main()
