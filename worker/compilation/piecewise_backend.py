"""The Dynamo backend of the compiled model: split the traced graph at the attention op and
compile every piece in between with Inductor.

Dynamo traces the model's forward once (the token count dynamic) into one FX graph. This
backend cuts it with ``torch.fx.passes.split_module`` at each ``tidal::attention`` call
(``attention_op``): the attention calls become submodules of their own that run eagerly (the
backend's own host-side planning, its paged K/V write), and every piece between two of them
(norms, projections, rotary, the MLP, the residual adds) is compiled by Inductor, with the
token count as a symbol, so one compiled piece serves every batch. The pieces are where CUDA
graphs go per capture size (not on this build: ``CompilationConfig``).

Each piece is compiled with ``torch._inductor.standalone_compile``, whose artifacts save to
and load from a file: ``compile_cache.CompileCache`` keeps them, keyed by everything that
changes the code, so a second start with the same key loads every piece without running
Inductor; with the plan the backend records (``warm_start``) it also skips Dynamo's trace
(``compiled_model``'s counters show which).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx, nn
from torch._guards import detect_fake_mode
from torch.fx.passes.split_module import split_module

from tidal.worker.compilation.attention_op import is_attention_node
from tidal.worker.compilation import warm_start
from tidal.worker.compilation.piecewise_graphs import PiecewiseGraphs, attention_fed_args
from tidal.worker.compilation.warm_start import WarmPlan

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CompileStats:
    """What compiling the model did, for the start-up log, the tests and the bench."""

    dynamo_traces: int = 0  # graphs Dynamo handed to the backend (a recompile adds one)
    pieces: int = 0  # pieces between attention calls, compiled or loaded
    attention_calls: int = 0  # attention ops the graph was split at
    inductor_compiles: int = 0  # pieces compiled by Inductor (cache misses)
    cache_hits: int = 0  # pieces loaded from the compile cache
    shared: int = 0  # pieces that reuse an identical piece's artifact (no compile, no load)
    cache_rebuilt: int = 0  # cache entries found corrupt or unreadable, compiled again
    trace_s: float = 0.0  # Dynamo's trace (first call to the backend, measured around it)
    compile_s: float = 0.0  # Inductor, for the pieces it compiled
    load_s: float = 0.0  # loading cached pieces
    warm_start: bool = False  # rebuilt from the cache's plan, without Dynamo (warm_start)


class PieceStore(Protocol):
    """Where compiled pieces are saved and looked up (``compile_cache.CompileCache``)."""

    def load(self, key: str, stats: CompileStats) -> Any | None: ...

    def save(self, key: str, artifact: Any) -> None: ...


class _Piece(nn.Module):
    """A compiled piece, in the place of its submodule in the split graph. ``single``: the
    submodule returned one value, which an artifact loaded from disk hands back as a 1-list
    (a freshly compiled one as it is). ``graphs``: the piecewise CUDA graphs it replays (or
    records) while a forward runs at a capture size; ``index``: its place in them; ``fed``: its
    arguments that attention outputs (``piecewise_graphs.attention_fed_args``)."""

    def __init__(self, fn: Callable[..., Any], name: str, single: bool, *,
                 graphs: PiecewiseGraphs | None = None, index: int = 0,
                 fed: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.fn = fn
        self.name = name
        self.single = single
        self.graphs = graphs
        self.index = index
        self.fed = fed

    def forward(self, *args: Any) -> Any:
        if self.graphs is None:
            out = self.fn(*args)
        else:
            out = self.graphs.run_piece(self.index, self.fn, args, self.fed)
        return out[0] if self.single and isinstance(out, (list, tuple)) else out


def _returns_one(gm: fx.GraphModule) -> bool:
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    return not isinstance(out.args[0], (tuple, list))


def split_at_attention(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str], int]:
    """``gm`` cut at every attention call: (the split graph, the names of its submodules
    that are compiled pieces in execution order, the number of attention calls)."""
    part = 0
    attention_parts: set[int] = set()
    assignment: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_attention_node(node):
            part += 1
            assignment[node] = part
            attention_parts.add(part)
            part += 1
        else:
            assignment[node] = part
    split = split_module(gm, None, lambda node: assignment[node], keep_original_order=True)
    pieces = []
    for node in split.graph.nodes:
        if node.op == "call_module":
            index = int(node.target.removeprefix("submod_"))
            if index not in attention_parts:
                pieces.append(node.target)
    return split, pieces, len(attention_parts)


def _describe_input(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{tuple(str(s) for s in x.shape)}{x.dtype}{x.device.type}{x.stride()}"
    return f"{type(x).__name__}:{x}"


def canonical_code(piece: fx.GraphModule) -> str:
    """``piece``'s Python code with every value renamed by its position. Dynamo names values
    after their source (``l_self_modules_layers_modules_7_...``), so the pieces of a decoder's
    identical middle layers differ only in those names; in this form they read the same."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(piece.graph.nodes):
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        target = f"v{i}" if node.op == "placeholder" else node.target
        env[node] = graph.create_node(node.op, target, args, kwargs, name=f"v{i}")
    return graph.python_code(root_module="self").src


