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

``--case ep`` (issue 26's expert-parallel case): TP=2 (one engine, its experts' intermediate
dimension sharded) against EP=2 over DP=2 (two engines, each holding half the experts whole,
``--enable-expert-parallel``), by default the Qwen3-30B-A3B shape at a 256-request decode
batch (target: EP >= 1.2x TP output tok/s). EP across engines runs eagerly (``--enforce-eager``:
its per-step token exchange is host code); ``--tp-eager`` runs the TP side eagerly too, for
the same footing::

    python tools/bench_dp.py --case ep --tokenizer tests/data/qwen3 --output ep.json

``--dbo-threshold N`` adds a third side, EP with ``--enable-dbo --dbo-token-threshold N`` (target:
>= 1.1x EP without it at the batch where it turns on); ``--dbo-threshold measure`` the same with
the threshold measured at start-up (``--enable-dbo`` alone; the decision, from the server log,
is ``dbo_measured``); ``--all2all`` adds EP with ``--all2all-backend alltoallv`` (its prompt
steps' tokens moved by all-to-all, compared with the gather); ``--skip-tp`` drops the TP side.

Each side also reports, per rank (``per_rank``, from the server's ``/metrics`` polled every
quarter second during the timed run): the requests it served and when its last one finished
(seconds from the start). An uneven split shows as a rank finishing late: with 1000 requests
and 512 sequences a rank, a rank given more than 512 runs a second wave for the rest.

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
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402
from bench_online_vs_offline import Server  # noqa: E402

TARGET_SPEEDUP = 1.85
TARGET_EP_SPEEDUP = 1.2
TARGET_DBO_SPEEDUP = 1.1
# --case ep: the shape and load of issue 26's EP target (a 256-request decode batch).
EP_DEFAULTS = {"shape": "qwen3-30b-a3b", "num_prompts": 256, "input_len": 128,
               "output_len": 256}
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


_POLL_S = 0.25


def _served_per_rank(base_url: str) -> dict[str, float]:
    """engine label -> requests finished there so far (every finish reason)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("tidal:request_success_total{"):
            engine = re.search(r'engine="([^"]*)"', line)
            if engine is not None:
                key = engine.group(1)
                out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class RankWatch:
    """Polls the server's per-rank finished counts while the timed run goes: how many requests
    each rank served, and when its count last moved (its last request's finish, to
    ``_POLL_S``)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        self._base: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._moved: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._base = _served_per_rank(self.base_url)
        self._last = dict(self._base)
        self._thread = threading.Thread(target=self._poll, name="bench_dp-rank-watch",
                                        daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._sample()

    def _sample(self) -> None:
        try:
            now = _served_per_rank(self.base_url)
        except OSError:
            return  # a slow scrape under load: the next one counts
        t = time.monotonic() - self._t0
        for rank, n in now.items():
            if n != self._last.get(rank):
                self._moved[rank] = t
        self._last = now

    def stop(self) -> dict[str, dict[str, float | None]]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return {rank: {"requests": n - self._base.get(rank, 0.0),
                       "last_finish_s": self._moved.get(rank)}
                for rank, n in sorted(self._last.items())}


def one_side(ns: argparse.Namespace, model_dir: str, dp: int, log: Path,
             extra: tuple[str, ...] = (), name: str = "") -> dict[str, Any]:
    flags = ["--data-parallel-size", str(dp), *extra, *shlex.split(ns.engine_flags)]
    if ns.model is None:
        flags += ["--load-format", "dummy"]
    server = Server(name or f"dp{dp}", model_dir, flags, log)
    try:
        server.start(ns.start_timeout)
        argv = ["--base-url", server.base_url, "--dataset", "random-ids",
                "--num-prompts", str(ns.num_prompts), "--input-len", str(ns.input_len),
                "--output-len", str(ns.output_len), "--max-token-id", str(ns.max_token_id),
                "--seed", "0"]
        watch = RankWatch(server.base_url)
        rep = bench_serve.run_bench(bench_serve.build_parser().parse_args(argv),
                                    on_start=watch.start)
        per_rank = watch.stop()
        if rep["result"].get("failed"):
            print(f"bench_dp: {rep['result']['failed']} requests failed on {server.name}; its "
                  f"log ends:\n{server.log_tail(150)}", file=sys.stderr)
        engines = _engine_pids(server)
        time.sleep(1.0)  # the last requests' going-idle reports
        before = _cpu_seconds(engines)
        time.sleep(ns.idle_s)
        after = _cpu_seconds(engines)
        idle = {engines[p]: (after[p] - before[p]) / ns.idle_s for p in before if p in after}
        return {"dp": dp, "flags": flags, "output_throughput": rep["result"]["output_throughput"],
                "startup_s": server.info.get("startup_s"), "idle_core_fraction": idle,
                "per_rank": per_rank,
                "server": server.info, "bench": rep}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", choices=("dp", "ep"), default="dp",
                   help="dp: DP=N against DP=1; ep: EP=2 over DP=2 against TP=2")
    p.add_argument("--tp-eager", action="store_true",
                   help="--case ep: the TP side without CUDA graphs")
    p.add_argument("--ep-eager", action="store_true",
                   help="--case ep: the EP side(s) without CUDA graphs (decode steps replay "
                        "graphs agreed between the engines otherwise)")
    p.add_argument("--dbo-threshold", default=None,
                   help="--case ep: a third side, EP with --enable-dbo from this many tokens "
                        "per step, or 'measure' (the engines measure it at start-up; target: "
                        ">= 1.1x EP without it)")
    p.add_argument("--all2all", action="store_true",
                   help="--case ep: a side with EP over --all2all-backend alltoallv (its "
                        "prompt steps' tokens moved by all-to-all; the decode graphs gather)")
    p.add_argument("--skip-tp", action="store_true",
                   help="--case ep: no TP side (with --dbo-threshold: DBO on vs off only)")
    p.add_argument("--shape", default=None, help="default: qwen3-0.6b (dp), qwen3-30b-a3b (ep)")
    p.add_argument("--model", default=None, help="a model folder instead of the dummy shape")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for the dummy shape")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=None, help="default: 1000 (dp), 256 (ep)")
    p.add_argument("--input-len", type=int, default=None, help="default: 512 (dp), 128 (ep)")
    p.add_argument("--output-len", type=int, default=None, help="default: 512 (dp), 256 (ep)")
    p.add_argument("--engine-flags", default="", help="more flags for both servers")
    p.add_argument("--idle-s", type=float, default=5.0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--smoke", action="store_true", help="a tiny CPU run of the tool")
    p.add_argument("--output", default=None)
    ns = p.parse_args(argv)
    from bench_common import SHAPES, write_model_dir  # imports torch: not at the top

    defaults = EP_DEFAULTS if ns.case == "ep" else {
        "shape": "qwen3-0.6b", "num_prompts": 1000, "input_len": 512, "output_len": 512}
    for key, value in defaults.items():
        if getattr(ns, key) is None:
            setattr(ns, key, value)
    if ns.case == "ep":
        return _ep_case(ns, SHAPES, write_model_dir)
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
        "per_rank": {"dp1": base["per_rank"], f"dp{ns.dp}": dp["per_rank"]},
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
          f"{(worst_idle or 0.0) * 100:.2f} % of a core; DP={ns.dp} per rank: "
          + ", ".join(f"rank {r} {v['requests']:.0f} requests, last at "
                      f"{v['last_finish_s'] or 0.0:.2f} s" for r, v in dp["per_rank"].items()),
          file=sys.stderr)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.output:
        Path(ns.output).write_text(text + "\n")
    return 0


def _ep_case(ns: argparse.Namespace, shapes: dict[str, Any], write_model_dir: Any) -> int:
    """TP=2 against EP=2 over DP=2, one server after the other."""
    if ns.smoke:
        ns.shape, ns.num_prompts, ns.input_len, ns.output_len = "tiny-moe", 8, 16, 8
        ns.idle_s = min(ns.idle_s, 2.0)
        ns.engine_flags = (ns.engine_flags + " --device cpu --max-model-len 256 "
                           "--kv-cache-memory-bytes 33554432 --cpu-threads 1 "
                           "--api-server-count 1")
    if ns.model is None and not ns.tokenizer:
        raise SystemExit("bench_dp: --tokenizer DIR is needed with a dummy shape (the server "
                         "detokenizes), e.g. tests/data/qwen3")
    tp_flags = ("--tensor-parallel-size", "2", *(("--enforce-eager",) if ns.tp_eager else ()))
    ep_flags = ("--enable-expert-parallel", *(("--enforce-eager",) if ns.ep_eager else ()))
    with tempfile.TemporaryDirectory(prefix="tidal-bench-ep-") as tmp:
        if ns.model is not None:
            model_dir = ns.model
            vocab = json.loads((Path(ns.model) / "config.json").read_text())["vocab_size"]
        else:
            model_dir = write_model_dir(ns.shape, Path(tmp) / ns.shape, ns.tokenizer)
            vocab = shapes[ns.shape]["vocab_size"]
        ns.max_token_id = min(vocab - 1, 10000)
        log = Path(tmp) / "servers.log"
        try:
            tp = None if ns.skip_tp else one_side(ns, model_dir, 1, log, tp_flags, "tp2")
            ep = one_side(ns, model_dir, 2, log, ep_flags, "ep2")
            dbo = None
            if ns.dbo_threshold is not None:
                mark = log.stat().st_size if log.exists() else 0
                given = () if ns.dbo_threshold == "measure" else \
                    ("--dbo-token-threshold", str(int(ns.dbo_threshold)))
                dbo = one_side(ns, model_dir, 2, log, (*ep_flags, "--enable-dbo", *given),
                               "ep2dbo")
                # (Whether any step reached the threshold: the workers log their first one;
                # a measured threshold: what the start-up measured and decided.)
                with log.open("rb") as f:
                    f.seek(mark)
                    text = f.read().decode(errors="replace")
                dbo["dbo_engaged"] = "first step with dual batch overlap" in text
                found = re.search(r"dual batch overlap: (.*)", text)
                dbo["dbo_measured"] = found.group(1).strip() if found else None
            a2a = (one_side(ns, model_dir, 2, log, (*ep_flags, "--all2all-backend",
                                                    "alltoallv"), "ep2a2a")
                   if ns.all2all else None)
        except BaseException:
            print(log.read_text(errors="replace")[-4000:] if log.exists() else "", file=sys.stderr)
            raise
    sides = {"tp2": tp, "ep2_dp2": ep, "ep2_dp2_dbo": dbo, "ep2_dp2_alltoallv": a2a}
    tok_s = {k: v["output_throughput"] for k, v in sides.items() if v is not None}
    for name, side in sides.items():
        if side is None:
            continue
        # (The lone request is bench_serve's warm-up: one engine busy, the other idle.)
        res, lone = side["bench"]["result"], side["bench"].get("ceiling") or {}
        tpot = (res.get("tpot_ms") or {}).get("median")
        print(f"{name}: {side['output_throughput']:,.0f} output tok/s, median TPOT "
              f"{tpot if tpot is None else f'{tpot:.2f}'} ms, a lone request "
              f"{lone.get('lone_tpot_ms', float('nan')):.2f} ms a token, "
              f"{res.get('failed', 0)} failed", file=sys.stderr)
    verdicts = {}
    if tp is not None:
        speedup = ep["output_throughput"] / tp["output_throughput"]
        verdicts["ep_speedup"] = {"target": f">= {TARGET_EP_SPEEDUP}", "value": speedup,
                                  "verdict": "PASS" if speedup >= TARGET_EP_SPEEDUP else "MISS"}
        print(f"TP=2{' (eager)' if ns.tp_eager else ''} {tp['output_throughput']:,.0f} output "
              f"tok/s, EP=2 over DP=2{' (eager)' if ns.ep_eager else ''} "
              f"{ep['output_throughput']:,.0f} output tok/s: "
              f"{speedup:.2f}x", file=sys.stderr)
    if dbo is not None:
        gain = dbo["output_throughput"] / ep["output_throughput"]
        verdicts["dbo_speedup"] = {"target": f">= {TARGET_DBO_SPEEDUP}", "value": gain,
                                   "threshold": ns.dbo_threshold,
                                   "measured": dbo["dbo_measured"],
                                   "engaged": dbo["dbo_engaged"],
                                   "verdict": "PASS" if gain >= TARGET_DBO_SPEEDUP else "MISS"}
        when = (f"measured ({dbo['dbo_measured']})" if ns.dbo_threshold == "measure"
                else f"from {ns.dbo_threshold} tokens")
        print(f"EP=2 with dual batch overlap {when}: "
              f"{dbo['output_throughput']:,.0f} output tok/s, {gain:.2f}x without"
              + ("" if dbo["dbo_engaged"] else " (no step reached the threshold)"),
              file=sys.stderr)
    if a2a is not None:
        ratio = a2a["output_throughput"] / ep["output_throughput"]
        verdicts["alltoallv_over_gather"] = {"value": ratio}
        print(f"EP=2 with --all2all-backend alltoallv: {a2a['output_throughput']:,.0f} output "
              f"tok/s, {ratio:.2f}x the gather", file=sys.stderr)
    result = {
        "case": "ep", "shape": ns.model or ns.shape, "num_prompts": ns.num_prompts,
        "input_len": ns.input_len, "output_len": ns.output_len, "smoke": ns.smoke,
        "tp_eager": ns.tp_eager, "ep_eager": ns.ep_eager, "output_tok_s": tok_s,
        "verdicts": verdicts,
        "sides": [v for v in sides.values() if v is not None],
    }
    text = json.dumps(result, indent=1)
    print(text)
    if ns.output:
        Path(ns.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
