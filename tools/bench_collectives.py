"""Shared-memory collectives against gloo on this host's CPU (issue 28).

    python tools/bench_collectives.py ops [--sizes 4K,16K,...,16M] [--rounds 3] --out ops.json
        all_reduce (float32 sum), all_gather, broadcast and send/recv (one way: half a ping-pong)
        between 2 spawned ranks, for each size: per-call times in a back-to-back loop, gloo and
        shm alternated over ``--rounds`` rounds, medians of all calls.
    python tools/bench_collectives.py decode [--batches 1,8] --out decode.json
        CPU tensor parallelism (one thread per rank) of the default model (SmolLM2-135M) with
        --cpu-collectives gloo and shm: median decode step time, engines alternated, the greedy
        tokens of both compared with one worker's. SmolLM2-135M's 9 heads do not split over 2
        ranks, so it runs at TP=3, and its shape with 8 heads (random weights) at TP=2.
    python tools/bench_collectives.py all --out tools/results/collectives_2core.json
        both, one JSON, with the machine's load (``uptime``) before and after and the verdicts
        against the issue's targets (shm all-reduce >= 5x gloo for 4 KiB - 1 MiB; TP=2 decode
        >= 1.3x).

The machine may be shared: the load averages are recorded so the figures can be judged.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

from bench_common import judge  # noqa: E402

OPS = ("all_reduce", "all_gather", "broadcast", "send_recv")
DEFAULT_SIZES = "4K,16K,64K,256K,1M,4M,16M"


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def iterations(nbytes: int) -> int:
    """Calls per round: many for small sizes, enough for a median at 16 MiB."""
    return max(15, min(400, (64 << 20) // max(nbytes, 1)))


# --- ops: two spawned ranks ----------------------------------------------------------------------


class OpTiming(msgspec.Struct):
    op: str
    nbytes: int
    backend: str
    seconds: list[float]


def _rank_main(rank: int, sizes: list[int], rounds: int, conn: Connection) -> None:
    import torch

    from tidal.worker.distributed.parallel_state import (
        ParallelGroup,
        destroy_distributed,
        init_distributed,
        serve_store,
    )
    from tidal.worker.distributed.shm_collectives import ShmCollectives

    torch.set_num_threads(1)
    store = None
    if rank == 0:
        store = serve_store("127.0.0.1")
        conn.send_bytes(msgspec.msgpack.encode(int(store.port)))
    port = msgspec.msgpack.decode(conn.recv_bytes(), type=int)
    gloo, _ = init_distributed(rank=rank, tp_size=2, pp_size=1, host="127.0.0.1", port=port,
                               device=torch.device("cpu"), store=store)
    shm = ParallelGroup(rank=gloo.rank, world_size=2, ranks=gloo.ranks,
                        shm=ShmCollectives.create(gloo.cpu_group, gloo.rank, gloo.ranks))
    peer = 1 - rank
    out: list[OpTiming] = []
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.zeros(n)
        rows = torch.zeros(max(1, n // 64), 64) if n >= 64 else torch.zeros(1, n)
        for op in OPS:
            calls = {
                "all_reduce": lambda g: g.all_reduce(x),
                "all_gather": lambda g: g.all_gather(rows, dim=0),
                "broadcast": lambda g: g.broadcast(x, src=0),
            }
            seconds: dict[str, list[float]] = {"gloo": [], "shm": []}
            iters = iterations(nbytes)
            for r in range(rounds):
                # Alternate which backend goes first, so drift in the machine's load is shared.
                order = ("gloo", "shm") if r % 2 == 0 else ("shm", "gloo")
                for backend in order:
                    g = gloo if backend == "gloo" else shm
                    if op == "send_recv":
                        def call(g=g) -> None:
                            if rank == 0:
                                g.send(x, peer).wait()
                                g.recv(x, peer)
                            else:
                                g.recv(x, peer)
                                g.send(x, peer).wait()
                    else:
                        call = (lambda g=g, f=calls[op]: f(g))
                    for _ in range(max(3, iters // 10)):  # warm-up: page faults, caches
                        call()
                    gloo.barrier()
                    times = seconds[backend]
                    for _ in range(iters):
                        t0 = time.perf_counter()
                        call()
                        dt = time.perf_counter() - t0
                        times.append(dt / 2 if op == "send_recv" else dt)
            for backend, times in seconds.items():
                out.append(OpTiming(op, nbytes, backend, times))
        if rank == 0:
            progress(f"  {nbytes} bytes done")
    destroy_distributed(shm)
    if rank == 0:
        conn.send_bytes(msgspec.msgpack.encode(out))


def bench_ops(sizes: list[int], rounds: int) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(2):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_rank_main, args=(rank, sizes, rounds, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    port = conns[0].recv_bytes()
    for c in conns:
        c.send_bytes(port)
    timings = msgspec.msgpack.decode(conns[0].recv_bytes(), type=list[OpTiming])
    for p in procs:
        p.join(60)
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for t in timings:
        row = rows.setdefault((t.op, t.nbytes), {"op": t.op, "bytes": t.nbytes})
        row[f"{t.backend}_us"] = round(statistics.median(t.seconds) * 1e6, 2)
        row[f"{t.backend}_calls"] = len(t.seconds)
    for row in rows.values():
        row["speedup"] = round(row["gloo_us"] / row["shm_us"], 2)
    return list(rows.values())


# --- decode: TP=2 engines ----------------------------------------------------------------------


def _decode_steps(core: Any, batch: int, prompt_len: int, tokens: int,
                  seed: int) -> tuple[list[float], list[list[int]]]:
    """Per-step seconds of the steps where every request decodes, and the greedy tokens."""
    import random

    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = core.config.model.vocab_size
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(prompt_len)]
        core.add_request(EngineCoreRequest(request_id=f"r{seed}-{i}", prompt_token_ids=prompt,
                                           sampling_params=params))
    out_tokens: dict[str, list[int]] = {}
    steps: list[float] = []
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        out = core.step()
        dt = time.perf_counter() - t0
        decoding = all(len(out_tokens.get(o.request_id, [])) > 0 for o in out.outputs)
        for o in out.outputs:
            out_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if out.outputs and decoding and len(out.outputs) == batch:
            steps.append(dt)
    return steps, [out_tokens[k] for k in sorted(out_tokens)]


# SmolLM2-135M has 9 attention heads (3 KV heads): TP=3 divides them, TP=2 does not. TP=2 runs
# on its shape with 8 heads (2 KV heads) and random weights instead.
DECODE_VARIANTS: dict[str, dict[str, Any]] = {
    "smollm2_tp3": dict(tp=3, load_format="auto", hf_overrides={}),
    "smollm2_shape_8_heads_tp2": dict(tp=2, load_format="dummy",
                                      hf_overrides={"num_attention_heads": 8,
                                                    "num_key_value_heads": 2}),
}


def _engine(model: str | None, tp: int, backend: str, load_format: str,
            hf_overrides: dict[str, Any]) -> Any:
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.core import EngineCore

    args = EngineArgs(model=model, tensor_parallel_size=tp, device="cpu", cpu_threads=1,
                      distributed_executor_backend="mp" if tp > 1 else None,
                      cpu_collectives=backend if tp > 1 else "auto", max_model_len=1024,
                      num_kv_blocks=256, load_format=load_format, hf_overrides=hf_overrides)
    return EngineCore(args.create_config())


def bench_decode(variant: str, batches: list[int], prompt_len: int, tokens: int, rounds: int,
                 model: str | None) -> dict[str, Any]:
    spec = DECODE_VARIANTS[variant]
    tp = spec["tp"]
    steps: dict[str, dict[int, list[float]]] = {"gloo": {}, "shm": {}}
    outputs: dict[str, dict[int, list[list[int]]]] = {"gloo": {}, "shm": {}, "tp1": {}}
    name = ""
    progress(f"decode {variant}: TP=1 for the reference tokens")
    core = _engine(model, 1, "auto", spec["load_format"], spec["hf_overrides"])
    try:
        for b in batches:
            outputs["tp1"][b] = _decode_steps(core, b, prompt_len, tokens, seed=b)[1]
    finally:
        core.shutdown()
    for r in range(rounds):
        order = ("gloo", "shm") if r % 2 == 0 else ("shm", "gloo")
        for backend in order:
            progress(f"decode {variant} round {r + 1}/{rounds}: TP={tp} over {backend}")
            core = _engine(model, tp, backend, spec["load_format"], spec["hf_overrides"])
            name = core.config.model.served_model_name
            try:
                _decode_steps(core, 1, 8, 4, seed=-1)  # warm-up
                for b in batches:
                    s, toks = _decode_steps(core, b, prompt_len, tokens, seed=b)
                    steps[backend].setdefault(b, []).extend(s)
                    outputs[backend][b] = toks
            finally:
                core.shutdown()
    result: dict[str, Any] = {"model": name, "tensor_parallel_size": tp,
                              "load_format": spec["load_format"],
                              "hf_overrides": spec["hf_overrides"], "cpu_threads_per_rank": 1,
                              "prompt_len": prompt_len, "tokens": tokens, "rounds": rounds,
                              "batches": {}}
    for b in batches:
        gloo_ms = statistics.median(steps["gloo"][b]) * 1e3
        shm_ms = statistics.median(steps["shm"][b]) * 1e3
        result["batches"][str(b)] = {
            "gloo_step_ms": round(gloo_ms, 3), "shm_step_ms": round(shm_ms, 3),
            "gloo_steps": len(steps["gloo"][b]), "shm_steps": len(steps["shm"][b]),
            "speedup": round(gloo_ms / shm_ms, 3),
            "same_greedy_tokens_gloo_shm": outputs["gloo"][b] == outputs["shm"][b],
            # TP=1 sums each projection in one GEMM, TP>1 in per-rank parts added up: random
            # weights' near-ties can flip a token (the real checkpoint's margins are wider).
            "same_greedy_tokens_as_tp1": outputs["shm"][b] == outputs["tp1"][b],
        }
    return result


# --- report ----------------------------------------------------------------------------------


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["ops", "decode", "all"])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated, e.g. 4K,1M")
    ap.add_argument("--rounds", type=int, default=3, help="gloo/shm alternations")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48, help="tokens generated per request")
    ap.add_argument("--decode-rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(DECODE_VARIANTS),
                    help=f"decode engines: {', '.join(DECODE_VARIANTS)}")
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import torch

    report: dict[str, Any] = {
        "benchmark": "collectives",
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch": torch.__version__,
        "uptime_before": uptime(),
    }
    values: dict[str, float | None] = {"all_reduce_min_speedup_4K_1M": None,
                                       "tp2_decode_speedup_batch1": None,
                                       "tp3_decode_speedup_batch1": None}
    if args.cmd in ("ops", "all"):
        sizes = [parse_size(s) for s in args.sizes.split(",")]
        progress(f"ops: sizes {sizes}, {args.rounds} rounds")
        report["ops"] = bench_ops(sizes, args.rounds)
        small = [r["speedup"] for r in report["ops"]
                 if r["op"] == "all_reduce" and 4 << 10 <= r["bytes"] <= 1 << 20]
        values["all_reduce_min_speedup_4K_1M"] = min(small) if small else None
        report["uptime_after_ops"] = uptime()
    if args.cmd in ("decode", "all"):
        batches = [int(b) for b in args.batches.split(",")]
        report["decode"] = {v: bench_decode(v, batches, args.prompt_len, args.tokens,
                                            args.decode_rounds, args.model)
                            for v in args.variants.split(",")}
        for v, key in (("smollm2_shape_8_heads_tp2", "tp2_decode_speedup_batch1"),
                       ("smollm2_tp3", "tp3_decode_speedup_batch1")):
            first = report["decode"].get(v, {}).get("batches", {}).get("1")
            values[key] = first["speedup"] if first else None
        report["uptime_after_decode"] = uptime()
    report["targets"] = judge({
        "all_reduce_min_speedup_4K_1M": (">=", 5.0, "shm all-reduce / gloo, slowest ratio over "
                                                    "4 KiB - 1 MiB"),
        "tp2_decode_speedup_batch1": (">=", 1.3, "CPU TP=2 decode step, gloo / shm, batch 1 "
                                                 "(SmolLM2's shape with 8 heads)"),
        "tp3_decode_speedup_batch1": (">=", 1.3, "CPU TP=3 decode step of SmolLM2, gloo / shm, "
                                                 "batch 1 (3 ranks on this host's cores)"),
    }, values)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    if "ops" in report:
        print(f"\n{'op':12}{'bytes':>10}{'gloo us':>12}{'shm us':>12}{'x':>8}")
        for r in report["ops"]:
            print(f"{r['op']:12}{r['bytes']:>10}{r['gloo_us']:>12.1f}{r['shm_us']:>12.1f}"
                  f"{r['speedup']:>8.2f}")


if __name__ == "__main__":
    main()
