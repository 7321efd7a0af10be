"""Quantized against bf16 in one run, on dummy weights (issue 23, "What it must show").

    python tools/bench_quant.py --shape llama-3.1-8b --out quant.json    # H100: ~6 minutes
    python tools/bench_quant.py --smoke                                  # tiny model, CPU, seconds

One engine per configuration, built, measured and shut down (its GPU memory freed) before the
next, all in this process:

* ``bf16``: batch-1 decode step time, batch-``--batch`` decode throughput, prefill ``NxL``.
* ``fp8`` (``--quantization fp8``: the dummy bf16 weights quantized per row as they load): the
  same three. Prefill MFU is against the FP8 matmul peak measured in this run (row-wise scaled
  ``torch._scaled_mm`` on 8192^3, as bench_common measures the bf16 peak). Its KV cache stays
  bf16: it is also the bf16-KV leg of the KV comparison.
* ``int4`` (``--quantization awq``), when this build of tidal accepts it: batch-1 decode.
* every engine but ``fp8_kv``: decode at batch ``--few-batch`` (default 4; 0 skips it), where
  the few-row kernels run (2-8 rows: also what a speculative verify reads). Not a target of
  the issue; ``few_rows`` gives each quantized step against bf16's (an INT4 step at batch 4
  took 8.7x bf16's on an H200 before INT4 had a few-row kernel of its own).
* ``fp8 + fp8 KV`` (``--kv-cache-dtype fp8``), when accepted: the batch decode leg (against
  bf16's: FP8 as a server would run it), and decode throughput at
  ``--kv-batch`` x ``--kv-context``, against the bf16-KV leg of the fp8 engine at the same
  shape. Each runs the largest batch (up to ``--kv-batch``) whose requests its KV cache holds
  whole, so the comparison is what twice the KV tokens buys; both capacities are reported.

Decode and prefill are ``bench_latency``'s measurements (ms per ``core.step()``, medians of
windows). Targets (issue 23): batch-1 fp8 <= 0.6x the bf16 step, int4 <= 0.4x; batch-256
throughput fp8 >= 1.5x bf16; prefill fp8 MFU >= 50 % of the FP8 peak; FP8 KV >= 1.3x bf16 KV
throughput. A leg that would start after ``--time-limit-s`` is skipped and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (  # noqa: E402
    device_name,
    dump,
    judge,
    measure_ceilings,
    now,
    shape_facts,
    time_cuda,
    write_model_dir,
)
from bench_latency import bench_decode, bench_prefill, decode_new_tokens  # noqa: E402
from tidal.engine_core.config import ConfigError, EngineArgs  # noqa: E402
from tidal.engine_core.core import EngineCore  # noqa: E402

logger = logging.getLogger("bench_quant")

TARGETS = {  # name -> (comparison, bound, what)
    "decode_b1_fp8_ratio": ("<=", 0.6, "batch-1 step time fp8 / bf16"),
    "decode_b1_int4_ratio": ("<=", 0.4, "batch-1 step time int4 / bf16"),
    "decode_batch_fp8_speedup": (">=", 1.5, "batch decode throughput fp8 / bf16"),
    # (The same target with the FP8 KV cache too: at context 1,024 a batch-256 step reads
    # more KV than weights, so FP8 weights alone cannot reach it.)
    "decode_batch_fp8_kv_speedup": (">=", 1.5,
                                    "batch decode throughput fp8 + FP8 KV / bf16"),
    "prefill_fp8_mfu": (">=", 0.5, "prefill FP8 MFU vs measured FP8 peak"),
    "kv_fp8_speedup": (">=", 1.3, "decode throughput FP8 KV / bf16 KV (long context)"),
}


# An AutoAWQ "gemm" checkpoint's quantization_config: 4 bits, groups of 128, zero points.
AWQ_CONFIG = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 128,
              "zero_point": True}


def measure_fp8_peak() -> dict[str, Any]:
    """The FP8 e4m3 matmul peak: ``torch._scaled_mm`` 8192^3 with row-wise scales and bf16
    out (what ``fp8_scaled_mm`` runs), median of 10 after 3 warm-ups. None off Ada/Hopper."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        return {"fp8_matmul_TFLOPs": None}
    m = 8192
    a = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(m, 1, device="cuda")
    sb = torch.ones(1, m, device="cuda")
    t = time_cuda(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                           out_dtype=torch.bfloat16), 10)
    del a, b
    torch.cuda.empty_cache()
    return {"fp8_matmul_TFLOPs": round(2 * m**3 / statistics.median(t) / 1e12, 1),
            "fp8_matmul_ms": [round(x * 1e3, 4) for x in t]}


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _engine_args(ns: argparse.Namespace, model: str, max_model_len: int, max_seqs: int,
                 **kw: Any) -> EngineArgs:
    return EngineArgs(model=model, load_format="dummy", dtype=ns.dtype, device=ns.device,
                      max_model_len=max_model_len, max_num_seqs=max_seqs,
                      max_num_batched_tokens=ns.max_num_batched_tokens,
                      gpu_memory_utilization=ns.gpu_memory_utilization,
                      # --smoke: a 2 GiB CPU default cache would cost more than the legs
                      kv_cache_memory_bytes=(64 << 20) if ns.smoke else None,
                      enable_prefix_caching=False, enforce_eager=ns.enforce_eager, **kw)


