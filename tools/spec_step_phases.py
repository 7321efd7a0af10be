"""Where a speculative decoding step's time goes: the target's forward pass, verification,
the proposal, and what is left (scheduling, input preparation, output handling), in ms per
step, against a plain decode step of the same engine shape.

    python tools/spec_step_phases.py --shape llama-3.1-8b --method eagle3 \
        --draft-shape eagle3-llama-3.1-8b --synthetic-alpha 0.8 --k 3 --batch 1

Each phase is timed with a device synchronisation on both sides, so phases do not overlap
here as they can in a normal run: the sum is an upper bound of the step, and each phase's
figure is its own cost (host and device).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))


def _timed(table: dict[str, list[float]], name: str, fn: Callable, sync: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        table[name].append(time.perf_counter() - t0)
        return out

    return wrapper


def kernel_table(model: str, engine_kw: dict[str, Any], batch: int, prompt: list[int],
                 max_tokens: int, top: int = 30) -> dict[str, Any]:
    """The device kernels of a steady-state run (torch.profiler; kernels inside CUDA graphs
    included), by total time, in µs per engine step: the phase timings say which phase is
    slow, this says which kernels make it so."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.frontend import LLM

    llm = LLM(model, **engine_kw)
    try:
        core = llm.engine.core
        steps = [0]
        step = core.step

        def counting(*a: Any, **kw: Any) -> Any:
            steps[0] += 1
            return step(*a, **kw)

        core.step = counting
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": prompt}] * batch
        llm.generate(prompts, params, use_tqdm=False)  # warm
        steps[0] = 0
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
    finally:
        llm.shutdown()
    rows = [(e.key, e.device_time_total, e.count) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[1])
    n = max(steps[0], 1)
    total = sum(r[1] for r in rows)
    return {"steps": n, "device_us_per_step": total / n,
            "kernels": [{"name": k[:120], "us_per_step": t / n, "calls_per_step": c / n}
                        for k, t, c in rows[:top]]}


def measure(model: str, engine_kw: dict[str, Any], batch: int, prompt: list[int],
            max_tokens: int) -> dict[str, Any]:
    import torch

    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.frontend import LLM

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    llm = LLM(model, **engine_kw)
    try:
        core = llm.engine.core
        runner = core.executor.worker.runner
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompts = [{"prompt_token_ids": prompt}] * batch
        llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0),
                     use_tqdm=False)
        t: dict[str, list[float]] = defaultdict(list)
        if runner.graphs is not None:
            g = runner.graphs
            g.replay = _timed(t, "target forward", g.replay, sync)
            g.replay_mixed = _timed(t, "target forward", g.replay_mixed, sync)
        spec = runner.spec
        if spec is not None:
            spec.verify = _timed(t, "verify", spec.verify, sync)
            spec.propose = _timed(t, "propose", spec.propose, sync)
        runner.execute_model = _timed(t, "execute_model", runner.execute_model, sync)
        core.step = _timed(t, "engine step", core.step, sync)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    finally:
        llm.shutdown()
    steps = len(t["engine step"])
    phases = {name: 1e3 * sum(v) / steps for name, v in t.items()}
    phases["other (schedule, inputs, outputs)"] = phases["engine step"] - sum(
        phases.get(n, 0.0) for n in ("target forward", "verify", "propose"))
    return {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps,
            "tok_s": tokens / wall, "ms_per_step": phases,
            "median_step_ms": 1e3 * statistics.median(t["engine step"])}


def main(argv: list[str] | None = None) -> int:
    from bench_spec import DRAFT_SHAPES, repeat_prompt_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--method", choices=("eagle3", "draft_model"), default="eagle3")
    p.add_argument("--draft-shape", choices=sorted(DRAFT_SHAPES), default="eagle3-llama-3.1-8b")
    p.add_argument("--synthetic-alpha", type=float, default=0.8)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--kv-gib", type=int, default=16)
    p.add_argument("--out", default=None)
    p.add_argument("--kernels", action="store_true",
                   help="also profile each side's device kernels (torch.profiler)")
    args = p.parse_args(argv)

    from bench_common import write_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="tidal-spec-phases-"))
    model = write_model_dir(args.shape, tmp)
    draft = tmp / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(DRAFT_SHAPES[args.draft_shape]))
    # Without async scheduling: the phases are timed between device synchronisations, which
    # would serialise a pipelined step anyway (tools/bench_spec.py measures the pipelined one).
    kw: dict[str, Any] = dict(load_format="dummy", max_model_len=2048, skip_tokenizer_init=True,
                              max_num_seqs=max(args.batch, 2), async_scheduling=False,
                              kv_cache_memory_bytes=args.kv_gib << 30)
    from tidal.engine_core.config import EngineArgs

    vocab = EngineArgs(model=model, load_format="dummy").create_config().model.vocab_size
    prompt = repeat_prompt_ids(vocab)
    spec = {"method": args.method, "model": str(draft), "num_speculative_tokens": args.k,
            "disable_by_batch_size": None, "disable_by_acceptance": False,
            "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rate": args.synthetic_alpha}
    out = {"shape": args.shape, "method": args.method, "draft_shape": args.draft_shape,
           "k": args.k, "batch": args.batch, "synthetic_alpha": args.synthetic_alpha}
    for side, extra in (("plain", {}), ("spec", {"speculative_config": spec})):
        out[side] = measure(model, {**kw, **extra}, args.batch, prompt, args.max_tokens)
        print(side, json.dumps(out[side], indent=1), flush=True)
        if args.kernels:
            table = kernel_table(model, {**kw, **extra}, args.batch, prompt, args.max_tokens)
            out[side]["kernels"] = table
            print(f"{side}: {table['device_us_per_step']:.0f} us of kernels per step")
            for k in table["kernels"]:
                print(f"  {k['us_per_step']:8.1f} us  x{k['calls_per_step']:6.1f}  {k['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
