"""``--pp-devices``: the device of each pipeline stage (``cuda,cpu``: the first stage on the GPU,
the last layers on the CPU), checked once at start-up.

A list whose stages all run on one device is the plain layout (the engine's device everywhere)
and resolves to ``()``. A mixed list keeps every stage's device; its workers join one gloo world
and hand activations between stages through host memory (``worker/distributed/hetero_groups``).
"""

from __future__ import annotations

PP_DEVICES = ("cpu", "cuda")


class PPDevicesError(ValueError):
    """``--pp-devices`` is malformed or impossible here; the message says why."""


def parse_pp_devices(value: str, pp_size: int) -> tuple[str, ...]:
    """The stage devices of ``--pp-devices`` (``"cuda,cpu"``), one per pipeline stage."""
    devices = tuple(d.strip().lower() for d in value.split(","))
    bad = [d for d in devices if d not in PP_DEVICES]
    if bad:
        raise PPDevicesError(f"--pp-devices: unknown device {bad[0]!r} in {value!r}; each "
                             f"stage is one of {', '.join(PP_DEVICES)}")
    if len(devices) != pp_size:
        raise PPDevicesError(f"--pp-devices names {len(devices)} device(s) ({value!r}) but "
                             f"--pipeline-parallel-size is {pp_size}: give one per stage")
    return devices


def resolve_pp_devices(value: str | None, requested: str, resolved: str,
                       pp_size: int) -> tuple[str, tuple[str, ...]]:
    """(the engine's device, the stage devices): ``()`` when every stage runs on the engine's
    device. ``requested`` is ``--device`` as given (``auto`` follows the stages: cuda if any
    stage is on the GPU), ``resolved`` what it resolved to without the stages."""
    if value is None or not value.strip():
        return resolved, ()
    devices = parse_pp_devices(value, pp_size)
    if "cuda" in devices:
        import torch

        if not torch.cuda.is_available():
            raise PPDevicesError(f"--pp-devices {value!r} puts a stage on cuda but no CUDA "
                                 "GPU is visible to torch")
    wants_gpu = "cuda" in devices
    device = ("cuda" if wants_gpu else "cpu") if requested == "auto" else resolved
    if wants_gpu and device != "cuda":
        raise PPDevicesError(f"--pp-devices {value!r} puts a stage on cuda but --device is "
                             f"{device}: pass --device cuda (or auto)")
    if not wants_gpu and device != "cpu":
        raise PPDevicesError(f"--pp-devices {value!r} runs every stage on the CPU but --device "
                             f"is {device}: pass --device cpu (or auto)")
    if all(d == device for d in devices):
        return device, ()
    return device, devices


def check_mixed(devices: tuple[str, ...], *, tensor_parallel_size: int, backend: str,
                data_parallel_size: int, compiled: bool, kv_transfer: bool) -> None:
    """Refuse what a mixed CPU + GPU pipeline does not do yet (``devices`` from
    ``resolve_pp_devices``; ``()`` passes)."""
    if not devices:
        return
    what = f"--pp-devices {','.join(devices)}"
    if tensor_parallel_size > 1:
        # Each stage's tensor group would need a backend of its own inside the gloo world
        # (NCCL among a GPU stage's ranks, shared memory among a CPU stage's), which does not
        # exist yet; a tensor group across devices is --tp-devices' (hier_allreduce), without
        # pipeline stages.
        raise PPDevicesError(f"{what} with tensor parallelism is not yet supported")
    if backend != "mp":
        raise PPDevicesError(f"{what} with the {backend} executor is not yet supported (the "
                             "stages are local processes: use the mp executor)")
    if data_parallel_size > 1:
        raise PPDevicesError(f"{what} with --data-parallel-size > 1 is not yet supported")
    if compiled:
        raise PPDevicesError(f"{what} with --compilation-config is not yet supported")
    if kv_transfer:
        raise PPDevicesError(f"{what} with a KV connector is not yet supported")
