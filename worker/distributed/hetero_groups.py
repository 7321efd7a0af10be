"""Pipelines whose stages run on different devices (``--pp-devices cuda,cpu``).

Every rank of a mixed layout joins one *gloo* world: NCCL cannot carry CPU tensors, and a CPU
rank inside an NCCL group deadlocks the group's start-up. So a mixed pipeline group has no
device group (``ParallelGroup.device_group`` is None: only GPU ranks could share one) and its
host side carries the activations: the shared-memory collectives (``shm_collectives``, the
default: every rank, GPU ones too, maps the group's segment) or its ``cpu_group`` (gloo,
``--cpu-collectives gloo``). A GPU stage copies its hidden states to host memory before the
send; a stage receives into host memory and copies to its own device. Tensor groups inside a
stage hold ranks of one device; tensor parallelism inside a mixed pipeline is refused at
start-up (``engine_core.pp_devices``), so they are groups of one.

Tensor-parallel ranks on different devices (``--tp-devices cuda,cpu``, no pipeline with it) join
the same gloo world; their tensor group's collectives are the hierarchical ones of
``hier_allreduce`` (NCCL among the GPU ranks, host memory with the CPU ranks).

Each worker process sees a plain single-device config (``stage_config``): its stage's device,
eager on a CPU, no weight offload there. The rest of the worker never learns the layout is
mixed.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import torch

from tidal.engine_core.config import EngineConfig

logger = logging.getLogger(__name__)


def is_mixed(config: EngineConfig) -> bool:
    """Stages or tensor-parallel ranks on different devices (``--pp-devices`` or
    ``--tp-devices`` resolved to a non-empty list)."""
    return bool(config.parallel.pp_devices or config.parallel.tp_devices)


def stage_device(config: EngineConfig, rank: int) -> str:
    """The device type of global ``rank`` (ranks are tensor-parallel first)."""
    tp = config.parallel.tensor_parallel_size
    if config.parallel.tp_devices:  # (--tp-devices: hier_allreduce; no pipeline with it)
        return config.parallel.tp_devices[rank % tp]
    devices = config.parallel.pp_devices
    if not devices:
        return config.runner.device
    return devices[rank // tp]


def gpu_index(config: EngineConfig, rank: int) -> int:
    """The CUDA device of ``rank`` on its host: GPU ranks are numbered among themselves, so
    ``cpu,cuda`` puts stage 1 on GPU 0."""
    if not is_mixed(config):
        return rank
    return sum(stage_device(config, r) == "cuda" for r in range(rank))


def stage_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config ``rank``'s worker runs with: its stage's device in place of the engine's (a
    CPU stage runs eagerly and offloads no weights); the same object where nothing differs."""
    device = stage_device(config, rank)
    if device == config.runner.device:
        return config
    runner = msgspec.structs.replace(config.runner, device=device)
    if device == "cpu":
        runner = msgspec.structs.replace(runner, enforce_eager=True, cpu_offload_bytes=0)
    return msgspec.structs.replace(config, runner=runner)


def send_through_host(pp: Any, t: torch.Tensor, dst: int) -> tuple[Any, torch.Tensor]:
    """Start sending ``t`` to group rank ``dst`` over the group's host side; returns the work
    handle and the host tensor it reads (keep both until ``wait()``). A GPU tensor is copied to
    the host first (the copy completes before the send starts)."""
    host = t.to("cpu") if t.device.type != "cpu" else t
    return pp.send(host, dst, cpu=True), host


def recv_through_host(pp: Any, shape: tuple[int, ...], dtype: torch.dtype,
                      device: torch.device, src: int) -> torch.Tensor:
    """Receive a tensor from group rank ``src`` over the group's host side and hand it over
    on ``device``."""
    host = pp.recv(torch.empty(shape, dtype=dtype), src, cpu=True)
    return host if device.type == "cpu" else host.to(device)
