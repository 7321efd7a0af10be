"""Start-up time with a cold and a warm kernel cache, and the first request after ready against
the same request in steady state (issue 17: "ready means warm").

    python tools/bench_startup.py --shape qwen3-0.6b --out startup.json
    python tools/bench_startup.py --shape tiny --device cpu          # smoke run on a CPU

Starts the engine (dummy weights, one in-process worker) twice in fresh processes, both times
with tidal's cache folder at ``<cache-dir>/cache`` (``TIDAL_CACHE_DIR``; Triton's kernels and the
CUDA extension's build live under it): *cold* with that folder emptied first, *warm* with what
the cold start left there. Each start reports its phases (the EngineCore's and the worker's:
model load, KV profile, KV allocation, graph capture, warm-up), the wall time from spawning the
process to ready (imports included) and the JIT compiles counted at start-up and after ready.
Then it times the TTFT of a request right after ready (a ``--prompt-len``-token prompt, greedy
unless ``--temperature``, measured on the EngineCore: from ``add_request`` to the step that
returns its first token) and of ``--repeats`` more of the same shape (other prompt ids, so no
prefix-cache hit makes them cheaper), whose median is the steady state.

Prints one JSON object on stdout (also written to ``--out``) with both starts, ``warm_over_cold``
(start-up time, spawn to ready), ``first_over_steady`` TTFT per start, and the goals of issue 17:
warm start-up <= 0.6 x cold, first TTFT <= 2 x steady. ``--compare-no-warmup`` adds a third
start, warm cache but ``TIDAL_WARMUP=0``, to show what the warm-up saves the first request.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_MARK = "BENCH_STARTUP_RESULT "
# Environment that would move the kernel caches out of the folder under test.
_CACHE_VARS = ("TRITON_CACHE_DIR", "TRITON_HOME", "TORCH_EXTENSIONS_DIR")


def _child(ns: argparse.Namespace) -> int:
    """One start: build the engine, time the first and the steady-state request, report."""
    spawned = float(os.environ["TIDAL_BENCH_SPAWNED"])
    t_import = time.time()
    import logging
    import random

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.control import GetCompileStats
    from tidal.engine_core.core import EngineCore
    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.sampling_params import SamplingParams
    imported = time.time()
    args = EngineArgs(model=ns.model_dir, load_format="dummy", dtype=ns.dtype, device=ns.device,
                      max_model_len=ns.max_model_len, ops_backend=ns.ops,
                      distributed_executor_backend="uni")
    t0 = time.perf_counter()
    core = EngineCore(args.create_config())
    engine_s = time.perf_counter() - t0
    ready = time.time()
    worker = core.executor.worker
    vocab = core.config.model.arch.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=ns.temperature, max_tokens=4, ignore_eos=True)

    def ttft(i: int) -> float:
        rid = f"bench-{i}"
        prompt = [rng.randrange(vocab) for _ in range(ns.prompt_len)]
        start = time.perf_counter()
        core.add_request(EngineCoreRequest(rid, prompt, params))
        first = None
        while core.has_unfinished_requests():
            outs = core.step()
            if first is None and any(o.request_id == rid and o.new_token_ids
                                     for o in outs.outputs):
                first = time.perf_counter() - start
        assert first is not None, "the request produced no token"
        return first

    first = ttft(0)
    steady = [ttft(i) for i in range(1, ns.repeats + 1)]
    stats = core.handle_control(GetCompileStats())
    result = {
        "spawn_to_ready_s": round(ready - spawned, 3),
        "interpreter_and_imports_s": round(imported - spawned, 3),
        "imports_s": round(imported - t_import, 3),
        "engine_s": round(engine_s, 3),
        "engine_phases_s": {k: round(v, 3) for k, v in core.startup.phases.items()},
        "worker_phases_s": {k: round(v, 3) for k, v in worker.startup.phases.items()},
        "warmup": worker.warmup.describe() if worker.warmup else None,
        "kv_blocks": core.config.cache.num_blocks,
        "cuda_graphs": len(worker.runner.graphs) if worker.runner.graphs else 0,
        "jit_compiles": {"active": stats.active, "startup": stats.startup,
                         "after_ready": stats.after_ready, "after_ready_kernels": stats.kernels},
        "ttft_first_ms": round(first * 1e3, 2),
        "ttft_steady_ms": [round(x * 1e3, 2) for x in steady],
        "ttft_steady_median_ms": round(statistics.median(steady) * 1e3, 2),
        "first_over_steady": round(first / statistics.median(steady), 2),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available()
        and ns.device != "cpu" else "cpu",
    }
    core.shutdown()
    print(_MARK + json.dumps(result), flush=True)
    return 0


def _start(ns: argparse.Namespace, model_dir: str, cache: Path, label: str,
           extra_env: dict[str, str]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in _CACHE_VARS}
    env.update(TIDAL_CACHE_DIR=str(cache), TIDAL_BENCH_SPAWNED=repr(time.time()), **extra_env)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model-dir", model_dir,
           "--ops", ns.ops, "--device", ns.device, "--dtype", ns.dtype,
           "--max-model-len", str(ns.max_model_len), "--prompt-len", str(ns.prompt_len),
           "--repeats", str(ns.repeats), "--temperature", str(ns.temperature)]
    print(f"== {label} start: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    # The child's log goes to our stderr; its result is one marked line on stdout.
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, timeout=ns.timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{label} start failed (exit {proc.returncode}): "
                           f"{proc.stdout[-2000:]}")
    return json.loads(lines[-1][len(_MARK):])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--ops", default="triton", help="fused ops: auto (builds the CUDA "
                    "extension when cold) | triton | cuda | torch")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5, help="steady-state requests after the "
                    "first")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cache-dir", default=None, help="where the caches under test go (kept); "
                    "default: a temporary folder, removed")
    ap.add_argument("--compare-no-warmup", action="store_true",
                    help="a third start: warm cache, TIDAL_WARMUP=0")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per start")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return _child(ns)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_common import write_model_dir

    root = Path(ns.cache_dir) if ns.cache_dir else Path(tempfile.mkdtemp(prefix="tidal-start-"))
    try:
        model_dir = write_model_dir(ns.shape, root / "model")
        cache = root / "cache"
        shutil.rmtree(cache, ignore_errors=True)  # cold means nothing compiled before
        cold = _start(ns, model_dir, cache, "cold", {})
        warm = _start(ns, model_dir, cache, "warm", {})
        result: dict[str, Any] = {
            "benchmark": "startup", "shape": ns.shape, "device": cold["device"],
            "ops": ns.ops, "dtype": ns.dtype, "prompt_len": ns.prompt_len,
            "temperature": ns.temperature, "cold": cold, "warm": warm,
            "warm_over_cold": round(warm["spawn_to_ready_s"] / cold["spawn_to_ready_s"], 3),
            "warm_over_cold_engine": round(warm["engine_s"] / cold["engine_s"], 3),
        }
        if ns.compare_no_warmup:
            result["warm_no_warmup"] = _start(ns, model_dir, cache, "warm, no warm-up",
                                              {"TIDAL_WARMUP": "0"})
        result["goals"] = {
            "warm_start_le_0.6_cold": result["warm_over_cold"] <= 0.6,
            "first_ttft_le_2x_steady_cold": cold["first_over_steady"] <= 2.0,
            "first_ttft_le_2x_steady_warm": warm["first_over_steady"] <= 2.0,
            "no_jit_compile_after_ready": cold["jit_compiles"]["after_ready"] == 0
            and warm["jit_compiles"]["after_ready"] == 0,
        }
    finally:
        if not ns.cache_dir:
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text)
    for name in ("cold", "warm", "warm_no_warmup"):
        r = result.get(name)
        if r:
            print(f"{name:>15}: ready {r['spawn_to_ready_s']:7.2f} s (engine {r['engine_s']:.2f} "
                  f"s; phases {r['worker_phases_s']}), TTFT first {r['ttft_first_ms']:.1f} ms "
                  f"vs steady {r['ttft_steady_median_ms']:.1f} ms, JIT compiles "
                  f"{r['jit_compiles']['startup']} at start-up / "
                  f"{r['jit_compiles']['after_ready']} after ready", file=sys.stderr)
    print(f"warm/cold start-up {result['warm_over_cold']}; goals {result['goals']}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
