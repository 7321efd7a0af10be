"""The compiled forward of a worker's model (``--compilation-config`` mode 3).

``CompiledForward(model, ...)`` numbers the model's attention layers for the
``tidal::attention`` op and wraps ``model(input_ids, positions, None)`` in ``torch.compile``
with the piecewise backend, ``fullgraph=True`` (a graph break is an error, never a silent
split) and the token count marked *unbacked* on both inputs: Dynamo then neither specialises
on it nor guards it (a backed size would be specialised at 0 and 1, so a one-token decode
step would recompile), so the one trace serves prefill, decode and mixed steps of every
size. ``compile(dummy)`` runs that trace at start-up; a model that cannot be traced as one
graph is reported (``failure``) and the runner keeps the eager model.

Each instance compiles its own copy of the wrapper's code object: Dynamo keeps its compiled
code per code object, so two engines in one process never share (or evict) each other's.
"""

from __future__ import annotations

import logging
import os
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tidal.engine_core.compilation_config import CompilationConfig
from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.compilation.attention_op import step_context
from tidal.worker.compilation.compile_cache import CompileCache, cache_key, key_parts
from tidal.worker.compilation.piecewise_backend import CompileStats, PiecewiseBackend

logger = logging.getLogger(__name__)


def _fresh_function(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own (Dynamo's compiled-code cache hangs on it)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__,
                              fn.__closure__)


def _forward(model: nn.Module, input_ids: torch.Tensor,
             positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    # No metadata: every attention layer calls the opaque op (layers/attention.py).
    return model(input_ids, positions, None)


class CompiledForward:
    def __init__(self, model: nn.Module, cc: CompilationConfig, *, key_inputs: dict[str, Any],
                 rank: int = 0) -> None:
        self.model = model
        self.cc = cc
        self.stats = CompileStats()
        self.layers = list(model.attention_layers())
        for i, layer in enumerate(self.layers):
            layer.op_index = i
        self.cache: CompileCache | None = None
        key = ""
        if cc.backend == "inductor":
            parts = key_parts(compilation=cc, rank=rank, **key_inputs)
            key = cache_key(parts)
            assert cc.cache_dir is not None
            try:
                self.cache = CompileCache(cc.cache_dir, key, parts)
            except OSError as exc:  # an unwritable folder costs start-up time, nothing else
                logger.warning("compile cache %s unusable (%s): compiling without it",
                               cc.cache_dir, exc)
        options: dict[str, Any] = {}
        if (os.cpu_count() or 1) <= 4:
            # Inductor's pool of compile workers costs more to start than it saves on a few
            # cores (measured on two: 17 s against 25 s for a two-layer model's pieces).
            options["compile_threads"] = 1
        self.backend = PiecewiseBackend(self.stats, store=self.cache, key=key,
                                        inductor_options=options,
                                        compile_pieces=cc.backend == "inductor")
        fn = _fresh_function(_forward, f"{id(self):x}")
        self._compiled = torch.compile(fn, backend=self.backend, fullgraph=True, dynamic=False)
        self.failure: str | None = None  # why the model runs eagerly after all

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        with step_context(meta, self.layers):
            return self._compiled(self.model, input_ids, positions)

    def compile(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> bool:
        """Trace and compile (or load) with these dummy inputs; False (and ``failure`` set,
        the layers back to eager) when the model cannot be compiled as one graph."""
        t0 = time.perf_counter()
        try:
            self(input_ids, positions, meta)
        except Exception as exc:  # noqa: BLE001 - any failure: say why and run eagerly
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self.failure = (f"{type(self.model).__name__} could not be compiled as one graph "
                            f"({type(exc).__name__}: {first[:300]})")
            logger.warning("compilation: falling back to the eager model: %s", self.failure)
            for layer in self.layers:
                layer.op_index = None
            return False
        stats = self.stats
        stats.trace_s = max(0.0, time.perf_counter() - t0 - stats.compile_s - stats.load_s)
        return True

    def describe(self) -> str:
        s = self.stats
        where = f"; cache {self.cache.dir}" if self.cache is not None else ""
        return (f"{s.pieces} pieces around {s.attention_calls} attention calls; trace "
                f"{s.trace_s:.2f} s, Inductor {s.inductor_compiles} piece(s) in "
                f"{s.compile_s:.2f} s, cache hits {s.cache_hits} loaded in {s.load_s:.2f} s, "
                f"rebuilt {s.cache_rebuilt}{where}")
