"""KV capacity of the hybrid KV cache manager: how many tokens of a long context fit, against the
same model with every layer's KV kept whole (``--disable-hybrid-kv-cache-manager``).

    python tools/bench_kv_capacity.py --dry-run                    # arithmetic, any machine
    python tools/bench_kv_capacity.py --shape gemma3-27b --context 32768 \\
        --tensor-parallel-size 2 --gpu-memory-utilization 0.9      # on GPUs, dummy weights
    python tools/bench_kv_capacity.py --shape mistral-7b --context 32768   # one H100
    python tools/bench_kv_capacity.py --dry-run --kv-cache-dtype fp8   # FP8 KV: 1 byte a value

(Gemma-3-27B's bf16 weights take 54 GB: on one 80 GB GPU the all-full layout cannot hold even
one 32k request, so run it with two GPUs, or compare at equal ``--kv-gib``.)

Shapes (HF config dicts below): Gemma-3-27B (10 global / 52 local layers, window 1024),
Mistral-7B-v0.1 (every layer windowed at 4096), Gemma-2-9B (alternating, window 4096); their
context is raised to ``--context`` where the checkpoint's is shorter (capacity only).

``--dry-run`` works from the block accounting alone: the KV bytes of one pool block in each
layout (``kv_groups``), the pool that ``--kv-gib`` of KV memory holds, the blocks one request
of ``--context`` tokens keeps while it decodes, and a simulation that fills the real KV cache
managers (``HybridKVCacheManager`` / ``KVCacheManager``) with such requests, prefilled in chunks
of ``--chunk`` tokens, until the pool refuses one. Without ``--dry-run`` an in-process engine is
started per layout (dummy weights, the KV memory what ``--gpu-memory-utilization`` leaves, or
``--kv-gib``), given more requests of ``--context`` tokens than fit, and stepped until they
finish; reported is the most context the running requests held at once. The ratio of the two
layouts is the capacity gain (issue 19 targets at 32k: Gemma-3-27B >= 4.5x with padding waste
<= 5 %, Mistral-7B >= 6x).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import SHAPES as COMMON_SHAPES  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-27b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262208, "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "max_position_embeddings": 131072, "sliding_window": 1024,
        "query_pre_attn_scalar": 168, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "torch_dtype": "bfloat16",
        "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    },
    "mistral-7b": {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 32768, "sliding_window": 4096, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": False,
    },
    "gemma2-9b": COMMON_SHAPES["gemma-2-9b"],  # (bench_latency measures its speed)
    # For the CPU: the engine path of this tool on a Gemma 3 layout, shrunk (CI runs it).
    "tiny-gemma3": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 512,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 512, "sliding_window": 32, "query_pre_attn_scalar": 16,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rms_norm_eps": 1e-6,
        "torch_dtype": "float32", "eos_token_id": 1, "bos_token_id": 2,
        "tie_word_embeddings": True,
    },
}
REAL_SHAPES = ("gemma3-27b", "mistral-7b", "gemma2-9b")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(slots=True)
class Capacity:
    shape: str
    layout: str  # "hybrid" | "all-full"
    context: int
    groups: str  # kv_groups' description
    group_size: int
    padding_waste: float
    bytes_per_block: int
    pool_blocks: int
    blocks_per_request: int  # held while decoding at the full context
    requests: int  # that fit at once (arithmetic)
    tokens: int  # requests * context
    null_blocks: int = 0  # the pool's one null block, when windowed groups need it
    simulated_requests: int | None = None  # the managers filled for real (dry run)
    measured_tokens: int | None = None  # the engine's peak (GPU run)
    measured_requests: int | None = None


def shape_config(name: str, context: int) -> dict[str, Any]:
    cfg = dict(SHAPES[name])
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], context)
    return cfg


def arithmetic(name: str, context: int, kv_bytes: int, block_size: int, hybrid: bool,
               tp: int = 1, dtype: str = "bfloat16", kv_cache_dtype: str = "auto") -> Capacity:
    """``kv_cache_dtype``: "auto" (the model's ``dtype``) or an FP8 one (one byte a value;
    the per-layer scales live outside the pool)."""
    from tidal.engine_core.kv_groups import layout_for
    from tidal.engine_core.model_arch import arch_from_hf_dict

    arch = arch_from_hf_dict(shape_config(name, context), name)
    layout = layout_for(arch, hybrid, context)
    heads = max(1, arch.num_kv_heads // tp)
    from tidal.engine_core.kv_cache_dtype import resolve_kv_cache_dtype

    value_bytes = DTYPE_BYTES[dtype] if resolve_kv_cache_dtype(kv_cache_dtype) == "auto" else 1
    per_block = 2 * layout.group_size * block_size * heads * arch.head_dim * value_bytes
    pool = kv_bytes // per_block
    per_req = layout.blocks_per_seq(context, block_size)
    null = 1 if layout.has_sliding else 0
    # The null block is shared: blocks_per_seq counts it once per request, the pool once.
    reqs = max(0, (pool - null) // (per_req - null)) if per_req > null else 0
    return Capacity(name, "hybrid" if hybrid else "all-full", context, layout.describe(),
                    layout.group_size, layout.padding_waste, per_block, pool, per_req, reqs,
                    reqs * context, null)


def simulate(name: str, context: int, pool: int, block_size: int, hybrid: bool,
             chunk: int, limit: int = 10_000) -> int:
    """Requests of ``context`` tokens the real KV cache manager admits at once: each prefilled
    in ``chunk``-token steps, then one decode step (a sliding group gives back what its chunks
    took beyond the window), until an allocation is refused."""
    from tidal.engine_core.hybrid_kv_cache_manager import HybridKVCacheManager
    from tidal.engine_core.kv_cache_manager import KVCacheManager
    from tidal.engine_core.kv_groups import layout_for
    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.request import Request
    from tidal.engine_core.sampling_params import SamplingParams

    layout = layout_for(arch_from_hf_dict(shape_config(name, context), name), hybrid, context)
    kv: Any = (HybridKVCacheManager(layout, pool, block_size) if layout.hybrid
               else KVCacheManager(pool, block_size))
    held = 0
    while held < limit:
        # Distinct tokens per request (no prefix sharing; caching is off anyway).
        prompt = [(held * 7919 + i) % 30000 for i in range(context - 1)]
        req = Request.from_engine_request(
            EngineCoreRequest(f"r{held}", prompt, SamplingParams(max_tokens=1)),
            context, frozenset())
        done = 0
        while done < context - 1:
            n = min(chunk, context - 1 - done)
            if kv.allocate_slots(req, n) is None:
                return held
            done += n
            req.num_computed_tokens = done
        req.all_token_ids.append(1)  # the sampled token, decoded at the last position
        if kv.allocate_slots(req, 1) is None:
            return held
        req.num_computed_tokens = context
        held += 1
    return held


def measure(name: str, context: int, hybrid: bool, ns: argparse.Namespace) -> tuple[int, int,
                                                                                      int]:
    """Start an engine on dummy weights, fill it with requests of ``context`` tokens; returns
    (pool blocks, most tokens held by running requests at once, most running requests)."""
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.core import EngineCore
    from tidal.engine_core.protocol import EngineCoreRequest
    from tidal.engine_core.sampling_params import SamplingParams

    folder = Path(tempfile.mkdtemp(prefix=f"kvcap-{name}-"))
    (folder / "config.json").write_text(json.dumps(shape_config(name, context)))
    kw: dict[str, Any] = dict(
        model=str(folder), load_format="dummy", dtype=ns.dtype, max_model_len=context,
        block_size=ns.block_size, gpu_memory_utilization=ns.gpu_memory_utilization,
        tensor_parallel_size=ns.tensor_parallel_size, enable_prefix_caching=False,
        max_num_seqs=ns.max_num_seqs, max_num_batched_tokens=ns.chunk,
        disable_hybrid_kv_cache_manager=not hybrid, device=ns.device,
        kv_cache_dtype=ns.kv_cache_dtype)
    if ns.kv_gib:
        kw["kv_cache_memory_bytes"] = int(ns.kv_gib * 2**30)
    core = EngineCore(EngineArgs(**kw).create_config())
    try:
        pool = core.config.cache.num_blocks or 0
        layout = core.config.kv_layout()
        per_req = layout.blocks_per_seq(context, ns.block_size)
        null = 1 if layout.has_sliding else 0
        # What the measured pool holds by the arithmetic, and a few more to keep it full.
        n_reqs = ns.requests or ((pool - null) // max(1, per_req - null) + 4)
        # Requests must stay resident while the others prefill (a token budget of ``chunk``
        # per step), or the engine never holds them all at once: decode that long.
        decode = ns.decode_tokens or min(context // 2,
                                         n_reqs * -(-context // ns.chunk) + 8)
        params = SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True)
        for i in range(n_reqs):
            prompt = [(i * 7919 + j) % 500 for j in range(context - decode)]
            core.add_request(EngineCoreRequest(f"fill{i}", prompt, params))
        peak_tokens = peak_running = 0
        start = time.monotonic()
        while core.has_unfinished_requests():
            core.step()
            running = core.scheduler.running
            peak_running = max(peak_running, len(running))
            peak_tokens = max(peak_tokens, sum(r.num_computed_tokens for r in running))
            if time.monotonic() - start > ns.max_seconds:
                print(f"{name}: stopped after {ns.max_seconds} s", file=sys.stderr)
                break
        return pool, peak_tokens, peak_running
    finally:
        core.shutdown()


def measure_in_child(name: str, context: int, hybrid: bool,
                     ns: argparse.Namespace) -> tuple[int, int, int]:
    """``measure`` in a child process of its own on a GPU: the next layout's engine then starts
    on a GPU the previous one has left (an engine's memory is not all returned by its
    shutdown). On the CPU (and so in the tests, which load this file by path, where a child
    could not import it) in this process."""
    import multiprocessing

    import torch

    if ns.device == "cpu" or not torch.cuda.is_available():
        return measure(name, context, hybrid, ns)
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, name, context, hybrid, ns).result()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--dry-run", action="store_true",
                   help="block accounting only (CPU, no model); else start engines")
    p.add_argument("--kv-gib", type=float, default=None,
                   help="KV memory per GPU; default: 40 with --dry-run, else what "
                        "--gpu-memory-utilization leaves")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (token budget)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_BYTES))
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="the engine's --kv-cache-dtype (fp8: one byte a value, the capacity "
                        "doubles against bfloat16)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--device", default="auto")
    p.add_argument("--requests", type=int, default=0,
                   help="requests to send (GPU run); default: what the engine's pool holds by "
                        "the arithmetic, + 4")
    p.add_argument("--decode-tokens", type=int, default=0,
                   help="tokens each request decodes (its prompt is the rest of the context); "
                        "default: long enough for all requests to be resident at once")
    p.add_argument("--max-seconds", type=float, default=900.0)
    p.add_argument("--no-simulate", action="store_true", help="dry run: arithmetic only")
    p.add_argument("--json", default=None, help="also write the results here")
    ns = p.parse_args(argv)
    shapes = list(REAL_SHAPES) if ns.shape == "all" else [ns.shape]
    kv_bytes = int((ns.kv_gib if ns.kv_gib else 40.0) * 2**30)
    results: list[Capacity] = []
    for name in shapes:
        pair = []
        for hybrid in (True, False):
            cap = arithmetic(name, ns.context, kv_bytes, ns.block_size, hybrid,
                             ns.tensor_parallel_size, ns.dtype, ns.kv_cache_dtype)
            if ns.dry_run:
                if not ns.no_simulate:
                    cap.simulated_requests = simulate(name, ns.context, cap.pool_blocks,
                                                      ns.block_size, hybrid, ns.chunk)
            else:
                try:
                    pool, tokens, running = measure_in_child(name, ns.context, hybrid, ns)
                except (RuntimeError, ValueError) as exc:
                    # Typically: not even one request of this context fits (all-full layout).
                    print(f"{name} ({cap.layout}): the engine did not start: {exc}",
                          file=sys.stderr)
                    pool, tokens, running = 0, 0, 0
                cap.pool_blocks, cap.measured_tokens, cap.measured_requests = pool, tokens, \
                    running
                # The arithmetic for the pool the engine measured.
                null = cap.null_blocks
                cap.requests = max(0, (pool - null) // max(1, cap.blocks_per_request - null))
                cap.tokens = cap.requests * ns.context
            pair.append(cap)
        results.extend(pair)
        hyb, full = pair
        # The gain per request (bytes one request keeps), free of the rounding to whole
        # requests that small pools show.
        per_req = (full.blocks_per_request * full.bytes_per_block) / (
            hyb.blocks_per_request * hyb.bytes_per_block)
        line = (f"{name} @ {ns.context}: {hyb.groups}; per request {hyb.blocks_per_request} "
                f"blocks x {hyb.bytes_per_block / 2**20:.2f} MiB vs {full.blocks_per_request} x "
                f"{full.bytes_per_block / 2**20:.2f} MiB: {per_req:.2f}x per request")
        if ns.dry_run:
            line += (f"; {kv_bytes / 2**30:.0f} GiB hold {hyb.tokens} vs {full.tokens} tokens "
                     f"({hyb.requests} vs {full.requests} requests"
                     + (f", simulated {hyb.simulated_requests} vs {full.simulated_requests}"
                        if hyb.simulated_requests is not None else "") + ")")
        else:
            line += (f"; measured {hyb.measured_tokens} vs {full.measured_tokens} tokens held "
                     f"({hyb.measured_requests} vs {full.measured_requests} requests, pools "
                     f"{hyb.pool_blocks} vs {full.pool_blocks} blocks): ")
            line += (f"{hyb.measured_tokens / full.measured_tokens:.2f}x"
                     if hyb.measured_tokens and full.measured_tokens
                     else "no ratio (a layout held nothing)")
        print(line)
    if ns.json:
        Path(ns.json).write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
