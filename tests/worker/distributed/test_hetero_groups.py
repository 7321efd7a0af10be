"""Pipelines with stages on different devices (worker/distributed/hetero_groups.py).

On a CPU the mixed layout's machinery runs with both stages on the CPU: the config is forced to
a mixed ``("cpu", "cpu")`` list (``--pp-devices`` itself resolves an all-CPU list to the plain
layout), so the workers join a gloo world, the pipeline group has no device group and the
activations cross through host memory, and the greedy tokens must equal one worker's. The GPU
test runs ``cuda,cpu`` for real."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.sampling_params import SamplingParams
from tidal.worker.distributed.hetero_groups import gpu_index, stage_config, stage_device

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 200, 17], [40, 41], list(range(30, 60))]


def _mixed(config, devices):
    parallel = msgspec.structs.replace(config.parallel, pp_devices=devices)
    return msgspec.structs.replace(config, parallel=parallel)


def test_stage_configs(tiny_models):
    folder, _ = tiny_models["llama"]
    base = EngineArgs(model=str(folder), device="cpu", pipeline_parallel_size=2,
                      tensor_parallel_size=2).create_config()
    assert stage_config(base, 3) is base and gpu_index(base, 3) == 3  # plain: unchanged
    # (A cuda config needs no GPU to be rewritten: only the struct changes.)
    cuda = msgspec.structs.replace(base, runner=msgspec.structs.replace(
        base.runner, device="cuda", enforce_eager=False, cpu_offload_bytes=1 << 30))
    config = _mixed(cuda, ("cpu", "cuda"))  # ranks 0, 1: stage 0; ranks 2, 3: stage 1
    assert [stage_device(config, r) for r in range(4)] == ["cpu", "cpu", "cuda", "cuda"]
    assert [gpu_index(config, r) for r in (2, 3)] == [0, 1]  # GPUs numbered among themselves
    cpu_stage = stage_config(config, 1)
    assert cpu_stage.runner.device == "cpu" and cpu_stage.runner.enforce_eager
    assert cpu_stage.runner.cpu_offload_bytes == 0
    assert stage_config(config, 2) is config


def _greedy(llm):
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [o.outputs[0].logprobs[i][t].logprob for i, t in enumerate(o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.slow
def test_mixed_pipeline_through_host_memory_matches_one_worker(tiny_models, monkeypatch):
    """(Over the shared-memory collectives, the default of a mixed layout; gloo carries the
    same host tensors through the same ``ParallelGroup.send``.)"""
    from tidal.frontend import LLM

    folder, _ = tiny_models["llama"]
    args = dict(skip_tokenizer_init=True, num_kv_blocks=128, max_num_seqs=3,
                max_num_batched_tokens=64, device="cpu", cpu_threads=1)
    llm = LLM(str(folder), **args)
    try:
        want = _greedy(llm)
    finally:
        llm.shutdown()
    create = EngineArgs.create_config
    monkeypatch.setattr(EngineArgs, "create_config",
                        lambda self: _mixed(create(self), ("cpu", "cpu")))
    llm = LLM(str(folder), pipeline_parallel_size=2, distributed_executor_backend="mp",
              cpu_collectives="shm", **args)
    try:
        assert llm.config.parallel.pp_devices == ("cpu", "cpu")
        got = _greedy(llm)
    finally:
        llm.shutdown()
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("devices", ["cuda,cpu", "cpu,cuda"])
def test_gpu_stage_and_cpu_stage_match_gpu_alone(tiny_models, devices):
    """One GPU: one stage on the GPU, the other on the CPU (cuda,cpu: the last layers and the
    sampler on the CPU; cpu,cuda: the GPU stage is rank 1 yet takes GPU 0), float32 both; the
    tokens must equal the all-GPU engine's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the CPU test above runs the mixed layout on the CPU)")
    from tidal.frontend import LLM

    folder, _ = tiny_models["llama"]
    args = dict(skip_tokenizer_init=True, num_kv_blocks=128, max_num_seqs=3, dtype="float32",
                gpu_memory_utilization=0.3)
    llm = LLM(str(folder), device="cuda", **args)
    try:
        want = _greedy(llm)
    finally:
        llm.shutdown()
    llm = LLM(str(folder), pipeline_parallel_size=2, pp_devices=devices, **args)
    try:
        assert llm.config.parallel.pp_devices == tuple(devices.split(","))
        assert llm.config.parallel.cpu_collectives == "shm"
        got = _greedy(llm)
    finally:
        llm.shutdown()
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-3
