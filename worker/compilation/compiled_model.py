"""The compiled forward of a worker's model (``--compilation-config`` mode 3).

``CompiledForward(model, ...)`` numbers the model's attention layers for the
``tidal::attention`` op and wraps ``model(input_ids, positions, None)`` in ``torch.compile``
with the piecewise backend, ``fullgraph=True`` (a graph break is an error, never a silent
split) and the token count marked *unbacked* on both inputs: Dynamo then neither specialises
on it nor guards it (a backed size would be specialised at 0 and 1, so a one-token decode
step would recompile), so the one trace serves prefill, decode and mixed steps of every
size. ``compile(dummy)`` runs that trace at start-up; a model that cannot be traced as one
graph is reported (``failure``) and the runner keeps the eager model. With a plan in the
compile cache (``warm_start``) ``compile`` rebuilds the forward from it instead: no trace.

Each instance compiles its own copy of the wrapper's code object: Dynamo keeps its compiled
code per code object, so two engines in one process never share (or evict) each other's.
"""

from __future__ import annotations

import logging
import os
import re
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
from tidal.worker.compilation import warm_start
from tidal.worker.compilation.piecewise_backend import CompileStats, PiecewiseBackend, _Piece
from tidal.worker.compilation.piecewise_graphs import PiecewiseGraphs
from tidal.worker.compilation.warm_start import SubSpec, WarmForward

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


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Close, not equal: the same kernels, but a GPU's reductions may order apart (a wrong
    plan, an argument in the wrong place, is far off)."""
    tol = 1e-3 if a.dtype == torch.float32 else 2e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _sharing_loader(cache: CompileCache, stats: CompileStats) -> Callable[[str], Any | None]:
    """``cache.load`` for a plan's pieces, each key loaded once: pieces of identical code
    (a decoder's middle layers) share one artifact (counted in ``stats.shared``)."""
    loaded: dict[str, Any] = {}

    def load(key: str) -> Any | None:
        if key in loaded:
            stats.shared += 1
            return loaded[key]
        artifact = loaded[key] = cache.load(key, stats)
        stats.cache_hits += artifact is not None
        return artifact

    return load


class CompiledForward:
    """``graphs``: the piecewise CUDA graphs its pieces replay (``cudagraph_mode`` PIECEWISE /
    FULL_AND_PIECEWISE; captured by ``capture_graphs``), or None."""

    def __init__(self, model: nn.Module, cc: CompilationConfig, *, key_inputs: dict[str, Any],
                 rank: int = 0, graphs: PiecewiseGraphs | None = None,
                 agree: Callable[[bool], bool] | None = None) -> None:
        self.model = model
        # Tensor-parallel ranks (whose forward runs collectives) must run the same start-up
        # forwards: a warm start (one forward) on one rank beside a cold start (the trace's,
        # then the plan's check) on another would pair their all-reduces wrongly. ``agree``
        # (True on every rank iff true on every rank) makes each such choice together.
        self._agree = agree or (lambda ok: ok)
        self.graphs = graphs
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
                                        compile_pieces=cc.backend == "inductor",
                                        graphs=graphs)
        fn = _fresh_function(_forward, f"{id(self):x}")
        self._compiled = torch.compile(fn, backend=self.backend, fullgraph=True, dynamic=False)
        self.failure: str | None = None  # why the model runs eagerly after all
        self._warm: WarmForward | None = None  # the forward rebuilt without Dynamo, if any
        # (cache hits, pieces sharing an identical one's artifact, seconds) of the plan's load
        self._warm_loaded = (0, 0, 0.0)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._warm is not None:  # rebuilt from the cache: no Dynamo (warm_start)
            with step_context(meta, self.layers):
                return self._warm(input_ids, positions)  # type: ignore[return-value]
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        with step_context(meta, self.layers):
            return self._compiled(self.model, input_ids, positions)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            buffers: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step: with ``buffers`` (the fixed id / position buffers whose head holds this
        step's ``input_ids`` / ``positions``) and a captured size that holds the step, the
        pieces replay their graphs of that size over the padded buffers (attention covers
        ``meta.num_actual_tokens`` rows); otherwise the compiled pieces run as they are."""
        graphs = self.graphs
        n = input_ids.shape[0]
        size = graphs.size_for(n) if graphs is not None and buffers is not None else None
        if size is None:
            if graphs is not None and buffers is not None:
                graphs.ungraphed_steps += 1
            return self(input_ids, positions, meta)
        assert graphs is not None and buffers is not None
        ids_buf, pos_buf = buffers
        if input_ids.data_ptr() != ids_buf.data_ptr() \
                or positions.data_ptr() != pos_buf.data_ptr():
            raise RuntimeError("a piecewise step's inputs must sit at the head of the fixed "
                               "step buffers")
        with graphs.running(size):
            hidden, residual = self(ids_buf[:size], pos_buf[:size], meta)
        return hidden[:n], None if residual is None else residual[:n]

    def release(self) -> None:
        """Give the piecewise graphs' memory back (the runner's ``release``)."""
        if self.graphs is not None:
            self.graphs.clear()

    def capture_graphs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       meta_for: Callable[[int], AttentionMetadata]) -> str:
        """Capture the piecewise graphs over the fixed step buffers ``input_ids`` /
        ``positions``, ``meta_for(size)`` giving a dummy step of ``size`` tokens that writes no
        KV; returns what it did for the start-up log."""
        graphs = self.graphs
        assert graphs is not None
        input_ids.zero_()
        positions.zero_()

        def forward(size: int, capture: bool) -> Any:
            return self(input_ids[:size], positions[:size], meta_for(size))

        graphs.capture_all(forward)
        return graphs.describe()

    def compile(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> bool:
        """Trace and compile (or load) with these dummy inputs; False (and ``failure`` set,
        the layers back to eager) when the model cannot be compiled as one graph. With a
        warm-start plan in the cache the forward is rebuilt from it instead, without Dynamo;
        a cold start records and checks one."""
        t0 = time.perf_counter()
        if self._warm_start(input_ids, positions, meta):
            self.stats.trace_s = 0.0
            return True
        try:
            result = self(input_ids, positions, meta)
        except Exception as exc:  # noqa: BLE001 - any failure: say why and run eagerly
            self.failure = (f"{type(self.model).__name__} could not be compiled as one graph "
                            f"({_root_cause(exc)})")
            logger.warning("compilation: falling back to the eager model: %s", self.failure)
            logger.debug("compilation failure", exc_info=True)
            for layer in self.layers:
                layer.op_index = None
            self._agree(False)  # (the other ranks' ``_save_plan`` asks once: no check forward)
            return False
        stats = self.stats
        stats.trace_s = max(0.0, time.perf_counter() - t0 - stats.compile_s - stats.load_s)
        self._save_plan(input_ids, positions, meta, result)
        return True

    def _make_piece(self, artifact: Any, spec: SubSpec, index: int) -> nn.Module:
        return _Piece(artifact, spec.name, spec.single, graphs=self.graphs, index=index,
                      fed=frozenset(spec.fed))

    def _warm_start(self, input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> bool:
        warm = self._load_warm()
        if not self._agree(warm is not None):
            if warm is not None:
                logger.info("warm start: another rank has no usable plan; tracing instead")
            return False
        self._warm = warm
        t0 = time.perf_counter()
        failed = None
        try:
            self(input_ids, positions, meta)
        except Exception as exc:  # noqa: BLE001 - a plan that does not run: trace instead
            failed = exc
        if not self._agree(failed is None):
            self._warm = None
            if failed is not None:
                logger.warning("warm start: the plan in %s failed (%s: %s); tracing instead",
                               self.cache.dir, type(failed).__name__, failed)
                self.cache.drop_plan()
            return False
        stats = self.stats
        hits, shared, load_s = self._warm_loaded
        stats.cache_hits += hits
        stats.shared += shared
        stats.load_s += load_s + time.perf_counter() - t0
        stats.pieces = sum(sub.kind == "piece" for sub in warm.plan.subs)
        stats.attention_calls = len(warm.plan.subs) - stats.pieces
        stats.warm_start = True
        return True

    def _load_warm(self) -> WarmForward | None:
        """The forward rebuilt from the cache's plan (not run yet), or None."""
        cache = self.cache
        data = cache.load_plan() if cache is not None else None
        if cache is None or data is None:
            return None
        # (The plan is code this process would run: only from a folder nobody else writes.)
        refused = warm_start.untrusted(cache.dir, cache.dir / warm_start.PLAN)
        if refused is not None:
            logger.warning("warm start: not running the plan in %s (%s); tracing instead",
                           cache.dir, refused)
            return None
        plan = warm_start.decode(data)
        scratch = CompileStats()
        t0 = time.perf_counter()
        warm = None

        if plan is not None:
            warm = warm_start.build(plan, self.model, _sharing_loader(cache, scratch),
                                    self._make_piece)
        stats = self.stats
        stats.cache_rebuilt += scratch.cache_rebuilt  # (a corrupt piece stays dropped)
        if warm is None:
            logger.info("warm start: the plan in %s does not load; tracing instead", cache.dir)
            return None
        # (Counted once the ranks have agreed to use it: a trace after loads its pieces again.)
        self._warm_loaded = (scratch.cache_hits, scratch.shared, time.perf_counter() - t0)
        return warm

    def _save_plan(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, result: Any) -> None:
        """Record the warm-start plan of this (cold) start, once it is shown to rebuild this
        forward: the plan read back from its bytes, its pieces loaded from the cache, must
        give the traced forward's outputs on the dummy step."""
        backend, cache = self.backend, self.cache
        warm = data = None
        if backend.plan is not None and cache is not None:
            plan = warm_start.finish(backend.plan, result, backend.graph_outputs)
            if plan is None:
                logger.info("warm start: the model's result does not match its graph's "
                            "outputs; no plan saved")
            else:
                data = warm_start.encode(plan)
                check = CompileStats()
                decoded = warm_start.decode(data)
                warm = None if decoded is None else warm_start.build(
                    decoded, self.model, _sharing_loader(cache, check),
                    lambda artifact, spec, index: _Piece(artifact, spec.name, spec.single))
        # (The check runs a forward: every rank or none.)
        if not self._agree(warm is not None):
            return
        try:
            with step_context(meta, self.layers):
                got = warm(input_ids, positions)
            same = all((a is None and b is None) or (
                isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and _close(a, b)) for a, b in zip(got, result))
        except Exception as exc:  # noqa: BLE001 - any failure: no plan, a trace next time
            logger.info("warm start: the plan does not run (%s: %s); not saved",
                        type(exc).__name__, exc)
            return
        # (Saved where it checked out; a rank without one makes every rank trace next time.)
        if same and len(got) == len(result):
            cache.save_plan(data)
        else:
            logger.info("warm start: the rebuilt forward differs from the traced one; no plan "
                        "saved")

    def describe(self) -> str:
        s = self.stats
        where = f"; cache {self.cache.dir}" if self.cache is not None else ""
        how = ("warm start without a Dynamo trace" if s.warm_start
               else f"trace {s.trace_s:.2f} s")
        return (f"{s.pieces} pieces around {s.attention_calls} attention calls; {how}, "
                f"Inductor {s.inductor_compiles} piece(s) in "
                f"{s.compile_s:.2f} s, cache hits {s.cache_hits} loaded in {s.load_s:.2f} s, "
                f"{s.shared} sharing an identical piece, rebuilt {s.cache_rebuilt}{where}")


