"""The CPU side of one decode step at batch 256, with the GPU work removed.

    python tools/bench_cpu_step.py [--batch 256] [--steps 300] [--tokenizer .bench_assets/qwen3]
    python tools/bench_cpu_step.py --modes sync --steps 300 --repeats 1 --profile 40
    python tools/bench_cpu_step.py --modes async --tokenizer QWEN3 --structured  # grammar work

An in-process EngineCore with the real scheduler, KV cache manager and model runner on the CPU,
whose model forward, LM head and sampler are replaced by stubs returning preallocated tensors:
what remains is what the host does every step on any device — schedule, apply the step's diffs,
prepare inputs (numpy gathers, staging, slot mapping and block-table lookups as torch ops),
build the output, update the scheduler. Reported per step (median of ``--repeats`` windows):
wall time, this thread's CPU time (robust to other processes sharing the cores), and the split
by phase. The frontend's output processing (``OutputProcessor``: incremental detokenization
when a tokenizer is given) is timed separately: in serving it runs in another process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import dump, summary, write_model_dir  # noqa: E402
from tidal.engine_core.config import EngineArgs  # noqa: E402
from tidal.engine_core.core import EngineCore  # noqa: E402
from tidal.engine_core.protocol import EngineCoreRequest, OutputBatch  # noqa: E402
from tidal.engine_core.sampling_params import OutputKind, SamplingParams  # noqa: E402
from tidal.worker.sample.sampler import SamplerOutput  # noqa: E402

# The Qwen3 vocabulary (so detokenization sees real ids) on a two-layer toy body.
_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "eos_token_id": 151645,
}


class StubModel(torch.nn.Module):
    """Stands in for the forward pass and LM head: preallocated outputs, no compute."""

    def __init__(self, real: torch.nn.Module, max_tokens: int, hidden: int) -> None:
        super().__init__()
        self._real = real
        self._hidden = torch.zeros(max_tokens, hidden)
        self._logits = torch.zeros(max_tokens, 8)

    def attention_layers(self):
        return self._real.attention_layers()

    def forward(self, input_ids, positions, meta, hidden=None, residual=None):
        return self._hidden[: input_ids.shape[0]], None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._logits[: hidden.shape[0]]


class StubSampler:
    def __init__(self, vocab: int, n: int, token: int | None = None) -> None:
        """``token``: every row samples it (a grammar that always allows it: ``--structured``)."""
        self._tokens = (torch.randint(1, vocab - 1, (n,), dtype=torch.int64) if token is None
                        else torch.full((n,), token, dtype=torch.int64))

    def __call__(self, logits, meta) -> SamplerOutput:
        return SamplerOutput(self._tokens[: logits.shape[0]], None)


class GcTimer:
    """Time spent in the cyclic garbage collector, by generation (gc.callbacks)."""

    def __init__(self) -> None:
        self.seconds = defaultdict(float)
        self._start = 0.0
        self.on = False
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self.on:
            self.seconds[f"gen{info['generation']}"] += time.perf_counter() - self._start

    def close(self) -> None:
        gc.callbacks.remove(self._cb)


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[label] += time.perf_counter() - t

        setattr(obj, name, timed)


def calibration_us(reps: int = 200) -> float:
    """Median time of a fixed pure-Python loop (256 objects, a few attribute reads, appends
    and a dict store each: the shape of the scheduler's per-request work). On a shared or
    throttled machine it moves with everything else; compare runs by it."""

    class Obj:
        __slots__ = ("a", "b", "c")

        def __init__(self, i: int) -> None:
            self.a, self.b, self.c = list(range(64)), i, f"r{i}"

    objs = [Obj(i) for i in range(256)]

    def loop() -> None:
        out, d = [], {}
        for o in objs:
            n = len(o.a) + o.b
            if n > 0:
                out.append(o.c)
                d[o.c] = n
                o.b = o.b

    times = []
    for _ in range(reps):
        t = time.perf_counter()
        loop()
        times.append(time.perf_counter() - t)
    times.sort()
    return round(times[len(times) // 2] * 1e6, 2)


def profile_steps(core: EngineCore, ns: argparse.Namespace, label: str) -> None:
    """Run ``--steps`` steps under a profiler and print where they went: cProfile (exact call
    counts, but its per-call overhead inflates small Python functions) or pyinstrument (a
    sampling profiler, ``pip install pyinstrument``: little overhead, a call tree)."""
    print(f"--- {ns.profiler}, {label}, {ns.steps} steps")
    if ns.profiler == "pyinstrument":
        from pyinstrument import Profiler

        prof = Profiler(interval=0.0001)
        prof.start()
        for _ in range(ns.steps):
            core.step()
        prof.stop()
        print(prof.output_text(unicode=True, show_all=False, color=False))
        return
    import cProfile
    import pstats

    cprof = cProfile.Profile()
    cprof.enable()
    for _ in range(ns.steps):
        core.step()
    cprof.disable()
    pstats.Stats(cprof).sort_stats("tottime").print_stats(ns.profile)


def run(ns: argparse.Namespace, async_scheduling: bool, model_dir: str) -> dict[str, Any]:
    budget = 8192  # the GPU default token budget
    # Early requests decode while later ones still prefill: room for all of those steps.
    new_tokens = (ns.steps * (ns.repeats + bool(ns.profile)) + 100
                  + ns.batch * ns.prompt // budget)
    args = EngineArgs(model=model_dir, load_format="dummy", device="cpu", dtype="float32",
                      max_model_len=4096, max_num_seqs=ns.batch, max_num_batched_tokens=budget,
                      num_kv_blocks=max(ns.batch * (ns.prompt + new_tokens + 32) // 16,
                                        4096 // 16),
                      async_scheduling=async_scheduling,
                      enable_prefix_caching=not ns.no_prefix_caching)
    core = EngineCore(args.create_config())
    runner = core.executor.worker.runner
    cfg = core.config
    timers = Timers()
    runner.model = StubModel(runner.model, runner.max_num_tokens, cfg.model.arch.hidden_size)
    token = None
    structured = None
    if ns.structured:
        # Every request under the grammar "a*", every row sampling "a": the engine thread's
        # grammar work (picking the constrained rows, advancing, handing the fill over, the
        # lazy sample's masks) without a grammar the stub's tokens could break.
        from tidal.engine_core.sampling_params import StructuredOutputsParams
        from tidal.frontend.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.model)
        token = tokenizer.convert_tokens_to_ids("a")
        if token is None or token == tokenizer.unk_token_id:
            raise SystemExit("--structured needs a tokenizer with a token 'a'")
        structured = StructuredOutputsParams(regex="a*")
        timers.wrap(core.structured, "begin_fill", "grammar: begin_fill")
        timers.wrap(core, "_advance_grammars", "grammar: advance")
        timers.wrap(core, "_sample_deferred", "grammar: sample_deferred")
    runner.sampler = StubSampler(cfg.model.arch.vocab_size, runner.max_num_tokens, token)

    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core.scheduler, "update_from_output", "update_from_output")
    timers.wrap(runner, "execute_model", "runner.execute_model")
    timers.wrap(runner, "prepare_inputs", "  of which prepare_inputs")
    timers.wrap(runner, "_resolve_through", "runner output (tokens to host, build output)")

    processor = None
    if ns.tokenizer:
        from tidal.frontend.output_processor import OutputProcessor
        from tidal.frontend.tokenizer import load_tokenizer

        processor = OutputProcessor(load_tokenizer(cfg.model))
    rng = random.Random(0)
    vocab = cfg.model.arch.vocab_size
    for i in range(ns.batch):
        prompt = [rng.randrange(vocab) for _ in range(ns.prompt)]
        params = SamplingParams(temperature=0.6, max_tokens=new_tokens, ignore_eos=True,
                                output_kind=OutputKind[ns.output_kind.upper()],
                                structured_outputs=structured)
        req = EngineCoreRequest(f"r{i}", prompt, params)
        if processor is not None:
            for r in processor.add_request(f"r{i}", None, prompt, params):
                core.add_request(r)
        else:
            core.add_request(req)
    seen: set[str] = set()
    while len(seen) < ns.batch:  # prefill everything
        seen.update(o.request_id for o in core.step().outputs)
    for _ in range(20):
        core.step()
    if structured is not None:
        assert len(core.structured.states) == ns.batch, "a request left its grammar"
    if ns.gc_freeze:
        gc.collect()
        gc.freeze()  # what a long-running engine process does after start-up
    if ns.profile:
        profile_steps(core, ns, "async" if async_scheduling else "sync")
    gct = GcTimer()
    windows, cpu_windows, detok = [], [], []
    for _ in range(ns.repeats):
        timers.on = gct.on = True
        sizes = []
        wall = cpu = detok_s = 0.0
        for _ in range(ns.steps):
            t, c = time.perf_counter(), time.thread_time()
            step = core.step()
            wall += time.perf_counter() - t
            cpu += time.thread_time() - c
            sizes.append(len(step.outputs))
            if processor is not None:  # the frontend's share, timed apart
                gct.on = timers.on = False
                t = time.perf_counter()
                processor.process_outputs(OutputBatch.pack(step.outputs))
                detok_s += time.perf_counter() - t
                gct.on = timers.on = True
        timers.on = gct.on = False
        windows.append(wall / ns.steps * 1e3)
        cpu_windows.append(cpu / ns.steps * 1e3)
        if processor is not None:
            detok.append(detok_s / ns.steps * 1e3)
        assert min(sizes[2:]) == ns.batch, f"not a full decode batch: {sizes}"
    total_steps = ns.steps * ns.repeats
    out: dict[str, Any] = {
        "async_scheduling": async_scheduling,
        "ms_per_step_wall": summary(windows, 4),
        "ms_per_step_thread_cpu": summary(cpu_windows, 4),
        "breakdown_ms_per_step": {k: round(v / total_steps * 1e3, 4)
                                  for k, v in timers.total.items()},
        "gc_ms_per_step": {k: round(v / total_steps * 1e3, 4) for k, v in gct.seconds.items()},
        "gc_frozen": ns.gc_freeze,
        "prefix_caching": not ns.no_prefix_caching,
        "structured": ns.structured,
        "output_kind": ns.output_kind,
    }
    gct.close()
    if ns.gc_freeze:
        gc.unfreeze()
    if detok:
        out["frontend_output_processing_ms_per_step"] = summary(detok, 4)
    core.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="sync,async")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="turn prefix caching off (it hashes and registers every block that "
                         "fills: its share of the step)")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after warm-up (long-lived objects leave the collector)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="before timing, run --steps steps under a profiler and print where "
                         "they went (cProfile: the top N functions by own time)")
    ap.add_argument("--profiler", choices=("cprofile", "pyinstrument"), default="cprofile",
                    help="pyinstrument prints a call tree (pip install pyinstrument)")
    ap.add_argument("--structured", action="store_true",
                    help="every request under a grammar (regex a*, the stub sampling 'a'): "
                         "the engine thread's structured-output work per step (needs "
                         "--tokenizer)")
    ap.add_argument("--output-kind", choices=("delta", "final_only"), default="delta",
                    help="the requests' output kind: delta (a stream, as the server asks) or "
                         "final_only (as LLM.generate: the text decoded once, at the end, "
                         "which the timed steps do not reach)")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.structured and not ns.tokenizer:
        ap.error("--structured needs --tokenizer (the grammar compiles against it)")
    torch.set_num_threads(ns.threads)
    # The tokenizer's thread pool would compete for the same few cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    result: dict[str, Any] = {
        "benchmark": "cpu_step", "cpus": len(os.sched_getaffinity(0)),
        "load_avg_before": [round(x, 2) for x in os.getloadavg()], "batch": ns.batch,
        "prompt": ns.prompt, "target_ms": 0.5, "runs": []}
    with tempfile.TemporaryDirectory(prefix="tidal-cpu-step-") as tmp:
        folder = Path(tmp) / "m"
        write_model_dir("tiny", folder, ns.tokenizer)
        (folder / "config.json").write_text(json.dumps(_CONFIG))
        result["calibration_loop_us_before"] = calibration_us()
        for mode in ns.modes.split(","):
            result["runs"].append(run(ns, mode == "async", str(folder)))
        result["calibration_loop_us_after"] = calibration_us()
    result["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    dump(result, ns.out)
    print(f"calibration loop: {result['calibration_loop_us_before']} / "
          f"{result['calibration_loop_us_after']} us (before / after)")
    for r in result["runs"]:
        print(f"{'async' if r['async_scheduling'] else 'sync ':>5}: "
              f"{r['ms_per_step_wall']['median']:.3f} ms/step wall "
              f"(min {r['ms_per_step_wall']['min']:.3f}), "
              f"{r['ms_per_step_thread_cpu']['median']:.3f} ms CPU; {r['breakdown_ms_per_step']}; "
              f"gc {r['gc_ms_per_step']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
