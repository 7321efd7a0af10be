"""The plugins an API server process runs (``tidal.engine_core.plugins`` finds them): stat
loggers, IO processors and LoRA resolvers, loaded once at start-up so that a broken one stops
the server with its name instead of failing requests later.

Interfaces (the README's plugin guide has a complete example package):

- stat logger (``tidal.stat_logger_plugins``): ``cls(config)``; ``record(stats, step)`` after
  every engine step with the same values the Prometheus metrics get (``SchedulerStats`` or None,
  and this server's ``StepRecord``); optional ``shutdown()``. Not created with
  ``--disable-log-stats``. An exception in ``record`` is logged and that logger dropped; the
  server carries on.
- IO processor (``tidal.io_processor_plugins``): ``cls(config, tokenizer)``;
  ``parse_request(body) -> IOProcessorInput`` (prompts as text or token ids, and
  SamplingParams for a generative model), ``output_to_response(body, outputs) -> JSON value``
  (``outputs``: one ``RequestOutput`` per prompt, or ``PoolingOutput`` on an embedding model).
  Served at ``POST /v1/io_processor/{name}``.
- LoRA resolver (``tidal.lora_resolvers``): ``cls()``; ``async resolve(base_model_name,
  lora_name) -> LoRARequest | None`` (any ``lora_int_id``: the server assigns its own).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tidal.engine_core.plugins import (
    IO_PROCESSOR,
    LORA_RESOLVERS,
    STAT_LOGGER,
    PluginError,
    load_plugins,
)
from tidal.engine_core.protocol import SchedulerStats
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.output_processor import StepRecord

if TYPE_CHECKING:
    from tidal.engine_core.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class IOProcessorInput:
    """What an IO processor makes of a request body: the prompts to run, and how to sample
    them (ignored on an embedding model)."""

    prompts: list[str | list[int]]
    params: SamplingParams = field(default_factory=SamplingParams)


def _instantiate(group: str, make: Callable[[Any], Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, cls in load_plugins(group).items():
        try:
            out[name] = make(cls)
        except Exception as exc:  # noqa: BLE001 - stops start-up, named
            raise PluginError(f"plugin {name!r} ({group}) failed to start: "
                              f"{type(exc).__name__}: {exc}") from exc
    return out


@dataclass(slots=True)
class ServerPlugins:
    stat_loggers: dict[str, Any] = field(default_factory=dict)
    io_processors: dict[str, Any] = field(default_factory=dict)
    lora_resolvers: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, config: EngineConfig, tokenizer: Any, *, log_stats: bool = True,
             lora_resolvers: dict[str, Any] | None = None) -> ServerPlugins:
        """Every allowed plugin of the server's groups, created. ``lora_resolvers``: built-in
        ones (``--lora-resolver-dir``) asked before the plugins'."""
        resolvers = dict(lora_resolvers or {})
        if config.lora is not None:
            resolvers.update(_instantiate(LORA_RESOLVERS, lambda c: c()))
        return cls(
            stat_loggers=_instantiate(STAT_LOGGER, lambda c: c(config)) if log_stats else {},
            io_processors=_instantiate(IO_PROCESSOR, lambda c: c(config, tokenizer)),
            lora_resolvers=resolvers,
        )

    def record(self, stats: SchedulerStats | None, step: StepRecord) -> None:
        for name in list(self.stat_loggers):
            try:
                self.stat_loggers[name].record(stats, step)
            except Exception:  # noqa: BLE001 - a broken logger must not break the server
                logger.exception("stat logger plugin %s failed; it is dropped", name)
                del self.stat_loggers[name]

    def shutdown(self) -> None:
        for name, stat_logger in self.stat_loggers.items():
            stop = getattr(stat_logger, "shutdown", None)
            if stop is not None:
                try:
                    stop()
                except Exception:  # noqa: BLE001
                    logger.exception("stat logger plugin %s failed to shut down", name)
