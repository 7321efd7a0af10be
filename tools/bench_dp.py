"""Data parallelism through the server: ``tidal serve --data-parallel-size N`` against N=1, both
in one run (issue 26's 2-GPU case).

    python tools/bench_dp.py --tokenizer tests/data/qwen3 [--shape qwen3-0.6b] [--dp 2] \\
        [--num-prompts 1000 --input-len 512 --output-len 512] [--output dp.json]

Each side is a fresh ``tidal serve`` of the shape with dummy weights (``--load-format dummy``;
``--model DIR`` serves a real folder instead), loaded with ``bench_serve.run_bench``: every
request sent at t=0, token-id prompts, ``ignore_eos``. Reported: output tok/s of each side and
their ratio (target: DP=2 >= 1.85x DP=1), and the CPU each idle EngineCore burns over
``--idle-s`` seconds after the load (target: < 2 % of a core each). On a GPU host each rank
takes its own ``world_size`` GPUs; ``--engine-flags`` go to both sides.

``--smoke``: a tiny CPU run (tiny shape, a few short requests): checks the tool end to end, its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402
from bench_online_vs_offline import Server  # noqa: E402

TARGET_SPEEDUP = 1.85
TARGET_IDLE_CORE = 0.02


def _engine_pids(server: Server) -> dict[int, str]:
    """pid -> rank name of the server's EngineCores, from its log."""
    text = server.own_log()
    pids = {int(p): f"EngineCore_DP{r}" for r, p in re.findall(r"EngineCore_DP(\d+)\[(\d+)\]",
                                                                text)}
    if not pids:
        pids = {int(p): "EngineCore" for p in re.findall(r"EngineCore\[(\d+)\]", text)}
    return pids


def _cpu_seconds(pids: dict[int, str]) -> dict[int, float]:
    """CPU seconds of each EngineCore and every process under it (its workers, where the
    executor runs them apart: a busy-waiting worker is idle CPU burnt too)."""
    import psutil

    out = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            tree = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        total = 0.0
        for member in tree:
            try:
                t = member.cpu_times()
            except psutil.Error:
                continue  # gone since it was listed
            total += t.user + t.system
        out[pid] = total
    return out


def one_side(ns: argparse.Namespace, model_dir: str, dp: int, log: Path) -> dict[str, Any]:
    flags = ["--data-parallel-size", str(dp), *shlex.split(ns.engine_flags)]
    if ns.model is None:
        flags += ["--load-format", "dummy"]
    server = Server(f"dp{dp}", model_dir, flags, log)
    try:
        server.start(ns.start_timeout)
        argv = ["--base-url", server.base_url, "--dataset", "random-ids",
                "--num-prompts", str(ns.num_prompts), "--input-len", str(ns.input_len),
                "--output-len", str(ns.output_len), "--max-token-id", str(ns.max_token_id),
                "--seed", "0"]
        rep = bench_serve.run_bench(bench_serve.build_parser().parse_args(argv))
        engines = _engine_pids(server)
        time.sleep(1.0)  # the last requests' going-idle reports
        before = _cpu_seconds(engines)
        time.sleep(ns.idle_s)
        after = _cpu_seconds(engines)
        idle = {engines[p]: (after[p] - before[p]) / ns.idle_s for p in before if p in after}
        return {"dp": dp, "output_throughput": rep["result"]["output_throughput"],
                "startup_s": server.info.get("startup_s"), "idle_core_fraction": idle,
                "server": server.info, "bench": rep}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--model", default=None, help="a model folder instead of the dummy shape")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for the dummy shape")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--engine-flags", default="", help="more flags for both servers")
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--smoke", action="store_true", help="a tiny CPU run of the tool")
    p.add_argument("--output", default=None)
    ns = p.parse_args(argv)
    from bench_common import SHAPES, write_model_dir  # imports torch: not at the top

    if ns.smoke:
        ns.shape, ns.num_prompts, ns.input_len, ns.output_len = "tiny", 8, 16, 8
        ns.idle_s = min(ns.idle_s, 2.0)
        ns.engine_flags = (ns.engine_flags + " --device cpu --max-model-len 256 "
                           "--kv-cache-memory-bytes 33554432 --cpu-threads 1 "
                           "--api-server-count 1")
    if ns.model is None and not ns.tokenizer:
        raise SystemExit("bench_dp: --tokenizer DIR is needed with a dummy shape (the server "
                         "detokenizes), e.g. tests/data/qwen3")
    if ns.dp < 2:
        raise SystemExit("bench_dp: --dp must be >= 2 (it is compared with 1)")
    with tempfile.TemporaryDirectory(prefix="tidal-bench-dp-") as tmp:
        if ns.model is not None:
            model_dir = ns.model
            vocab = json.loads((Path(ns.model) / "config.json").read_text())["vocab_size"]
        else:
            model_dir = write_model_dir(ns.shape, Path(tmp) / ns.shape, ns.tokenizer)
            vocab = SHAPES[ns.shape]["vocab_size"]
        ns.max_token_id = min(vocab - 1, 10000)
        log = Path(tmp) / "servers.log"
        try:
            sides = [one_side(ns, model_dir, 1, log), one_side(ns, model_dir, ns.dp, log)]
        except BaseException:
            print(log.read_text(errors="replace")[-4000:] if log.exists() else "", file=sys.stderr)
            raise
    base, dp = sides
    speedup = dp["output_throughput"] / base["output_throughput"]
    worst_idle = max([*base["idle_core_fraction"].values(), *dp["idle_core_fraction"].values()],
                     default=None)
    result = {
        "shape": ns.model or ns.shape, "num_prompts": ns.num_prompts, "input_len": ns.input_len,
        "output_len": ns.output_len, "smoke": ns.smoke,
        "output_tok_s": {"dp1": base["output_throughput"], f"dp{ns.dp}": dp["output_throughput"]},
        "speedup": speedup,
        "verdicts": {
            "speedup": {"target": f">= {TARGET_SPEEDUP}", "value": speedup,
                        "verdict": "PASS" if speedup >= TARGET_SPEEDUP else "MISS"},
            "idle_engine_core_fraction": {
                "target": f"< {TARGET_IDLE_CORE}", "value": worst_idle,
                "verdict": "n/a" if worst_idle is None
                else ("PASS" if worst_idle < TARGET_IDLE_CORE else "MISS")},
        },
        "sides": sides,
    }
    print(f"DP=1 {base['output_throughput']:,.0f} output tok/s, DP={ns.dp} "
          f"{dp['output_throughput']:,.0f} output tok/s: {speedup:.2f}x; idle engines at most "
          f"{(worst_idle or 0.0) * 100:.2f} % of a core", file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.output:
        Path(ns.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