def piece_key(base: str, piece: fx.GraphModule, args: Sequence[Any]) -> str:
    """The cache key of one piece: the engine's key, its code (``canonical_code``) and its
    inputs' layouts. Pieces with one key are one compiled artifact: a decoder's middle
    layers compile, save and load once."""
    h = hashlib.sha256()
    h.update(base.encode())
    h.update(canonical_code(piece).encode())
    for a in args:
        h.update(_describe_input(a).encode())
    return h.hexdigest()[:32]


class _CompileInterpreter(fx.Interpreter):
    """Runs the split graph on fake inputs; each piece it reaches is compiled (or loaded)
    with the inputs it gets there, and put in its submodule's place."""

    def __init__(self, split: fx.GraphModule, pieces: list[str],
                 compile_piece: Callable[[int, str, fx.GraphModule, list[Any]], Callable]
                 ) -> None:
        super().__init__(split)
        self.pieces = {name: i for i, name in enumerate(pieces)}
        self.compile_piece = compile_piece
        self.compiled: dict[str, Callable] = {}

    def call_module(self, target: Any, args: tuple, kwargs: dict) -> Any:
        out = super().call_module(target, args, kwargs)
        index = self.pieces.get(target)
        if index is not None:
            sub = self.fetch_attr(target)
            self.compiled[target] = self.compile_piece(index, target, sub, list(args))
        return out


class PiecewiseBackend:
    """A Dynamo backend (``torch.compile(backend=...)``). ``store``: the compile cache (None:
    none); ``key``: the engine's cache key; ``inductor_options``: Inductor config patches;
    ``compile_pieces`` off: the pieces run as traced (no Inductor: for debugging a trace);
    ``graphs``: the piecewise CUDA graphs the pieces replay (None: none)."""

    def __init__(self, stats: CompileStats, *, store: PieceStore | None = None, key: str = "",
                 inductor_options: dict[str, Any] | None = None,
                 compile_pieces: bool = True, graphs: PiecewiseGraphs | None = None) -> None:
        self.stats = stats
        self.store = store
        self.key = key
        # We capture the pieces ourselves (piecewise_graphs): Inductor's CUDA graph trees off.
        self.inductor_options = {**dict(inductor_options or {}), "triton.cudagraphs": False}
        self.compile_pieces = compile_pieces
        self.graphs = graphs
        self.piece_keys: dict[str, str] = {}  # piece name -> its cache key
        self._artifacts: dict[str, Any] = {}  # cache key -> its compiled (or loaded) artifact
        # The split graph's plan for a trace-free warm start (warm_start), once traced.
        self.plan: WarmPlan | None = None
        self.graph_outputs = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        stats = self.stats
        stats.dynamo_traces += 1
        split, pieces, n_attn = split_at_attention(gm)
        stats.attention_calls = n_attn
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None:
            raise RuntimeError("the piecewise backend found no fake mode in its inputs")
        fake_args = [fake_mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                     for a in example_inputs]
        interp = _CompileInterpreter(split, pieces, self._compile_piece)
        with fake_mode:
            interp.run(*fake_args)
        fed = attention_fed_args(split, pieces)
        singles = {name: _returns_one(getattr(split, name)) for name in pieces}
        if self.store is not None and self.compile_pieces:
            try:
                self.plan = warm_start.record(gm, split, pieces, self.piece_keys, singles, fed)
            except Exception as exc:  # noqa: BLE001 - no plan costs a trace next time only
                logger.info("warm start: no plan recorded (%s: %s)", type(exc).__name__, exc)
            self.graph_outputs = warm_start.graph_outputs(split)
        for index, name in enumerate(pieces):
            fn = interp.compiled[name]
            # (The eager backend keeps the piece as is, unless graphs wrap it.)
            if fn is not getattr(split, name) or self.graphs is not None:
                split._modules[name] = _Piece(fn, name, singles[name], graphs=self.graphs,
                                              index=index, fed=fed.get(name, frozenset()))
        stats.pieces = len(pieces)
        logger.info("compiled the model's graph as %d pieces around %d attention calls "
                    "(%d compiled by Inductor, %d from the cache, %d sharing an identical "
                    "piece's code)", len(pieces), n_attn, stats.inductor_compiles,
                    stats.cache_hits, stats.shared)
        return split

    def _compile_piece(self, index: int, name: str, sub: fx.GraphModule,
                       args: list[Any]) -> Callable[..., Any]:
        if not self.compile_pieces:
            return sub
        stats = self.stats
        key = piece_key(self.key, sub, args)
        self.piece_keys[name] = key
        shared = self._artifacts.get(key)
        if shared is not None:  # (an identical earlier piece: another layer of the same code)
            stats.shared += 1
            return shared
        if self.store is not None:
            t0 = time.perf_counter()
            loaded = self.store.load(key, stats)
            if loaded is not None:
                stats.cache_hits += 1
                stats.load_s += time.perf_counter() - t0
                self._artifacts[key] = loaded
                return loaded
        from torch._inductor import standalone_compile  # (imports Inductor: only here)

        t0 = time.perf_counter()
        artifact = standalone_compile(
            sub, args, dynamic_shapes="from_tracing_context",
            options={"config_patches": dict(self.inductor_options)})
        stats.inductor_compiles += 1
        stats.compile_s += time.perf_counter() - t0
        if self.store is not None:
            self.store.save(key, artifact)
        self._artifacts[key] = artifact
        return artifact
