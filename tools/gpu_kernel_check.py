"""Build the CUDA extension and microbenchmark tidal's GPU kernels (driven by gpu_kernel_check.sh).

    python tools/gpu_kernel_check.py build --out build.json
    python tools/gpu_kernel_check.py bench --out kernel_bench.json

``bench`` measures, in one run: the HBM ceiling (a 2 GiB device-to-device copy, bytes read +
written), paged-attention decode for the Triton and CUDA backends at batch 1/64/256 x context
1024 on the Qwen3-0.6B attention shape (16 q heads, 8 KV heads, head 128, bf16, block 16) as
achieved KV bandwidth, prefill attention throughput, and the fused ops. Kernel times come from
CUDA-graph replays (launch gaps excluded, as in a captured decode step) timed with CUDA events;
each timed call reads a different KV set, so the working set exceeds the L2 cache. Prints a
table and writes one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

QWEN3 = {"num_heads": 16, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "hidden": 1024, "ffn": 3072}


def cmd_build(args: argparse.Namespace) -> int:
    from tidal.worker.ops.cuda_ext import build_result

    t0 = time.perf_counter()
    res = build_result()
    info = {
        "ok": res.module is not None,
        "build_seconds": round(res.seconds, 2),
        "wall_seconds": round(time.perf_counter() - t0, 2),
        "arch": res.arch,
        "build_dir": res.build_dir,
        "error": res.error,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    print(json.dumps(info, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(info, f, indent=1)
    return 0 if info["ok"] else 1


# ----------------------------------------------------------------------------- timing helpers


def _events_ms(run: Callable[[], None], reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_calls(calls: list[Callable[[], None]], reps: int = 10) -> dict[str, float]:
    """Median/min/max ms per call over ``reps`` replays of a graph holding all ``calls``."""
    for c in calls:  # warm-up: compiles, allocator
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        run = graph.replay
        mode = "graph"
    except Exception as exc:  # fall back to eager launches, say so in the result
        print(f"  (graph capture failed: {exc}; timing eager launches)", file=sys.stderr)

        def run() -> None:
            for c in calls:
                c()

        mode = "eager"
    run()
    torch.cuda.synchronize()
    per_call = [t / len(calls) for t in _events_ms(run, reps)]
    return {
        "ms": statistics.median(per_call),
        "ms_min": min(per_call),
        "ms_max": max(per_call),
        "mode": mode,
    }


def hbm_ceiling() -> dict[str, float]:
    n = 2 * 1024**3
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = _events_ms(lambda: dst.copy_(src), 10)
    ms = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * n, "ms": ms, "GBps": 2 * n / ms / 1e6}


# ----------------------------------------------------------------------------- attention


def _paged_sets(
    batch: int, ctx: list[int], q_lens: list[int], n_sets: int, shape: dict[str, int], dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """One KV cache holding ``n_sets`` disjoint, shuffled block sets, and a metadata per set."""
    from tidal.worker.attention.backend import AttentionMetadata

    bs, hkv, d, h = shape["block_size"], shape["num_kv_heads"], shape["head_dim"], shape["num_heads"]
    need = [-(-c // bs) for c in ctx]
    per_set = sum(need)
    ids = list(range(per_set * n_sets))
    random.Random(seed).shuffle(ids)
    kv = torch.empty((2, per_set * n_sets, bs, hkv, d), dtype=dtype, device="cuda").normal_()
    num_tokens = sum(q_lens)
    query = torch.randn((num_tokens, h, d), dtype=dtype, device="cuda")
    qsl = np.zeros(batch + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q_lens)
    seq_np = np.asarray(ctx, dtype=np.int32)
    metas = []
    for s in range(n_sets):
        table = torch.zeros((batch, max(need)), dtype=torch.int32)
        k = s * per_set
        for i, n in enumerate(need):
            table[i, :n] = torch.tensor(ids[k : k + n], dtype=torch.int32)
            k += n
        metas.append(
            AttentionMetadata(
                num_actual_tokens=num_tokens,
                num_reqs=batch,
                max_query_len=max(q_lens),
                max_seq_len=max(ctx),
                query_start_loc=torch.from_numpy(qsl).cuda(),
                seq_lens=torch.from_numpy(seq_np).cuda(),
                block_table=table.cuda(),
                slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device="cuda"),
                query_start_loc_cpu=qsl,
                seq_lens_cpu=seq_np,
                num_decodes=batch if max(q_lens) == 1 else 0,
            )
        )
    return query, kv, metas


def _impls() -> dict[str, Any]:
    from tidal.worker.attention.triton_attn import TritonAttention

    impls: dict[str, Any] = {"triton": TritonAttention()}
    try:
        from tidal.worker.attention.cuda_attn import CudaAttention

        impls["cuda"] = CudaAttention()
    except Exception as exc:
        print(f"  cuda backend unavailable: {exc}", file=sys.stderr)
    return impls


def bench_decode(ceiling: float, shape: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    dtype = torch.bfloat16
    h, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    scale = d**-0.5
    impls = _impls()
    for batch in (1, 64, 256):
        ctx = [1024] * batch
        kv_bytes = 2 * batch * 1024 * hkv * d * 2  # K and V, bf16
        # Enough distinct sets that one replay streams >= 256 MiB (5x the L2), at most 16 sets.
        n_sets = max(2, min(16, math.ceil(256 * 2**20 / kv_bytes)))
        query, kv, metas = _paged_sets(batch, ctx, [1] * batch, n_sets, shape, dtype, seed=batch)
        out = torch.empty_like(query)
        for name, impl in impls.items():
            calls = [
                (lambda m=m, impl=impl: impl.forward(query, kv, m, scale, out)) for m in metas
            ]
            t = time_calls(calls)
            gbps = kv_bytes / t["ms"] / 1e6
            rows.append(
                {
                    "kernel": f"decode/{name}",
                    "batch": batch,
                    "context": 1024,
                    "kv_bytes": kv_bytes,
                    **t,
                    "GBps": gbps,
                    "frac_of_ceiling": gbps / ceiling,
                }
            )
        # Dense reference: torch SDPA over contiguous K/V of the same sizes (no paging).
        q4 = torch.randn((batch, h, 1, d), dtype=dtype, device="cuda")
        kd = [torch.randn((batch, hkv, 1024, d), dtype=dtype, device="cuda") for _ in range(min(n_sets, 4))]
        vd = [torch.randn_like(k) for k in kd]
        calls = [
            (lambda k=k, v=v: torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True))
            for k, v in zip(kd, vd)
        ]
        try:
            t = time_calls(calls)
            gbps = kv_bytes / t["ms"] / 1e6
            rows.append({"kernel": "decode/torch_sdpa_dense", "batch": batch, "context": 1024,
                         "kv_bytes": kv_bytes, **t, "GBps": gbps, "frac_of_ceiling": gbps / ceiling})  # fmt: skip
        except Exception as exc:
            print(f"  sdpa dense decode failed: {exc}", file=sys.stderr)
        del kv, kd, vd
        torch.cuda.empty_cache()
    return rows


def bench_prefill(shape: dict[str, int]) -> list[dict[str, Any]]:
    rows = []
    dtype = torch.bfloat16
    h, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    scale = d**-0.5
    impls = _impls()
    cases = {
        "4x2048 prompts": ([2048] * 4, [2048] * 4),
        "2048-token chunk of an 8192 context": ([2048], [8192]),
    }
    for label, (q_lens, ctx) in cases.items():
        # Causal pairs: query j of a request sees ctx - q + j + 1 positions.
        pairs = sum(sum(c - q + j + 1 for j in range(q)) for q, c in zip(q_lens, ctx))
        flops = 4 * h * d * pairs
        query, kv, metas = _paged_sets(len(q_lens), ctx, q_lens, 2, shape, dtype, seed=7)
        out = torch.empty_like(query)
        for name, impl in impls.items():
            calls = [(lambda m=m, impl=impl: impl.forward(query, kv, m, scale, out)) for m in metas]
            t = time_calls(calls, reps=5)
            rows.append({"kernel": f"prefill/{name}", "case": label, "tokens": sum(q_lens), **t,
                         "TFLOPs": flops / t["ms"] / 1e9})  # fmt: skip
        if len(set(q_lens)) == 1 and q_lens == ctx:
            b, n = len(q_lens), q_lens[0]
            q4 = torch.randn((b, h, n, d), dtype=dtype, device="cuda")
            k4 = torch.randn((b, hkv, n, d), dtype=dtype, device="cuda")
            v4 = torch.randn_like(k4)
            try:
                t = time_calls(
                    [lambda: torch.nn.functional.scaled_dot_product_attention(
                        q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)],
                    reps=5,
                )  # fmt: skip
                rows.append({"kernel": "prefill/torch_sdpa_dense", "case": label, "tokens": b * n, **t,
                             "TFLOPs": flops / t["ms"] / 1e9})  # fmt: skip
            except Exception as exc:
                print(f"  sdpa dense prefill failed: {exc}", file=sys.stderr)
        del kv
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- fused ops


def bench_ops(ceiling: float, shape: dict[str, int]) -> list[dict[str, Any]]:
    from tidal.worker.ops import torch_ops

    impls: dict[str, Any] = {"torch": torch_ops}
    from tidal.worker.ops import triton_ops

    impls["triton"] = triton_ops
    from tidal.worker.ops.cuda_ext import load_extension

    if load_extension() is not None:
        from tidal.worker.ops import cuda_ops

        impls["cuda"] = cuda_ops
    tokens, hidden, ffn = 8192, shape["hidden"], shape["ffn"]
    h, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    dt = torch.bfloat16
    sets = 4  # rotate inputs so the working set is not L2-resident
    xs = [torch.randn(tokens, hidden, dtype=dt, device="cuda") for _ in range(sets)]
    rs = [torch.randn(tokens, hidden, dtype=dt, device="cuda") for _ in range(sets)]
    w = torch.randn(hidden, dtype=dt, device="cuda")
    gs = [torch.randn(tokens, 2 * ffn, dtype=dt, device="cuda") for _ in range(sets)]
    qkvs = [torch.randn(tokens, (h + 2 * hkv) * d, dtype=dt, device="cuda") for _ in range(sets)]
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    fr = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    cache = torch.cat((fr.cos(), fr.sin()), -1)
    e = 2  # bytes per bf16 element
    cases = {
        "rms_norm": (lambda m, i: m.rms_norm(xs[i], w, 1e-6), 2 * tokens * hidden * e),
        "fused_add_rms_norm": (lambda m, i: m.fused_add_rms_norm(xs[i], rs[i], w, 1e-6), 4 * tokens * hidden * e),
        "silu_and_mul": (lambda m, i: m.silu_and_mul(gs[i]), 3 * tokens * ffn * e),
        "rotary_embedding": (
            lambda m, i: m.rotary_embedding(
                pos, qkvs[i][:, : h * d].view(tokens, h, d), qkvs[i][:, h * d : (h + hkv) * d].view(tokens, hkv, d),
                cache, True),
            2 * tokens * (h + hkv) * d * e,
        ),
    }  # fmt: skip
    rows = []
    for op, (fn, nbytes) in cases.items():
        for name, mod in impls.items():
            t = time_calls([(lambda i=i, mod=mod, fn=fn: fn(mod, i)) for i in range(sets)])
            gbps = nbytes / t["ms"] / 1e6
            rows.append({"kernel": f"op/{op}/{name}", "tokens": tokens, "bytes": nbytes, **t,
                         "GBps": gbps, "frac_of_ceiling": gbps / ceiling})  # fmt: skip
    # write_kv: this step's K/V of 8192 tokens into random slots of a big cache.
    from tidal.worker.ops import triton_attention_kernels as tk

    bs = shape["block_size"]
    blocks = 4 * tokens // bs
    kvc = torch.empty((2, blocks, bs, hkv, d), dtype=dt, device="cuda")
    slots = torch.randperm(blocks * bs, device="cuda")[:tokens]
    kv_rows = [(q[:, h * d : (h + hkv) * d].view(tokens, hkv, d), q[:, (h + hkv) * d :].view(tokens, hkv, d)) for q in qkvs]
    k_flat, v_flat = kvc[0].view(-1, hkv, d), kvc[1].view(-1, hkv, d)

    def torch_write(i: int) -> None:
        # write_kv_reference minus its padding check, which syncs the host (not capturable).
        k_flat.index_copy_(0, slots, kv_rows[i][0])
        v_flat.index_copy_(0, slots, kv_rows[i][1])

    wk = {
        "torch": torch_write,
        "triton": lambda i: tk.write_kv(kv_rows[i][0], kv_rows[i][1], kvc[0], kvc[1], slots),
    }
    if "cuda" in impls:
        ext = load_extension()
        wk["cuda"] = lambda i: ext.reshape_and_cache(kv_rows[i][0], kv_rows[i][1], kvc[0], kvc[1], slots)
    nbytes = 2 * 2 * tokens * hkv * d * e
    for name, fn in wk.items():
        t = time_calls([(lambda i=i, fn=fn: fn(i)) for i in range(sets)])
        gbps = nbytes / t["ms"] / 1e6
        rows.append({"kernel": f"op/write_kv/{name}", "tokens": tokens, "bytes": nbytes, **t,
                     "GBps": gbps, "frac_of_ceiling": gbps / ceiling})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- batch-1 decode

# (name, N, K, how the engine runs it at batch 1): every decode projection of the two shapes.
DECODE1_GEMVS = [
    ("qwen3/qkv", 4096, 1024, "norm"), ("qwen3/o", 1024, 2048, ""),
    ("qwen3/gate_up", 6144, 1024, "silu"), ("qwen3/down", 1024, 3072, ""),
    ("llama8b/qkv", 6144, 4096, "norm"), ("llama8b/o", 4096, 4096, ""),
    ("llama8b/gate_up", 28672, 4096, "silu"), ("llama8b/down", 4096, 14336, ""),
    # Gemma's norms are (1 + w), run apart (plain GEMVs); its GeGLU is the gate/up GEMV's
    # epilogue (issue 19).
    ("gemma2_9b/qkv", 8192, 3584, ""), ("gemma2_9b/o", 3584, 4096, ""),
    ("gemma2_9b/gate_up", 28672, 3584, "gelu"), ("gemma2_9b/down", 3584, 14336, ""),
    ("gemma3_12b/qkv", 8192, 3840, ""), ("gemma3_12b/o", 3840, 4096, ""),
    ("gemma3_12b/gate_up", 30720, 3840, "gelu"), ("gemma3_12b/down", 3840, 15360, ""),
    # Speculative drafters' one-row passes (issue 21; `--gemvs draft/`): Llama-3.2-1B as a
    # draft model, and Llama-3.1-8B's EAGLE-3 head (fc over three hidden states, q/k/v over
    # two, its LM head over the 32k draft vocabulary; the rest are the 8B's own shapes). On an
    # H200 the sweep beat the default rule on five of them by 5-30 %, but with those shapes
    # neither drafter sped up end to end
    # (tools/results/spec_h200_draft_gemv_shapes_not_adopted.json).
    ("draft/llama1b_qkv", 3072, 2048, "norm"), ("draft/llama1b_o", 2048, 2048, ""),
    ("draft/llama1b_gate_up", 16384, 2048, "silu"), ("draft/llama1b_down", 2048, 8192, ""),
    ("draft/eagle3_fc", 4096, 12288, ""), ("draft/eagle3_qkv", 6144, 8192, ""),
    ("draft/llama1b_lm_head", 128256, 2048, ""), ("draft/eagle3_lm_head", 32000, 4096, ""),
]  # fmt: skip
GEMV_SWEEP = [(2, 2048, 4), (4, 512, 4), (4, 1024, 4), (4, 2048, 4), (8, 512, 4), (8, 1024, 4),
              (16, 512, 4), (16, 512, 8), (2, 1024, 4), (4, 256, 4), (8, 256, 4), (2, 4096, 8),
              (4, 1024, 8), (8, 512, 8)]  # fmt: skip


def bench_decode1(ceiling: float, sweep: bool = True, only: str = "") -> list[dict[str, Any]]:
    """Batch-1 decode pieces: the one-row GEMV (cuBLAS vs the Triton kernel, plain and with the
    fusions the engine uses, plus a launch-shape sweep), split-KV attention at batch 1 with the
    fused merge on/off, the fused q/k-norm + rotary + K/V write against the four kernels it
    replaces, and the two-stage argmax. Weights rotate over enough copies to stream >= 256 MiB
    per replay (the L2 holds 50 MB), as consecutive layers do."""
    import torch.nn.functional as F

    from tidal.worker.ops import triton_decode as td
    from tidal.worker.ops import triton_ops, torch_ops

    rows: list[dict[str, Any]] = []
    dt = torch.bfloat16
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def add(kernel: str, case: str, nbytes: int, t: dict[str, float], **extra: Any) -> None:
        gbps = nbytes / t["ms"] / 1e6
        rows.append({"kernel": kernel, "case": case, "bytes": nbytes, **t, "GBps": gbps,
                     "frac_of_ceiling": gbps / ceiling, **extra})  # fmt: skip

    for name, n, k, kind in DECODE1_GEMVS:
        if only and only not in name:
            continue
        nbytes = n * k * 2
        copies = max(2, min(48, math.ceil(256 * 2**20 / nbytes)))
        ws = [torch.randn((n, k), device=dev, dtype=dt) for _ in range(copies)]
        x = torch.randn((1, k), device=dev, dtype=dt)
        r = torch.randn((1, k), device=dev, dtype=dt)
        nw = torch.randn(k, device=dev, dtype=dt)
        silu, gelu = kind == "silu", kind == "gelu"
        gated = silu or gelu
        add("gemv/cublas", name, nbytes, time_calls([(lambda w=w: F.linear(x, w)) for w in ws]))
        if silu:  # what the engine ran before: norm, cuBLAS (split-K + reduce), SiLU
            old = [(lambda w=w: triton_ops.silu_and_mul(F.linear(
                triton_ops.fused_add_rms_norm(x, r, nw, 1e-6)[0], w))) for w in ws]
        elif gelu:  # cuBLAS, then the GeGLU kernel (the engine before ran the plain GEMV)
            old = [(lambda w=w: triton_ops.gelu_tanh_and_mul(F.linear(x, w))) for w in ws]
        elif kind == "norm":
            old = [(lambda w=w: F.linear(triton_ops.fused_add_rms_norm(x, r, nw, 1e-6)[0], w))
                   for w in ws]  # fmt: skip
        else:
            old = None
        if old is not None:
            add("gemv/cublas" + ("+geglu" if gelu else "+norm" + ("+silu" if silu else "")),
                name, nbytes, time_calls(old))
        act = "_silu" if silu else "_geglu" if gelu else ""
        cfg = td.gemv_config(n // 2 if gated else n, k, gated, 2, sms)
        add("gemv/triton" + act, name, nbytes,
            time_calls([(lambda w=w: td.gemv(x, w, silu=silu, gelu=gelu)) for w in ws]),
            config=cfg)
        norm = kind in ("silu", "norm")
        if norm:
            add("gemv/triton_norm" + ("_silu" if silu else ""), name, nbytes, time_calls(
                [(lambda w=w: td.gemv(x, w, norm_weight=nw, residual=r, eps=1e-6, silu=silu))
                 for w in ws]), config=cfg)  # fmt: skip
        if sweep:  # launch shapes of the variant the engine runs (with its norm / SiLU)
            nwv, rv = (nw, r) if norm else (None, None)
            for c in GEMV_SWEEP:
                if c == cfg or c[1] > max(64, 1 << (k - 1).bit_length()):
                    continue
                try:
                    t = time_calls([(lambda w=w, c=c: td.gemv(
                        x, w, norm_weight=nwv, residual=rv, eps=1e-6, silu=silu, gelu=gelu,
                        config=c))
                        for w in ws])  # fmt: skip
                except Exception as exc:  # a launch shape that does not compile
                    rows.append({"kernel": "sweep/gemv", "case": name, "config": c,
                                 "error": str(exc)[:200]})  # fmt: skip
                    continue
                add("sweep/gemv" + ("_norm" if norm else "") + act, name, nbytes, t, config=c)
        del ws
        torch.cuda.empty_cache()

    # Split-KV decode attention at batch 1, context 1024, both shapes' head layouts.
    import dataclasses

    from tidal.worker.ops import triton_attention_kernels as tk
    from tidal.worker.ops.attention_plan import plan_triton_attention

    for label, heads, kv_heads in (("qwen3", 16, 8), ("llama8b", 32, 8)):
        shape = dict(QWEN3, num_heads=heads, num_kv_heads=kv_heads)
        kv_bytes = 2 * 1024 * kv_heads * 128 * 2
        query, kv, metas = _paged_sets(1, [1024], [1], 16, shape, dt, seed=5)
        out = torch.empty_like(query)
        base = plan_triton_attention(1, 1, 1, heads, kv_heads, 128, dt, query.device)
        for fused, early_v in ((False, True), (True, True)):
            plan = dataclasses.replace(base, early_v=early_v)
            calls = [
                (lambda m=m, p=plan, f=fused: tk.paged_attention(
                    query, kv[0], kv[1], m.block_table, m.seq_lens, m.query_start_loc, 1,
                    128**-0.5, out, p, fused_merge=f))
                for m in metas
            ]  # fmt: skip
            add("decode1/attention", f"{label} fused_merge={int(fused)} early_v={int(early_v)}",
                kv_bytes, time_calls(calls), splits=base.num_splits)  # fmt: skip
        del kv
        torch.cuda.empty_cache()

    # q/k norm + rotary + K/V write for one token against the separate kernels.
    from tidal.worker.layers.rotary import build_cos_sin_cache

    for label, heads, kv_heads, norm in (("qwen3", 16, 8, True), ("llama8b", 32, 8, False)):
        d = 128
        cs = build_cos_sin_cache(d, 4096, 1e6, None).to(dev)
        qkvs = [torch.randn((1, (heads + 2 * kv_heads) * d), device=dev, dtype=dt)
                for _ in range(8)]  # fmt: skip
        pos = torch.tensor([1000], device=dev)
        qw = torch.randn(d, device=dev, dtype=dt)
        kw = torch.randn(d, device=dev, dtype=dt)
        cache = torch.zeros((2, 512, 16, kv_heads, d), device=dev, dtype=dt)
        slots = torch.tensor([777], device=dev)
        nbytes = (heads + 2 * kv_heads) * d * 2 + (heads + 2 * kv_heads) * d * 2

        def unfused(qkv, heads=heads, kv_heads=kv_heads, norm=norm, cs=cs, cache=cache,
                    slots=slots, qw=qw, kw=kw, pos=pos, d=d):
            q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q, k = q.reshape(1, heads, d), k.reshape(1, kv_heads, d)
            if norm:
                q, k = triton_ops.rms_norm(q, qw, 1e-6), triton_ops.rms_norm(k, kw, 1e-6)
            q, k = triton_ops.rotary_embedding(pos, q, k, cs, True)
            tk.write_kv(k, v.reshape(1, kv_heads, d), cache[0], cache[1], slots)

        add("decode1/qk_norm_rope_kv", f"{label} unfused", nbytes,
            time_calls([(lambda q=q: unfused(q)) for q in qkvs]))
        add("decode1/qk_norm_rope_kv", f"{label} fused", nbytes, time_calls(
            [(lambda q=q: td.qk_norm_rope_write_kv(q, pos, heads, kv_heads, d,
                                                   qw if norm else None, kw if norm else None,
                                                   1e-6, cs, cache, slots)) for q in qkvs]))  # fmt: skip

    # Greedy argmax over one row of logits.
    for label, vocab in (("qwen3", 151936), ("llama8b", 128256)):
        logits = [torch.randn((1, vocab), device=dev, dtype=dt) for _ in range(8)]
        add("decode1/argmax", f"{label} torch", vocab * 2,
            time_calls([(lambda x=x: torch_ops.argmax(x)) for x in logits]))
        add("decode1/argmax", f"{label} triton", vocab * 2,
            time_calls([(lambda x=x: td.argmax(x)) for x in logits]))
    return rows


# Llama-3.1-8B per-rank GEMV shapes under tensor parallelism (n outputs, k, kind): q/k/v and
# gate/up split their outputs, o and down their inputs.
LLAMA8B_TP_GEMVS = {
    tp: [("qkv", (4096 + 2 * 1024) // tp, 4096, "norm"), ("o", 4096, 4096 // tp, ""),
         ("gate_up", 2 * 14336 // tp, 4096, "silu"), ("down", 4096, 14336 // tp, "")]
    for tp in (1, 2, 4)
}  # fmt: skip
TP_GEMV_SWEEP = [(bn, bk, w) for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048, 4096)
                 for w in (4, 8) if bn * bk <= 8192 and not (w == 8 and bn * bk < 2048)]


def bench_decode1_tp(ceiling: float) -> list[dict[str, Any]]:
    """Batch-1 GEMVs of one tensor-parallel rank of Llama-3.1-8B (TP 1/2/4): each shape with the
    launch shape the engine picks and a sweep of others, then a whole decode step's GEMV chain
    (32 layers x q/k/v with its norm, o, gate/up with norm + SiLU, down; weights of every layer
    resident) in one graph, with the engine's launch shapes and with the sweep's best ones. The
    chain is the GEMV floor of a rank's decode step: what tensor parallelism can divide."""
    from tidal.worker.ops import triton_decode as td

    rows: list[dict[str, Any]] = []
    dt, dev = torch.bfloat16, "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn((1, 14336), device=dev, dtype=dt)
    r = torch.randn((1, 4096), device=dev, dtype=dt)
    nw = torch.randn(4096, device=dev, dtype=dt)

    def call(w, kind, k, cfg):
        silu = kind == "silu"
        if kind:
            return lambda: td.gemv(x[:, :k], w, norm_weight=nw, residual=r, eps=1e-6, silu=silu,
                                   config=cfg)
        return lambda: td.gemv(x[:, :k], w, config=cfg)

    for tp, shapes in LLAMA8B_TP_GEMVS.items():
        best: dict[str, tuple[int, int, int]] = {}
        for name, n, k, kind in shapes:
            nbytes = n * k * 2
            copies = max(2, min(48, math.ceil(256 * 2**20 / nbytes)))
            ws = [torch.randn((n, k), device=dev, dtype=dt) for _ in range(copies)]
            n_out = n // 2 if kind == "silu" else n
            engine_cfg = td.gemv_config(n_out, k, kind == "silu", 2, sms)
            timed = []
            # TP=1's shapes were tuned with bench_decode1's sweep: only the engine's pick here.
            sweep = [c for c in TP_GEMV_SWEEP if c != engine_cfg[:3]] if tp > 1 else []
            for c in [engine_cfg] + sweep:
                if c[1] > max(64, 1 << (k - 1).bit_length()):
                    continue
                try:
                    t = time_calls([call(w, kind, k, c) for w in ws])
                except Exception as exc:  # a launch shape that does not compile
                    rows.append({"kernel": "tp/gemv", "case": f"tp{tp}/{name}", "config": c,
                                 "error": str(exc)[:200]})  # fmt: skip
                    continue
                timed.append((t["ms"], c))
                rows.append({"kernel": "tp/gemv" + ("/engine" if c == engine_cfg else ""),
                             "case": f"tp{tp}/{name}", "config": c, "bytes": nbytes, **t,
                             "GBps": nbytes / t["ms"] / 1e6,
                             "frac_of_ceiling": nbytes / t["ms"] / 1e6 / ceiling})  # fmt: skip
            best[name] = min(timed)[1]
            print(f"tp{tp} {name} {n}x{k}: engine {engine_cfg} {timed[0][0] * 1e3:.1f} us, "
                  f"best {best[name]} {min(timed)[0] * 1e3:.1f} us")
            del ws
            torch.cuda.empty_cache()
        layers = [{name: torch.randn((n, k), device=dev, dtype=dt) for name, n, k, _ in shapes}
                  for _ in range(32)]
        step_bytes = sum(n * k * 2 for _, n, k, _ in shapes) * 32
        for label, pick in (("engine", None), ("best", best)):
            calls = []
            for lw in layers:
                for name, n, k, kind in shapes:
                    calls.append(call(lw[name], kind, k, pick[name] if pick else None))
            t = time_calls(calls, reps=20)
            ms = t["ms"] * len(calls)
            rows.append({"kernel": "tp/gemv_chain", "case": f"tp{tp} {label}", "bytes": step_bytes,
                         "ms": ms, "ms_min": t["ms_min"] * len(calls),
                         "ms_max": t["ms_max"] * len(calls), "GBps": step_bytes / ms / 1e6,
                         "frac_of_ceiling": step_bytes / ms / 1e6 / ceiling,
                         "configs": pick or "engine"})  # fmt: skip
            print(f"tp{tp} chain ({label}): {ms:.3f} ms per step, {step_bytes / ms / 1e6:.0f} GB/s")
        del layers
        torch.cuda.empty_cache()
    return rows


