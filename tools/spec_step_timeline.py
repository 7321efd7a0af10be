"""When the host and the device do each part of a speculative decoding step, in the engine's
normal (pipelined, async-scheduling) run: where the device waits for the host.

    python tools/spec_step_timeline.py --shape llama-3.1-8b --method eagle3 \
        --draft-shape eagle3-llama-3.1-8b --synthetic-alpha 0.8 --k 3 --batch 1

``tools/spec_step_phases.py`` times each phase between device synchronisations, which
serialises the pipeline it measures. Here nothing synchronises: each wrapped call records its
host start and end (``perf_counter``) and a CUDA event before and after it on the current
stream. An event completes when the stream reaches it, so the "before" event of a call that
launches device work is when the device started that work (or, if the stream was idle, about
when the host enqueued it). The report gives, per step, each part's host and device time, and
the device's idle time before each target forward: the host's critical path between steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))


class _HostEvent:
    """A stand-in for a CUDA event without a GPU (to try the tool on CPU): the host time."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _HostEvent) -> float:
        return 1e3 * (other.t - self.t)


class Recorder:
    """Host times and stream events of the wrapped calls, in call order."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.Event = torch.cuda.Event if self.cuda else _HostEvent
        self.calls: list[tuple[str, float, float, Any, Any]] = []
        self.on = False
        self.base_event: Any = None
        self.base_host = 0.0

    def start(self) -> None:
        self._sync()
        self.base_event = self.Event(enable_timing=True)
        self.base_event.record()
        self._sync()
        self.base_host = time.perf_counter()
        self.calls.clear()
        self.on = True

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def wrap(self, obj: Any, attr: str, name: str) -> None:
        fn = getattr(obj, attr)
        Event = self.Event

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            e0 = Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                e1 = Event(enable_timing=True)
                e1.record()
                self.calls.append((name, t0, t1, e0, e1))

        setattr(obj, attr, wrapper)

    def rows(self) -> list[dict[str, Any]]:
        """Every call with its host and device start / end, ms since ``start``."""
        self._sync()
        self.on = False
        out = []
        for name, t0, t1, e0, e1 in self.calls:
            out.append({"name": name, "host0": 1e3 * (t0 - self.base_host),
                        "host1": 1e3 * (t1 - self.base_host),
                        "dev0": self.base_event.elapsed_time(e0),
                        "dev1": self.base_event.elapsed_time(e1)})
        out.sort(key=lambda r: r["host0"])
        return out


def instrument(llm: Any, rec: Recorder) -> None:
    core = llm.engine.core
    runner = core.executor.worker.runner
    rec.wrap(core, "step", "engine step")
    rec.wrap(core.scheduler, "schedule", "schedule")
    rec.wrap(core.scheduler, "update_from_output", "update_from_output")
    rec.wrap(runner, "execute_model", "execute_model")
    rec.wrap(runner, "finish_inflight", "finish_inflight")
    rec.wrap(runner, "prepare_inputs", "prepare_inputs")
    if runner.graphs is not None:
        rec.wrap(runner.graphs, "replay", "target forward")
        rec.wrap(runner.graphs, "replay_mixed", "target forward")
    rec.wrap(runner.model, "compute_logits", "logits")
    spec = runner.spec
    if spec is not None:
        for attr in ("launch_verify", "finish_verify", "verify", "propose"):
            rec.wrap(spec, attr, attr)
        if spec.drafter is not None:
            rec.wrap(spec.drafter, "propose_early", "propose_early")


def summarize(rows: list[dict[str, Any]], show_steps: int) -> dict[str, Any]:
    steps = [r for r in rows if r["name"] == "engine step"]
    forwards = [r for r in rows if r["name"] == "target forward"]
    per: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in rows:
        per[r["name"]].append((r["host1"] - r["host0"], r["dev1"] - r["dev0"]))
    n = max(len(steps), 1)
    table = {name: {"calls_per_step": len(v) / n,
                    "host_ms_per_call": statistics.mean(h for h, _ in v),
                    "device_ms_per_call": statistics.mean(d for _, d in v)}
             for name, v in per.items()}
    # Device idle before each target forward: its start minus the end of the device work the
    # stream had before it (the latest "after" event recorded before this forward's launch).
    idle = []
    for f in forwards[1:]:
        before = [r["dev1"] for r in rows if r["host1"] <= f["host0"] and r["name"] not in (
            "engine step", "execute_model")]
        if before:
            idle.append(f["dev0"] - max(before))
    fwd_gap = [b["dev0"] - a["dev0"] for a, b in zip(forwards, forwards[1:])]
    out = {"steps": len(steps), "forwards": len(forwards),
           "forward_to_forward_ms": statistics.median(fwd_gap) if fwd_gap else None,
           "device_idle_before_forward_ms": statistics.median(idle) if idle else None,
           "calls": table}
    if forwards and show_steps:
        mid = forwards[len(forwards) // 2]["host0"]
        window = [r for r in rows if r["host0"] >= mid][:show_steps * 12]
        out["timeline"] = window
    return out


def main(argv: list[str] | None = None) -> int:
    from bench_spec import DRAFT_SHAPES, repeat_prompt_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--method", choices=("eagle3", "draft_model", "none"), default="eagle3")
    p.add_argument("--draft-shape", choices=sorted(DRAFT_SHAPES), default="eagle3-llama-3.1-8b")
    p.add_argument("--synthetic-alpha", type=float, default=0.8)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-gib", type=int, default=12)
    p.add_argument("--engine-args", default="{}", help="JSON engine arguments added")
    p.add_argument("--show-steps", type=int, default=3)
    p.add_argument("--runs", type=int, default=2,
                   help="timed runs (each printed); the last is the one recorded")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true",
                   help="a tiny random Llama and the tiny draft of --method (CPU-sized run)")
    args = p.parse_args(argv)

    from bench_common import write_model_dir

    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.frontend import LLM

    tmp = Path(tempfile.mkdtemp(prefix="tidal-spec-timeline-"))
    kw: dict[str, Any] = dict(max_model_len=2048, skip_tokenizer_init=True)
    if args.smoke:
        import reference

        model = str(tmp / "tiny")
        reference.make_tiny_model("llama", Path(model))
        kw.update(max_model_len=512, load_format="dummy")
        args.shape = "tiny"
        args.draft_shape = "tiny-draft" if args.method == "draft_model" else "tiny-eagle3"
    else:
        model = write_model_dir(args.shape, tmp)
        kw.update(load_format="dummy", kv_cache_memory_bytes=args.kv_gib << 30)
    kw.update(json.loads(args.engine_args))
    if args.method != "none":
        draft = tmp / "draft"
        draft.mkdir()
        (draft / "config.json").write_text(json.dumps(DRAFT_SHAPES[args.draft_shape]))
        kw["speculative_config"] = {
            "method": args.method, "model": str(draft), "num_speculative_tokens": args.k,
            "disable_by_batch_size": None, "disable_by_acceptance": False,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": args.synthetic_alpha}
    vocab = EngineArgs(model=model, load_format=kw.get("load_format", "auto")
                       ).create_config().model.vocab_size
    prompts = [{"prompt_token_ids": repeat_prompt_ids(vocab)}] * args.batch
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(model, **kw)
    try:
        # Warmed as tools/bench_spec.py warms: a short generation.
        llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0),
                     use_tqdm=False)
        rec = Recorder()
        instrument(llm, rec)
        for run in range(args.runs):
            if run == args.runs - 1:
                rec.start()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
            print(f"run {run}: {sum(len(o.outputs[0].token_ids) for o in outs) / wall:.1f} "
                  "tok/s", flush=True)
        rows = rec.rows()
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    out = {"shape": args.shape, "method": args.method, "batch": args.batch, "k": args.k,
           "engine_args": json.loads(args.engine_args), "tokens": tokens,
           "tok_s": tokens / wall, **summarize(rows, args.show_steps)}
    timeline = out.pop("timeline", [])
    print(json.dumps(out, indent=1))
    if timeline:
        print(f"{'call':<20} {'host0':>9} {'host1':>9} {'dev0':>9} {'dev1':>9}  (ms)")
        for r in timeline:
            print(f"{r['name']:<20} {r['host0']:9.3f} {r['host1']:9.3f} {r['dev0']:9.3f} "
                  f"{r['dev1']:9.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps({**out, "timeline": timeline}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
