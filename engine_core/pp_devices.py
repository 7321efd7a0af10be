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


def resolve_device_list(value: str | None, requested: str, resolved: str, size: int, *,
                        flag: str, unit: str, size_flag: str,
                        error: type[ValueError]) -> tuple[str, tuple[str, ...]]:
    """A per-``unit`` device list (``--pp-devices``: one per stage; ``--tp-devices``: one per
    rank) -> (the engine's device, the devices): ``()`` when every one runs on the engine's
    device. ``requested`` is ``--device`` as given (``auto`` follows the list: cuda if any
    entry is on the GPU), ``resolved`` what it resolved to without the list."""
    if value is None or not value.strip():
        return resolved, ()
    devices = tuple(d.strip().lower() for d in value.split(","))
    bad = [d for d in devices if d not in PP_DEVICES]
    if bad:
        raise error(f"{flag}: unknown device {bad[0]!r} in {value!r}; each {unit} is one of "
                    f"{', '.join(PP_DEVICES)}")
    if len(devices) != size:
        raise error(f"{flag} names {len(devices)} device(s) ({value!r}) but {size_flag} is "
                    f"{size}: give one per {unit}")
    wants_gpu = "cuda" in devices
    if wants_gpu:
        import torch

        if not torch.cuda.is_available():
            raise error(f"{flag} {value!r} puts a {unit} on cuda but no CUDA GPU is visible "
                        "to torch")
    device = ("cuda" if wants_gpu else "cpu") if requested == "auto" else resolved
    if wants_gpu and device != "cuda":
        raise error(f"{flag} {value!r} puts a {unit} on cuda but --device is {device}: pass "
                    "--device cuda (or auto)")
    if not wants_gpu and device != "cpu":
        raise error(f"{flag} {value!r} runs every {unit} on the CPU but --device is {device}: "
                    "pass --device cpu (or auto)")
    if all(d == device for d in devices):
        return device, ()
    return device, devices


def resolve_pp_devices(value: str | None, requested: str, resolved: str,
                       pp_size: int) -> tuple[str, tuple[str, ...]]:
    """(the engine's device, the stage devices of ``--pp-devices``): ``resolve_device_list``."""
    return resolve_device_list(value, requested, resolved, pp_size, flag="--pp-devices",
                               unit="stage", size_flag="--pipeline-parallel-size",
                               error=PPDevicesError)


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
