"""Online against offline (docs/BENCHMARKS.md workload 6, issue 17): the same requests through
``LLM.generate`` and through ``tidal serve`` on one machine, plus the serving stack's own ceiling
(``--distributed-executor-backend noop``), with every ratio of issue 17 against its target.

    python tools/bench_online_vs_offline.py --shape qwen3-0.6b --tokenizer .bench_assets/qwen3 \\
        --out online_vs_offline.json --log-dir logs
    python tools/bench_online_vs_offline.py --shape llama-3.1-8b --tokenizer .bench_assets/qwen3 \\
        --phases offline,serve --workloads long
    # a CPU smoke run (tiny model; flag values that start with -- need the = form):
    python tools/bench_online_vs_offline.py --shape tiny --tokenizer DIR --repeats 1 \\
        --requests short=32 long=8 poisson=20 probe=4 noop_req=200 noop_stream=100 \\
        --poisson-rate 5 --api-server-counts 1,2 \\
        --engine-args="--max-model-len 2048 --num-kv-blocks 4096 --cpu-threads 1"

Requests (docs/BENCHMARKS.md workloads 4 and 6): random token-id prompts, exact output lengths,
``ignore_eos``, temperature 0; online they are streamed ``/v1/completions`` with usage, sent by
``bench_serve.run_bench`` (its multi-process client, whose own CPU use is reported per run);
offline the same token ids (``bench_serve.make_workload`` with the same seed) go through
``LLM.generate`` with ``SamplingParams(max_tokens=L, ignore_eos=True, temperature=0)``. Each
repeat of a workload draws fresh prompts (seed + repeat), the same on both sides, so no run hits
the prefix cache another one filled; each run starts with one untimed lone request (prompt 0) on
both sides, as bench_serve does. Medians over ``--repeats`` are compared; raw runs are in the JSON.

Workloads (``--requests NAME=N`` changes a count, e.g. for a CPU smoke run):
  short    1000 x 128/128, all at once: online/offline output tok/s (>= 0.90), and the burst's
           TTFT p99 (<= 1.5 s)
  long     256 x 512/512, all at once: online/offline output tok/s (>= 0.95)
  poisson  400 x 512/256 at 20 req/s (Poisson): TTFT p99 (<= 100 ms), ITL p99 <= 3 x TPOT median
  probe    512/16, one at a time: the first request after /health is 200 against the median of
           8 fresh ones after the other phases (<= 2x; fresh ids, so no prefix-cache hit)
  noop_req     2000 x 128/16 against a noop server: req/s (>= 4,000)
  noop_stream  1000 x 128/128 against a noop server: streamed output tok/s (>= 250,000)

Phases (``--phases``, run in this order whatever the order given; each under its own time limit,
``--time-limit PHASE=SECONDS``, so one slow phase cannot eat the run):
  offline  LLM.generate on short and long (``--workloads``), in a child process that exits
           before any server starts (it frees the GPU)
  first, serve, poisson   one model server for all three: the first probe right after ready,
           then short and long, then poisson, then the steady-state probes
  noop     a noop server with the default API server count: noop_req and noop_stream
  scaling  a noop server per ``--api-server-counts`` K (passes ``--api-server-count K``):
           noop_req and noop_stream, ``--scaling-repeats`` runs each
Servers are ``python -m tidal.frontend.cli serve MODEL --load-format dummy --port P [...]`` in
their own process group, polled on ``/health``; each is stopped with SIGTERM and waited for, and
whatever of its process group is left is killed (and reported). ``--engine-args`` go to the
offline engine and to every server (the same EngineArgs on both sides; the fused-op choice is
the engine's default on both, so on a fresh GPU machine the offline start builds the CUDA
extension once and the server finds it cached, as it finds the kernels the offline run
compiled); noop servers add ``--noop-engine-args``. For every run the JSON has, over its timed
part, the server's CPU seconds per process (roles from its log: engine_core, api_server_k), the
client's, the whole host's busy cores, and ``other_cpu_s``: what neither used (someone else's
load on a shared machine).

Time on one H100, Qwen3-0.6B shape, repeats 3 (estimates: server start-up with dummy weights
and CUDA graph capture 30-60 s, a noop server 5-10 s; each run adds ~1-2 s of warm-up request and
client start): offline 60-90 s (plus a first CUDA-extension build on a fresh machine); first +
serve + poisson 110-160 s (one start, 3 x short at 3-9 s, 3 x long at 4-7 s, 20 s of Poisson,
probes); noop 30-60 s; scaling 15-30 s per count. Llama-3.1-8B shape, long only: offline and
serve ~2 min each (a run ~15-20 s).

Prints progress and a table of every ratio with its target and pass/fail on stderr, and one JSON
object on stdout (and ``--out``): the device, the host's CPUs, both sides' raw numbers, the
ratios. Exit code 0 when every phase ran (targets missed or not), 1 when one failed or the
run was interrupted (SIGTERM or Ctrl-C: the servers are stopped, what finished is reported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402

# This module is the __main__ of bench_serve's spawned client processes too, so its top level
# stays light: torch and tidal are imported where the offline child needs them.

PHASES = ("offline", "first", "serve", "poisson", "noop", "scaling")
MODEL_SERVER_PHASES = ("first", "serve", "poisson")


@dataclass(frozen=True, slots=True)
class Spec:
    """A workload: ``num_prompts`` prompts of ``input_len`` random token ids, each generating
    exactly ``output_len`` tokens, sent at ``rate`` req/s (inf: all at once)."""

    num_prompts: int
    input_len: int
    output_len: int
    rate: float = math.inf
    seed: int = 0  # base seed; a repeat adds its index


SPECS: dict[str, Spec] = {
    "short": Spec(1000, 128, 128, seed=1000),
    "long": Spec(256, 512, 512, seed=2000),
    "poisson": Spec(400, 512, 256, rate=20.0, seed=3000),
    "probe": Spec(9, 512, 16, seed=4000),
    "noop_req": Spec(2000, 128, 16, seed=5000),
    "noop_stream": Spec(1000, 128, 128, seed=6000),
}

DEFAULT_LIMITS = {"offline": 420.0, "first": 60.0, "serve": 300.0, "poisson": 120.0,
                  "noop": 180.0, "scaling": 360.0}


class PhaseTimeout(Exception):
    pass


@dataclass(slots=True)
class Deadline:
    """A phase's time limit."""

    phase: str
    limit: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        left = self.limit - (time.monotonic() - self.start)
        if left <= 0:
            raise PhaseTimeout(f"phase {self.phase} outlasted its limit of {self.limit:.0f} s")
        return left


