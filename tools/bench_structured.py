"""Structured-output cost: batch-N decode with every request under a JSON schema vs the same
batch unconstrained, the mask fill time per sequence per step, and the time to first mask over
the schema corpus (tools/schema_corpus.py).

    python tools/bench_structured.py --shape qwen3-0.6b --batch 256 --tokens 256     # a GPU
    python tools/bench_structured.py --layers 2 --batch 32 --tokens 64 --corpus 200  # a CPU
    python tools/bench_structured.py --backend xgrammar ...       # auto | guidance | xgrammar
    python tools/bench_structured.py --engine-process ...  # the EngineCore in its own process
    python tools/bench_structured.py --compare-fill-early ...  # fills begun early against late

Dummy weights on a shape from bench_common, with the real Qwen3 tokenizer (tests/data/qwen3,
152k-entry vocabulary) so masks have a realistic size. The constrained workload's schema is an
array of at least ``--tokens`` small integers: it cannot close before ``max_tokens``, so both
runs decode the same number of steps. Reported: output tokens/s of each (totals over
``--repeats`` alternating runs), their ratio, the added time per step, the mask fill time per
sequence per step (each fill's time over its sequences: p50/p99), and the time to first
mask over the corpus: distinct schemas, cold cache, arriving ``--corpus-burst`` at a time;
from a request's arrival at the engine to its grammar compiled and its first mask computed
(llguidance's definition, queueing behind the rest of the burst included). Also reported:
the later parts (to admission: taken by the engine loop, free to sample; to the mask filled
for its step; to the mask read by the sampler, after the whole burst's prefill), the compile
times, and the time to first token of the same bursts with and without their schemas (what
the grammars add to it). ``--backend`` is the engine's
``--structured-outputs-backend``; with xgrammar, the corpus schemas it would not enforce in
full (a pattern next to a length bound) are left out of the time to first mask and counted as
``refused``. ``--engine-process`` runs the EngineCore
in its own process, as ``tidal serve`` does, while this one processes the outputs (the default
does both on one thread, as ``LLM`` does): throughputs and the CPU time of each thread.
Every run reports each thread's CPU time per step (``thread_cpu_ms_per_step``, this process
and the EngineCore's), which tells the thread that bounds the step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_name, dump, write_model_dir  # noqa: E402
from schema_corpus import corpus  # noqa: E402

from tidal.engine_core.sampling_params import StructuredOutputsParams  # noqa: E402
from tidal.engine_core.structured_output.spec import xgrammar_refusal  # noqa: E402
from tidal.frontend import LLM, SamplingParams  # noqa: E402

TOKENIZER = Path(__file__).resolve().parents[1] / "tests" / "data" / "qwen3"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def us(x: float) -> float:
    return round(x * 1e6, 1)


class ThreadCpu:
    """CPU time of every thread of this process and its descendants (the EngineCore's, with
    ``--engine-process``), from /proc: the milliseconds each thread spent on a CPU per engine
    step of a timed run, by process, thread id and name (a process's main thread, which runs
    its engine loop or the ``LLM`` loop, is marked). A thread near the step time is the
    bottleneck; the rest say what runs beside it. Linux only (elsewhere: empty)."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.before: dict[tuple[int, int], tuple[str, float]] = {}

    @staticmethod
    def _children(pid: int) -> list[int]:
        found: list[int] = []
        with contextlib.suppress(OSError):  # (gone, or no /proc: no children found)
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    found += [int(c) for c in f.read().split()]
        return found

    def _sample(self) -> dict[tuple[int, int], tuple[str, float]]:
        pids, seen = [os.getpid()], {}
        while pids:
            pid = pids.pop()
            pids += self._children(pid)
            try:
                tasks = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        stat = f.read()
                except OSError:
                    continue
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                try:  # nanoseconds on a CPU, where the kernel keeps them
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        cpu = int(f.read().split()[0]) / 1e9
                except (OSError, ValueError, IndexError):
                    fields = stat[stat.rindex(")") + 2:].split()
                    cpu = (int(fields[11]) + int(fields[12])) / self.tick
                label = "this process" if pid == os.getpid() else f"child {pid}"
                main = " (main)" if int(tid) == pid else ""
                seen[(pid, int(tid))] = (f"{label} tid {tid}{main}: {name}", cpu)
        return seen

    def start(self) -> None:
        self.before = self._sample()

    def per_step_ms(self, steps: int) -> dict[str, float]:
        """Each thread's CPU ms per step since ``start``, the twelve busiest, those under
        0.05 ms left out."""
        totals: dict[str, float] = {}
        for key, (name, cpu) in self._sample().items():
            spent = cpu - self.before.get(key, (name, 0.0))[1]
            totals[name] = totals.get(name, 0.0) + spent
        rows = sorted(((n, round(t * 1e3 / steps, 3)) for n, t in totals.items()),
                      key=lambda r: -r[1])
        return {n: v for n, v in rows[:12] if v >= 0.05}


