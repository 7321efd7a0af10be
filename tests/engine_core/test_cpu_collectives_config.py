"""``--cpu-collectives``: auto picks shared memory for CPU workers of the mp executor and gloo
elsewhere; shm where it cannot work, or an unknown value, is refused naming the flag."""

from __future__ import annotations

import pytest

from tidal.engine_core.config import (
    ConfigError,
    EngineArgs,
    ParallelConfig,
    _resolve_cpu_collectives,
)


@pytest.fixture(scope="module")
def folder(tiny_models):
    return str(tiny_models["llama"][0])


def _collectives(folder: str, **kw) -> str:
    args = EngineArgs(model=folder, device="cpu", num_kv_blocks=64, **kw)
    return args.create_config().parallel.cpu_collectives


def test_auto_is_shm_for_cpu_workers_of_the_mp_executor(folder):
    assert _collectives(folder, tensor_parallel_size=2) == "shm"
    assert _collectives(folder, pipeline_parallel_size=2, distributed_executor_backend="mp") \
        == "shm"
    assert _collectives(folder, tensor_parallel_size=2, cpu_collectives="gloo") == "gloo"
    assert _collectives(folder, tensor_parallel_size=2, cpu_collectives="shm") == "shm"
    assert _collectives(folder) == "gloo"  # one in-process worker: no group at all


def test_shm_where_it_cannot_work_is_refused(folder):
    with pytest.raises(ConfigError, match="cpu_collectives must be one of auto, shm, gloo"):
        _collectives(folder, tensor_parallel_size=2, cpu_collectives="mpi")
    with pytest.raises(ConfigError, match="--cpu-collectives shm: not yet supported with the "
                                          "ray executor"):
        _resolve_cpu_collectives("shm", ParallelConfig(tensor_parallel_size=2,
                                                       distributed_executor_backend="ray"), "cpu")
    mp = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ConfigError, match="not yet supported with cuda workers"):
        _resolve_cpu_collectives("shm", mp, "cuda")
    assert _resolve_cpu_collectives("auto", mp, "cuda") == "gloo"
    ray = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")
    assert _resolve_cpu_collectives("auto", ray, "cpu") == "gloo"
