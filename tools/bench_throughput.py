"""Offline throughput through the normal ``LLM`` API with dummy weights (docs/BENCHMARKS.md
workloads 1, 2, 5).

    python tools/bench_throughput.py --shape qwen3-0.6b --workloads nano,fixed1024,fixed128
    python tools/bench_throughput.py --compare-hf            # HF generate() on the same shape

Workloads:
* ``nano``: the nano-vllm benchmark. ``random.seed(0)``; 256 prompts of ``randint(100, 1024)``
  tokens drawn from ``randint(0, 10000)``, then 256 ``max_tokens = randint(100, 1024)``, in the
  order nano-vllm's ``bench.py`` draws them (this is the order whose Σ max_tokens is 133,966);
  temperature 0.6, ``ignore_eos``; one untimed warm-up request; the whole ``generate`` is timed.
* ``fixed1024`` / ``fixed128``: ``--fixed-requests`` requests (default 1000; the 1024 one can be
  cut with ``--fixed1024-requests``) of 1024 (128) random prompt tokens and exactly 1024 (128)
  output tokens, ``ignore_eos``.

Each workload reports output and total tokens/s (median and min-max of ``--repeats`` runs; the
prefix cache is reset between runs) and the ratio to a roofline lower bound computed from the same
requests: every decode step reads the weights once, every sequence's KV once per step
(docs/BENCHMARKS.md), prefill costs 2·params FLOPs per prompt token at the measured matmul
peak.

``--compare-hf``: HF transformers ``generate()`` (greedy, dynamic cache) on the same shape and
random weights, batch 1 and 128, prompt 128, 256 new tokens, next to tidal on the same requests.
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    device_name,
    dump,
    measure_ceilings,
    shape_facts,
    summary,
    write_model_dir,
)
from tidal.frontend import LLM, SamplingParams  # noqa: E402

logger = logging.getLogger("bench_throughput")

NANO_SUM_MAX_TOKENS = 133_966


def nano_workload() -> tuple[list[list[int]], list[int]]:
    from random import randint, seed

    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    max_tokens = [randint(100, 1024) for _ in range(256)]
    assert sum(max_tokens) == NANO_SUM_MAX_TOKENS, sum(max_tokens)
    return prompts, max_tokens


def fixed_workload(n: int, length: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)], [length] * n


def roofline_seconds(prompts: list[list[int]], max_tokens: list[int], max_num_seqs: int,
                     facts, bw_gbps: float, peak_tflops: float) -> float:
    """Lower bound: sequences run in waves of ``max_num_seqs``; each decode step of a wave
    reads the weights once and every live sequence's KV once. MoE: a step reads the routed
    experts its live sequences are expected to touch (``ShapeFacts.weight_bytes_batch``), so
    the weight bytes shrink as a wave's sequences finish."""
    kv, w = facts.kv_bytes_per_token, facts.weight_bytes_per_step
    total_bytes = 0.0
    order = list(range(len(prompts)))
    for start in range(0, len(order), max_num_seqs):
        wave = order[start:start + max_num_seqs]
        steps = max(max_tokens[i] for i in wave)
        if facts.num_experts:
            lengths = [max_tokens[i] for i in wave]
            total_bytes += sum(facts.weight_bytes_batch(sum(1 for m in lengths if m > s))
                               for s in range(steps))
        else:
            total_bytes += steps * w
        for i in wave:
            p, m = len(prompts[i]), max_tokens[i]
            total_bytes += kv * (m * p + m * (m - 1) / 2)  # contexts p .. p+m-1
    prefill_flops = facts.prefill_flops([len(p) for p in prompts], 0)
    return total_bytes / (bw_gbps * 1e9) + prefill_flops / (peak_tflops * 1e12)


