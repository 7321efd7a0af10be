"""--cpu-offload-gb benchmark (issue 28): batch-1 decode step time with weights streamed from
pinned host memory, against the bound the copies set.

Measures, in one run on one GPU:
1. host -> device bandwidth of pinned copies (``--copy-mib`` per copy, the median of several);
2. the all-GPU batch-1 decode step (median over ``--steps`` steps after ``--warmup``);
3. the same step with ``--offload-gb`` of the weights in host memory (whole decoder layers, from
   the last backwards; ``worker/cpu_offload.py``), and how many bytes that is.

Target (one H100, Llama-3.1-8B shape, dummy bf16 weights, ``--offload-gb 8``): offloaded step
<= 1.2 x (offloaded bytes / bandwidth + all-GPU step). Prints one JSON object with the verdict.
``--smoke`` runs the tiny shape on a CPU with the offloader's CPU mode (host = device = CPU):
its figures mean nothing, the verdict stays n/a.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_common import device_name, dump, judge, write_model_dir

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--offload-gb", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per engine")
    p.add_argument("--warmup", type=int, default=3, help="decode steps before timing")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--copy-mib", type=int, default=1024, help="bytes of each timed H2D copy")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs in either engine (default: graphs, the copies inside)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def h2d_bandwidth(mib: int, repeats: int = 5) -> float | None:
    """GB/s of one pinned host -> device copy of ``mib`` MiB (the median)."""
    if not torch.cuda.is_available():
        return None
    host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return (mib << 20) / statistics.median(times[1:]) / 1e9


def decode_steps(core: EngineCore, args: argparse.Namespace, vocab: int) -> list[float]:
    """Seconds of each decode step of one request (after the prompt and ``--warmup`` steps)."""
    prompt = [(7 * i + 3) % (vocab - 3) + 3 for i in range(args.prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=args.warmup + args.steps + 2,
                            ignore_eos=True)
    core.add_request(EngineCoreRequest("r0", prompt, params))
    core.step()  # the prompt
    times = []
    while core.has_unfinished_requests():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        core.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[args.warmup:args.warmup + args.steps]


def engine(args: argparse.Namespace, model: str, offload_gb: float) -> EngineCore:
    eargs = EngineArgs(model=model, load_format="dummy", max_model_len=512, num_kv_blocks=64,
                       max_num_seqs=4, max_num_batched_tokens=512,
                       # (batch-1 decode graphs only: each capture of the offloaded model
                       # streams every offloaded layer twice)
                       max_mixed_cudagraph_tokens=0,
                       enforce_eager=args.enforce_eager or args.smoke,
                       cpu_offload_gb=offload_gb, enable_prefix_caching=False)
    return EngineCore(eargs.create_config())


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        args.shape = "tiny"
    with tempfile.TemporaryDirectory() as tmp:
        return _run(args, write_model_dir(args.shape, Path(tmp) / args.shape))


def _smoke_offloader(budget: int):
    """On a CPU the flag is a no-op: the runner gets the offloader's CPU mode instead."""
    from tidal.worker.cpu_offload import LayerOffloader
    from tidal.worker.model_runner import ModelRunner
    from tidal.worker.models.decoder import layer_range

    def offloader(self):
        start, end = layer_range(self.arch.num_layers, self.pp)
        return LayerOffloader(budget, self.device, tuple(range(start, end)), pin=False)

    original = ModelRunner._cpu_offloader
    ModelRunner._cpu_offloader = offloader
    return lambda: setattr(ModelRunner, "_cpu_offloader", original)


def _run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "cpu_offload", "device": device_name(),
                              "shape": args.shape, "offload_gb": args.offload_gb,
                              "cuda_graphs": not (args.enforce_eager or args.smoke),
                              "smoke": args.smoke}
    progress("host -> device bandwidth")
    bw = h2d_bandwidth(args.copy_mib)
    result["h2d_GBps"] = None if bw is None else round(bw, 2)
    progress("all-GPU engine")
    core = engine(args, model, 0.0)
    vocab = core.config.model.arch.vocab_size
    base = decode_steps(core, args, vocab)
    core.shutdown()
    del core
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    progress(f"engine with --cpu-offload-gb {args.offload_gb}")
    restore = _smoke_offloader(int(args.offload_gb * 2**30)) if args.smoke else None
    try:
        t0 = time.perf_counter()
        core = engine(args, model, args.offload_gb)
        startup = time.perf_counter() - t0
        off = core.executor.worker.runner.cpu_offload
        offloaded = 0 if off is None else off.offloaded_bytes
        layers = 0 if off is None else off.num_offloaded
        steps = decode_steps(core, args, vocab)
        core.shutdown()
    finally:
        if restore is not None:
            restore()
    base_s, off_s = statistics.median(base), statistics.median(steps)
    result.update({
        "all_gpu_step_ms": round(base_s * 1e3, 3),
        "offload_step_ms": round(off_s * 1e3, 3),
        "offloaded_bytes": offloaded, "offloaded_layers": layers,
        "offload_engine_startup_s": round(startup, 2),
    })
    bound = None
    if bw is not None and offloaded:
        bound = offloaded / (bw * 1e9) + base_s
        result["bound_ms"] = round(bound * 1e3, 3)
        result["copy_ms"] = round(offloaded / (bw * 1e9) * 1e3, 3)
    ratio = None if bound is None else round(off_s / bound, 3)
    result["ratio_to_bound"] = ratio
    result["targets"] = judge({
        "ratio_to_bound": ("<=", 1.2, "offloaded batch-1 step / (offloaded bytes / H2D "
                           "bandwidth + all-GPU step)"),
    }, {"ratio_to_bound": ratio if torch.cuda.is_available() else None})
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    dump(run(args), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
