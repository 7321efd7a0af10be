"""Tensor-parallel checks and measurements on GPUs (driven by tools/gpu_distributed_check.sh).

    python tools/bench_tp.py equal --tp 1 2 4 --out equal.json
        greedy tokens of tiny random Llama and Qwen3 models (float32) at each TP size; they must
        equal TP=1's exactly.
    python tools/bench_tp.py perf --tp 2 --out perf_tp2.json [--requests 64] [--eager]
        a Llama-3.1-8B-shaped model with dummy weights (bf16): decode ms/step at batch 1, the
        all-reduce share of a decode step (torch profiler on every rank), and output tokens/s on
        the fixed-length 1024-in / 1024-out workload.
    python tools/bench_tp.py allreduce --tp 2 4 --out allreduce.json
        latency of one NCCL all-reduce of a decode step's hidden states, eager and in a graph.

Each invocation measures one TP size in a fresh process (GPU memory starts clean). Results are
JSON, merged by the shell driver into tools/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


# A small stand-in for a smoke run of this script on a CPU (--shape small --device cpu).
SMALL = dict(LLAMA_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=4, vocab_size=4096)


def _is_allreduce_kernel(name: str) -> bool:
    """NCCL's collectives, the one-shot symmetric-memory reduction or the signal-free one."""
    low = name.lower()
    return "nccl" in low or "all_reduce" in low


def _engine_kwargs(args: argparse.Namespace, tp: int) -> dict[str, Any]:
    eager, attention = args.eager, args.attention
    kw: dict[str, Any] = dict(skip_tokenizer_init=True, tensor_parallel_size=tp,
                              device=args.device, enforce_eager=eager)
    if args.device == "cpu":
        kw["cpu_threads"] = 1
    if tp > 1:
        kw["distributed_executor_backend"] = "mp"
    if attention:
        kw["attention_backend"] = attention
    return kw


# --- equality ----------------------------------------------------------------------------------


def cmd_equal(args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "tests"))
    import reference

    from tidal.frontend import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    solo = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(384) for _ in range(rng.randint(1, 100))] for _ in range(16)]
    out: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="tidal-tiny-"))
    for family in ("llama", "qwen3"):
        folder = root / family
        reference.make_tiny_model(family, folder)
        tokens: dict[int, list[list[int]]] = {}
        for tp in args.tp:
            start = time.perf_counter()
            llm = LLM(str(folder), dtype="float32", num_kv_blocks=512,
                      **_engine_kwargs(args, tp))
            try:
                tokens[tp] = [o.outputs[0].token_ids
                              for o in llm.generate(prompts, params, use_tqdm=False)]
                # Alone, each decode step is one row: the batch-1 kernels (and, with tensor
                # parallelism, the all-reduce fused into them) produce every token.
                tokens[tp] += [llm.generate([p], solo, use_tqdm=False)[0].outputs[0].token_ids
                               for p in prompts[:3]]
            finally:
                llm.shutdown()
            print(f"{family} tp={tp}: {time.perf_counter() - start:.1f} s", flush=True)
        base = tokens[args.tp[0]]
        out[family] = {f"tp{tp}": tokens[tp] == base for tp in args.tp[1:]}
        if 2 in args.tp and args.device == "cuda":
            # bf16 at TP=2: the signal-free all-reduce (forced on), the batch-1 all-reduces
            # fused into the GEMVs (opt-in), and the one-shot all-reduce. All round the float32
            # sum of two bf16 partials once, so the tokens must match.
            paths = {}
            for name, lamport, push in (("fused", "force", "1"), ("lamport", "force", "0"),
                                        ("one_shot", "0", "0")):
                # The workers read these at start-up.
                os.environ["TIDAL_LAMPORT_ALLREDUCE"] = lamport
                os.environ["TIDAL_PUSH_ALLREDUCE"] = push
                try:
                    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=512,
                              **_engine_kwargs(args, 2))
                finally:
                    os.environ.pop("TIDAL_LAMPORT_ALLREDUCE")
                    os.environ.pop("TIDAL_PUSH_ALLREDUCE")
                try:
                    paths[name] = [o.outputs[0].token_ids
                                   for o in llm.generate(prompts, params, use_tqdm=False)]
                    paths[name] += [llm.generate([p], solo, use_tqdm=False)[0].outputs[0]
                                    .token_ids for p in prompts[:3]]
                finally:
                    llm.shutdown()
            out[family]["bf16_tp2_lamport_equals_one_shot"] = paths["lamport"] == paths["one_shot"]
            out[family]["bf16_tp2_fused_equals_one_shot"] = paths["fused"] == paths["one_shot"]
        for tp in args.tp[1:]:
            if tokens[tp] != base:
                bad = [i for i, (a, b) in enumerate(zip(base, tokens[tp])) if a != b]
                out[family][f"tp{tp}_mismatched_prompts"] = bad
        print(f"{family}: {out[family]}", flush=True)
    out["all_equal"] = all(v for fam in ("llama", "qwen3") for k, v in out[fam].items()
                           if (k.startswith("tp") and "_" not in k) or k.startswith("bf16"))
    return out