def run_workload(llm: LLM, name: str, prompts, max_tokens, temperature: float, repeats: int,
                 ceilings: dict[str, Any], facts, max_num_seqs: int) -> dict[str, Any]:
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True)
              for m in max_tokens]
    times = []
    for _ in range(repeats):
        llm.engine.core.scheduler.kv.reset_prefix_cache()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        got = sum(len(o.outputs[0].token_ids) for o in outs)
        assert got == sum(max_tokens), (got, sum(max_tokens))
    n_out, n_in = sum(max_tokens), sum(len(p) for p in prompts)
    s = summary(times, 3)
    out: dict[str, Any] = {
        "workload": name, "requests": len(prompts), "prompt_tokens": n_in, "output_tokens": n_out,
        "seconds": s, "output_tok_s": round(n_out / s["median"], 1),
        "output_tok_s_min_max": [round(n_out / s["max"], 1), round(n_out / s["min"], 1)],
        "total_tok_s": round((n_in + n_out) / s["median"], 1),
    }
    if ceilings.get("hbm_GBps"):
        floor = roofline_seconds(prompts, max_tokens, max_num_seqs, facts, ceilings["hbm_GBps"],
                                 ceilings["matmul_TFLOPs"])
        out["roofline_seconds"] = round(floor, 3)
        out["roofline_output_tok_s"] = round(n_out / floor, 1)
        out["ratio_to_roofline"] = round(floor / s["median"], 4)
    logger.info("%s: %s", name, out)
    return out


def tidal_same_shape(llm: LLM, batch: int, prompt_len: int, new: int, vocab: int) -> dict:
    rng = random.Random(2)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch + 1)]
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    # Warm up on a prompt of the same length that is not timed: a warm-up on a timed prompt
    # would turn its prefill into a prefix-cache hit (a query shape compiled on first use,
    # inside the timed region).
    llm.generate(prompts[-1:], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    prompts = prompts[:batch]
    llm.engine.core.scheduler.kv.reset_prefix_cache()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return {"batch": batch, "new_tokens": new, "seconds": round(dt, 3),
            "tok_s": round(batch * new / dt, 1)}


def hf_generate(model_dir: str, batch: int, prompt_len: int, new: int, dtype: torch.dtype,
                static: bool = False) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    rng = random.Random(2)
    ids = torch.tensor([[rng.randrange(cfg.vocab_size) for _ in range(prompt_len)]
                        for _ in range(batch)], device=dev)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    if static:
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
    assert out.shape[1] == prompt_len + new
    del model, out
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"batch": batch, "new_tokens": new, "seconds": round(dt, 3),
            "tok_s": round(batch * new / dt, 1), "cache": "static" if static else "dynamic"}