class StepPhases:
    """Host time in each part of the engine's step, by wrapping the methods the step calls
    (instance attributes shadow them; nothing in the engine changes). ``wait`` is the time
    spent waiting for the device's result, ``fill_wait`` for a mask fill to end (inside
    ``runner.prepare_inputs``, where a deferred step is sampled); ``outside`` is the LLM
    loop's own work (output processing) between steps."""

    PARTS = (("step", "core", "step"), ("schedule", "scheduler", "schedule"),
             ("launch", "executor", "execute_model"), ("update", "scheduler",
             "update_from_output"), ("advance", "core", "_advance_grammars"),
             ("fill", "structured", "fill_bitmask"), ("sample", "executor", "finish_sample"),
             ("begin_fill", "structured", "begin_fill"),
             ("pick_constrained", "core", "_sampling_constrained"),
             ("pick_masked", "structured", "needing_masks"), ("stats", "scheduler", "make_stats"))

    def __init__(self, llm: LLM) -> None:
        from tidal.engine_core import executor as executor_mod
        from tidal.engine_core.structured_output import fill_thread

        core = llm.engine.core
        owners = {"core": core, "scheduler": core.scheduler, "executor": core.executor,
                  "structured": core.structured}
        self.total: dict[str, float] = {}
        self.steps = 0
        for label, owner, name in self.PARTS:
            self._wrap(owners[owner], name, label, owner == "core" and name == "step")
        # Inside launch and sample (a worker in this process): where their host time goes.
        runner = getattr(getattr(core.executor, "worker", None), "runner", None)
        for name in ("prepare_inputs", "_attach_grammar", "_sample", "_launch_output"):
            if runner is not None and hasattr(runner, name):
                self._wrap(runner, name, "runner." + name.lstrip("_"), False)
        # Waits: for the device's result, and for a mask fill to end.
        self._wrap_class(executor_mod.Deferred, "result", "wait")
        self._wrap_class(fill_thread.FillJob, "wait", "fill_wait")

    def _wrap_class(self, cls: Any, name: str, label: str) -> None:
        fn = getattr(cls, name)
        phases = self

        def timed(self_: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(self_)
            finally:
                phases.total[label] = phases.total.get(label, 0.0) + (
                    time.perf_counter() - start)

        setattr(cls, name, timed)

    def _wrap(self, owner: Any, name: str, label: str, count: bool) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            if count:
                self.steps += 1
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.total[label] = self.total.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.total.clear()
        self.steps = 0

    def per_step_ms(self, elapsed: float) -> dict[str, float]:
        n = max(self.steps, 1)
        out = {k: round(v / n * 1e3, 3) for k, v in self.total.items()}
        out["outside"] = round((elapsed - self.total.get("step", 0.0)) / n * 1e3, 3)
        out["steps"] = self.steps
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--override", action="append", default=[], metavar="KEY=INT",
                   help="another config override, e.g. hidden_size=128 (a CPU run: the mask "
                        "costs do not depend on the model)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--corpus", type=int, default=500, help="schemas for time to first mask")
    p.add_argument("--corpus-burst", type=int, default=None,
                   help="distinct schemas arriving at once for the time to first mask (each "
                        "burst waits for the one before to finish; default: --batch)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="auto", choices=("auto", "guidance", "xgrammar"))
    p.add_argument("--phases", action="store_true",
                   help="also report the host time per step in each part of the engine's step "
                        "(scheduling, launch, waiting for the device, grammar advance and fill, "
                        "sampling launch, output processing)")
    p.add_argument("--engine-process", action="store_true",
                   help="run the EngineCore in its own process, as `tidal serve` does (the "
                        "outputs are processed in this one, beside the engine loop): only the "
                        "throughputs are measured, not the mask times or time to first mask")
    p.add_argument("--compare-fill-early", action="store_true",
                   help="also time the constrained runs with the fill job begun after the "
                        "scheduler's update ($TIDAL_GRAMMAR_FILL_EARLY=0), alternating in this "
                        "process: json_schema_late in the results")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.compare_fill_early and args.engine_process:
        p.error("--compare-fill-early switches the engine in this process: not with "
                "--engine-process")
    if args.engine_process and args.phases:
        p.error("--phases times the engine's methods in this process: not with "
                "--engine-process")

    folder = Path(tempfile.mkdtemp(prefix="bench-structured-"))
    write_model_dir(args.shape, folder, str(TOKENIZER))
    overrides: dict[str, Any] = {}
    if args.layers is not None:
        overrides["num_hidden_layers"] = args.layers
    for item in args.override:
        key, _, value = item.partition("=")
        overrides[key] = int(value)
    llm = LLM(str(folder), load_format="dummy", hf_overrides=overrides,
              max_num_seqs=args.batch, max_model_len=args.prompt_len + args.tokens + 16,
              enable_prefix_caching=False, structured_outputs_backend=args.backend,
              multiprocess=args.engine_process)
    core = None if args.engine_process else llm.engine.core
    stats = None if core is None else core.structured.stats
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(args.prompt_len)]
               for i in range(args.batch)]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": args.tokens}
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=args.tokens,
                                 structured_outputs=StructuredOutputsParams(json=schema))

    phases = StepPhases(llm) if args.phases else None
    phase_ms: dict[str, dict[str, float]] = {}
    threads = ThreadCpu()
    thread_ms: dict[str, dict[str, float]] = {}

    def timed(params: SamplingParams) -> tuple[float, int]:
        if phases is not None:
            phases.reset()
        threads.start()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        kind = ("unconstrained" if params.structured_outputs is None
                else "json_schema" if core is None or core.fill_early else "json_schema_late")
        thread_ms[kind] = threads.per_step_ms(args.tokens)
        if phases is not None:
            phase_ms[kind] = phases.per_step_ms(elapsed)
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)

    # Warm-up: the tokenizer tables, the grammar (cached from here on), the model.
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=(
        constrained.structured_outputs)), use_tqdm=False)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    runs: dict[str, list[tuple[float, int]]] = {"unconstrained": [], "json_schema": []}
    if args.compare_fill_early:
        if core is None or not core.fill_early:
            sys.exit("--compare-fill-early: this engine does not begin its fills early "
                     "($TIDAL_GRAMMAR_FILL_EARLY=0 or $TIDAL_GRAMMAR_ADVANCE_IN_FILL=0)")
        runs["json_schema_late"] = []
    fills: list[tuple[int, float]] = []
    advances: list[tuple[int, float]] = []
    for _ in range(args.repeats):
        runs["unconstrained"].append(timed(plain))
        if stats is not None:
            stats.fills.clear()
            stats.advances.clear()
        runs["json_schema"].append(timed(constrained))
        if stats is not None:
            fills.extend(stats.fills)
            advances.extend(stats.advances)
        if args.compare_fill_early:
            core.fill_early = False
            runs["json_schema_late"].append(timed(constrained))
            core.fill_early = True
    # Totals over the repeats (runs alternate, so drifting load hits both alike).
    tps = {k: sum(n for _, n in v) / sum(t for t, _ in v) for k, v in runs.items()}
    step = {k: sum(t for t, _ in v) / (len(v) * args.tokens) for k, v in runs.items()}
    per_seq = [dt / n for n, dt in fills]
    per_step = [dt for _, dt in fills]
    advance_per_step = [dt for _, dt in advances]

    result = {
        "device": device_name(), "shape": args.shape, "layers": args.layers,
        "backend": args.backend, "engine": "own process" if core is None else "this process",
        "batch": args.batch, "tokens": args.tokens,
        "tokens_per_s": {k: round(v, 1) for k, v in tps.items()},
        "throughput_ratio": round(tps["json_schema"] / tps["unconstrained"], 3),
        **({"throughput_ratio_late": round(tps["json_schema_late"] / tps["unconstrained"], 3)}
           if "json_schema_late" in tps else {}),
        "step_ms": {k: round(v * 1e3, 3) for k, v in step.items()},
        "added_time_per_step": round(step["json_schema"] / step["unconstrained"] - 1, 4),
        # Each repeat's ratio (the spread says how far one run can be trusted).
        "ratio_by_repeat": {k: [round(runs["unconstrained"][i][0] / t, 3)
                                for i, (t, _) in enumerate(v)]
                            for k, v in runs.items() if k != "unconstrained"},
        # (The last repeat's; CPU ms per step by thread, this process's and the engine's.)
        "thread_cpu_ms_per_step": thread_ms,
    }
    if stats is None:
        llm.shutdown()
        dump(result, args.out)
        return

    # Time to first mask over distinct corpus schemas (cold compile cache for each).
    stats.first_mask_s.clear()
    stats.admit_s.clear()
    stats.compiled_s.clear()
    stats.first_filled_s.clear()
    stats.compile_s.clear()
    schemas = corpus(args.corpus, seed=1)
    refused = 0
    if args.backend == "xgrammar":
        kept = [s for s in schemas if xgrammar_refusal(StructuredOutputsParams(json=s)) is None]
        refused, schemas = len(schemas) - len(kept), kept
    batch = [SamplingParams(max_tokens=1, structured_outputs=StructuredOutputsParams(json=s))
             for s in schemas]
    burst = args.corpus_burst or args.batch
    # The engine's steps while the bursts are served: when each started and ended, and what
    # it scheduled (admissions wait for a step to end), against when the requests arrived.
    trace: list[tuple[float, float, int, int]] = []  # (start, end, tokens, new requests)
    arrivals: list[float] = []
    engine_step, schedule, add = core.step, core.scheduler.schedule, core.add_request
    scheduled: list[tuple[int, int]] = []

    def traced_step(*a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        scheduled.clear()
        try:
            return engine_step(*a, **k)
        finally:
            tokens, new = scheduled[0] if scheduled else (0, 0)
            trace.append((start, time.perf_counter(), tokens, new))

    def traced_schedule(*a: Any, **k: Any) -> Any:
        out = schedule(*a, **k)
        scheduled.append((out.total_num_scheduled_tokens, len(out.new_reqs)))
        return out

    def traced_add(*a: Any, **k: Any) -> Any:
        arrivals.append(time.perf_counter())
        return add(*a, **k)

    core.step, core.scheduler.schedule, core.add_request = (traced_step, traced_schedule,
                                                             traced_add)
    walls: list[float] = []
    step_s: list[float] = []
    timeline: list[Any] = []
    # Time to first token (frontend arrival to first token) in each burst: constrained, then
    # the same burst again unconstrained.
    ttft: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    one = SamplingParams(max_tokens=1)
    for i in range(0, len(batch), burst):
        group = batch[i:i + burst]
        group_prompts = [prompts[j % len(prompts)] for j in range(len(group))]
        trace.clear()
        arrivals.clear()
        start = time.perf_counter()
        outs = llm.generate(group_prompts, group, use_tqdm=False)
        walls.append(time.perf_counter() - start)
        ttft["json_schema"] += [o.metrics.first_token_time - o.metrics.arrival_time
                                for o in outs if o.metrics.first_token_time is not None]
        step_s.extend(b - a for a, b, _, _ in trace)
        # ms from the burst's first arrival: its last arrival, then each step (start,
        # duration, tokens, new requests)
        t0 = arrivals[0]
        timeline = [round((arrivals[-1] - t0) * 1e3, 2)] + [
            (round((a - t0) * 1e3, 2), round((b - a) * 1e3, 2), n, r) for a, b, n, r in trace]
        outs = llm.generate(group_prompts, [one] * len(group), use_tqdm=False)
        ttft["unconstrained"] += [o.metrics.first_token_time - o.metrics.arrival_time
                                  for o in outs if o.metrics.first_token_time is not None]
    del core.step, core.scheduler.schedule, core.add_request
    first = list(stats.first_mask_s)
    admit, filled = list(stats.admit_s), list(stats.first_filled_s)
    compiled = list(stats.compiled_s)
    compiles = list(stats.compile_s)
    result.update({
        "compiled_by": dict(core.structured._backend.compiled_by),
        "vocab": core.config.model.vocab_size,
        "mask_fill_us_per_seq": {"p50": us(pct(per_seq, 0.5)), "p99": us(pct(per_seq, 0.99)),
                                 "fills": len(per_seq)},
        "mask_fill_ms_per_step": {"p50": round(pct(per_step, 0.5) * 1e3, 3),
                                  "p99": round(pct(per_step, 0.99) * 1e3, 3)},
        # The matchers fed their previous tokens by the fill job, before it fills
        # ($TIDAL_GRAMMAR_ADVANCE_IN_FILL; none: on the engine thread, in host_ms_per_step).
        "advance_in_fill_ms_per_step": {"p50": round(pct(advance_per_step, 0.5) * 1e3, 3),
                                        "steps": len(advance_per_step)},
        # Arrival to the grammar compiled with its first mask computed (a request copying a
        # template compiled before it arrived: 0).
        "time_to_first_mask_ms": {"p50": round(pct(compiled, 0.5) * 1e3, 2),
                                  "p99": round(pct(compiled, 0.99) * 1e3, 2),
                                  "max": round(max(compiled, default=0) * 1e3, 2),
                                  "schemas": len(compiled), "refused": refused,
                                  "burst": burst},
        # The later parts: to admission (taken by the engine loop), to its first step's mask
        # filled, and to that mask read by the sampler (after the burst's prefill).
        "to_sampler_ms": {"p50": round(pct(first, 0.5) * 1e3, 2),
                          "p99": round(pct(first, 0.99) * 1e3, 2),
                          "max": round(max(first, default=0) * 1e3, 2)},
        "ttft_burst_ms": {k: {"p50": round(pct(v, 0.5) * 1e3, 2),
                              "p99": round(pct(v, 0.99) * 1e3, 2), "n": len(v)}
                          for k, v in ttft.items()},
        "to_admission_ms": {"p50": round(pct(admit, 0.5) * 1e3, 2),
                            "p99": round(pct(admit, 0.99) * 1e3, 2)},
        "to_first_mask_filled_ms": {"p50": round(pct(filled, 0.5) * 1e3, 2),
                                    "p99": round(pct(filled, 0.99) * 1e3, 2),
                                    "n": len(filled)},
        "compile_ms": {"p50": round(pct(compiles, 0.5) * 1e3, 3),
                       "p99": round(pct(compiles, 0.99) * 1e3, 3)},
        # Each burst's wall time (its requests finish after one token), and the engine steps
        # taken meanwhile (admissions wait for a step to end).
        "burst_wall_ms": {"p50": round(pct(walls, 0.5) * 1e3, 1),
                          "max": round(max(walls, default=0) * 1e3, 1)},
        "corpus_steps": {"n": len(step_s),
                         "per_burst": round(len(step_s) / max(1, len(walls)), 1),
                         "p50_ms": round(pct(step_s, 0.5) * 1e3, 2),
                         "max_ms": round(max(step_s, default=0) * 1e3, 2)},
        # The last burst: ms from its first arrival to its last, then its steps as
        # (start, duration, tokens scheduled, requests newly scheduled).
        "last_burst_timeline": timeline,
    })
    if phase_ms:
        result["host_ms_per_step"] = phase_ms  # (the last repeat's)
    llm.shutdown()
    dump(result, args.out)


if __name__ == "__main__":
    main()
