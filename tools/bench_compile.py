"""torch.compile against the eager model (issue 25): decode throughput, mixed-step
throughput and start-up, cold and warm.

    python tools/bench_compile.py --shape gemma-2-9b --out compile.json   # the issue's H100 case
    python tools/bench_compile.py --smoke        # tiny model, CPU (minutes: cold Inductor compile)
    python tools/bench_compile.py --engines eager,compiled_piecewise --no-startup   # a subset

Engines (dummy weights, one in-process worker), each built, measured and shut down in turn:

- ``eager``: compilation off (mode 0) with today's whole-model CUDA graphs of decode and small
  mixed steps (on a GPU; none on a CPU);
- ``eager_nographs``: mode 0, ``cudagraph_mode`` NONE;
- ``compiled``: mode 3 (Dynamo trace once, split at attention, Inductor pieces) with
  ``cudagraph_mode`` NONE, so every step runs the compiled pieces;
- ``compiled_full`` (GPU): mode 3 with the whole-model graphs capturing the compiled forward;
- ``compiled_piecewise`` (GPU): mode 3, ``cudagraph_mode`` PIECEWISE: every piece a CUDA graph
  per capture size (default sizes: up to 512 tokens or the token budget), attention eager
  between them, for decode and mixed steps alike;
- ``compiled_full_and_piecewise`` (GPU): FULL_AND_PIECEWISE: pure decode steps replay the
  whole-model graphs of the compiled forward, every other step the piecewise ones;
- ``compiled_custom_ops`` (GPU): the same with ``custom_ops: ["all"]``: the kernel policy's
  hand-written fused ops stay in the compiled graph as opaque custom ops.

The engines share one compile cache (its key leaves the graph mode out), so only the first
compiled engine runs Inductor. The targets judge the fastest compiled engine of each leg
against ``eager``; ``speedups`` lists every engine's ratio.

Legs: ``decode``: ``--batch`` requests of ``--prompt-len`` tokens generating ``--decode-len``
each (after a warm-up request), tokens per second over the batch's wall time; ``mixed``: twice
as many requests of ``--mixed-prompt-len`` tokens under a ``--max-num-batched-tokens`` budget, so
prompt chunks ride along with decodes; tokens (prompt + generated) per second.

Start-up: three fresh processes time ``LLM(...)`` from import to ready: mode 3
(``--startup-cudagraph-mode``, by default FULL_AND_PIECEWISE on a GPU: graph capture included)
with an empty compile cache and an empty Inductor cache (*cold*), then compilation off, then
mode 3 on the same folders again (*warm*); each reports the worker's phases and the compile
counters (Dynamo traces, pieces compiled by Inductor, pieces loaded from the cache). A warm
start rebuilds the forward from the cache's plan: ``dynamo_traces`` 0, ``warm_start`` true.

Prints one JSON object (also written to ``--out``) with the runs and the issue's targets:
decode speedup >= 1.25, mixed >= 1.1, warm start-up <= 1.2 x compilation off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_name, dump, judge, write_model_dir  # noqa: E402

_MARK = "BENCH_COMPILE_STARTUP "
TARGETS = {
    "decode_speedup": (">=", 1.25, "compiled / eager decode tokens/s at --batch"),
    "mixed_speedup": (">=", 1.1, "compiled / eager tokens/s of mixed prefill + decode steps"),
    "warm_over_off": ("<=", 1.2, "warm compiled start-up / start-up with compilation off"),
}


COMPILED = ("compiled", "compiled_full", "compiled_piecewise", "compiled_full_and_piecewise")


def engines(device: str) -> dict[str, dict[str, Any] | None]:
    """Engine label -> compilation_config (None: the engine cannot be built here: CUDA graphs
    need a GPU)."""
    gpu = device == "cuda"
    return {
        "eager": {"mode": 0},
        "eager_nographs": {"mode": 0, "cudagraph_mode": "NONE"} if gpu else None,
        # The issue's premise, "a family without hand-written kernels": Gemma 2 has had fused
        # Triton norm/GeGLU/decode kernels since issue 19, so the eager baseline above is the
        # hand-fused one; this engine is eager with the fused ops as plain torch ops.
        "eager_unfused": {"mode": 0, _LLM_KW: {"ops_backend": "torch",
                                               "kernel_config": {"decode_kernels": False}}}
        if gpu else None,
        "compiled": {"mode": 3, "cudagraph_mode": "NONE"},
        "compiled_full": {"mode": 3, "cudagraph_mode": "FULL"} if gpu else None,
        "compiled_piecewise": {"mode": 3, "cudagraph_mode": "PIECEWISE"} if gpu else None,
        "compiled_full_and_piecewise": ({"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"}
                                        if gpu else None),
        # The same with the policy's hand-written kernels kept as opaque custom ops inside the
        # compiled graph (Qwen3's eager engine beats the compiled one with them).
        "compiled_custom_ops": ({"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE",
                                 "custom_ops": ["all"]} if gpu else None),
    }


_LLM_KW = "_llm_kwargs"  # an engine's extra LLM arguments (not compilation_config fields)


def _llm(model: str, ns: argparse.Namespace, cc: dict[str, Any], cache_dir: str):
    from tidal.frontend import LLM

    cc = dict(cc)
    extra = cc.pop(_LLM_KW, {})
    if cc.get("mode") == 3:
        cc["cache_dir"] = cache_dir
    return LLM(model, load_format="dummy", skip_tokenizer_init=True, device=ns.device,
               dtype=ns.dtype, max_num_seqs=max(2 * ns.batch, 8),
               max_num_batched_tokens=ns.max_num_batched_tokens,
               max_model_len=ns.max_model_len, compilation_config=cc,
               gpu_memory_utilization=ns.gpu_memory_utilization, **extra)


def _timed(llm, prompts: list[list[int]], gen: int) -> tuple[float, int]:
    from tidal.frontend import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.outputs[0].token_ids) for o in outs)


def run_engine(model: str, ns: argparse.Namespace, cc: dict[str, Any], cache_dir: str,
               vocab: int) -> dict[str, Any]:
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]

    t0 = time.perf_counter()
    llm = _llm(model, ns, cc, cache_dir)
    out: dict[str, Any] = {"startup_s": round(time.perf_counter() - t0, 3)}
    try:
        runner = llm.engine.core.executor.worker.runner
        _timed(llm, prompts(2, ns.prompt_len), 4)  # a warm-up request
        wall, gen = _timed(llm, prompts(ns.batch, ns.prompt_len), ns.decode_len)
        out["decode"] = {"batch": ns.batch, "wall_s": round(wall, 4),
                         "tokens_per_s": round(gen / wall, 2)}
        n_mixed = 2 * ns.batch
        wall, gen = _timed(llm, prompts(n_mixed, ns.mixed_prompt_len), ns.decode_len)
        out["mixed"] = {"requests": n_mixed, "wall_s": round(wall, 4),
                        "tokens_per_s": round((gen + n_mixed * ns.mixed_prompt_len) / wall, 2)}
        compiled = runner.compiled
        if compiled is not None:
            s = compiled.stats
            out["compile"] = {"dynamo_traces": s.dynamo_traces, "pieces": s.pieces,
                              "inductor_compiles": s.inductor_compiles,
                              "cache_hits": s.cache_hits}
            g = compiled.graphs
            if g is not None:  # (counted over the warm-up request and both legs)
                out["piecewise"] = {"sizes": f"{g.captured[0]}..{g.captured[-1]}"
                                    if g.captured else "none",
                                    "graphs": len(g), "capture_s": round(g.capture_s, 3),
                                    "pool_mib": round(g.pool_bytes / 2**20, 1),
                                    "graph_steps": g.graph_steps, "replays": g.replays,
                                    "ungraphed_steps": g.ungraphed_steps}
    finally:
        llm.shutdown()
    return out


def _startup_child(ns: argparse.Namespace) -> int:
    """One start in this fresh process: time LLM() and report the compile counters."""
    t0 = time.perf_counter()
    import logging

    from tidal.frontend import LLM

    # (the parent reads the worker's start-up phases from this log)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(message)s")
    cc = json.loads(ns.child_cc)
    llm = LLM(ns.child_model, load_format="dummy", skip_tokenizer_init=True, device=ns.device,
              dtype=ns.dtype, max_model_len=ns.max_model_len, compilation_config=cc,
              gpu_memory_utilization=ns.gpu_memory_utilization)
    ready = time.perf_counter() - t0
    res: dict[str, Any] = {"ready_s": round(ready, 3)}
    compiled = llm.engine.core.executor.worker.runner.compiled
    if compiled is not None:
        s = compiled.stats
        res.update(dynamo_traces=s.dynamo_traces, inductor_compiles=s.inductor_compiles,
                   cache_hits=s.cache_hits, trace_s=round(s.trace_s, 3),
                   compile_s=round(s.compile_s, 3), load_s=round(s.load_s, 3),
                   warm_start=s.warm_start)
        if compiled.graphs is not None:
            res["piecewise_capture_s"] = round(compiled.graphs.capture_s, 3)
    llm.shutdown()
    print(_MARK + json.dumps(res), flush=True)
    return 0


def startup(model: str, ns: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    cache = tmp / "compile-cache"
    inductor = tmp / "inductor-cache"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(inductor))
    on = {"mode": 3, "cache_dir": str(cache), "cudagraph_mode": ns.startup_cudagraph_mode
          or ("FULL_AND_PIECEWISE" if ns.device == "cuda" else "NONE")}
    out: dict[str, Any] = {"cudagraph_mode": on["cudagraph_mode"]}
    # Cold first: it fills the caches both other starts share (Triton's JIT cache above all;
    # an H200 start with compilation off measured 84 s on an empty one, its graph capture and
    # warm-up compiling kernels, against 23 s for the warm compiled start after it), so off and
    # warm then differ by compilation alone.
    for label, cc in (("cold", on), ("off", {"mode": 0}), ("warm", on)):
        cmd = [sys.executable, __file__, "--child-startup", "--child-model", model,
               "--child-cc", json.dumps(cc), "--device", ns.device, "--dtype", ns.dtype,
               "--max-model-len", str(ns.max_model_len),
               "--gpu-memory-utilization", str(ns.gpu_memory_utilization)]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        line = next((x for x in proc.stdout.splitlines() if x.startswith(_MARK)), None)
        if proc.returncode != 0 or line is None:
            out[label] = {"error": proc.stderr.strip().splitlines()[-1:] or ["no output"]}
            continue
        res = json.loads(line[len(_MARK):])
        res["process_s"] = round(time.perf_counter() - t0, 3)
        phases = [x.split("start-up: ", 1)[1] for x in proc.stderr.splitlines()
                  if "start-up: rank 0" in x]
        res["worker_phases"] = phases
        out[label] = res
    return out


def speedups(result: dict[str, Any]) -> dict[str, float]:
    """Every compiled engine's tokens/s over eager's, per leg (``engine/leg``)."""
    runs = result.get("runs", {})
    out = {}
    for leg in ("decode", "mixed"):
        base = runs.get("eager", {}).get(leg)
        for k in COMPILED:
            if base and leg in runs.get(k, {}):
                out[f"{k}/{leg}"] = round(runs[k][leg]["tokens_per_s"] / base["tokens_per_s"],
                                          3)
    return out


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    runs = result.get("runs", {})

    def ratio(leg: str) -> float | None:
        best = max((runs[k][leg]["tokens_per_s"] for k in COMPILED
                    if leg in runs.get(k, {})), default=None)
        base = runs.get("eager", {}).get(leg)
        if best is None or not base:
            return None
        return round(best / base["tokens_per_s"], 3)

    unfused = {leg: runs.get("eager_unfused", {}).get(leg) for leg in ("decode", "mixed")}
    for leg, base in unfused.items():
        best = max((runs[k][leg]["tokens_per_s"] for k in COMPILED
                    if leg in runs.get(k, {})), default=None)
        if best and base:
            # Reported beside the verdicts: the compiled engines against eager without the
            # hand-fused kernels (what the issue's 1.25x / 1.1x were written against).
            result.setdefault("vs_eager_unfused", {})[leg] = round(best / base["tokens_per_s"],
                                                                   3)
    st = result.get("startup", {})
    warm, off = st.get("warm", {}).get("ready_s"), st.get("off", {}).get("ready_s")
    return judge(TARGETS, {
        "decode_speedup": ratio("decode"),
        "mixed_speedup": ratio("mixed"),
        "warm_over_off": round(warm / off, 3) if warm and off else None,
    })


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gemma-2-9b")
    ap.add_argument("--smoke", action="store_true",
                    help="the tiny shape on the CPU, a few tokens: checks the tool")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=128)
    ap.add_argument("--mixed-prompt-len", type=int, default=512)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--no-startup", action="store_true", help="skip the three start-ups")
    ap.add_argument("--engines", default="all",
                    help="comma-separated engine labels to run (all: every one this device "
                         "can build; none: start-ups only)")
    ap.add_argument("--startup-cudagraph-mode", default=None,
                    help="cudagraph_mode of the compiled start-ups (default: "
                         "FULL_AND_PIECEWISE on a GPU, NONE on a CPU)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-startup", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-cc", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child_startup:
        return _startup_child(ns)
    if ns.smoke:
        ns.shape, ns.device, ns.dtype = "tiny", "cpu", "float32"
        ns.batch, ns.prompt_len, ns.decode_len, ns.mixed_prompt_len = 2, 8, 4, 24
        ns.max_num_batched_tokens, ns.max_model_len = 16, 128
    import torch

    from bench_common import SHAPES

    result: dict[str, Any] = {
        "benchmark": "compile", "device": device_name(), "torch": torch.__version__,
        "shape": ns.shape, "dtype": ns.dtype, "runs": {}, "unavailable": {},
        "workload": {"batch": ns.batch, "prompt_len": ns.prompt_len,
                     "decode_len": ns.decode_len, "mixed_prompt_len": ns.mixed_prompt_len,
                     "max_num_batched_tokens": ns.max_num_batched_tokens},
    }
    with tempfile.TemporaryDirectory(prefix="tidal-compile-") as tmp_name:
        tmp = Path(tmp_name)
        model = write_model_dir(ns.shape, tmp / ns.shape)
        vocab = SHAPES[ns.shape]["vocab_size"]
        table = engines(ns.device)
        wanted = (set(table) if ns.engines == "all" else set() if ns.engines == "none"
                  else {x.strip() for x in ns.engines.split(",") if x.strip()})
        unknown = wanted - set(table)
        if unknown:
            ap.error(f"--engines: unknown {sorted(unknown)}; known: {', '.join(table)}")
        for label, cc in table.items():
            if label not in wanted:
                continue
            if cc is None:
                result["unavailable"][label] = f"no CUDA graphs on {ns.device}"
                continue
            try:
                result["runs"][label] = run_engine(model, ns, cc, str(tmp / "bench-cache"),
                                                   vocab)
            except Exception as exc:  # noqa: BLE001 - one engine's failure: the others still run
                result["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
                print(f"{label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        if not ns.no_startup:
            result["startup"] = startup(model, ns, tmp)
    result["speedups"] = speedups(result)
    result["targets"] = verdicts(result)
    dump(result, ns.out)
    for name, t in result["targets"].items():
        print(f"{name}: {t['value']} (target {t['target']}): {t['verdict']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