NORM_SWEEP = [(bn, bk, w) for bn in (2, 4, 8) for bk in (512, 1024, 2048) for w in (4, 8)
              if bn * bk <= 8192 and not (w == 8 and bn * bk < 2048)]


def bench_decode1_norm(ceiling: float, sweep: bool = True,
                       budget_s: float = 360.0) -> list[dict[str, Any]]:
    """Where the RMSNorm of a batch-1 decode step goes, on one rank of Llama-3.1-8B at TP 1/2:
    a whole step's GEMV chain (32 layers, weights resident, one graph) with

    - ``prologue``: the norm (and residual add) as the prologue of the q/k/v and gate/up GEMVs,
      every program reading the whole row (the engine before this section existed);
    - ``add-norm kernel``: a one-program add + RMSNorm kernel before plain GEMVs (at TP>1 after
      the all-reduce; ``triton_decode.add_rms_norm_row``);
    - ``ss from all-reduce`` (TP>1): the all-reduce adds the residual and writes each chunk's
      sum of squares; the GEMV norms its input from those few numbers;

    each with one or two weight chunks fetched before the wait for the previous kernel, then
    with launch shapes swept for the variant (``sweep``; stops after ``budget_s``). The
    all-reduce runs with one rank (its buffers on this GPU): the kernels and their boundaries,
    not NVLink."""
    from tidal.worker.ops import triton_allreduce as ta
    from tidal.worker.ops import triton_decode as td

    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    dt, dev = torch.bfloat16, "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn((1, 14336), device=dev, dtype=dt)
    h = torch.randn((1, 4096), device=dev, dtype=dt)
    r = torch.randn((1, 4096), device=dev, dtype=dt)
    nw = torch.randn(4096, device=dev, dtype=dt)
    ss = torch.rand(8, device=dev) * 4096
    row = ta.CHUNK * ta.MAX_PROGRAMS
    buf = torch.full((2, 1, row), ta.SENTINEL, dtype=torch.int16, device=dev)
    ptrs = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=dev)
    counts = torch.zeros(ta.MAX_PROGRAMS, dtype=torch.int32, device=dev)
    ar_out = torch.empty_like(h)
    ss_out = torch.zeros(8, device=dev)

    def ar() -> None:
        ta.lamport_all_reduce(h, ar_out, ptrs, counts, 0, 1, row)

    def ar_ss() -> None:
        ta.lamport_all_reduce(h, ar_out, ptrs, counts, 0, 1, row, residual=r, sum_squares=ss_out)

    def add_norm() -> None:
        td.add_rms_norm_row(h, r, nw, 1e-6)

    def gemv(w, k, kind, mode, prefetch, cfg):
        silu = kind == "silu"
        if kind and mode == "prologue":
            return lambda: td.gemv(x[:, :k], w, norm_weight=nw, residual=r, eps=1e-6,
                                   silu=silu, prefetch=prefetch, config=cfg)
        if kind and mode == "ss":
            return lambda: td.gemv(x[:, :k], w, norm_weight=nw, eps=1e-6, silu=silu,
                                   norm_ss=ss, prefetch=prefetch, config=cfg)
        return lambda: td.gemv(x[:, :k], w, silu=silu, prefetch=prefetch, config=cfg)

    # variant -> (kernels before a normed GEMV, how that GEMV norms), per TP
    plans = {1: {"prologue": ([], "prologue"), "add-norm kernel": ([add_norm], "plain")},
             2: {"prologue": ([ar], "prologue"), "add-norm kernel": ([ar, add_norm], "plain"),
                 "ss from all-reduce": ([ar_ss], "ss")}}
    for tp in (1, 2):
        shapes = {name: (n, k, kind) for name, n, k, kind in LLAMA8B_TP_GEMVS[tp]}
        layers = [{name: torch.randn((n, k), device=dev, dtype=dt)
                   for name, (n, k, _) in shapes.items()} for _ in range(32)]
        step_bytes = sum(n * k * 2 for n, k, _ in shapes.values()) * 32

        def chain(before, mode, prefetch, cfgs):
            calls = []
            for lw in layers:
                for name, (n, k, kind) in shapes.items():
                    if kind:
                        calls.extend(before)
                    calls.append(gemv(lw[name], k, kind, mode if kind else "plain", prefetch,
                                      cfgs.get(name)))
            return calls

        def record(label, calls):
            t = time_calls(calls, reps=20)
            ms = t["ms"] * len(calls)
            rows.append({"kernel": "tp/norm_chain", "case": f"tp{tp} {label}",
                         "bytes": step_bytes, "ms": ms, "ms_min": t["ms_min"] * len(calls),
                         "ms_max": t["ms_max"] * len(calls), "GBps": step_bytes / ms / 1e6,
                         "frac_of_ceiling": step_bytes / ms / 1e6 / ceiling,
                         "kernels": len(calls)})  # fmt: skip
            print(f"tp{tp} {label}: {ms * 1e3:.0f} us per step ({len(calls)} kernels)")

        for label, (before, mode) in plans[tp].items():
            for prefetch in (1, 2):
                record(f"{label} prefetch{prefetch}", chain(before, mode, prefetch, {}))
        record("gemvs alone prefetch2", chain([], "plain", 2, {}))
        for label, fn in (("all-reduce", ar), ("all-reduce + ss", ar_ss), ("add-norm", add_norm)):
            if tp == 1 and label != "add-norm":
                continue
            t = time_calls([fn] * 64, reps=20)
            rows.append({"kernel": "tp/norm_kernel", "case": f"tp{tp} {label}", "ms": t["ms"],
                         "ms_min": t["ms_min"], "ms_max": t["ms_max"]})
            print(f"tp{tp} {label}: {t['ms'] * 1e3:.2f} us")
        if not sweep:
            continue
        # Launch shapes per variant: each GEMV alone, 48 copies back to back.
        for label, (before, mode) in plans[tp].items():
            if label == "prologue":
                continue
            best: dict[str, tuple[int, int, int]] = {}
            pick_prefetch: dict[str, int] = {}
            for name, (n, k, kind) in shapes.items():
                n_out = n // 2 if kind == "silu" else n
                engine_cfg = td.gemv_config(n_out, k, kind == "silu", 2, sms)[:3]
                timed = []
                for prefetch in (1, 2):
                    for c in [engine_cfg] + [c for c in NORM_SWEEP if c != engine_cfg]:
                        if time.perf_counter() - t_start > budget_s:
                            break
                        try:
                            t = time_calls([gemv(layers[i][name], k, kind,
                                                 mode if kind else "plain", prefetch, c)
                                            for i in range(32)], reps=10)
                        except Exception as exc:  # noqa: BLE001 - a shape that does not build
                            print(f"  {name} {c}: {type(exc).__name__}", file=sys.stderr)
                            continue
                        timed.append((t["ms"], prefetch, c))
                if not timed:
                    continue
                ms, pf, c = min(timed)
                best[name], pick_prefetch[name] = c, pf
                eng = [t for t in timed if t[1] == 1 and t[2] == engine_cfg]
                rows.append({"kernel": "tp/norm_gemv_best", "case": f"tp{tp}/{name} {label}",
                             "config": c, "prefetch": pf, "ms": ms, "ms_min": ms, "ms_max": ms,
                             "engine_config_ms": eng[0][0] if eng else None,
                             "tried": len(timed)})  # fmt: skip
                print(f"tp{tp} {label} {name}: best {c} prefetch{pf} {ms * 1e3:.2f} us"
                      f" (engine shape {eng[0][0] * 1e3 if eng else float('nan'):.2f}, "
                      f"{len(timed)} tried)")
            if len(best) == len(shapes):
                for pf in sorted(set(pick_prefetch.values())):
                    # (one prefetch depth per chain: the kernels share it)
                    record(f"{label} tuned prefetch{pf}", chain(before, mode, pf, best))
        layers.clear()
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------- config sweeps


