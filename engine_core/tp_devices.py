"""``--tp-devices``: the device of each tensor-parallel rank (``cuda,cpu``: rank 0 on the GPU,
rank 1 a CPU process), checked once at start-up. vLLM has no equivalent: its CPU and GPU
workers never share a tensor-parallel group.

A list whose ranks all run on one device is the plain layout and resolves to ``()``. A mixed
list keeps every rank's device; the ranks' all-reduce becomes the hierarchical one
(``worker/distributed/hier_allreduce``): NCCL among the GPU ranks, then host memory with the
CPU ranks.
"""

from __future__ import annotations

from tidal.engine_core.pp_devices import resolve_device_list

# The dtypes every rank computes in: a CPU's float16 matmuls are slow or missing, and mixing
# precisions across ranks would make the sum depend on where a shard ran.
MIXED_TP_DTYPES = ("float32", "bfloat16")


class TPDevicesError(ValueError):
    """``--tp-devices`` is malformed or impossible here; the message says why."""


def resolve_tp_devices(value: str | None, requested: str, resolved: str, tp_size: int,
                       pp_devices: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
    """(the engine's device, the rank devices of ``--tp-devices``): ``resolve_device_list``;
    ``pp_devices`` the resolved ``--pp-devices`` (the two do not combine)."""
    if pp_devices and value is not None and value.strip():
        raise TPDevicesError(f"--tp-devices {value!r} with --pp-devices is not yet supported "
                             "(one mixed dimension at a time)")
    return resolve_device_list(value, requested, resolved, tp_size, flag="--tp-devices",
                               unit="rank", size_flag="--tensor-parallel-size",
                               error=TPDevicesError)


def check_mixed_tp(devices: tuple[str, ...], *, pipeline_parallel_size: int, backend: str,
                   data_parallel_size: int, dtype: str, compiled: bool, kv_transfer: bool,
                   expert_parallel: bool, speculative: bool, lora: bool) -> None:
    """Refuse what tensor parallelism across CPU and GPU ranks does not do (``devices`` from
    ``resolve_tp_devices``; ``()`` passes). CUDA graphs are not refused but turned off: the
    all-reduce waits on the host, which no graph can hold (``EngineArgs.create_config``)."""
    if not devices:
        return
    what = f"--tp-devices {','.join(devices)}"
    if pipeline_parallel_size > 1:
        raise TPDevicesError(f"{what} with pipeline parallelism is not yet supported")
    if backend != "mp":
        raise TPDevicesError(f"{what} with the {backend} executor is not yet supported (the "
                             "ranks are local processes: use the mp executor)")
    if data_parallel_size > 1:
        raise TPDevicesError(f"{what} with --data-parallel-size > 1 is not yet supported")
    if dtype not in MIXED_TP_DTYPES:
        raise TPDevicesError(f"{what} computes in {dtype} on a CPU rank: every rank must use "
                             f"one dtype the CPU runs, pass --dtype float32 or bfloat16")
    for on, name in ((compiled, "--compilation-config"), (kv_transfer, "a KV connector"),
                     (expert_parallel, "--enable-expert-parallel"),
                     (speculative, "speculative decoding"), (lora, "--enable-lora")):
        if on:
            raise TPDevicesError(f"{what} with {name} is not yet supported")
