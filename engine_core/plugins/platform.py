"""Device platforms: what device the engine runs on, its default attention backend, and the
collective backend its ranks talk through.

CUDA and CPU are the two built-in platforms. A ``tidal.platform_plugins`` entry point is a
callable taking nothing that returns a :class:`Platform` (or None where its device is absent);
the first plugin platform that reports itself available wins over the built-ins (in
``$TIDAL_PLUGINS`` order, else by entry-point name). A platform's ``device_type`` must be a
torch device type the worker runs today (``cuda`` or ``cpu``): a plugin can change the
defaults on those devices, and another device type is refused with a clear error until the
worker supports one.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Protocol, runtime_checkable

from tidal.engine_core.plugins import PLATFORM, PluginError, load_plugins

logger = logging.getLogger(__name__)

SUPPORTED_DEVICE_TYPES = ("cuda", "cpu")


@runtime_checkable
class Platform(Protocol):
    name: str
    device_type: str  # the torch device type: "cuda" | "cpu"
    dist_backend: str  # torch.distributed backend between ranks: "nccl" | "gloo"
    # The attention backend to use where the user names none; None: the kernel policy picks.
    default_attention_backend: str | None

    def is_available(self) -> bool: ...


class CudaPlatform:
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_attention_backend: str | None = None

    def is_available(self) -> bool:
        import torch

        return torch.cuda.is_available()


class CpuPlatform:
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_attention_backend: str | None = None

    def is_available(self) -> bool:
        return True


BUILTIN: dict[str, Platform] = {"cuda": CudaPlatform(), "cpu": CpuPlatform()}


def _check(name: str, plat: object) -> Platform:
    if not isinstance(plat, Platform):
        raise PluginError(f"platform plugin {name!r} returned {type(plat).__name__}, not a "
                          "Platform (name, device_type, dist_backend, "
                          "default_attention_backend, is_available())")
    if plat.device_type not in SUPPORTED_DEVICE_TYPES:
        raise PluginError(f"platform plugin {name!r}: device type {plat.device_type!r} is not "
                          f"yet supported by tidal's worker (it runs "
                          f"{', '.join(SUPPORTED_DEVICE_TYPES)})")
    return plat


def plugin_platform() -> Platform | None:
    """The first available plugin platform, or None."""
    for name, make in load_plugins(PLATFORM).items():
        try:
            plat = make()
        except Exception as exc:  # noqa: BLE001 - stops start-up, named
            raise PluginError(f"platform plugin {name!r} failed: {type(exc).__name__}: "
                              f"{exc}") from exc
        if plat is None:
            continue
        plat = _check(name, plat)
        if plat.is_available():
            logger.info("platform %s (plugin %s)", plat.name, name)
            return plat
    return None


@cache
def current_platform() -> Platform:
    """This process's platform: a plugin's when one is available, else CUDA where a GPU is
    visible, else the CPU (found once per process)."""
    plat = plugin_platform()
    if plat is not None:
        return plat
    cuda = BUILTIN["cuda"]
    return cuda if cuda.is_available() else BUILTIN["cpu"]


def platform_for(device_type: str) -> Platform:
    """The platform serving ``device_type``: the current one if it is of that type, else the
    built-in one."""
    plat = current_platform()
    if plat.device_type == device_type:
        return plat
    return BUILTIN[device_type]
