"""Plugins: user code tidal runs without being patched, found through Python entry points.

A plugin is an entry point of an installed distribution (its ``pyproject.toml``'s
``[project.entry-points."<group>"]``); nothing is imported by path. ``$TIDAL_PLUGINS`` (a
comma-separated list of entry-point names) limits which are loaded, in every group. A plugin
that fails to import, or whose start-up call raises, stops start-up with its name and the error.

Groups (see the README's plugin guide):

- ``tidal.general_plugins``: a callable run once in every process at start-up (API server,
  EngineCore, workers), e.g. ``register_model`` of another package's model family;
- ``tidal.platform_plugins``: a callable returning a :class:`~.platform.Platform` (or None where
  its device is absent);
- ``tidal.io_processor_plugins``: a class turning a custom request body into prompts and the
  outputs back into a response (``POST /v1/io_processor/{name}``);
- ``tidal.logits_processors``: a batch-level logits processor class (``worker/sample``),
  named per request or given globally with ``--logits-processors``;
- ``tidal.stat_logger_plugins``: a class receiving every engine step's statistics;
- ``tidal.lora_resolvers``: a class offered the unknown ``model`` names of requests.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from typing import Any

from tidal.engine_core import envs

logger = logging.getLogger(__name__)

GENERAL = "tidal.general_plugins"
PLATFORM = "tidal.platform_plugins"
IO_PROCESSOR = "tidal.io_processor_plugins"
LOGITS_PROCESSORS = "tidal.logits_processors"
STAT_LOGGER = "tidal.stat_logger_plugins"
LORA_RESOLVERS = "tidal.lora_resolvers"
GROUPS = (GENERAL, PLATFORM, IO_PROCESSOR, LOGITS_PROCESSORS, STAT_LOGGER, LORA_RESOLVERS)


class PluginError(RuntimeError):
    """A plugin could not be loaded or run; the message names it."""


def _entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    found = {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}
    allowed = envs.plugins()
    if allowed is None:
        return [found[name] for name in sorted(found)]
    # The allow-list's order is the order plugins run in (and resolvers are asked in).
    return [found[name] for name in allowed if name in found]


def plugin_names(group: str) -> list[str]:
    """The entry-point names of ``group`` that ``$TIDAL_PLUGINS`` lets load, without loading
    them (the API server validates per-request names against this)."""
    return [ep.name for ep in _entry_points(group)]


def load_plugins(group: str) -> dict[str, Any]:
    """Every allowed plugin of ``group``, loaded: ``{entry-point name: object}`` in order.
    Raises :class:`PluginError` naming the first that fails."""
    loaded: dict[str, Any] = {}
    for ep in _entry_points(group):
        try:
            loaded[ep.name] = ep.load()
        except Exception as exc:  # noqa: BLE001 - any import error stops start-up, named
            raise PluginError(f"plugin {ep.name!r} ({group} = {ep.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc
        logger.info("loaded plugin %s (%s = %s)", ep.name, group, ep.value)
    return loaded


def load_plugin(group: str, name: str) -> Any:
    """The one plugin ``name`` of ``group``; :class:`PluginError` when it is not installed, not
    allowed by ``$TIDAL_PLUGINS``, or fails to load."""
    for ep in _entry_points(group):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as exc:  # noqa: BLE001
                raise PluginError(f"plugin {name!r} ({group} = {ep.value}) failed to load: "
                                  f"{type(exc).__name__}: {exc}") from exc
    raise PluginError(f"no plugin {name!r} in {group}; installed and allowed: "
                      f"{', '.join(plugin_names(group)) or 'none'}")


def import_string(target: str) -> Any:
    """``"package.module:Name"`` (or ``package.module.Name``) imported: how flags name classes
    that another process must import too (no callables cross a socket)."""
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise PluginError(f"{target!r} is not an import string like 'package.module:Name'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PluginError(f"cannot import {target!r}: {type(exc).__name__}: {exc}") from exc
    return obj


# Once per process: a spawned process (EngineCore, worker) starts with this False.
_general_done = False


def load_general_plugins() -> None:
    """Run every allowed ``tidal.general_plugins`` callable once in this process."""
    global _general_done
    if _general_done:
        return
    _general_done = True
    for name, fn in load_plugins(GENERAL).items():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - stops start-up, named
            raise PluginError(f"plugin {name!r} ({GENERAL}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
