"""Host time per EngineCore step, by phase, for a batch of constrained requests against the same
batch unconstrained (issue 20: where the structured-output step time goes).

    python tools/structured_step_phases.py --tokenizer .bench_assets/qwen3        # a GPU
    python tools/structured_step_phases.py --tokenizer tests/data/qwen3 --batch 16 --tokens 16 \\
        --override num_hidden_layers=1                                          # a CPU smoke run

Dummy weights on a shape from bench_common with a real tokenizer (mask sizes follow its
vocabulary), the schema of tools/bench_structured.py (an array of at least ``--tokens`` small
integers, so both runs decode the same steps). The EngineCore's phases are wrapped with timers
(scheduling, launching the step, waiting for the previous step's result, the scheduler's update,
advancing the matchers, filling the masks, sampling under them); printed per step, each run
twice, alternating. The time the host spends in ``STEP`` against the device's is what decides
whether the masks are free.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import write_model_dir  # noqa: E402

from tidal.engine_core import executor as executor_module  # noqa: E402
from tidal.engine_core.sampling_params import (  # noqa: E402
    SamplingParams,
    StructuredOutputsParams,
)
from tidal.frontend import LLM  # noqa: E402

PHASES = ("STEP", "schedule", "launch", "wait_result", "update", "advance", "fill",
          "refill", "finish_sample")


class Timers:
    def __init__(self) -> None:
        self.total: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter[str] = collections.Counter()

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(obj, name, timed)

    def line(self) -> str:
        steps = max(1, self.calls["STEP"])
        return " ".join(f"{k} {self.total[k] * 1e3 / steps:.2f}" for k in PHASES)


def _tune_fill(structured: Any, timers: Timers, threads: int, refill: bool) -> None:
    """Swap llguidance's executor for one with ``threads`` threads; with ``refill``, fill every
    batch twice and time the second apart (same matcher states)."""
    original = structured.fill_bitmask

    def fill(ids: list[str], out: Any = None) -> Any:
        backend = structured._backend
        if threads and backend is not None:
            import llguidance

            for b in getattr(backend, "_backends", {"guidance": backend}).values():
                if getattr(b, "name", "") == "guidance" and not getattr(b, "_tuned", False):
                    b._executor = llguidance.LLExecutor(num_threads=threads)
                    b._tuned = True
        result = original(ids, out)
        if refill and backend is not None:
            scratch = result.copy()
            start = time.perf_counter()
            backend.fill([structured.states[r].matcher for r in ids], scratch)
            timers.total["refill"] += time.perf_counter() - start
            timers.calls["refill"] += 1
        return result

    structured.fill_bitmask = fill


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--backend", default="guidance", choices=("auto", "guidance", "xgrammar"))
    p.add_argument("--override", action="append", default=[], metavar="KEY=INT")
    p.add_argument("--seed", type=int, default=0, help="every request's seed; -1: unseeded")
    p.add_argument("--fill-threads", type=int, default=0,
                   help="llguidance's mask-fill threads (0: its default)")
    p.add_argument("--refill", action="store_true",
                   help="time a second fill of the same masks right after each (phase refill)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="print the N functions with the most host time in the last constrained run")
    ns = p.parse_args(argv)
    overrides = {k: int(v) for k, _, v in (o.partition("=") for o in ns.override)}
    folder = write_model_dir(ns.shape, Path(tempfile.mkdtemp()) / ns.shape, tokenizer=ns.tokenizer)
    llm = LLM(folder, load_format="dummy", hf_overrides=overrides, max_num_seqs=ns.batch,
              max_model_len=ns.tokens + 64, enable_prefix_caching=False,
              structured_outputs_backend=ns.backend)
    core = llm.engine.core
    timers = Timers()
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update")
    timers.wrap(core.executor, "execute_model", "launch")
    if hasattr(core.executor, "finish_sample"):
        timers.wrap(core.executor, "finish_sample", "finish_sample")
    timers.wrap(core, "_advance_grammars", "advance")
    timers.wrap(core.structured, "fill_bitmask", "fill")
    if ns.fill_threads or ns.refill:
        _tune_fill(core.structured, timers, ns.fill_threads, ns.refill)
    timers.wrap(core, "step", "STEP")
    timers.wrap(executor_module.Deferred, "result", "wait_result")
    prompts = [[100 + (i * 7 + j) % 5000 for j in range(32)] for i in range(ns.batch)]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "minItems": ns.tokens}
    spec = StructuredOutputsParams(json=schema)
    seed = None if ns.seed < 0 else ns.seed
    plain = SamplingParams(temperature=1.0, seed=seed, max_tokens=ns.tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=seed, max_tokens=ns.tokens,
                                 structured_outputs=spec)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, structured_outputs=spec),
                 use_tqdm=False)  # the grammar compiled, the tokenizer tables built
    runs = (("plain", plain), ("constrained", constrained)) * 2
    for n, (name, params) in enumerate(runs):
        timers.total.clear()
        timers.calls.clear()
        profiler = cProfile.Profile() if ns.cprofile and n == len(runs) - 1 else None
        start = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        llm.generate(prompts, params, use_tqdm=False)
        if profiler is not None:
            profiler.disable()
        wall = time.perf_counter() - start
        print(f"{name}: wall {wall * 1e3:.0f} ms, {timers.calls['STEP']} steps; ms per step: "
              f"{timers.line()}", flush=True)
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(ns.cprofile)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