# --- performance -------------------------------------------------------------------------------


def _decode_steps(core: Any, prompt: list[int], n: int, rid: str) -> list[float]:
    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.sampling_params import SamplingParams

    core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=n,
                                                                   ignore_eos=True)))
    times = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    return times[1:]  # the first step is the prefill


def _profile_decode(core: Any, prompt: list[int], n: int, trace_dir: str = "") -> dict[str, Any]:
    """All-reduce share of a batch-1 decode step, from the torch profiler on every rank; with
    ``trace_dir``, Chrome traces of every rank go there and ``tools/trace_steps.py`` breaks the
    step down along the device timeline (the kernel sums overlap under dependent launch)."""
    import torch

    executor = core.executor
    if hasattr(executor, "profile"):
        executor.profile(True)
        t0 = time.perf_counter()
        times = _decode_steps(core, prompt, n, "prof")
        wall = time.perf_counter() - t0
        summaries = executor.profile(False, trace_dir)
        ranks = [dict(rank=s.rank, device_us=s.device_us, comm_us=s.comm_us,
                      cpu_comm_us=s.cpu_comm_us, top=s.top[:8]) for s in summaries]
    else:  # in-process worker (TP=1): profile this process
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            t0 = time.perf_counter()
            times = _decode_steps(core, prompt, n, "prof")
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        if trace_dir:
            os.makedirs(trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(trace_dir, "trace_rank0.json"))
        dev = comm = 0.0
        kernels = []
        for ev in prof.key_averages():
            us = float(getattr(ev, "self_device_time_total", 0.0) or 0.0)
            if us > 0:
                dev += us
                kernels.append((ev.key[:120], us, int(ev.count)))
                if _is_allreduce_kernel(ev.key):
                    comm += us
        kernels.sort(key=lambda k: -k[1])
        ranks = [dict(rank=0, device_us=dev, comm_us=comm, cpu_comm_us=0.0, top=kernels[:8])]
    timelines = []
    if trace_dir:
        sys.path.insert(0, str(REPO / "tools"))
        from trace_steps import analyse

        # The trace starts with the prefill: analyse the last steps' worth of the timeline.
        tail = len(times) - 2
        window = tail * statistics.median(times) * 1e6
        for path in sorted(Path(trace_dir).glob("trace_rank*.json")):
            timelines.append(analyse(path, tail, window))
    steps = len(times) + 1
    step_ms = statistics.median(times) * 1e3
    # An all-reduce kernel runs from its launch until the last rank joins, so ranks that run
    # ahead (every rank but the output rank, which also samples and replies) count time spent
    # waiting for the slowest. The rank with the least all-reduce time is the one everybody
    # waits for: its figure is the collective's own cost.
    slowest = min(ranks, key=lambda r: r["comm_us"])
    comm_ms = slowest["comm_us"] / steps / 1e3
    dev_ms = slowest["device_us"] / steps / 1e3
    return dict(profiled_steps=steps, profiled_step_ms_median=step_ms,
                profiled_wall_s=wall, allreduce_ms_per_step=comm_ms,
                allreduce_ms_per_step_incl_waiting=max(r["comm_us"] for r in ranks) / steps / 1e3,
                device_kernel_ms_per_step=dev_ms, critical_rank=slowest["rank"],
                allreduce_share_of_step=comm_ms / step_ms if step_ms else None,
                allreduce_share_of_kernel_time=comm_ms / dev_ms if dev_ms else None,
                ranks=ranks, timelines=timelines)