def _root_cause(exc: BaseException) -> str:
    """``Type: first line`` of the error underneath ``exc``: a backend's failure reaches us
    wrapped by Dynamo (``BackendCompilerFailed``, whose own first line names only the
    backend), the cause chained or held as ``inner_exception``; then, where Dynamo says it,
    the model code it was tracing (``at file:line in function``)."""
    seen = {id(exc)}
    where = _user_frame(exc)
    while True:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if inner is None or id(inner) in seen:
            break
        seen.add(id(inner))
        exc = inner
        where = _user_frame(exc) or where
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}" + (f" at {where}" if where else "")


_USER_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _user_frame(exc: BaseException) -> str:
    """The innermost model frame Dynamo was tracing when ``exc`` was raised (its
    ``real_stack``, else the "from user code:" part of its message), as ``file:line in
    function`` with the path from the package on; "" when it says none."""
    stack = getattr(exc, "real_stack", None)
    frames = [(f.filename, f.lineno, f.name) for f in stack] if stack else []
    if not frames:
        text = str(exc)
        at = text.find("from user code:")
        if at >= 0:
            frames = [(m[0], int(m[1]), m[2]) for m in _USER_FRAME.findall(text[at:])]
    if not frames:
        return ""
    path, line, name = frames[-1]
    for root in ("/tidal/", "/worker/", "/engine_core/"):
        if root in path:
            path = path[path.rindex(root) + 1:]
            break
    return f"{path}:{line} in {name}"
