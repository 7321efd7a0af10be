"""--tp-devices (engine_core/tp_devices.py): one device per tensor-parallel rank, checked at
start-up; and each rank's device and config (worker/distributed/hetero_groups.py)."""

from __future__ import annotations

import argparse

import msgspec
import pytest
import torch

from tidal.engine_core.cli import add_engine_args, engine_args_from
from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.tp_devices import TPDevicesError, check_mixed_tp, resolve_tp_devices
from tidal.worker.distributed.hetero_groups import gpu_index, is_mixed, stage_config, stage_device


@pytest.fixture(scope="module")
def build(tiny_models):
    folder, _ = tiny_models["llama"]

    def make(**kw):
        return EngineArgs(model=str(folder), tensor_parallel_size=2, **kw).create_config()

    return make


def test_flag_and_plain_layout(build, tiny_models):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--model", str(tiny_models["llama"][0]), "--tp-devices", "cuda,cpu"])
    assert engine_args_from(ns).tp_devices == "cuda,cpu"
    config = build(tp_devices="CPU, cpu", device="cpu")
    assert config.parallel.tp_devices == () and not is_mixed(config)
    assert build(tp_devices="cpu,cpu").runner.device == "cpu"  # --device auto follows


@pytest.mark.parametrize("value,match", [
    ("cpu", "names 1 device.*--tensor-parallel-size is 2"),
    ("cpu,cpu,cpu", "names 3 device"),
    ("cpu,npu", "unknown device 'npu'"),
])
def test_malformed_lists_are_refused(build, value, match):
    with pytest.raises(ConfigError, match=match):
        build(tp_devices=value, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_rank_without_a_gpu_is_refused(build):
    with pytest.raises(ConfigError, match="puts a rank on cuda but no CUDA GPU"):
        build(tp_devices="cuda,cpu")


def test_resolution(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_tp_devices("cuda,cpu", "auto", "cpu", 2) == ("cuda", ("cuda", "cpu"))
    assert resolve_tp_devices("cpu,cuda", "cuda", "cuda", 2) == ("cuda", ("cpu", "cuda"))
    assert resolve_tp_devices("cuda,cuda", "auto", "cuda", 2) == ("cuda", ())
    assert resolve_tp_devices(" ", "auto", "cuda", 2) == ("cuda", ())
    with pytest.raises(TPDevicesError, match="--device is cpu: pass --device cuda"):
        resolve_tp_devices("cuda,cpu", "cpu", "cpu", 2)
    with pytest.raises(TPDevicesError, match="with --pp-devices is not yet supported"):
        resolve_tp_devices("cuda,cpu", "auto", "cuda", 2, ("cuda", "cpu"))


@pytest.mark.parametrize("kw,match", [
    (dict(pipeline_parallel_size=2), "pipeline parallelism is not yet supported"),
    (dict(backend="ray"), "ray executor is not yet supported"),
    (dict(data_parallel_size=2), "data-parallel-size > 1 is not yet supported"),
    (dict(dtype="float16"), "float16 on a CPU rank.*--dtype float32 or bfloat16"),
    (dict(compiled=True), "compilation-config is not yet supported"),
    (dict(kv_transfer=True), "KV connector is not yet supported"),
    (dict(expert_parallel=True), "enable-expert-parallel is not yet supported"),
    (dict(speculative=True), "speculative decoding is not yet supported"),
    (dict(lora=True), "enable-lora is not yet supported"),
])
def test_mixed_ranks_refuse_what_they_cannot_do(kw, match):
    base = dict(pipeline_parallel_size=1, backend="mp", data_parallel_size=1, dtype="bfloat16",
                compiled=False, kv_transfer=False, expert_parallel=False, speculative=False,
                lora=False)
    check_mixed_tp(("cuda", "cpu"), **base)  # the supported combination passes
    check_mixed_tp((), **dict(base, **kw))  # a plain layout is never refused here
    with pytest.raises(TPDevicesError, match=match):
        check_mixed_tp(("cuda", "cpu"), **dict(base, **kw))


def test_rank_devices_and_configs(build):
    base = build(device="cpu")
    # (A cuda config needs no GPU to be rewritten: only the struct changes.)
    cuda = msgspec.structs.replace(base, runner=msgspec.structs.replace(
        base.runner, device="cuda", enforce_eager=True, cpu_offload_bytes=1 << 30),
        parallel=msgspec.structs.replace(base.parallel, tp_devices=("cpu", "cuda")))
    assert is_mixed(cuda)
    assert [stage_device(cuda, r) for r in range(2)] == ["cpu", "cuda"]
    assert gpu_index(cuda, 1) == 0  # GPUs numbered among themselves
    cpu_rank = stage_config(cuda, 0)
    assert cpu_rank.runner.device == "cpu" and cpu_rank.runner.cpu_offload_bytes == 0
    assert stage_config(cuda, 1) is cuda
