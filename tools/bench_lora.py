"""LoRA serving speed against the base model in one run, on dummy weights (issue 24, "What it
must show").

    python tools/bench_lora.py --shape llama-3.1-8b --out lora.json   # H100, dummy bf16
    python tools/bench_lora.py --smoke                                # tiny model, CPU, seconds

Random rank-``--rank`` adapters on every q/k/v/o and gate/up/down projection are written to a
temporary folder as PEFT would (``adapter_config.json`` + ``adapter_model.safetensors``). Two
in-process engines, one after the other (the first freed before the second starts):

* ``base``: the plain engine (no ``--enable-lora``): batch-1 decode step time and
  batch-``--batch`` decode throughput.
* ``lora`` (``--enable-lora --max-loras --slots``): the same two with every request on an
  adapter (the batch mixes ``--adapters`` of them); the hot load of one adapter (read from disk
  into the host cache, then copied into a device slot: the worker's own calls, timed with the
  device synchronised); and ``--registered`` adapters registered while ``--slots`` sit on the
  device, the first-token time of a request on a cold adapter (never loaded) less that of one
  on a warm adapter (both a ``--context``-token prompt, no prefix hit).

Targets (issue 24): mixed-batch decode throughput >= 0.85x the base's, batch-1 step time with
an adapter <= 1.15x the base's, hot load <= 200 ms, cold adapter first token <= 300 ms extra.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import SHAPES, device_name, dump, judge, now, write_model_dir  # noqa: E402
from tidal.engine_core.config import EngineArgs  # noqa: E402
from tidal.engine_core.core import EngineCore  # noqa: E402
from tidal.engine_core.lora_request import LoRARequest  # noqa: E402
from tidal.engine_core.protocol import EngineCoreRequest  # noqa: E402
from tidal.engine_core.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger("bench_lora")

TARGETS = {  # name -> (comparison, bound, what)
    "decode_batch_ratio": (">=", 0.85, "mixed-adapter batch decode throughput / base"),
    "decode_b1_ratio": ("<=", 1.15, "batch-1 step time with an adapter / base"),
    "hot_load_ms": ("<=", 200.0, "hot load of one adapter (disk -> host -> device slot), ms"),
    "cold_first_token_extra_ms": ("<=", 300.0, "cold adapter's first token, extra ms"),
}
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: dict[str, Any], rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter for ``config``'s shape (bf16, every projection)."""
    from safetensors.torch import save_file

    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or h // heads
    shapes = {"q_proj": (heads * d, h), "k_proj": (kv * d, h), "v_proj": (kv * d, h),
              "o_proj": (h, heads * d), "gate_proj": (inter, h), "up_proj": (inter, h),
              "down_proj": (h, inter)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, (out_f, in_f) in shapes.items():
            part = "self_attn" if proj in TARGET_MODULES[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{name}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen)
                                                * in_f ** -0.5).to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen)
                                                * 0.01).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGET_MODULES), "bias": "none"}))
    return str(folder)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _drain(core: EngineCore) -> None:
    while core.has_unfinished_requests():
        core.step()


def decode_leg(core: EngineCore, batch: int, ns: argparse.Namespace, vocab: int,
               loras: list[LoRARequest | None], rng: random.Random) -> dict[str, Any]:
    """ms per decode step and tokens/s for ``batch`` requests (request i on ``loras[i %
    len]``), medians of ``--repeats`` windows of ``--steps`` steps."""
    total = ns.warmup + ns.steps * ns.repeats + 4
    ids = []
    for i in range(batch):
        rid = f"d{batch}-{i}-{rng.random()}"
        ids.append(rid)
        prompt = [rng.randrange(vocab) for _ in range(ns.context)]
        core.add_request(EngineCoreRequest(rid, prompt, _params(total),
                                           lora_request=loras[i % len(loras)]))
    seen: set[str] = set()
    while len(seen) < batch:  # every prompt prefilled
        seen.update(o.request_id for o in core.step().outputs if o.new_token_ids)
    for _ in range(ns.warmup):
        core.step()
    windows = []
    for _ in range(ns.repeats):
        _sync()
        t0 = now()
        for _ in range(ns.steps):
            core.step()
        _sync()
        windows.append((now() - t0) / ns.steps * 1e3)
    if ns.profile and batch == ns.batch:
        _profile_steps(core, ns, batch)
    core.abort_requests(ids)
    _drain(core)
    ms = statistics.median(windows)
    return {"batch": batch, "ms_per_step": round(ms, 4), "tokens_per_s": round(batch / ms * 1e3, 1)}