def _hf_new(ns: argparse.Namespace, batch: int) -> int:
    if batch == 1 and ns.hf_batch1_new_tokens:
        return ns.hf_batch1_new_tokens
    return ns.hf_new_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--workloads", default="nano,fixed1024,fixed128")
    ap.add_argument("--fixed-requests", type=int, default=1000)
    ap.add_argument("--fixed1024-requests", type=int, default=None,
                    help="requests of the 1024/1024 workload (default --fixed-requests; 1000 "
                         "take about a minute on one H100)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fixed1024-repeats", type=int, default=None,
                    help="repeats of the 1024/1024 workload (default --repeats)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (detokenize outputs)")
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--hf-batches", default="1,128")
    ap.add_argument("--hf-new-tokens", type=int, default=256)
    ap.add_argument("--hf-batch1-new-tokens", type=int, default=None,
                    help="fewer new tokens for HF at batch 1 (its ~80 ms steps are slow)")
    ap.add_argument("--hf-prompt-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV cache size in GiB instead of what the memory profile leaves")
    ap.add_argument("--async-scheduling", type=int, choices=(0, 1), default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--ops", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    ceilings = {} if ns.no_ceilings else measure_ceilings()
    facts = shape_facts(ns.shape)
    result: dict[str, Any] = {"benchmark": "throughput", "device": device_name(),
                              "torch": torch.__version__, "shape": ns.shape, "dtype": ns.dtype,
                              "ceilings": ceilings, "workloads": []}
    with tempfile.TemporaryDirectory(prefix="tidal-tp-") as tmp:
        model = write_model_dir(ns.shape, Path(tmp) / ns.shape, ns.tokenizer)
        kwargs = dict(load_format="dummy", dtype=ns.dtype, device=ns.device,
                      max_model_len=ns.max_model_len, max_num_seqs=ns.max_num_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      gpu_memory_utilization=ns.gpu_memory_utilization,
                      kv_cache_memory_bytes=int(ns.kv_gib * 2**30) if ns.kv_gib else None,
                      async_scheduling=bool(ns.async_scheduling), enforce_eager=ns.enforce_eager,
                      attention_backend=ns.attention_backend, ops_backend=ns.ops)
        t0 = time.perf_counter()
        llm = LLM(model, skip_tokenizer_init=ns.tokenizer is None, **kwargs)
        runner = llm.engine.core.executor.worker.runner
        result["engine"] = {
            "startup_s": round(time.perf_counter() - t0, 2),
            "kv_blocks": llm.config.cache.num_blocks, "async_scheduling": bool(ns.async_scheduling),
            "cuda_graphs": runner.graphs is not None,
            "graph_capture_s": round(runner.graphs.capture_seconds, 2) if runner.graphs else None,
            "attention": runner.attn_impl.name, "ops": runner.kernels.name,
            "detokenize": ns.tokenizer is not None, "max_num_seqs": ns.max_num_seqs,
            "max_num_batched_tokens": llm.config.scheduler.max_num_batched_tokens,
        }
        vocab = llm.config.model.arch.vocab_size
        # One untimed warm-up request.
        llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.6, max_tokens=16,
                                                    ignore_eos=True), use_tqdm=False)
        for name in [w for w in ns.workloads.split(",") if w]:
            if name == "nano":
                prompts, max_tokens = nano_workload()
                temp = 0.6
            elif name.startswith("fixed"):
                length = int(name.removeprefix("fixed"))
                n = ns.fixed_requests
                if length == 1024 and ns.fixed1024_requests:
                    n = ns.fixed1024_requests
                prompts, max_tokens = fixed_workload(n, length, vocab)
                temp = 0.0
            else:
                raise SystemExit(f"unknown workload {name!r}")
            repeats = ns.repeats
            if name == "fixed1024" and ns.fixed1024_repeats:
                repeats = ns.fixed1024_repeats
            result["workloads"].append(run_workload(llm, name, prompts, max_tokens, temp,
                                                    repeats, ceilings, facts,
                                                    ns.max_num_seqs))
        if ns.compare_hf:
            batches = [int(b) for b in ns.hf_batches.split(",")]
            result["compare_hf"] = {"prompt_len": ns.hf_prompt_len,
                                    "new_tokens": ns.hf_new_tokens, "tidal": [], "hf": []}
            for b in batches:
                result["compare_hf"]["tidal"].append(
                    tidal_same_shape(llm, b, ns.hf_prompt_len, _hf_new(ns, b), vocab))
        llm.shutdown()
        del llm, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if ns.compare_hf:
            dtype = getattr(torch, ns.dtype)
            for b in batches:
                r = hf_generate(model, b, ns.hf_prompt_len, _hf_new(ns, b), dtype)
                result["compare_hf"]["hf"].append(r)
                logger.info("HF generate: %s", r)
            for t, h in zip(result["compare_hf"]["tidal"], result["compare_hf"]["hf"]):
                t["speedup_vs_hf"] = round(t["tok_s"] / h["tok_s"], 2)
    dump(result, ns.out)
    _table(result)
    return 0


def _table(r: dict[str, Any]) -> None:
    print(f"\n{r['shape']} on {r['device']} (HBM {r['ceilings'].get('hbm_GBps')} GB/s, "
          f"matmul {r['ceilings'].get('matmul_TFLOPs')} TFLOP/s)")
    print(f"{'workload':>10} {'reqs':>5} {'out tok/s':>10} {'min-max':>19} {'roofline':>9} "
          f"{'ratio':>6}")
    for w in r["workloads"]:
        lo, hi = w["output_tok_s_min_max"]
        print(f"{w['workload']:>10} {w['requests']:>5} {w['output_tok_s']:>10.0f} "
              f"{lo:>9.0f}-{hi:<9.0f} {w.get('roofline_output_tok_s', 0):>9.0f} "
              f"{w.get('ratio_to_roofline', '-'):>6}")
    hf = r.get("compare_hf")
    if hf:
        for t, h in zip(hf["tidal"], hf["hf"]):
            print(f"batch {t['batch']:>4}: tidal {t['tok_s']:.0f} tok/s, HF generate "
                  f"{h['tok_s']:.0f} tok/s ({t.get('speedup_vs_hf')}x)")


if __name__ == "__main__":
    sys.exit(main())
