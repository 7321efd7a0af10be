"""Logits processors: user code that edits a batch's logits before sampling, in the worker.

The interface (stable; vLLM v1's batch-level shape, simplified)::

    class MyProcessor:
        def __init__(self, vocab_size: int, device: torch.device) -> None: ...
        def apply(self, logits: torch.Tensor, state: BatchState) -> torch.Tensor: ...

``apply`` gets the float32 logits of the whole sampling batch ``[B, V]`` and the rows it acts
on (``state.rows``: every row for a global processor, else those of the requests that named it)
and returns the logits (edited in place or new). It runs after the grammar masks and before
allowed_token_ids, logit bias, penalties and temperature.

Processors reach the worker by name only, never as callables over a socket: a request names
entry points of the ``tidal.logits_processors`` group (``logits_processors: ["name"]``), and
``--logits-processors`` gives global ones as entry-point names or ``"package.module:Class"``
import strings. One instance of each lives per worker.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tidal.engine_core.plugins import LOGITS_PROCESSORS, import_string, load_plugin

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class BatchState:
    rows: torch.Tensor  # int64 [R]: the rows of ``logits`` this processor acts on
    req_ids: list[str]  # the requests of those rows
    # Each row's generated tokens so far (a token still in flight on the device reads -1).
    output_token_ids: list[Sequence[int]]


class LogitsProcessor(Protocol):
    def __init__(self, vocab_size: int, device: torch.device) -> None: ...

    def apply(self, logits: torch.Tensor, state: BatchState) -> torch.Tensor: ...


def resolve_class(name: str) -> Any:
    """A processor class by entry-point name or ``module:Class`` import string."""
    if ":" in name:
        return import_string(name)
    return load_plugin(LOGITS_PROCESSORS, name)


class LogitsProcessors:
    """The worker's processor instances: the global ones, and those requests name (created on
    first use)."""

    def __init__(self, vocab_size: int, device: torch.device,
                 global_names: Sequence[str] = ()) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._by_name: dict[str, Any] = {}
        self.global_names = tuple(global_names)
        for name in self.global_names:
            self.get(name)  # a global one that cannot load stops start-up

    def get(self, name: str) -> Any:
        proc = self._by_name.get(name)
        if proc is None:
            cls = resolve_class(name)
            proc = self._by_name[name] = cls(self.vocab_size, self.device)
            logger.info("logits processor %s: %s", name, type(proc).__name__)
        return proc


def apply_processors(logits: torch.Tensor,
                     work: list[tuple[Any, BatchState]]) -> torch.Tensor:
    for proc, state in work:
        out = proc.apply(logits, state)
        if out is not None:
            logits = out
    return logits