def bench_sweep(ceiling: float, shape: dict[str, int]) -> list[dict[str, Any]]:
    """Launch-configuration sweeps that the planners' defaults were chosen from."""
    import dataclasses

    from tidal.worker.ops import triton_attention_kernels as tk
    from tidal.worker.ops.attention_plan import plan_triton_attention
    from tidal.worker.ops.cuda_ext import load_extension

    ext = load_extension()
    dtype = torch.bfloat16
    h, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    scale = d**-0.5
    rows: list[dict[str, Any]] = []

    def triton_calls(query, kv, metas, out, plan):
        return [
            (lambda m=m: tk.paged_attention(query, kv[0], kv[1], m.block_table, m.seq_lens,
                                            m.query_start_loc, m.num_reqs, scale, out, plan))
            for m in metas
        ]  # fmt: skip

    # Decode: number of context splits (runtime argument of both kernels: no recompiles).
    for batch, ctx_len in ((1, 1024), (1, 8192), (16, 1024), (64, 1024)):
        kv_bytes = 2 * batch * ctx_len * hkv * d * 2
        n_sets = max(2, min(16, math.ceil(256 * 2**20 / kv_bytes)))
        query, kv, metas = _paged_sets(batch, [ctx_len] * batch, [1] * batch, n_sets, shape, dtype, seed=3)
        out = torch.empty_like(query)
        base = plan_triton_attention(query.shape[0], batch, 1, h, hkv, d, dtype, query.device)
        for splits in (1, 2, 4, 8, 16):
            plan = dataclasses.replace(base, num_splits=splits)
            t = time_calls(triton_calls(query, kv, metas, out, plan))
            rows.append({"kernel": "sweep/decode_splits/triton", "batch": batch, "context": ctx_len,
                         "splits": splits, "default": base.num_splits, **t,
                         "GBps": kv_bytes / t["ms"] / 1e6})  # fmt: skip
        if ext is not None:
            for splits in (1, 2, 4, 8, 16, 32):
                parts = (
                    torch.empty((query.shape[0], h, splits, d), dtype=torch.float32, device="cuda"),
                    torch.empty((query.shape[0], h, splits), dtype=torch.float32, device="cuda"),
                    torch.empty((query.shape[0], h, splits), dtype=torch.float32, device="cuda"),
                )
                calls = [
                    (lambda m=m, sp=splits, pb=parts: ext.paged_attention_decode(
                        out, query, kv[0], kv[1], m.block_table, m.seq_lens, m.query_start_loc,
                        batch, scale, sp, pb[0] if sp > 1 else None, pb[1] if sp > 1 else None,
                        pb[2] if sp > 1 else None))
                    for m in metas
                ]  # fmt: skip
                t = time_calls(calls)
                rows.append({"kernel": "sweep/decode_splits/cuda", "batch": batch, "context": ctx_len,
                             "splits": splits, **t, "GBps": kv_bytes / t["ms"] / 1e6})  # fmt: skip
        del kv
        torch.cuda.empty_cache()

    # Decode tiles/warps/stages at bandwidth-bound batch sizes.
    for batch in (64, 256):
        kv_bytes = 2 * batch * 1024 * hkv * d * 2
        n_sets = max(2, min(16, math.ceil(256 * 2**20 / kv_bytes)))
        query, kv, metas = _paged_sets(batch, [1024] * batch, [1] * batch, n_sets, shape, dtype, seed=4)
        out = torch.empty_like(query)
        base = plan_triton_attention(query.shape[0], batch, 1, h, hkv, d, dtype, query.device)
        for tile_n, warps, stages in ((64, 4, 3), (32, 4, 3), (128, 4, 3), (64, 2, 3), (64, 4, 2),
                                      (64, 4, 4), (128, 8, 3), (32, 2, 4)):  # fmt: skip
            plan = dataclasses.replace(base, tile_n=tile_n, num_warps=warps, num_stages=stages)
            t = time_calls(triton_calls(query, kv, metas, out, plan))
            rows.append({"kernel": "sweep/decode_cfg/triton", "batch": batch, "tile_n": tile_n,
                         "num_warps": warps, "num_stages": stages, **t, "GBps": kv_bytes / t["ms"] / 1e6,
                         "frac_of_ceiling": kv_bytes / t["ms"] / 1e6 / ceiling})  # fmt: skip
        del kv
        torch.cuda.empty_cache()

    # Prefill tile shapes.
    q_lens = [2048] * 4
    pairs = sum(sum(j + 1 for j in range(q)) for q in q_lens)
    flops = 4 * h * d * pairs
    query, kv, metas = _paged_sets(4, q_lens, q_lens, 2, shape, dtype, seed=8)
    out = torch.empty_like(query)
    base = plan_triton_attention(query.shape[0], 4, 2048, h, hkv, d, dtype, query.device)
    for block_m, tile_n, warps, stages in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 3),
                                           (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3),
                                           (128, 64, 8, 4), (64, 128, 4, 2)):  # fmt: skip
        plan = dataclasses.replace(base, block_m=block_m, block_q=block_m // (h // hkv), tile_n=tile_n,
                                   num_warps=warps, num_stages=stages,
                                   grid0=query.shape[0] // (block_m // (h // hkv)) + 4)  # fmt: skip
        try:
            t = time_calls(triton_calls(query, kv, metas, out, plan), reps=5)
        except Exception as exc:  # e.g. out of shared memory for a large tile
            rows.append({"kernel": "sweep/prefill_cfg/triton", "block_m": block_m, "tile_n": tile_n,
                         "num_warps": warps, "num_stages": stages, "error": str(exc)[:200]})  # fmt: skip
            continue
        rows.append({"kernel": "sweep/prefill_cfg/triton", "case": "4x2048", "block_m": block_m,
                     "tile_n": tile_n, "num_warps": warps, "num_stages": stages, **t,
                     "TFLOPs": flops / t["ms"] / 1e9})  # fmt: skip
    return rows


def cmd_bench(args: argparse.Namespace) -> int:
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "shape": QWEN3,
    }
    try:
        import triton

        result["triton"] = triton.__version__
    except Exception:
        result["triton"] = None
    ceil = hbm_ceiling()
    result["hbm_copy"] = ceil
    print(f"device {props.name}: d2d copy {ceil['GBps']:.0f} GB/s (read+write of 2 GiB)")
    sections = [("decode", lambda: bench_decode(ceil["GBps"], QWEN3)), ("prefill", lambda: bench_prefill(QWEN3)),
                ("ops", lambda: bench_ops(ceil["GBps"], QWEN3)),
                ("decode1", lambda: bench_decode1(ceil["GBps"], sweep=args.sweep, only=args.gemvs)),
                ("decode1_tp", lambda: bench_decode1_tp(ceil["GBps"])),
                ("decode1_norm", lambda: bench_decode1_norm(ceil["GBps"], sweep=args.sweep))]  # fmt: skip
    if args.sweep:
        sections.append(("sweep", lambda: bench_sweep(ceil["GBps"], QWEN3)))
    if args.sections:
        keep = args.sections.split(",")
        sections = [sec for sec in sections if sec[0] in keep]
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as exc:
            import traceback

            traceback.print_exc()
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print("\nkernel                          case                  ms (min-max)          GB/s   %ceil  TFLOP/s")
    for name, _ in sections:
        rows = result.get(name)
        if not isinstance(rows, list):
            print(f"{name}: {rows}")
            continue
        for r in rows:
            if "ms" not in r:
                print(f"{r['kernel']:<31} {r}")
                continue
            case = r.get("case") or f"b={r.get('batch', r.get('tokens'))}"
            knobs = [f"{k}={r[k]}" for k in ("context", "splits", "block_m", "tile_n", "num_warps", "num_stages", "config")
                     if k in r and not (k == "context" and r[k] == 1024 and "splits" not in r)]  # fmt: skip
            if knobs:
                case = f"{case} " + " ".join(knobs).replace("num_warps", "w").replace("num_stages", "st")
            frac = r.get("frac_of_ceiling", r["GBps"] / ceil["GBps"]) if "GBps" in r else 0.0
            gb = f"{r['GBps']:7.0f}  {100 * frac:5.1f}" if "GBps" in r else " " * 14
            tf = f"{r['TFLOPs']:7.1f}" if "TFLOPs" in r else ""
            print(f"{r['kernel']:<31} {case:<21} {r['ms']:8.4f} ({r['ms_min']:.4f}-{r['ms_max']:.4f})"
                  f" {gb} {tf}")  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out")
    c = sub.add_parser("bench")
    c.add_argument("--out")
    c.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    c.add_argument("--gemvs", default="",
                   help="decode1: only the GEMVs whose case name holds this (e.g. gemma3_12b)")
    c.add_argument("--sections", default="",
                   help="comma-separated subset of decode,prefill,ops,decode1,decode1_tp,decode1_norm,"
                        "sweep (default: all)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    return cmd_build(args) if args.cmd == "build" else cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
