"""Per-request and per-step overhead of the engine stack, with a no-op model.

The ``noop`` executor (``distributed_executor_backend="noop"``) returns one fixed token per step
without running anything, so what is measured is tidal itself: scheduling, the EngineCore loop,
(de)serialisation and the sockets, and the frontend's output processing.

    python tools/bench_overhead.py [--requests 300] [--tokens 500] [--batch 64]

Reported, for the EngineCore alone (``core``), ``AsyncLLM`` with the engine in a thread
(``thread``) and in its own process over ZeroMQ (``process``); modes suffixed ``-uni`` / ``-mp``
run a tiny 2-layer random-weight model in-process / in a worker process fed by the shared-memory
ring instead of the no-op executor, so ``core-mp`` minus ``core-uni`` is the worker hop and
``process-mp`` is the whole frontend -> core -> worker path:

* round trip: one request of one token after another (add -> schedule -> execute -> output ->
  frontend), mean and percentiles;
* per step, one request: a single request streaming ``--tokens`` tokens (one step each);
* per step, batch: ``--batch`` concurrent requests of ``--tokens`` tokens.

Machine load moves these numbers a lot; run it on a quiet machine and compare runs only on the
same one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tidal.engine_core.config import EngineArgs, EngineConfig
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.async_llm import AsyncLLM

# A config.json is all a no-op engine needs (no weights are read).
_TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 384,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "eos_token_id": 0,
}


def _engine_args(model_dir: str, batch: int, executor: str = "noop") -> EngineArgs:
    """``executor``: "noop" (no model, no worker), or "uni"/"mp" running the tiny 2-layer model
    with random weights in-process or in a worker process behind the shared-memory ring (their
    difference is the cost of the worker hop)."""
    return EngineArgs(model=model_dir, distributed_executor_backend=executor, num_kv_blocks=8192,
                      max_num_seqs=max(batch, 1), enable_prefix_caching=False,
                      load_format="auto" if executor == "noop" else "dummy", cpu_threads=1)


def _params(tokens: int, kind: OutputKind = OutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, output_kind=kind)


def _summary(samples_s: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples_s)
    return {
        "mean_us": round(statistics.fmean(us), 1),
        "p50_us": round(us[len(us) // 2], 1),
        "p90_us": round(us[int(len(us) * 0.9)], 1),
        "p99_us": round(us[min(len(us) - 1, int(len(us) * 0.99))], 1),
    }


def bench_core(config: EngineConfig, n_requests: int, tokens: int, batch: int) -> dict:
    core = EngineCore(config)
    prompt = list(range(1, 9))
    rt = []
    for i in range(n_requests):
        start = time.perf_counter()
        core.add_request(EngineCoreRequest(f"r{i}", prompt, _params(1)))
        while core.has_unfinished_requests():
            core.step()
        rt.append(time.perf_counter() - start)
    out = {"round_trip": _summary(rt)}
    for name, n in (("step_1_request", 1), (f"step_{batch}_requests", batch)):
        for i in range(n):
            core.add_request(EngineCoreRequest(f"s{name}{i}", prompt, _params(tokens)))
        core.step()  # prefill
        start = time.perf_counter()
        steps = 0
        while core.has_unfinished_requests():
            core.step()
            steps += 1
        out[name + "_us"] = round((time.perf_counter() - start) / steps * 1e6, 1)
    core.shutdown()
    return out


async def _bench_async(llm: AsyncLLM, n_requests: int, tokens: int, batch: int) -> dict:
    prompt = list(range(1, 9))
    for i in range(20):  # warm-up: sockets connected, code paths hot
        async for _ in llm.generate(prompt, _params(1), f"w{i}"):
            pass
    rt = []
    for i in range(n_requests):
        start = time.perf_counter()
        async for _ in llm.generate(prompt, _params(1, OutputKind.FINAL_ONLY), f"r{i}"):
            pass
        rt.append(time.perf_counter() - start)
    out = {"round_trip": _summary(rt)}

    async def stream(rid: str) -> int:
        n = 0
        async for o in llm.generate(prompt, _params(tokens), rid):
            n += len(o.outputs[0].token_ids)
        return n

    for name, n in (("step_1_request", 1), (f"step_{batch}_requests", batch)):
        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(f"{name}{i}") for i in range(n)))
        assert all(c == tokens for c in counts), counts
        out[name + "_us"] = round((time.perf_counter() - start) / tokens * 1e6, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--modes", default="core,thread,process")
    ap.add_argument("--uvloop", action="store_true", help="run the frontend on uvloop")
    ns = ap.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="tidal-bench-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(_TINY_CONFIG))
        results: dict[str, dict] = {}
        for mode in ns.modes.split(","):
            # "core-uni"/"core-mp"/"process-mp": the tiny model in-process / in a worker process.
            base, _, executor = mode.partition("-")
            args = _engine_args(tmp, ns.batch, executor or "noop")
            if base == "core":
                results[mode] = bench_core(args.create_config(), ns.requests, ns.tokens,
                                           ns.batch)
                continue
            llm = AsyncLLM.from_engine_args(args, mode=base, skip_tokenizer_init=True)
            try:
                runner = asyncio.run
                if ns.uvloop:
                    import uvloop

                    runner = uvloop.run
                results[mode] = runner(_bench_async(llm, ns.requests, ns.tokens, ns.batch))
            finally:
                llm.shutdown()
        print(json.dumps({"cpus": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
                          "requests": ns.requests, "tokens": ns.tokens, "batch": ns.batch,
                          "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