def _available(ns: argparse.Namespace, model: str, **kw: Any) -> str | None:
    """None when this build accepts the configuration ``kw``, else why not."""
    try:
        _engine_args(ns, model, 4096, 8, **kw).create_config()
    except (ConfigError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


class Clock:
    """The run's time budget: a leg that would start past it is skipped."""

    def __init__(self, limit_s: float) -> None:
        self.t0, self.limit = now(), limit_s

    def left(self) -> float:
        return self.limit - (now() - self.t0)


def _kv_tokens(core: EngineCore) -> int:
    return core.config.cache.num_blocks * core.config.cache.block_size


def run_engine(label: str, args: EngineArgs, legs: list[tuple[str, Any]], clock: Clock,
               result: dict[str, Any]) -> None:
    """Build the engine, run each ``(name, fn(core))`` leg into ``result['runs'][label]``,
    shut it down and free its memory."""
    entry: dict[str, Any] = {}
    result["runs"][label] = entry
    if clock.left() <= 0:
        entry["skipped"] = "time limit reached before the engine was built"
        return
    t0 = now()
    try:
        core = EngineCore(args.create_config())
    except Exception as exc:  # a configuration this build cannot run: say so, go on
        logger.exception("%s: the engine did not start", label)
        entry["error"] = f"{type(exc).__name__}: {exc}"
        _free()
        return
    try:
        entry["startup_s"] = round(now() - t0, 2)
        entry["kv_tokens"] = _kv_tokens(core)
        entry["kv_cache_dtype"] = core.config.cache.cache_dtype
        for name, fn in legs:
            if clock.left() <= 0:
                entry[name] = {"skipped": "time limit"}
                continue
            t1 = now()
            entry[name] = fn(core)
            entry[name]["leg_s"] = round(now() - t1, 2)
            logger.info("%s %s: %s", label, name, _brief(entry[name]))
    finally:
        core.shutdown()
        del core
        _free()


def _brief(r: dict[str, Any]) -> str:
    keys = ("batch", "ms_per_step", "tokens_per_s", "MFU", "kv_tokens")
    return ", ".join(f"{k}={r[k]}" for k in keys if k in r)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 4)


