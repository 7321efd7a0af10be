"""Decode and prefill latency of the whole engine (EngineCore steps), with dummy weights.

    python tools/bench_latency.py --shape qwen3-0.6b --batches 1,8,64,256 --out lat.json
    python tools/bench_latency.py --shape llama-3.1-8b --batches 1 --prefill 8x2048

Decode: B requests with a ``--context``-token prompt are prefilled, then every ``core.step()``
decodes one token for each; ms/step is the wall time of ``--steps`` consecutive steps (medians of
``--repeats`` windows, min-max), so it includes scheduling, input preparation, the forward (a
CUDA graph when captured), sampling and output handling. MBU = (weights + Σ contexts · KV bytes
per token) / step time / the HBM bandwidth measured in this run (docs/BENCHMARKS.md).

Prefill: ``N x L`` prompts that each produce one token, timed from the first step to the last
output; reported as tokens/s and MFU against the bf16 matmul peak measured in this run.

``--quantization fp8`` / ``--kv-cache-dtype fp8`` measure the engine as ``tools/bench_quant.py``
builds it (with ``--profile``: where a quantized step's time goes).

``--profile`` adds a torch.profiler table of the device kernels for a few decode steps at each
batch (and for one prefill), written next to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    SHAPES,
    config_facts,
    device_name,
    dump,
    measure_ceilings,
    now,
    summary,
    write_model_dir,
)
from tidal.engine_core.config import EngineArgs  # noqa: E402
from tidal.engine_core.core import EngineCore  # noqa: E402
from tidal.engine_core.protocol import EngineCoreRequest  # noqa: E402
from tidal.engine_core.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("bench_latency")


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run_until_done(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def _profile_steps(core: EngineCore, steps: int, path: Path | None, label: str) -> list[dict]:
    """Kernel time table of ``steps`` engine steps (top 20 by device time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                     else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            core.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=25)
    if path is not None:
        # The timeline too, for tools/trace_steps.py (kernel sums overcount overlapped kernels).
        slug = "".join(c if c.isalnum() else "_" for c in label)
        prof.export_chrome_trace(str(path.with_name(f"{path.stem}.{slug}.trace.json")))
        with open(path, "a") as f:
            f.write(f"\n=== {label} ({steps} steps)\n{table}\n")
    rows = []
    for ev in sorted(prof.key_averages(), key=lambda e: -getattr(e, key, 0))[:20]:
        rows.append({"name": ev.key[:90], "calls": ev.count,
                     "device_us_total": round(getattr(ev, "self_device_time_total", 0), 1),
                     "cpu_us_total": round(ev.self_cpu_time_total, 1)})
    return rows


