"""The Ray executor on a local Ray cluster (CPU, gloo): greedy tokens at TP=2 and TP=2 x PP=2
equal a single worker's exactly; an engine process joins an existing cluster
(``RAY_ADDRESS``); killing one rank's actor mid-generation fails every in-flight request with
``EngineDeadError`` within 5 s, and no engine process or worker actor is left behind.

Skipped, with the reason, where Ray is not installed (``pip install 'tidal[ray]'``).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import psutil
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'tidal[ray]'")

from tidal.engine_core.config import EngineArgs  # noqa: E402
from tidal.engine_core.sampling_params import OutputKind, SamplingParams  # noqa: E402
from tidal.frontend import LLM  # noqa: E402
from tidal.frontend.async_llm import AsyncLLM, EngineDeadError  # noqa: E402

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster, shared by the tests here (starting one takes seconds). More logical
    CPUs than cores: every rank is one CPU bundle."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(2)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def _tokens(folder, prompts, **kw) -> list[list[int]]:
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, cpu_threads=1,
              max_num_seqs=4, **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


def _actor_processes() -> list[psutil.Process]:
    """Processes running a tidal worker actor (Ray titles them after the actor class)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "RayWorkerActor" in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


# TP alone (one batch in flight) and TP x PP (the pipelined path, with a TP group per stage);
# PP alone adds no Ray path of its own (the mp executor's tests run it).
@pytest.mark.parametrize("family,tp,pp", [("qwen3", 2, 1), ("qwen3", 2, 2)],
                         ids=["qwen3-tp2", "qwen3-tp2xpp2"])
def test_ray_matches_single_worker(ray_cluster, tiny_models, family, tp, pp):
    folder, hf = tiny_models[family]
    prompts = _prompts(8, hf.config.vocab_size)
    reference = _tokens(folder, prompts)
    got = _tokens(folder, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  distributed_executor_backend="ray")
    assert got == reference
    # Shut down: every actor was killed (their processes are gone).
    assert not psutil.wait_procs(_actor_processes(), timeout=10)[1]


def test_constrained_requests_sample_after_their_masks_on_ray(ray_cluster, tiny_smol_path):
    """Async scheduling on Ray: a constrained request's step is sent first and sampled once
    its mask follows (`FinishSample`); its output is the one-process engine's, token for
    token."""
    import re

    from tidal.engine_core.sampling_params import StructuredOutputsParams

    rx = r"[a-z]{2,5}-[0-9]{1,3}( [a-z]{3,8}){2,6}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48,
                             structured_outputs=StructuredOutputsParams(regex=rx))
              for i in range(4)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    texts = {}
    for backend in ("uni", "ray"):
        kw = dict(distributed_executor_backend="ray", tensor_parallel_size=2,
                  async_scheduling=True) if backend == "ray" else {}
        llm = LLM(str(tiny_smol_path), max_num_seqs=8, num_kv_blocks=256, max_model_len=256,
                  cpu_threads=1, dtype="float32", **kw)
        try:
            assert llm.engine.core.defer_masks == (backend == "ray")
            outs = llm.generate(["Go:"] * 5, params + [plain], use_tqdm=False)
            texts[backend] = [o.outputs[0].text for o in outs]
        finally:
            llm.shutdown()
    assert texts["ray"] == texts["uni"]
    assert all(re.fullmatch(rx, t) for t in texts["ray"][:4]), texts["ray"]


def test_ray_rank_killed_fails_every_request(ray_cluster, tiny_models, monkeypatch):
    folder, _ = tiny_models["qwen3"]
    # The spawned EngineCore joins this cluster instead of starting its own.
    monkeypatch.setenv("RAY_ADDRESS", ray_cluster)
    args = EngineArgs(model=str(folder), tensor_parallel_size=2,
                      distributed_executor_backend="ray", num_kv_blocks=256, cpu_threads=1)
    llm = AsyncLLM.from_engine_args(args, skip_tokenizer_init=True)
    engine = psutil.Process(llm.client.conn.engine_pid)
    actors = _actor_processes()
    assert len(actors) == 2, [a.cmdline() for a in actors]
    params = SamplingParams(max_tokens=None, ignore_eos=True, output_kind=OutputKind.DELTA)

    async def main():
        streaming = [asyncio.Event() for _ in range(8)]

        async def consume(i: int) -> None:
            async for _ in llm.generate([3, 4, i + 1], params, f"r{i}"):
                streaming[i].set()

        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        for event in streaming:
            await event.wait()
        os.kill(actors[-1].pid, signal.SIGKILL)
        killed = time.monotonic()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return results, time.monotonic() - killed

    try:
        results, elapsed = asyncio.run(main())
    finally:
        llm.shutdown()
    print(f"8 in-flight requests failed {elapsed:.3f} s after kill -9 of a Ray rank: "
          f"{results[0]}")
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert elapsed < 5.0
    assert llm.client.conn.proc.exitcode == 1
    assert not psutil.wait_procs([engine, *actors], timeout=10)[1], "orphaned processes"
    assert not psutil.wait_procs(_actor_processes(), timeout=10)[1], "orphaned actors"