def _get(result: dict[str, Any], label: str, leg: str, *path: str) -> Any:
    v: Any = result["runs"].get(label, {}).get(leg)
    for p in path:
        if not isinstance(v, dict):
            return None
        v = v.get(p)
    return v


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """Each target's measured value and PASS / MISS (``None``: not measured, and why)."""
    b1 = lambda lbl: _get(result, lbl, "decode_b1", "ms_per_step", "median")  # noqa: E731
    tput = lambda lbl, leg: _get(result, lbl, leg, "tokens_per_s")  # noqa: E731
    values = {
        "decode_b1_fp8_ratio": _ratio(b1("fp8"), b1("bf16")),
        "decode_b1_int4_ratio": _ratio(b1("int4"), b1("bf16")),
        "decode_batch_fp8_speedup": _ratio(tput("fp8", "decode_batch"),
                                           tput("bf16", "decode_batch")),
        "prefill_fp8_mfu": _get(result, "fp8", "prefill", "MFU", "median"),
        "decode_batch_fp8_kv_speedup": _ratio(tput("fp8_kv", "decode_batch"),
                                              tput("bf16", "decode_batch")),
        "kv_fp8_speedup": _ratio(tput("fp8_kv", "decode_kv"), tput("fp8", "decode_kv")),
    }
    out = judge(TARGETS, values)
    if result.get("int4_unavailable"):
        out["decode_b1_int4_ratio"]["note"] = "int4: not available"
    if result.get("kv_fp8_unavailable"):
        for name in ("kv_fp8_speedup", "decode_batch_fp8_kv_speedup"):
            out[name]["note"] = "fp8 KV cache: not available"
    return out


def few_rows(result: dict[str, Any]) -> dict[str, Any]:
    """Each quantized engine's step at ``--few-batch`` rows against bf16's (None: not run)."""
    few = lambda lbl: _get(result, lbl, "decode_few", "ms_per_step", "median")  # noqa: E731
    return {lbl: _ratio(few(lbl), few("bf16")) for lbl in ("fp8", "int4")}


def _decode_leg(batch: int, context: int, ns: argparse.Namespace, vocab: int, facts,
                bw: float | None, rng: random.Random):
    def leg(core: EngineCore) -> dict[str, Any]:
        return bench_decode(core, batch, context, ns.steps, ns.repeats, ns.warmup, vocab,
                            facts, bw, rng, None)
    return leg