def _profile_steps(core: EngineCore, ns: argparse.Namespace, batch: int, steps: int = 8
                   ) -> None:
    """The GPU kernels of ``steps`` decode steps, summed by name, to
    ``--profile``/<engine>_b<batch>.txt (an engine with --enable-lora is ``lora``)."""
    from torch.profiler import ProfilerActivity, profile

    name = "lora" if core.config.lora is not None else "base"
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            core.step()
        _sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40,
                                      max_name_column_width=90)
    path = Path(ns.profile) / f"{name}_b{batch}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{steps} decode steps of batch {batch}\n{table}\n")
    logger.info("profile of %d %s steps: %s", steps, name, path)


def first_token_ms(core: EngineCore, vocab: int, context: int, lora: LoRARequest | None,
                   rng: random.Random) -> float:
    rid = f"ttft-{rng.random()}"
    prompt = [rng.randrange(vocab) for _ in range(context)]
    _sync()
    t0 = now()
    core.add_request(EngineCoreRequest(rid, prompt, _params(1), lora_request=lora))
    while True:
        if any(o.request_id == rid and o.new_token_ids for o in core.step().outputs):
            break
    _sync()
    ms = (now() - t0) * 1e3
    _drain(core)
    return ms


def _engine(model: str, ns: argparse.Namespace, max_model_len: int, **kw) -> EngineCore:
    args = EngineArgs(model=model, load_format="dummy", dtype=ns.dtype, device=ns.device,
                      max_model_len=max_model_len, max_num_seqs=max(ns.batch, 8),
                      gpu_memory_utilization=ns.gpu_memory_utilization,
                      enforce_eager=ns.enforce_eager,
                      cpu_threads=1 if ns.smoke else None,
                      # --smoke: a 2 GiB CPU default cache would cost more than the legs
                      kv_cache_memory_bytes=(64 << 20) if ns.smoke else None, **kw)
    return EngineCore(args.create_config())


