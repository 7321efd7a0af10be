"""--pp-devices (engine_core/pp_devices.py): one device per pipeline stage, checked at start-up."""

from __future__ import annotations

import pytest
import torch

from tidal.engine_core.config import ConfigError, EngineArgs
from tidal.engine_core.pp_devices import PPDevicesError, check_mixed, resolve_pp_devices


@pytest.fixture(scope="module")
def build(tiny_models):
    folder, _ = tiny_models["llama"]

    def make(**kw):
        return EngineArgs(model=str(folder), pipeline_parallel_size=2, **kw).create_config()

    return make


def test_one_device_everywhere_is_the_plain_layout(build):
    config = build(pp_devices="cpu, CPU", device="cpu")
    assert config.parallel.pp_devices == ()
    assert config.runner.device == "cpu"
    assert config.parallel.cpu_collectives == "shm"  # as a plain CPU pipeline
    # --device auto follows the stages.
    assert build(pp_devices="cpu,cpu").runner.device == "cpu"


@pytest.mark.parametrize("value,device,match", [
    ("cpu", "cpu", "names 1 device.*--pipeline-parallel-size is 2"),
    ("cpu,cpu,cpu", "cpu", "names 3 device"),
    ("cpu,tpu", "cpu", "unknown device 'tpu'"),
    ("cpu,", "cpu", "unknown device ''"),
])
def test_malformed_lists_are_refused(build, value, device, match):
    with pytest.raises(ConfigError, match=match):
        build(pp_devices=value, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_cuda_stage_without_a_gpu_is_refused(build):
    with pytest.raises(ConfigError, match="puts a stage on cuda but no CUDA GPU"):
        build(pp_devices="cuda,cpu")


def test_device_must_agree_with_the_stages(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PPDevicesError, match="--device is cpu: pass --device cuda"):
        resolve_pp_devices("cuda,cpu", "cpu", "cpu", 2)
    with pytest.raises(PPDevicesError, match="every stage on the CPU but --device is cuda"):
        resolve_pp_devices("cpu,cpu", "cuda", "cuda", 2)
    assert resolve_pp_devices("cuda,cpu", "auto", "cpu", 2) == ("cuda", ("cuda", "cpu"))
    assert resolve_pp_devices("cpu,cuda", "cuda", "cuda", 2) == ("cuda", ("cpu", "cuda"))
    assert resolve_pp_devices("cuda,cuda", "auto", "cuda", 2) == ("cuda", ())
    assert resolve_pp_devices(None, "auto", "cuda", 2) == ("cuda", ())


@pytest.mark.parametrize("kw,match", [
    (dict(tensor_parallel_size=2), "tensor parallelism is not yet supported"),
    (dict(backend="ray"), "ray executor is not yet supported"),
    (dict(data_parallel_size=2), "data-parallel-size > 1 is not yet supported"),
    (dict(compiled=True), "compilation-config is not yet supported"),
    (dict(kv_transfer=True), "KV connector is not yet supported"),
])
def test_mixed_layout_refuses_what_it_cannot_do_yet(kw, match):
    base = dict(tensor_parallel_size=1, backend="mp", data_parallel_size=1, compiled=False,
                kv_transfer=False)
    check_mixed(("cuda", "cpu"), **base)  # the supported combination passes
    check_mixed((), **dict(base, **kw))  # a plain layout is never refused here
    with pytest.raises(PPDevicesError, match=match):
        check_mixed(("cuda", "cpu"), **dict(base, **kw))