def _kv_leg(ns: argparse.Namespace, vocab: int, facts, bw: float | None, rng: random.Random):
    """Decode at ``--kv-context`` with the largest batch up to ``--kv-batch`` whose requests
    the engine's KV cache holds whole (prompt and every decoded token)."""
    def leg(core: EngineCore) -> dict[str, Any]:
        kv = _kv_tokens(core)
        block = core.config.cache.block_size
        per_req = ns.kv_context + decode_new_tokens(ns.kv_batch, ns.kv_context,
                                                    ns.max_num_batched_tokens, ns.steps,
                                                    ns.repeats, ns.warmup, False)
        per_req = -(-per_req // block) * block
        batch = max(1, min(ns.kv_batch, kv // per_req))
        r = bench_decode(core, batch, ns.kv_context, ns.steps, ns.repeats, ns.warmup, vocab,
                         facts, bw, rng, None)
        r["kv_tokens"] = kv
        r["batch_asked"] = ns.kv_batch
        return r
    return leg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny shape on the CPU, a few steps: checks the tool in seconds")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of decode legs")
    ap.add_argument("--batch", type=int, default=256, help="the throughput decode batch")
    ap.add_argument("--few-batch", type=int, default=4,
                    help="a decode batch of 2-8 rows (the few-row kernels); 0 to skip")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--prefill", default="8x2048", help="NxL prompts; empty to skip")
    ap.add_argument("--prefill-repeats", type=int, default=2)
    ap.add_argument("--kv-batch", type=int, default=256)
    ap.add_argument("--kv-context", type=int, default=4096)
    ap.add_argument("--no-kv", action="store_true", help="skip the FP8 KV comparison")
    ap.add_argument("--no-int4", action="store_true", help="skip the int4 engine")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--time-limit-s", type=float, default=450.0,
                    help="legs that would start later are skipped (H100 full run: ~6 min)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.smoke:
        ns.shape, ns.device, ns.context, ns.batch = "tiny", "cpu", 32, 8
        ns.steps, ns.repeats, ns.warmup, ns.prefill_repeats = 2, 1, 1, 1
        ns.prefill, ns.kv_batch, ns.kv_context = "2x64", 4, 128
        ns.max_num_batched_tokens = 512
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    clock = Clock(ns.time_limit_s)

    ceilings = measure_ceilings()
    ceilings.update(measure_fp8_peak())
    bw = ceilings.get("hbm_GBps")
    facts = shape_facts(ns.shape)
    rng = random.Random(0)
    prefill = tuple(int(x) for x in ns.prefill.lower().split("x")) if ns.prefill else None
    decode_len = lambda b, c: c + decode_new_tokens(  # noqa: E731
        b, c, ns.max_num_batched_tokens, ns.steps, ns.repeats, ns.warmup, False)
    max_model_len = max(4096 if not ns.smoke else 256, decode_len(ns.batch, ns.context),
                        decode_len(ns.kv_batch, ns.kv_context),
                        (prefill[1] + 1) if prefill else 0)
    result: dict[str, Any] = {
        "benchmark": "quant", "device": device_name(), "torch": torch.__version__,
        "shape": ns.shape, "dtype": ns.dtype, "ceilings": ceilings, "runs": {},
        "workload": {"context": ns.context, "batch": ns.batch, "few_batch": ns.few_batch,
                     "prefill": ns.prefill,
                     "kv_batch": ns.kv_batch, "kv_context": ns.kv_context,
                     "steps": ns.steps, "repeats": ns.repeats},
    }
    with tempfile.TemporaryDirectory(prefix="tidal-quant-") as tmp:
        model = write_model_dir(ns.shape, Path(tmp) / ns.shape)
        vocab = facts.vocab
        max_seqs = max(ns.batch, ns.kv_batch, 8)

        def legs(batch_leg: bool, prefill_peak: float | None,
                 kv_leg: bool = False) -> list[tuple[str, Any]]:
            out = [("decode_b1", _decode_leg(1, ns.context, ns, vocab, facts, bw, rng))]
            if ns.few_batch:
                out.append(("decode_few",
                            _decode_leg(ns.few_batch, ns.context, ns, vocab, facts, bw, rng)))
            if batch_leg:
                out.append(("decode_batch",
                            _decode_leg(ns.batch, ns.context, ns, vocab, facts, bw, rng)))
            if prefill is not None and batch_leg:
                out.append(("prefill", lambda core: bench_prefill(
                    core, prefill[0], prefill[1], ns.prefill_repeats, vocab, facts,
                    prefill_peak, rng, None)))
            if kv_leg:
                out.append(("decode_kv", _kv_leg(ns, vocab, facts, bw, rng)))
            return out

        kv_why = None if ns.no_kv else _available(ns, model, kv_cache_dtype="fp8")
        kv = not ns.no_kv and kv_why is None
        run_engine("bf16", _engine_args(ns, model, max_model_len, max_seqs), legs(
            True, ceilings.get("matmul_TFLOPs")), clock, result)
        run_engine("fp8", _engine_args(ns, model, max_model_len, max_seqs, quantization="fp8"),
                   legs(True, ceilings.get("fp8_matmul_TFLOPs"), kv_leg=kv), clock, result)
        int4_why, int4_model = "--no-int4", model
        if not ns.no_int4:
            # Quantized on load if this build does that; else a dummy AWQ checkpoint (random
            # packed nibbles are valid INT4 weights: the speed is the same).
            int4_why = _available(ns, model, quantization="awq")
            if int4_why is not None:
                int4_model = write_model_dir(ns.shape, Path(tmp) / f"{ns.shape}-awq")
                cfg_path = Path(int4_model) / "config.json"
                cfg = json.loads(cfg_path.read_text())
                cfg["quantization_config"] = AWQ_CONFIG
                cfg_path.write_text(json.dumps(cfg))
                why = _available(ns, int4_model)
                int4_why = None if why is None else f"{int4_why}; as an AWQ checkpoint: {why}"
        if int4_why is None:
            run_engine("int4", _engine_args(ns, int4_model, max_model_len, max_seqs,
                                            **({"quantization": "awq"}
                                               if int4_model == model else {})),
                       legs(False, None), clock, result)
        else:
            result["int4_unavailable"] = int4_why
            logger.info("int4: not available (%s)", int4_why)
        if kv:
            run_engine("fp8_kv", _engine_args(ns, model, max_model_len, max_seqs,
                                              quantization="fp8", kv_cache_dtype="fp8"),
                       [("decode_batch",
                         _decode_leg(ns.batch, ns.context, ns, vocab, facts, bw, rng)),
                        ("decode_kv", _kv_leg(ns, vocab, facts, bw, rng))], clock, result)
        else:
            result["kv_fp8_unavailable"] = kv_why or "--no-kv"
            logger.info("fp8 KV cache: not available (%s)", result["kv_fp8_unavailable"])
    result["targets"] = verdicts(result)
    result["few_rows"] = {"batch": ns.few_batch, "step_vs_bf16": few_rows(result)}
    result["elapsed_s"] = round(now() - clock.t0, 1)
    dump(result, ns.out)
    table(result)
    return 0


def table(r: dict[str, Any]) -> None:
    c = r["ceilings"]
    print(f"\n{r['shape']} on {r['device']}: HBM {c.get('hbm_GBps')} GB/s, bf16 matmul "
          f"{c.get('matmul_TFLOPs')} TFLOP/s, fp8 matmul {c.get('fp8_matmul_TFLOPs')} TFLOP/s")
    few_label = f"b{r.get('workload', {}).get('few_batch', '-')} ms/step"
    print(f"{'engine':>8} {'b1 ms/step':>11} {few_label:>11} {'batch tok/s':>12} "
          f"{'prefill tok/s':>14} {'MFU':>7} {'KV tokens':>10} {'long-ctx tok/s (batch)':>24}")
    for label, e in r["runs"].items():
        if "error" in e or "skipped" in e:
            print(f"{label:>8} {e.get('error') or e.get('skipped')}")
            continue
        b1 = (e.get("decode_b1") or {}).get("ms_per_step", {}).get("median")
        bf = (e.get("decode_few") or {}).get("ms_per_step", {}).get("median")
        bt = (e.get("decode_batch") or {}).get("tokens_per_s")
        pf = e.get("prefill") or {}
        kvl = e.get("decode_kv") or {}
        kv_txt = (f"{kvl.get('tokens_per_s')} ({kvl.get('batch')})"
                  if "tokens_per_s" in kvl else "-")
        print(f"{label:>8} {b1 if b1 is not None else '-':>11} "
              f"{bf if bf is not None else '-':>11} {bt or '-':>12} "
              f"{pf.get('tokens_per_s', '-'):>14} "
              f"{(pf.get('MFU') or {}).get('median', '-'):>7} {e.get('kv_tokens', '-'):>10} "
              f"{kv_txt:>24}")
    if r.get("int4_unavailable"):
        print(f"int4: not available ({r['int4_unavailable']})")
    if r.get("kv_fp8_unavailable"):
        print(f"fp8 KV cache: not available ({r['kv_fp8_unavailable']})")
    print(f"\n{'target':<58} {'value':>8} {'goal':>8} verdict")
    for t in r["targets"].values():
        v = t["value"]
        print(f"{t['what']:<58} {v if v is not None else '-':>8} {t['target']:>8} "
              f"{t['verdict']}")


if __name__ == "__main__":
    sys.exit(main())