# ---------------------------------------------------------------------------------------------
# requests: the same on both sides


def serve_args(spec: Spec, repeat: int, max_token_id: int, base_url: str = "",
               client_procs: str = "auto", time_limit: float | None = None) -> argparse.Namespace:
    """bench_serve's arguments for one run of ``spec``; ``make_workload`` of them gives the
    prompts both sides use."""
    argv = ["--dataset", "random-ids", "--num-prompts", str(spec.num_prompts),
            "--input-len", str(spec.input_len), "--output-len", str(spec.output_len),
            "--request-rate", str(spec.rate), "--seed", str(spec.seed + repeat),
            "--max-token-id", str(max_token_id), "--client-procs", client_procs]
    if base_url:
        argv += ["--base-url", base_url]
    if time_limit is not None:
        argv += ["--time-limit", f"{time_limit:.1f}"]
    return bench_serve.build_parser().parse_args(argv)


# ---------------------------------------------------------------------------------------------
# offline side (a child process: it holds the GPU until it exits)


def offline_child(spec_path: str) -> None:
    """Run the offline workloads of the JSON spec at ``spec_path``; write the results to its
    ``out`` after every run (a timed-out child still leaves the runs it finished)."""
    import dataclasses

    import torch

    from bench_common import device_name
    from tidal.engine_core.cli import add_engine_args, engine_args_from
    from tidal.frontend import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    engine_args = engine_args_from(parser.parse_args([*spec["engine_argv"],
                                                      "--model", spec["model"]]))
    out: dict[str, Any] = {"device": device_name(), "torch": torch.__version__, "runs": []}
    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(engine_args))
    out["startup_s"] = time.perf_counter() - t0
    out["kv_blocks"] = llm.config.cache.num_blocks
    out["max_num_seqs"] = llm.config.scheduler.max_num_seqs
    Path(spec["out"]).write_text(json.dumps(out))
    for run in spec["runs"]:
        w = bench_serve.make_workload(serve_args(Spec(**run["spec"]), run["repeat"],
                                                 spec["max_token_id"]))
        lone = SamplingParams(max_tokens=w.out_lens[0], ignore_eos=True, temperature=0)
        llm.generate([w.prompts[0]], lone, use_tqdm=False)
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
                  for n in w.out_lens]
        t = time.perf_counter()
        outs = llm.generate(w.prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        n_in = sum(len(p) for p in w.prompts)
        out["runs"].append({"workload": run["name"], "repeat": run["repeat"],
                            "requests": len(outs), "input_tokens": n_in, "output_tokens": n_out,
                            "seconds": dt, "output_throughput": n_out / dt,
                            "total_token_throughput": (n_in + n_out) / dt})
        print(f"offline {run['name']} r{run['repeat']}: {len(outs)} requests, "
              f"{n_out / dt:,.0f} output tok/s ({dt:.2f} s)", file=sys.stderr, flush=True)
        Path(spec["out"]).write_text(json.dumps(out))
    llm.shutdown()


def run_offline(ctx: Context, dl: Deadline, res: dict[str, Any]) -> None:
    runs = [{"name": name, "repeat": r, "spec": _spec_dict(ctx.specs[name])}
            for name in ctx.workloads for r in range(ctx.repeats)]
    spec_path = ctx.tmp / "offline_spec.json"
    out_path = ctx.tmp / "offline_out.json"
    spec_path.write_text(json.dumps({
        "model": ctx.model_dir, "engine_argv": ctx.engine_argv, "runs": runs,
        "max_token_id": ctx.max_token_id, "out": str(out_path)}))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-child", str(spec_path)]
    log = ctx.log_dir / "offline.log"
    res["log"] = str(log)
    _print(f"[offline] {len(runs)} runs in a child process (log {log})")
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(timeout=dl.left())
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _end_group(proc, grace=5.0)
        if out_path.exists():
            res.update(json.loads(out_path.read_text()))
    if rc is None:
        raise PhaseTimeout(f"phase offline outlasted its limit of {dl.limit:.0f} s")
    if rc != 0:
        raise RuntimeError(f"the offline child exited with {rc}:\n{_tail(log)}")


def _spec_dict(spec: Spec) -> dict[str, Any]:
    return {"num_prompts": spec.num_prompts, "input_len": spec.input_len,
            "output_len": spec.output_len, "rate": spec.rate, "seed": spec.seed}


# ---------------------------------------------------------------------------------------------
# servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _group_members(pgid: int) -> dict[int, tuple[str, float]]:
    """pid -> (command name, CPU seconds) of the live (not zombie) processes of a process
    group, from /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            found[int(entry)] = (comm, (int(fields[11]) + int(fields[12])) / _CLK_TCK)
    return found


def _host_busy_seconds() -> float:
    """CPU seconds the whole host has been busy (all cores: /proc/stat's user, nice, system,
    irq, softirq and steal; guest time is inside user)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _CLK_TCK


def _end_group(proc: subprocess.Popen[bytes], grace: float) -> list[int]:
    """Make sure nothing of ``proc``'s process group is left: SIGTERM the leader if it still
    runs, wait ``grace`` s, then SIGKILL the group. Returns the pids that had to be killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + grace
    while _group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = sorted(_group_members(proc.pid))
    if left:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)
    return left


class Server:
    """One ``tidal serve`` in its own process group, its output appended to ``log``."""

    def __init__(self, name: str, model_dir: str, flags: list[str], log: Path) -> None:
        self.name = name
        self.port = _free_port()
        self.cmd = [sys.executable, "-m", "tidal.frontend.cli", "serve", model_dir,
                    "--port", str(self.port), *flags]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_start = 0
        self.info: dict[str, Any] = {"name": name, "cmd": shlex.join(self.cmd[1:])}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float) -> None:
        """Start it and wait for ``/health`` 200 (``PhaseTimeout`` after ``timeout`` s)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log, "ab") as f:
            f.write(f"\n===== {self.name}: {shlex.join(self.cmd)}\n".encode())
            f.flush()
            self.log_start = f.tell()
            t0 = time.monotonic()
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        _print(f"[{self.name}] starting: {shlex.join(self.cmd[3:])}")
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during "
                                   f"start-up:\n{self.log_tail()}")
            if self._health() == 200:
                break
            if time.monotonic() - t0 > timeout:
                raise PhaseTimeout(f"{self.name} not healthy after {timeout:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)
        self.info["startup_s"] = time.monotonic() - t0
        _print(f"[{self.name}] ready in {self.info['startup_s']:.1f} s")

    def _health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def own_log(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.own_log().splitlines()[-n:])

    def roles(self) -> dict[int, str]:
        """Process roles named by the server's log (``EngineCore[pid]``, ``APIServer-k[pid]``,
        ``frontend k connected (pid p``)."""
        text = self.own_log()
        roles = {int(p): "engine_core" for p in re.findall(r"EngineCore\[(\d+)\]", text)}
        for p in re.findall(r"frontend \d+ connected \(pid (\d+)", text):
            roles[int(p)] = "api_server"
        for k, p in re.findall(r"APIServer-(\d+)\[(\d+)\]", text):
            roles[int(p)] = f"api_server_{k}"
        if self.proc is not None:
            roles[self.proc.pid] = roles.get(self.proc.pid, "serve") + " (leader)"
        return roles

    def cpu(self) -> dict[int, tuple[str, float]]:
        assert self.proc is not None
        return _group_members(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM, wait for the drain and exit; kill what is left of the group."""
        if self.proc is None:
            return
        t0 = time.monotonic()
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(60.0)
            except subprocess.TimeoutExpired:
                rc = None
        left = _end_group(self.proc, grace=5.0)
        self.info.update(exit_code=rc, stop_s=time.monotonic() - t0, leftover_pids=left)
        status = "" if rc == 0 and not left else f" (exit {rc}, killed leftovers {left})"
        _print(f"[{self.name}] stopped in {self.info['stop_s']:.1f} s{status}")
        self.proc = None


@contextlib.contextmanager
def running(server: Server, timeout: float) -> Iterator[Server]:
    try:
        server.start(timeout)
        yield server
    finally:
        server.stop()


def bench_run(ctx: Context, server: Server, phase: str, name: str, repeat: int,
              dl: Deadline) -> dict[str, Any]:
    """One bench_serve run of workload ``name`` against ``server``, with the CPU use over the
    timed part (from /proc, in clock ticks): the server's per process, and the whole host's
    (``host_busy_cores``; what neither the server nor the client used is ``other_cpu_s``: on a
    shared machine, someone else's load)."""
    args = serve_args(ctx.specs[name], repeat, ctx.max_token_id, server.base_url,
                      ctx.client_procs, dl.left())
    marks: list[tuple[float, float, dict[int, tuple[str, float]]]] = []

    def mark() -> None:
        marks.append((time.monotonic(), _host_busy_seconds(), server.cpu()))

    try:
        rep = bench_serve.run_bench(args, on_start=mark, on_end=mark)
    except TimeoutError as exc:
        raise PhaseTimeout(str(exc)) from None
    (t0, host0, before), (t1, host1, after) = marks
    wall = t1 - t0
    roles = server.roles()
    procs: list[dict[str, Any]] = []
    for pid, (comm, cpu) in after.items():
        used = cpu - before.get(pid, ("", 0.0))[1]
        procs.append({"pid": pid, "role": roles.get(pid, "child"), "comm": comm,
                      "cpu_s": round(used, 2), "busy": round(used / wall, 3)})
    procs.sort(key=lambda p: -p["cpu_s"])
    server_s = sum(p["cpu_s"] for p in procs)
    server_cpu = {"interval_s": round(wall, 2), "cpu_s": round(server_s, 2),
                  "per_process": procs, "host_busy_cores": round((host1 - host0) / wall, 2),
                  "other_cpu_s": round(host1 - host0 - server_s - rep["client"]["cpu_s"], 2)}
    # The run's own figures; the workload, server and host are in the top-level JSON.
    rep = {"name": name, "repeat": repeat, "seed": args.seed, "result": rep["result"],
           "ceiling": rep["ceiling"], "client": rep["client"], "server_cpu": server_cpu}
    r, c = rep["result"], rep["client"]
    _print(f"[{phase}] {name} r{repeat}: {r['completed']}/{ctx.specs[name].num_prompts} ok, "
           f"{r['request_throughput']:,.1f} req/s, {r['output_throughput']:,.0f} out tok/s, "
           f"TTFT p99 {r['ttft_ms']['p99']:,.1f} ms; client {c['procs']} procs, busiest "
           f"{c['max_proc_busy']:.2f}; server CPU {server_s:.1f} s in {wall:.1f} s, host "
           f"{server_cpu['host_busy_cores']:.1f} cores busy")
    return rep


def probe_ttft(server: Server, args: argparse.Namespace, prompt: str | list[int],
               max_tokens: int) -> float:
    """TTFT (ms) of one streamed request, alone, on a fresh connection."""

    res = bench_serve.run_loop(bench_serve.one_request(bench_serve.Endpoint.of(args), args,
                                                       prompt, max_tokens))
    if not res.ok or res.ttft is None:
        raise RuntimeError(f"probe request failed on {server.name}: {res.error}")
    return res.ttft * 1000.0


# ---------------------------------------------------------------------------------------------
# phases


@dataclass(slots=True)
class Context:
    shape: str
    model_dir: str
    tmp: Path
    log_dir: Path
    engine_argv: list[str]
    noop_argv: list[str]
    specs: dict[str, Spec]
    workloads: list[str]
    repeats: int
    client_procs: str
    max_token_id: int
    limits: dict[str, float]
    server_start_timeout: float
    api_server_counts: list[int]
    scaling_repeats: int


def run_model_server(ctx: Context, phases: list[str], out: dict[str, Any]) -> None:
    """first, serve and poisson on one model server, each into ``out[phase]``."""
    server = Server("model-server", ctx.model_dir, ctx.engine_argv, ctx.log_dir / "servers.log")
    probe = ctx.specs["probe"]
    probe_args = serve_args(probe, 0, ctx.max_token_id, "", ctx.client_procs)
    probe_args.timeout = ctx.limits["first"]
    probe_args.model = Path(ctx.model_dir).name  # the served name: no /v1/models call first
    probe_prompts = bench_serve.make_workload(probe_args).prompts
    for phase in phases:
        out[phase] = {"server": server.info}

    def serve(dl: Deadline, res: dict[str, Any]) -> None:
        for name in ctx.workloads:
            res[name] = []
            for r in range(ctx.repeats):
                res[name].append(bench_run(ctx, server, "serve", name, r, dl))

    def poisson(dl: Deadline, res: dict[str, Any]) -> None:
        res.update(bench_run(ctx, server, "poisson", "poisson", 0, dl))

    def steady(dl: Deadline, res: dict[str, Any]) -> None:
        ttfts = res["steady_ttft_ms"] = []
        for prompt in probe_prompts[1:]:
            dl.left()
            ttfts.append(probe_ttft(server, probe_args, prompt, probe.output_len))
        res["steady_ttft_median_ms"] = statistics.median(ttfts)
        res["ratio"] = res["first_ttft_ms"] / res["steady_ttft_median_ms"]
        _print(f"[first] steady state: TTFT median {res['steady_ttft_median_ms']:.1f} ms of "
               f"{len(ttfts)}; first / steady {res['ratio']:.2f}")

    try:
        with running(server, ctx.server_start_timeout):
            probe_args.base_url = server.base_url
            if "first" in phases:
                try:
                    ttft = probe_ttft(server, probe_args, probe_prompts[0], probe.output_len)
                    out["first"]["first_ttft_ms"] = ttft
                    _print(f"[first] the first request after ready: TTFT {ttft:.1f} ms")
                except RuntimeError as exc:
                    out["first"]["error"] = str(exc)
                    _print(f"[first] {exc}")
            if "serve" in phases:
                _phase(ctx, "serve", serve, out["serve"])
            if "poisson" in phases:
                _phase(ctx, "poisson", poisson, out["poisson"])
            if "first_ttft_ms" in out.get("first", {}):
                _phase(ctx, "first", steady, out["first"])
    except (PhaseTimeout, RuntimeError) as exc:  # the start-up
        _print(f"[model-server] {exc}")
        for phase in phases:
            out[phase].setdefault("error", str(exc))


def run_noop(ctx: Context, phase: str, count: int | None, repeats: int, dl: Deadline,
             res: dict[str, Any]) -> None:
    """noop_req and noop_stream on a noop server (``--api-server-count count`` if given)."""
    flags = [*ctx.engine_argv, *ctx.noop_argv, "--distributed-executor-backend", "noop"]
    if count is not None:
        flags += ["--api-server-count", str(count)]
    server = Server("noop-server" + ("" if count is None else f"-k{count}"), ctx.model_dir,
                    flags, ctx.log_dir / "servers.log")
    res["api_server_count"] = "default" if count is None else count
    res["server"] = server.info
    with running(server, min(ctx.server_start_timeout, dl.left())):
        for name in ("noop_req", "noop_stream"):
            res[name] = []
            for r in range(repeats):
                res[name].append(bench_run(ctx, server, phase, name, r, dl))
        res["api_servers_seen"] = sum(role.startswith("api_server")
                                      for role in server.roles().values())


def run_scaling(ctx: Context, dl: Deadline, res: dict[str, Any]) -> None:
    counts = res["counts"] = {}
    for k in ctx.api_server_counts:
        counts[k] = {}
        try:
            run_noop(ctx, "scaling", k, ctx.scaling_repeats, dl, counts[k])
        except RuntimeError as exc:  # this count failed; the next may not
            counts[k]["error"] = str(exc)
            _print(f"[scaling] K={k}: {exc}")


def _phase(ctx: Context, phase: str, fn: Callable[[Deadline, dict[str, Any]], None],
           res: dict[str, Any]) -> dict[str, Any]:
    """``fn(deadline, res)`` fills ``res``; what it finished stays when it fails or outlasts
    the phase's limit (then ``res["error"]`` says why)."""
    dl = Deadline(phase, ctx.limits[phase])
    try:
        fn(dl, res)
    except (PhaseTimeout, RuntimeError, SystemExit) as exc:
        if isinstance(exc, SystemExit) and not isinstance(exc.code, str):
            raise  # a signal (see _on_sigterm), not a failed warm-up request
        _print(f"[{phase}] failed: {exc}")
        res["error"] = str(exc)
    res["wall_s"] = round(time.monotonic() - dl.start, 1)
    return res


# ---------------------------------------------------------------------------------------------
# ratios and the table


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _serve_metric(runs: list[dict[str, Any]] | None, get: Callable[[dict], float]) -> \
        tuple[float | None, list[float]]:
    values = [get(r["result"]) for r in runs or [] if r["result"]["completed"]]
    return _median(values), values


def ratios(shape: str, specs: dict[str, Spec], phases: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ratio of issue 17 that the phases run can give, with its target."""

    def desc(name: str) -> str:
        s = specs[name]
        rate = "" if math.isinf(s.rate) else f" @ {s.rate:g}/s"
        return f"{s.num_prompts} x {s.input_len}/{s.output_len}{rate}"

    rows: list[dict[str, Any]] = []

    def row(name: str, value: float | None, op: str | None, target: float | None,
            detail: str = "", values: list[float] | None = None) -> None:
        ok = None
        if value is not None and target is not None:
            ok = value >= target if op == ">=" else value <= target
        rows.append({"name": name, "value": value, "op": op, "target": target, "pass": ok,
                     "detail": detail, "values": values or []})

    offline = phases.get("offline", {})
    serve = phases.get("serve", {})
    for wname, target in (("short", None if shape == "llama-3.1-8b" else 0.90), ("long", 0.95)):
        off = [r["output_throughput"] for r in offline.get("runs", [])
               if r["workload"] == wname]
        on_med, on = _serve_metric(serve.get(wname), lambda r: r["output_throughput"])
        off_med = _median(off)
        if off_med is None and on_med is None:
            continue
        value = on_med / off_med if on_med and off_med else None
        row(f"online/offline out tok/s, {desc(wname)}",
            value, ">=", target, f"online {_fmt(on_med)} / offline {_fmt(off_med)} tok/s "
            f"(medians of {len(on)} / {len(off)})", on)
    if serve.get("short"):
        p99, vals = _serve_metric(serve["short"], lambda r: r["ttft_ms"]["p99"])
        row(f"burst {desc('short')}: TTFT p99 (ms)", p99, "<=", 1500.0,
            f"runs {', '.join(_fmt(v) for v in vals)}", vals)
    noop = phases.get("noop", {})
    if noop.get("noop_req") or noop.get("noop_stream"):
        count = noop.get("api_servers_seen") or noop.get("api_server_count")
        rps, vals = _serve_metric(noop.get("noop_req"), lambda r: r["request_throughput"])
        row(f"noop ceiling req/s, {desc('noop_req')} ({count} API server(s))", rps, ">=", 4000.0,
            f"runs {', '.join(_fmt(v) for v in vals)}", vals)
        tps, vals = _serve_metric(noop.get("noop_stream"), lambda r: r["output_throughput"])
        row(f"noop ceiling streamed tok/s, {desc('noop_stream')} ({count} API server(s))", tps,
            ">=", 250000.0, f"runs {', '.join(_fmt(v) for v in vals)}", vals)
    base: tuple[int, float, float] | None = None
    for k, res in phases.get("scaling", {}).get("counts", {}).items():
        rps, _ = _serve_metric(res.get("noop_req"), lambda r: r["request_throughput"])
        tps, _ = _serve_metric(res.get("noop_stream"), lambda r: r["output_throughput"])
        if rps is None or tps is None:
            continue
        base = base or (k, rps, tps)
        row(f"scaling, {k} API server(s): noop req/s (streamed tok/s in detail)", rps, None,
            None, f"{_fmt(tps)} tok/s; x{rps / base[1]:.2f} req/s, x{tps / base[2]:.2f} tok/s "
            f"of {base[0]}")
    poisson = phases.get("poisson", {})
    if "result" in poisson:
        r = poisson["result"]
        row(f"poisson {desc('poisson')}: TTFT p99 (ms)", r["ttft_ms"]["p99"], "<=", 100.0,
            f"median {_fmt(r['ttft_ms']['median'])} ms")
        itl, tpot = r["itl_ms"]["p99"], r["tpot_ms"]["median"]
        row("poisson: ITL p99 / TPOT median", itl / tpot if itl is not None and tpot else None,
            "<=", 3.0, f"ITL p99 {_fmt(itl)} ms, TPOT median {_fmt(tpot)} ms")
    first = phases.get("first", {})
    if "ratio" in first:
        row("first request after ready: TTFT / steady TTFT", first["ratio"], "<=", 2.0,
            f"{_fmt(first['first_ttft_ms'])} ms vs median {_fmt(first['steady_ttft_median_ms'])}"
            " ms")
    return rows


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def run_summary(phases: dict[str, Any]) -> dict[str, Any]:
    """Over every run: the load client's busiest process and largest share of the host, the
    runs with a saturated client process (their numbers may be the client's), and the most CPU
    that neither the server nor the client used (someone else's load on a shared machine)."""
    busiest: tuple[float, str] = (0.0, "")
    other: tuple[float, str] = (0.0, "")
    host = 0.0
    saturated = []
    for phase, res in phases.items():
        for run in _runs(res):
            c, label = run["client"], f"{phase} {run['name']} r{run['repeat']}"
            busiest = max(busiest, (c["max_proc_busy"], f"{label} ({c['procs']} procs)"))
            other = max(other, (run["server_cpu"]["other_cpu_s"], label))
            host = max(host, c["cpu_fraction_of_host"])
            if c["max_proc_busy"] > 0.9:
                saturated.append(f"{label}: busiest client process {c['max_proc_busy']:.2f} of "
                                 f"a core ({c['procs']} procs)")
    return {"client_max_proc_busy": busiest[0], "client_max_proc_busy_run": busiest[1],
            "client_max_fraction_of_host": host, "client_saturated_runs": saturated,
            "max_other_cpu_s": other[0], "max_other_cpu_run": other[1]}


def _runs(res: Any) -> Iterator[dict[str, Any]]:
    if isinstance(res, dict):
        if "client" in res and "result" in res:
            yield res
        else:
            for v in res.values():
                yield from _runs(v)
    elif isinstance(res, list):
        for v in res:
            yield from _runs(v)


def print_table(result: dict[str, Any]) -> None:
    lines = [f"{'=' * 30} online vs offline {'=' * 30}",
             f"{result['shape']} on {result['device']}; host {result['host']['cpus']} CPUs "
             f"({result['host']['cpu_model']})",
             f"{'ratio':<62}{'value':>10}  {'target':<12}{'':<6} detail"]
    for r in result["ratios"]:
        target = "" if r["target"] is None else f"{r['op']} {_fmt(r['target'])}"
        verdict = {True: "PASS", False: "FAIL", None: ""}[r["pass"]]
        lines.append(f"{r['name']:<62}{_fmt(r['value']):>10}  {target:<12}{verdict:<6} "
                     f"{r['detail']}")
    for phase, res in result["phases"].items():
        if isinstance(res, dict) and res.get("error"):
            lines.append(f"phase {phase} failed: {res['error'].splitlines()[0]}")
    s = result["runs"]
    lines.append(f"load client: busiest process {s['client_max_proc_busy']:.2f} of a core "
                 f"({s['client_max_proc_busy_run'] or '-'}); at most "
                 f"{s['client_max_fraction_of_host']:.2f} of the host's CPU")
    lines.append(f"other load on the host: at most {s['max_other_cpu_s']:.2f} CPU-s in a run "
                 f"({s['max_other_cpu_run'] or '-'})")
    for w in s["client_saturated_runs"]:
        lines.append(f"warning: the client may have set the pace: {w}")
    _print("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# main


def _print(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def _device() -> str:
    if shutil.which("nvidia-smi"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30).stdout.split("\n")
            if names[0].strip():
                return names[0].strip()
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _parse_kv(items: list[str], what: str, cast: Callable[[str], Any]) -> dict[str, Any]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"bench_online_vs_offline: {what} takes NAME=VALUE, got {item!r}")
        out[key] = cast(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    cpus = os.cpu_count() or 1
    counts = ",".join(str(1 << i) for i in range(max(1, cpus // 2).bit_length()))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="qwen3-0.6b",
                   help="a bench_common.SHAPES entry: qwen3-0.6b, llama-3.1-8b, tiny")
    p.add_argument("--tokenizer", default=None,
                   help="folder with the tokenizer files (tokenizer.json, possibly .gz); needed")
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--workloads", default="short,long",
                   help="what offline and serve compare: short, long")
    p.add_argument("--requests", nargs="*", default=[], metavar="NAME=N",
                   help=f"request counts by workload ({', '.join(SPECS)})")
    p.add_argument("--poisson-rate", type=float, default=SPECS["poisson"].rate)
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each offline, serve and noop workload (fresh prompts each)")
    p.add_argument("--scaling-repeats", type=int, default=1)
    p.add_argument("--api-server-counts", default=counts,
                   help="K values for the scaling phase (default: powers of two up to half the "
                        "cores)")
    p.add_argument("--engine-args", default="--max-model-len 4096",
                   help="engine flags for the offline engine and every server (give them as "
                        "--engine-args='...')")
    p.add_argument("--noop-engine-args", default="--num-kv-blocks 65536",
                   help="flags noop servers add (noop allocates no KV cache)")
    p.add_argument("--client-procs", default="auto", help="bench_serve --client-procs")
    p.add_argument("--time-limit", nargs="*", default=[], metavar="PHASE=S",
                   help=f"per-phase limits in seconds; defaults {DEFAULT_LIMITS}")
    p.add_argument("--server-start-timeout", type=float, default=300.0)
    p.add_argument("--log-dir", default=None,
                   help="where servers.log and offline.log go (default: a temporary folder)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)
    return p


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through the servers' finally blocks


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.offline_child:
        offline_child(ns.offline_child)
        return 0
    from bench_common import SHAPES, write_model_dir  # imports torch: not at the top

    phases = [p for p in PHASES if p in ns.phases.split(",")]
    unknown = set(ns.phases.split(",")) - set(PHASES)
    workloads = [w for w in ns.workloads.split(",") if w]
    if unknown or not set(workloads) <= {"short", "long"} or ns.shape not in SHAPES:
        raise SystemExit(f"bench_online_vs_offline: unknown phase(s) {sorted(unknown)}, "
                         f"workloads {workloads} or shape {ns.shape!r}")
    if not ns.tokenizer:
        raise SystemExit("bench_online_vs_offline: --tokenizer DIR is needed (the server "
                         "detokenizes)")
    counts = _parse_kv(ns.requests, "--requests", int)
    specs = {name: Spec(counts.get(name, s.num_prompts), s.input_len, s.output_len,
                        ns.poisson_rate if name == "poisson" else s.rate, s.seed)
             for name, s in SPECS.items()}
    signal.signal(signal.SIGTERM, _on_sigterm)
    vocab = SHAPES[ns.shape]["vocab_size"]
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="tidal-ovo-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {}
    interrupted = None
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="tidal-ovo-") as tmp_name:
        tmp = Path(tmp_name)
        ctx = Context(
            shape=ns.shape, model_dir=write_model_dir(ns.shape, tmp / ns.shape, ns.tokenizer),
            tmp=tmp, log_dir=log_dir,
            engine_argv=[*shlex.split(ns.engine_args), "--load-format", "dummy"],
            noop_argv=shlex.split(ns.noop_engine_args), specs=specs, workloads=workloads,
            repeats=ns.repeats, client_procs=ns.client_procs,
            max_token_id=min(10000, vocab - 1),
            limits={**DEFAULT_LIMITS, **_parse_kv(ns.time_limit, "--time-limit", float)},
            server_start_timeout=ns.server_start_timeout,
            api_server_counts=[int(k) for k in ns.api_server_counts.split(",") if k],
            scaling_repeats=ns.scaling_repeats)
        try:
            if "offline" in phases:
                out["offline"] = _phase(ctx, "offline",
                                        lambda dl, res: run_offline(ctx, dl, res), {})
            model_phases = [p for p in phases if p in MODEL_SERVER_PHASES]
            if model_phases:
                run_model_server(ctx, model_phases, out)
            if "noop" in phases:
                out["noop"] = _phase(ctx, "noop", lambda dl, res: run_noop(
                    ctx, "noop", None, ctx.repeats, dl, res), {})
            if "scaling" in phases:
                out["scaling"] = _phase(ctx, "scaling",
                                        lambda dl, res: run_scaling(ctx, dl, res), {})
        except (KeyboardInterrupt, SystemExit) as exc:  # servers are stopped by now
            interrupted = f"interrupted ({type(exc).__name__} {getattr(exc, 'code', '')})"
            _print(f"bench_online_vs_offline: {interrupted}; reporting what finished")
    result = {
        "benchmark": "online_vs_offline", "shape": ns.shape,
        "device": out.get("offline", {}).get("device") or _device(),
        "host": {"node": platform.node(), "cpus": os.cpu_count(), "cpu_model": _cpu_model(),
                 "load_avg_at_end": os.getloadavg()},
        "engine_args": ctx.engine_argv, "noop_engine_args": ctx.noop_argv,
        "repeats": ns.repeats, "client_procs": ns.client_procs,
        "workloads": {k: {**_spec_dict(v), "rate": "inf" if math.isinf(v.rate) else v.rate}
                      for k, v in specs.items()},
        "wall_s": round(time.monotonic() - t0, 1), "log_dir": str(log_dir),
        "interrupted": interrupted,
        "ratios": ratios(ns.shape, specs, out), "runs": run_summary(out),
        "phases": out,
    }
    print_table(result)
    text = json.dumps(result, indent=1)
    print(text)
    if ns.out:
        Path(ns.out).write_text(text + "\n")
    failed = [p for p, r in out.items() if isinstance(r, dict) and r.get("error")]
    return 1 if failed or interrupted else 0

if __name__ == "__main__":
    sys.exit(main())