def cmd_perf(args: argparse.Namespace) -> dict[str, Any]:
    from tidal.frontend import LLM, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="tidal-llama8b-"))
    (folder / "config.json").write_text(json.dumps(LLAMA_8B if args.shape == "8b" else SMALL))
    tp = args.tp[0]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    result: dict[str, Any] = dict(tp=tp, model=f"Llama-3.1-8B shape ({args.shape}), dummy "
                                  f"weights, {dtype}", device=args.device,
                                  eager=args.eager, attention=args.attention or "default")
    start = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", dtype=dtype, max_model_len=4096,
              max_num_seqs=max(args.requests, 8), **_engine_kwargs(args, tp))
    result["startup_s"] = time.perf_counter() - start
    result["executor"] = type(llm.engine.core.executor).__name__
    result["num_kv_blocks"] = llm.config.cache.num_blocks
    print(f"tp={tp}: engine up in {result['startup_s']:.1f} s", flush=True)
    core = llm.engine.core
    rng = random.Random(tp)
    prompt = [rng.randrange(100, 4000) for _ in range(32)]
    try:
        # Warm over the same context lengths as the timed steps: a Triton specialisation first
        # met inside the timed window costs a compile (seconds) in one of its steps.
        _decode_steps(core, prompt, args.decode_steps, "warm")
        times = _decode_steps(core, prompt, args.decode_steps, "decode")
        result["decode_batch1_ms_median"] = statistics.median(times) * 1e3
        result["decode_batch1_ms_mean"] = statistics.fmean(times) * 1e3
        result["decode_batch1_ms_p90"] = sorted(times)[int(0.9 * len(times))] * 1e3
        print(f"tp={tp}: decode batch 1: {result['decode_batch1_ms_median']:.3f} ms/step "
              "(median)", flush=True)
        try:
            trace_dir = (os.path.join(args.trace_dir, Path(args.out).stem) if args.trace_dir
                         else "")
            result["profile"] = _profile_decode(core, prompt, args.profile_steps, trace_dir)
            p = result["profile"]
            for t in p["timelines"]:
                cats = ", ".join(f"{k} {v:.0f}" for k, v in
                                 list(t.get("by_category_us_per_step", {}).items())[:8])
                print(f"tp={tp}: {t['trace']}: {t.get('per_step_us', 0):.0f} us/step on the "
                      f"device timeline, idle {t.get('idle_us_per_step', 0):.0f}: {cats}",
                      flush=True)
            print(f"tp={tp}: all-reduce {p['allreduce_ms_per_step']:.3f} ms/step "
                  f"({100 * (p['allreduce_share_of_step'] or 0):.1f}% of the step)", flush=True)
        except Exception as exc:  # noqa: BLE001 - the numbers above still count
            result["profile_error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        if args.requests:
            prompts = [[rng.randrange(100, 4000) for _ in range(args.input_len)]
                       for _ in range(args.requests)]
            # Untimed first pass over the same shapes and context lengths: the prefill and the
            # long-context decode kernels compile here (seconds on a cold Triton cache, up to
            # 12 % of the timed run otherwise, in the first process of a call).
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.output_len,
                                                 ignore_eos=True), use_tqdm=False)
            params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            n_out = sum(len(o.outputs[0].token_ids) for o in outs)
            result["throughput"] = dict(
                requests=args.requests, input_len=args.input_len, output_len=args.output_len,
                elapsed_s=elapsed, output_tok_s=n_out / elapsed,
                total_tok_s=(n_out + args.requests * args.input_len) / elapsed)
            print(f"tp={tp}: {args.requests} x {args.input_len}/{args.output_len}: "
                  f"{n_out / elapsed:.0f} output tok/s in {elapsed:.1f} s", flush=True)
    finally:
        llm.shutdown()
    return result


