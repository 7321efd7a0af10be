"""How long the engine's steps take when prompts arrive into a running decode batch (the ITL tail
of issue 17's Poisson workload), with dummy weights.

    python tools/bench_mixed_steps.py --shape qwen3-0.6b --running 16 --prompt 512 --out m.json
    python tools/bench_mixed_steps.py --compilation-config '{"mode": 3}'   # compiled (issue 25)

``--running`` requests decode steadily; every ``--every`` steps one new ``--prompt``-token
request arrives. Each ``core.step()`` is timed; steps are classed as "decode" (no arrival in the
last two steps) or "arrival" (the two steps after one: with async scheduling the mixed step's
cost lands in either). ``--profile`` adds a torch.profiler table (device and host time) of a
window holding one arrival, to say whether the tail is device work or host work.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import device_name, now, summary, write_model_dir  # noqa: E402
from tidal.engine_core.config import EngineArgs  # noqa: E402
from tidal.engine_core.core import EngineCore  # noqa: E402
from tidal.engine_core.protocol import EngineCoreRequest  # noqa: E402
from tidal.engine_core.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("bench_mixed_steps")


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run(core: EngineCore, running: int, prompt: int, every: int, arrivals: int, vocab: int,
        rng: random.Random, profile: bool) -> dict[str, Any]:
    steps_total = every * (arrivals + 2)
    for i in range(running):
        core.add_request(EngineCoreRequest(f"r{i}", [rng.randrange(vocab) for _ in range(prompt)],
                                           _params(steps_total + 64)))
    for _ in range(32):  # prefill them all and settle into decode
        core.step()
    kinds: list[str] = []
    times: list[float] = []
    since_arrival = 99
    for step in range(steps_total):
        if step % every == every // 2 and step // every < arrivals:
            core.add_request(EngineCoreRequest(
                f"a{step}", [rng.randrange(vocab) for _ in range(prompt)], _params(every)))
            since_arrival = 0
        t0 = now()
        core.step()
        times.append((now() - t0) * 1e3)
        kinds.append("arrival" if since_arrival < 2 else "decode")
        since_arrival += 1
    out: dict[str, Any] = {
        "running": running, "prompt": prompt, "every": every, "arrivals": arrivals,
        "decode_ms": summary([t for t, k in zip(times, kinds) if k == "decode"], 3),
        "arrival_ms": summary([t for t, k in zip(times, kinds) if k == "arrival"], 3),
        "slowest_ms": sorted(times)[-8:],
    }
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof_ctx

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available()
                                         else [])
        core.add_request(EngineCoreRequest("prof", [rng.randrange(vocab) for _ in range(prompt)],
                                           _params(4)))
        with prof_ctx(activities=acts) as p:
            for _ in range(3):
                core.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        out["profile_device"] = p.key_averages().table(sort_by=key, row_limit=20)
        out["profile_host"] = p.key_averages().table(sort_by="self_cpu_time_total",
                                                     row_limit=20)
    core.abort_requests([f"r{i}" for i in range(running)])
    while core.has_unfinished_requests():
        core.step()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--arrivals", type=int, default=40)
    ap.add_argument("--async-scheduling", type=int, choices=(0, 1), default=1)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--compilation-config", default=None,
                    help='torch.compile as JSON, e.g. \'{"mode": 3, "cudagraph_mode": '
                         '"FULL_AND_PIECEWISE"}\' (default: off)')
    ap.add_argument("--max-mixed-cudagraph-tokens", type=int, default=None,
                    help="0: mixed steps run kernel by kernel (the eager engine before mixed "
                         "CUDA graphs; issue 25's baseline); default: the engine's")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="tidal-mixed-") as tmp:
        model = write_model_dir(ns.shape, Path(tmp) / ns.shape)
        args = EngineArgs(model=model, load_format="dummy", dtype=ns.dtype, device=ns.device,
                          max_model_len=ns.max_model_len, max_num_seqs=max(64, ns.running * 2),
                          enable_prefix_caching=False, async_scheduling=bool(ns.async_scheduling),
                          enforce_eager=ns.enforce_eager,
                          max_mixed_cudagraph_tokens=ns.max_mixed_cudagraph_tokens,
                          compilation_config=(json.loads(ns.compilation_config)
                                              if ns.compilation_config else None))
        core = EngineCore(args.create_config())
        result = {"benchmark": "mixed_steps", "device": device_name(), "shape": ns.shape,
                  "async_scheduling": bool(ns.async_scheduling), "enforce_eager": ns.enforce_eager,
                  "compilation_config": ns.compilation_config,
                  "max_mixed_cudagraph_tokens": ns.max_mixed_cudagraph_tokens,
                  **run(core, ns.running, ns.prompt, ns.every, ns.arrivals,
                        core.config.model.arch.vocab_size, rng, ns.profile)}
        core.shutdown()
    for k in ("profile_device", "profile_host"):
        if k in result:
            print(result[k])
    brief = {k: v for k, v in result.items() if not k.startswith("profile")}
    print(json.dumps(brief, indent=1))
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