def decode_new_tokens(batch: int, context: int, max_batched_tokens: int, steps: int,
                      repeats: int, warmup: int, profile: bool) -> int:
    """Tokens each decode request generates: requests prefilled first decode while the rest
    still prefill, so there is room for those steps too, and no request finishes (and the
    batch never shrinks) before the end."""
    prefill_steps = -(-batch * context // max_batched_tokens)
    return prefill_steps + warmup + steps * repeats + 16 + (4 if profile else 0)


def bench_decode(core: EngineCore, batch: int, context: int, steps: int, repeats: int,
                 warmup: int, vocab: int, facts, bw: float | None, rng: random.Random,
                 profile_path: Path | None) -> dict[str, Any]:
    total_new = decode_new_tokens(batch, context,
                                  core.config.scheduler.max_num_batched_tokens, steps, repeats,
                                  warmup, profile_path is not None)
    kv_tokens = core.config.cache.num_blocks * core.config.cache.block_size
    fits = batch * (context + total_new) <= kv_tokens
    if not fits:
        # Preemption would shrink the batch mid-window and the bytes would be wrong.
        logger.warning("decode batch %d x %d tokens exceeds the KV cache (%d tokens): raise "
                       "--gpu-memory-utilization / --kv-gib or lower --context", batch,
                       context + total_new, kv_tokens)
    ids = []
    for i in range(batch):
        rid = f"d{batch}-{i}-{rng.random()}"
        ids.append(rid)
        prompt = [rng.randrange(vocab) for _ in range(context)]
        core.add_request(EngineCoreRequest(rid, prompt, _params(total_new)))
    produced = {rid: 0 for rid in ids}
    # Prefill every request (and let the batch settle into pure decode steps).
    while min(produced.values()) < 1:
        for o in core.step().outputs:
            produced[o.request_id] = produced.get(o.request_id, 0) + len(o.new_token_ids)
    for _ in range(warmup):
        core.step()
    # Tokens each request holds beyond its prompt when the timed windows start (on average).
    generated = sum(produced.values()) / batch + warmup
    windows, contexts = [], []
    for _ in range(repeats):
        t0 = now()
        for _ in range(steps):
            core.step()
        windows.append((now() - t0) / steps)
        # Mean context read per request in this window (prompt + tokens so far).
        contexts.append(context + generated + steps / 2)
        generated += steps
    prof = None
    if profile_path is not None:
        prof = _profile_steps(core, 4, profile_path, f"decode batch {batch}")
    core.abort_requests(ids)
    _run_until_done(core)
    ms = [w * 1e3 for w in windows]
    out: dict[str, Any] = {"batch": batch, "context": context, "steps_per_window": steps,
                           "ms_per_step": summary(ms, 4), "kv_cache_fits": fits}
    mean_ctx = sum(contexts) / len(contexts)
    step_bytes = facts.decode_bytes_batch(batch, mean_ctx)
    out["mean_context"] = round(mean_ctx, 1)
    out["bytes_per_step"] = step_bytes
    out["weight_bytes_per_step"] = facts.weight_bytes_batch(batch)
    if facts.num_experts:
        # Uniform-routing expectation (bench_common.ShapeFacts): k at batch 1.
        out["experts_touched_per_layer"] = round(facts.experts_touched(batch), 2)
    out["tokens_per_s"] = round(batch / (out["ms_per_step"]["median"] / 1e3), 1)
    if not fits:
        # The batch never ran whole (preempted requests waited), so the bytes above were not
        # what the steps read: no MBU rather than a wrong one.
        out["MBU_omitted"] = (f"batch {batch} x {context + total_new} tokens does not fit the "
                              f"KV cache ({kv_tokens} tokens)")
    elif bw:
        floor_ms = step_bytes / (bw * 1e9) * 1e3
        out["roofline_ms"] = round(floor_ms, 4)
        ms_s = out["ms_per_step"]
        # The slowest step window gives the lowest utilisation.
        out["MBU"] = {"median": round(floor_ms / ms_s["median"], 4),
                      "min": round(floor_ms / ms_s["max"], 4),
                      "max": round(floor_ms / ms_s["min"], 4)}
    if prof is not None:
        out["profile_top_kernels"] = prof
    return out


def bench_prefill(core: EngineCore, n: int, length: int, repeats: int, vocab: int, facts,
                  peak: float | None, rng: random.Random, profile_path: Path | None
                  ) -> dict[str, Any]:
    times = []
    for rep in range(repeats + 1):  # the first round warms up
        for i in range(n):
            prompt = [rng.randrange(vocab) for _ in range(length)]
            core.add_request(EngineCoreRequest(f"p{rep}-{i}-{rng.random()}", prompt,
                                               _params(1)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = now()
        _run_until_done(core)
        if rep:
            times.append(now() - t0)
    tokens = n * length
    flops = facts.prefill_flops([length] * n, n)
    out: dict[str, Any] = {"prompts": n, "prompt_len": length, "tokens": tokens,
                           "seconds": summary(times, 5),
                           "tokens_per_s": round(tokens / summary(times)["median"], 1),
                           "flops": flops}
    if peak:
        t = summary(times, 6)
        out["TFLOPs"] = round(flops / t["median"] / 1e12, 1)
        out["MFU"] = {"median": round(flops / t["median"] / 1e12 / peak, 4),
                      "min": round(flops / t["max"] / 1e12 / peak, 4),
                      "max": round(flops / t["min"] / 1e12 / peak, 4)}
    if profile_path is not None:
        for i in range(n):
            prompt = [rng.randrange(vocab) for _ in range(length)]
            core.add_request(EngineCoreRequest(f"pp-{i}-{rng.random()}", prompt, _params(1)))
        out["profile_top_kernels"] = _profile_steps(core, 2, profile_path, f"prefill {n}x{length}")
        _run_until_done(core)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prefill", default="8x2048", help="NxL prompts; empty to skip")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=4096,
                    help="raised to fit --context plus the decode steps, and the prefill")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="a 61 GB MoE shape on an 80 GB card wants ~0.95 for batch-64 KV")
    ap.add_argument("--kv-gib", type=float, default=None,
                    help="KV cache size in GiB instead of what the memory profile leaves")
    ap.add_argument("--async-scheduling", type=int, choices=(0, 1), default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--ops", default="auto", help="fused ops: auto | triton | cuda | torch")
    ap.add_argument("--quantization", default=None,
                    help="as the engine's --quantization (fp8: the dummy weights quantized)")
    ap.add_argument("--fp8-group-size", type=int, default=None,
                    help="with --quantization fp8: a scale per row and this many inputs "
                         "(the block-wise FP8 path; TIDAL_SKINNY_FP8_BLOCK=0 runs its "
                         "1-8 rows on the Triton block GEMM, not the CUDA few-row product)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-layers", type=int, default=None,
                    help="the shape with this many decoder layers (num_hidden_layers) instead of "
                         "its own: a proxy of a shape too big for the GPU; bytes and FLOPs follow")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-out", default=None,
                    help="append the profiler tables here (default: next to --out)")
    ap.add_argument("--no-ceilings", action="store_true")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    ceilings = {} if ns.no_ceilings else measure_ceilings()
    bw, peak = ceilings.get("hbm_GBps"), ceilings.get("matmul_TFLOPs")
    batches = [int(x) for x in ns.batches.split(",") if x]
    config = dict(SHAPES[ns.shape])
    if ns.num_layers is not None:
        if ns.num_layers < 1 or any(config.get(k) for k in ("layer_types",
                                                                "mlp_only_layers")):
            raise SystemExit(f"--num-layers: not for {ns.shape} (>= 1 layer, no per-layer lists)")
        config["num_hidden_layers"] = ns.num_layers
    facts = config_facts(config, ns.shape)
    rng = random.Random(0)
    profile_path = None
    if ns.profile:
        profile_path = Path(ns.profile_out or Path(ns.out or "latency.json").with_suffix(
            ".profile.txt"))
    prefill_len = int(ns.prefill.lower().split("x")[1]) if ns.prefill else 0
    max_model_len = max([ns.max_model_len, prefill_len + 1] + [
        ns.context + decode_new_tokens(b, ns.context, ns.max_num_batched_tokens, ns.steps,
                                       ns.repeats, ns.warmup, ns.profile) for b in batches])
    if max_model_len != ns.max_model_len:
        logger.info("max_model_len raised to %d (context %d + decode steps)", max_model_len,
                    ns.context)
    with tempfile.TemporaryDirectory(prefix="tidal-lat-") as tmp:
        model = write_model_dir(ns.shape, Path(tmp) / ns.shape)
        if ns.num_layers is not None:
            (Path(model) / "config.json").write_text(json.dumps(config))
        kv_bytes = int(ns.kv_gib * 2**30) if ns.kv_gib else None
        args = EngineArgs(model=model, load_format="dummy", dtype=ns.dtype, device=ns.device,
                          max_model_len=max_model_len,
                          max_num_seqs=max(batches + [8]),
                          max_num_batched_tokens=ns.max_num_batched_tokens,
                          gpu_memory_utilization=ns.gpu_memory_utilization,
                          kv_cache_memory_bytes=kv_bytes,
                          enable_prefix_caching=False, async_scheduling=bool(ns.async_scheduling),
                          enforce_eager=ns.enforce_eager, attention_backend=ns.attention_backend,
                          ops_backend=ns.ops, quantization=ns.quantization,
                          fp8_group_size=ns.fp8_group_size, kv_cache_dtype=ns.kv_cache_dtype)
        t0 = now()
        core = EngineCore(args.create_config())
        startup = now() - t0
        runner = core.executor.worker.runner
        graphs = runner.graphs
        result: dict[str, Any] = {
            "benchmark": "latency", "device": device_name(), "torch": torch.__version__,
            "shape": ns.shape, "dtype": ns.dtype, "quantization": ns.quantization,
            "fp8_group_size": ns.fp8_group_size,
            "kv_cache_dtype": ns.kv_cache_dtype, "ceilings": ceilings,
            "num_layers": facts.num_layers,
            "layers_override": ns.num_layers is not None,
            "weights_bytes_per_step": facts.weight_bytes_per_step,
            "kv_bytes_per_token": facts.kv_bytes_per_token,
            "active_params_per_token": facts.linear_params,
            **_sparse_result(facts),
            "engine": {"async_scheduling": bool(ns.async_scheduling),
                       "cuda_graphs": graphs is not None and len(graphs) > 0,
                       "graph_capture_s": round(graphs.capture_seconds, 2) if graphs else None,
                       "graph_pool_MiB": round(graphs.pool_bytes / 2**20, 1) if graphs else None,
                       "attention": runner.attn_impl.name, "ops": runner.kernels.name,
                       "kv_blocks": core.config.cache.num_blocks, "startup_s": round(startup, 2),
                       # Switches of the batch-1 decode kernels (unset: on, no GEMV size limit).
                       "decode_kernel_env": {k: os.environ[k] for k in (
                           "TIDAL_DECODE_KERNELS", "TIDAL_GEMV", "TIDAL_GEMV_MAX_MB",
                           "TIDAL_ATTN_FUSED_MERGE", "TIDAL_PDL") if k in os.environ}},
            "decode": [], "prefill": None,
        }
        vocab = core.config.model.arch.vocab_size
        for b in batches:
            r = bench_decode(core, b, ns.context, ns.steps, ns.repeats, ns.warmup, vocab, facts,
                             bw, rng, profile_path)
            result["decode"].append(r)
            logger.info("decode batch %d: %s ms/step, MBU %s", b, r["ms_per_step"],
                        r.get("MBU"))
        if ns.prefill:
            n, length = (int(x) for x in ns.prefill.lower().split("x"))
            result["prefill"] = bench_prefill(core, n, length, ns.prefill_repeats, vocab, facts,
                                              peak, rng, profile_path)
            logger.info("prefill: %s", {k: v for k, v in result["prefill"].items()
                                        if k != "profile_top_kernels"})
        core.shutdown()
    dump(result, ns.out)
    _table(result)
    return 0


def _sparse_result(facts) -> dict[str, Any]:
    """The MoE / MLA accounting of the shape (bench_common.ShapeFacts), for the JSON."""
    out: dict[str, Any] = {}
    if facts.num_experts:
        out["moe"] = {"experts": facts.num_experts, "top_k": facts.experts_per_tok,
                      "moe_layers": facts.num_moe_layers,
                      "expert_bytes": facts.expert_params * facts.dtype_bytes,
                      "routing_assumption": "uniform: E*(1-(1-k/E)^B) experts per layer"}
    if facts.kv_cache_dim:
        out["mla"] = {"kv_values_per_token_layer": facts.kv_cache_dim,
                      "mha_kv_bytes_per_token": facts.mha_kv_bytes_per_token,
                      "kv_reduction_vs_mha": round(facts.mha_kv_bytes_per_token
                                                   / facts.kv_bytes_per_token, 3)}
    return out


def _table(r: dict[str, Any]) -> None:
    print(f"\n{r['shape']} on {r['device']} (HBM {r['ceilings'].get('hbm_GBps')} GB/s, "
          f"matmul {r['ceilings'].get('matmul_TFLOPs')} TFLOP/s)")
    if r.get("mla"):
        print(f"MLA KV bytes/token {r['kv_bytes_per_token']} vs MHA "
              f"{r['mla']['mha_kv_bytes_per_token']}: {r['mla']['kv_reduction_vs_mha']}x smaller")
    print(f"{'batch':>6} {'ctx':>6} {'GB/step':>8} {'ms/step':>9} {'min-max':>17} "
          f"{'floor ms':>9} {'MBU':>6}")
    for d in r["decode"]:
        ms = d["ms_per_step"]
        mbu = d.get("MBU", {}).get("median")
        print(f"{d['batch']:>6} {d['context']:>6} {d['bytes_per_step'] / 1e9:>8.2f} "
              f"{ms['median']:>9.3f} {ms['min']:>8.3f}-{ms['max']:<8.3f} "
              f"{d.get('roofline_ms', float('nan')):>9.3f} {mbu if mbu is not None else '-':>6}")
    p = r.get("prefill")
    if p:
        print(f"prefill {p['prompts']}x{p['prompt_len']}: {p['tokens_per_s']:.0f} tok/s, "
              f"{p.get('TFLOPs')} TFLOP/s, MFU {p.get('MFU')}")


if __name__ == "__main__":
    sys.exit(main())