# --- all-reduce latency ----------------------------------------------------------------------


def _allreduce_rank(rank: int, world: int, port_q: Any, out_q: Any) -> None:
    import torch

    from tidal.worker.distributed.parallel_state import init_distributed, serve_store

    torch.cuda.set_device(rank)
    store = None
    if rank == 0:
        store = serve_store("127.0.0.1")
        for _ in range(world - 1):
            port_q.put(int(store.port))
        port = int(store.port)
    else:
        port = port_q.get()
    tp, _ = init_distributed(rank=rank, tp_size=world, pp_size=1, host="127.0.0.1", port=port,
                             device=torch.device("cuda", rank), store=store)
    res: dict[str, Any] = {}
    for rows in (1, 64):
        x = torch.ones(rows, 4096, dtype=torch.bfloat16, device="cuda")
        for _ in range(20):
            tp.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        for _ in range(200):
            tp.all_reduce(x)
        end.record()
        end.synchronize()
        res[f"eager_us_rows{rows}"] = start.elapsed_time(end) * 1e3 / 200
        try:  # the same 64 all-reduces a decode step makes, captured in one CUDA graph
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                with torch.cuda.graph(graph, stream=stream):
                    for _ in range(64):
                        tp.all_reduce(x)
            torch.cuda.current_stream().wait_stream(stream)
            graph.replay()
            torch.cuda.synchronize()
            start.record()
            for _ in range(20):
                graph.replay()
            end.record()
            end.synchronize()
            res[f"graph_us_rows{rows}"] = start.elapsed_time(end) * 1e3 / (20 * 64)
        except Exception as exc:  # noqa: BLE001 - reported
            res[f"graph_error_rows{rows}"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        out_q.put(res)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def cmd_allreduce(args: argparse.Namespace) -> dict[str, Any]:
    """Latency of one NCCL all-reduce of a decode step's hidden states (bf16, 4096 wide), eager
    and captured in a CUDA graph: what each of the 2 x layers all-reduces of a step costs."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {}
    for world in args.tp:
        port_q, out_q = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port_q, out_q))
                 for r in range(world)]
        for p in procs:
            p.start()
        res = out_q.get(timeout=120)
        for p in procs:
            p.join(30)
        out[f"tp{world}"] = res
        print(f"all-reduce tp={world}: {res}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["equal", "perf", "allreduce"])
    ap.add_argument("--tp", type=int, nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--attention", default=None, help="attention backend (torch|triton|cuda)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--shape", default="8b", choices=["8b", "small"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--decode-steps", type=int, default=200)
    ap.add_argument("--profile-steps", type=int, default=30)
    ap.add_argument("--trace-dir", default="",
                    help="write each rank's profiler trace here and break the step down")
    args = ap.parse_args()
    try:
        commands = {"equal": cmd_equal, "perf": cmd_perf, "allreduce": cmd_allreduce}
        result = commands[args.cmd](args)
        result["ok"] = True
    except Exception as exc:  # noqa: BLE001 - recorded, and the driver tries a fallback
        traceback.print_exc()
        result = dict(ok=False, error=f"{type(exc).__name__}: {exc}", tp=args.tp,
                      eager=args.eager, attention=args.attention)
    Path(args.out).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