def _free(core: EngineCore) -> None:
    core.shutdown()
    del core
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_lora_engine(model: str, ns: argparse.Namespace, max_model_len: int, paths: list[str],
                    vocab: int, rng: random.Random) -> dict[str, Any]:
    core = _engine(model, ns, max_model_len, enable_lora=True, max_loras=ns.slots,
                   max_cpu_loras=max(ns.slots, 2 * ns.adapters), max_lora_rank=ns.rank)
    out: dict[str, Any] = {}
    try:
        mixed = [LoRARequest(f"mix{i}", i + 1, paths[i % len(paths)])
                 for i in range(ns.adapters)]
        for lora in mixed:
            core.lora_registry.add(lora)
        out["decode_b1"] = decode_leg(core, 1, ns, vocab, mixed[:1], rng)
        out["decode_batch"] = decode_leg(core, ns.batch, ns, vocab, mixed, rng)
        if ns.decode_only:
            return out
        # Hot load: the worker's own two calls, on an adapter it has never seen.
        runner = core.executor.worker.runner
        mgr = runner.lora
        fresh = LoRARequest("hot", 10_000, paths[-1])
        _sync()
        t0 = now()
        adapter = mgr._load(fresh)
        t1 = now()
        mgr.slots.load(mgr.slots.num_slots - 1, adapter)
        _sync()
        t2 = now()
        out["hot_load"] = {"host_read_ms": round((t1 - t0) * 1e3, 2),
                           "slot_copy_ms": round((t2 - t1) * 1e3, 2),
                           "total_ms": round((t2 - t0) * 1e3, 2),
                           "adapter_MiB": round(adapter.nbytes / 2**20, 2)}
        # Many registered, the slots full of warm ones: a cold adapter's first token.
        registered = [LoRARequest(f"reg{i}", 20_000 + i, paths[i % len(paths)])
                      for i in range(ns.registered)]
        for lora in registered:
            core.lora_registry.add(lora)
        for lora in registered[:ns.slots]:
            first_token_ms(core, vocab, 8, lora, rng)  # now in a slot
        warm = [first_token_ms(core, vocab, ns.context, registered[i % ns.slots], rng)
                for i in range(3)]
        cold = [first_token_ms(core, vocab, ns.context, registered[ns.slots + i], rng)
                for i in range(3)]
        out["cold_adapter"] = {"registered": ns.registered, "slots": ns.slots,
                               "warm_first_token_ms": round(statistics.median(warm), 2),
                               "cold_first_token_ms": round(statistics.median(cold), 2),
                               "extra_ms": round(statistics.median(cold)
                                                 - statistics.median(warm), 2)}
    finally:
        _free(core)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def verdicts(result: dict[str, Any]) -> dict[str, Any]:
    """Each target's measured value and PASS / MISS (``n/a``: not measured)."""
    base, lora = result.get("base", {}), result.get("lora", {})

    def get(d: dict, *keys: str) -> Any:
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    values = {
        "decode_batch_ratio": _ratio(get(lora, "decode_batch", "tokens_per_s"),
                                     get(base, "decode_batch", "tokens_per_s")),
        "decode_b1_ratio": _ratio(get(lora, "decode_b1", "ms_per_step"),
                                  get(base, "decode_b1", "ms_per_step")),
        "hot_load_ms": get(lora, "hot_load", "total_ms"),
        "cold_first_token_extra_ms": get(lora, "cold_adapter", "extra_ms"),
    }
    out = judge(TARGETS, values)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny Llama on the CPU, a few steps: checks the tool in seconds")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=8, help="adapters mixed in the batch")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--slots", type=int, default=32, help="--max-loras of the LoRA engine")
    ap.add_argument("--registered", type=int, default=500)
    ap.add_argument("--distinct-files", type=int, default=8,
                    help="adapter folders written (registered adapters reuse them by id)")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--decode-only", action="store_true",
                    help="the decode legs only (no hot load, no cold adapter)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also write each engine's GPU kernels over 8 steps of the batch leg")
    ap.add_argument("--out", default=None)
    ns = ap.parse_args(argv)
    if ns.smoke:
        ns.shape, ns.device, ns.dtype = "tiny-llama", "cpu", "float32"
        ns.batch, ns.adapters, ns.slots, ns.registered, ns.distinct_files = 8, 4, 4, 12, 3
        ns.context, ns.steps, ns.repeats, ns.warmup = 16, 2, 1, 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = SMOKE_SHAPE if ns.smoke else SHAPES[ns.shape]
    vocab = config["vocab_size"]
    max_model_len = ns.context + ns.warmup + ns.steps * ns.repeats + 64
    rng = random.Random(0)
    result: dict[str, Any] = {
        "benchmark": "lora", "device": device_name(), "torch": torch.__version__,
        "shape": ns.shape, "dtype": ns.dtype,
        "workload": {"rank": ns.rank, "adapters": ns.adapters, "batch": ns.batch,
                     "slots": ns.slots, "registered": ns.registered, "context": ns.context,
                     "steps": ns.steps, "repeats": ns.repeats},
    }
    with tempfile.TemporaryDirectory(prefix="tidal-lora-") as tmp:
        folder = Path(tmp) / ns.shape
        if ns.smoke:
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(SMOKE_SHAPE))
            model = str(folder)
        else:
            model = write_model_dir(ns.shape, folder)
        t0 = now()
        paths = [write_adapter(Path(tmp) / f"adapter{i}", config, ns.rank, seed=i)
                 for i in range(ns.distinct_files)]
        result["adapter_write_s"] = round(now() - t0, 2)
        core = _engine(model, ns, max_model_len)
        try:
            result["base"] = {"decode_b1": decode_leg(core, 1, ns, vocab, [None], rng),
                              "decode_batch": decode_leg(core, ns.batch, ns, vocab, [None],
                                                         rng)}
        finally:
            _free(core)
        result["lora"] = run_lora_engine(model, ns, max_model_len, paths, vocab, rng)
    result["verdicts"] = verdicts(result)
    for name, v in result["verdicts"].items():
        logger.info("%s: %s (target %s) %s", name, v["value"], v["target"], v["verdict"])
    dump(result, ns.out)
    return 0


# The smoke run's model: Llama-shaped (LoRA serves the plain decoder families), tiny.
SMOKE_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "eos_token_id": 0,
}


if __name__ == "__main__":
    raise SystemExit(main())
