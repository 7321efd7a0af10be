"""CUDA graphs around the compiled pieces (``cudagraph_mode`` PIECEWISE / FULL_AND_PIECEWISE).

The compiled model is a split graph: pieces (Inductor code) with an attention call between
every two of them (``piecewise_backend``). Attention cannot be captured for every step (its
backends plan prefill and mixed batches on the host), the pieces can: they are matmuls and
elementwise kernels over ``[tokens, ...]`` rows. So each piece is captured once per *capture
size* (a token count) and a step of N tokens runs at the smallest captured size >= N: its
inputs padded to that many rows, every piece replayed, the attention run eagerly on the N real
rows between them. A step above the largest size runs the compiled pieces without graphs.

Where a graph's inputs live:

- the model's inputs (``input_ids`` / ``positions``): the runner's fixed step buffers, whose
  first ``size`` rows the step passes (rows after the step's N are stale ids / positions of
  earlier steps, valid values whose results are dropped);
- parameters and buffers (rotary caches): they never move;
- the previous piece's outputs: that piece's graph wrote them where it wrote them at capture,
  so they are already in place;
- an attention output (a fresh tensor each step): copied into a *staging* buffer that every
  graph of every size reads it from (one per (slot, dtype, row shape), ``max size`` rows; the
  graphs replay one after another, so one buffer serves them all). Attention covers the step's
  ``num_actual_tokens`` rows only (``attention_op``): padding rows write no KV and read none.

Every other input is checked at replay (its address, or its value for a size argument): a
mismatch is an error, never a silent wrong answer.

All graphs share one memory pool and are captured from the largest size down, each after a
warm-up run of the compiled pieces at its size (cuBLAS heuristics and Triton launches are
settled outside the capture). A graph's outputs are kept as *weak* references (tensors over
the pool's memory that do not own it): once a size's forward has run, the pool may hand that
memory to the next (smaller) size's graphs, which is safe because graphs only ever replay in
the order they were captured, one forward at a time, never two at once. So the pool holds about
one forward's activations at the largest size, not one per size. Inductor's own CUDA graphs
stay off (``triton.cudagraphs``): these are the only ones.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import fx

from tidal.worker.compilation.attention_op import is_attention_node
from tidal.worker.cuda_graphs import capture_sizes

logger = logging.getLogger(__name__)


def default_capture_sizes(max_num_tokens: int) -> list[int]:
    """vLLM's grid of piecewise sizes: 1, 2, 4, 8, every 8 up to 256, every 16 beyond, up to
    512 tokens or the rows a step can hold (``max_num_tokens``), whichever is less. (vLLM
    stops at 2 x max_num_seqs; the pieces are for mixed steps too, whose token budget is the
    reach that matters: on an H100, Gemma-2-9B's 512-token mixed steps ran the compiled pieces
    at 0.57x the eager model's mixed graphs without graphs, tools/results/
    compile_h100_gemma2_9b_before_piecewise.json.)"""
    return capture_sizes(min(512, max_num_tokens))


def piecewise_sizes(given: Sequence[int] | None, *, max_num_tokens: int,
                    above: int = 0) -> list[int]:
    """The capture sizes to use, ascending: ``given`` (``cudagraph_capture_sizes``, checked
    against ``max_num_tokens`` at config time) or the default grid, of those only the ones
    above ``above``: the largest step that whole-model graphs already hold
    (FULL_AND_PIECEWISE with mixed-step graphs, 2048 tokens by default, so the default grid
    adds none: steps above 2048 tokens run the compiled pieces without graphs, as vLLM's
    steps above its 512-token grid do; on an H100 the 24 piecewise sizes of 2304..8192
    tokens cost Qwen3-0.6B 2 s of start-up)."""
    sizes = sorted(set(given)) if given else default_capture_sizes(max_num_tokens)
    return [s for s in sizes if above < s <= max_num_tokens and s >= 1]


def padded_size(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``num_tokens``; None above them all."""
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None


def attention_fed_args(split: fx.GraphModule, pieces: Sequence[str]) -> dict[str, frozenset[int]]:
    """For each piece of ``split`` (the split graph), the positions of its arguments that an
    attention submodule produced (directly or through ``getitem``): the inputs that arrive at
    a new address every step and are copied into staging buffers."""
    attention_parts = set()
    for name, sub in split.named_children():
        if isinstance(sub, fx.GraphModule) and any(is_attention_node(n) for n in sub.graph.nodes):
            attention_parts.add(name)
    wanted = set(pieces)
    fed: dict[str, frozenset[int]] = {}
    for node in split.graph.nodes:
        if node.op != "call_module" or node.target not in wanted:
            continue
        if node.kwargs:
            raise RuntimeError(f"piece {node.target} takes keyword arguments: not expected "
                               "from split_module")
        found = set()
        for i, arg in enumerate(node.args):
            src = arg
            while isinstance(src, fx.Node) and src.op == "call_function" \
                    and src.target is operator.getitem:
                src = src.args[0]
            if isinstance(src, fx.Node) and src.op == "call_module" \
                    and src.target in attention_parts:
                found.add(i)
        fed[node.target] = frozenset(found)
    return fed


class PieceGraph(Protocol):
    """One captured piece: ``capture`` records ``fn(*args)`` (returning its outputs, whose
    memory the replays write), ``replay`` runs it again over the same memory."""

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any: ...

    def replay(self) -> None: ...


class CudaPieceGraph:
    """A ``torch.cuda.CUDAGraph`` of one piece, in the shared pool, captured on a side stream
    (the capture API's contract), without ``torch.cuda.graph``'s per-capture ``empty_cache``
    (hundreds of captures: each would free the eager allocator's cache)."""

    __slots__ = ("graph", "pool", "stream")

    def __init__(self, pool: Any, stream: torch.cuda.Stream) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool
        self.stream = stream

    def capture(self, fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        torch.cuda.synchronize()  # the inputs are ready before the side stream records
        with torch.cuda.stream(self.stream):
            self.graph.capture_begin(pool=self.pool)
            try:
                out = fn(*args)
            finally:
                self.graph.capture_end()
        return out

    def replay(self) -> None:
        self.graph.replay()


def weak_ref(t: Any) -> Any:
    """A tensor over ``t``'s memory that does not keep it allocated (anything else as is)."""
    if not isinstance(t, torch.Tensor):
        return t
    st = t.untyped_storage()
    storage = torch._C._construct_storage_from_data_pointer(st.data_ptr(), t.device,
                                                            st.nbytes())
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(storage, t.storage_offset(), t.size(), t.stride())


def _map(out: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(out, (list, tuple)):
        return type(out)(fn(x) for x in out)
    return fn(out)


@dataclass(slots=True)
class _Entry:
    """One piece's graph at one size."""

    graph: PieceGraph
    copies: list[tuple[int, torch.Tensor]]  # (argument, staging rows it is copied into)
    pinned: list[tuple[int, int]]  # (argument, address it must have)
    sizes: list[tuple[int, int]]  # (argument, the int it must equal: a token count)
    output: Any  # the graph's outputs (weak references unless kept)


class PiecewiseGraphs:
    """The piecewise graphs of one compiled model. ``sizes``: the capture sizes; ``new_graph``:
    makes a ``PieceGraph`` (None: CUDA graphs in one shared pool); ``weak_outputs``: keep
    outputs as weak references (right for CUDA graphs in a pool; a test's stand-in graphs
    keep theirs)."""

    def __init__(self, sizes: Sequence[int], *,
                 new_graph: Callable[[], PieceGraph] | None = None,
                 weak_outputs: bool = True) -> None:
        self.sizes = sorted(set(sizes))
        self.captured: list[int] = []  # ascending, complete sizes only
        self._entries: dict[tuple[int, int], _Entry] = {}
        self._staging: dict[tuple[Any, ...], torch.Tensor] = {}
        self._new_graph = new_graph
        self._weak = weak_outputs
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self._size: int | None = None  # the size this forward runs at (None: no graphs)
        self._capturing = False
        self.replays = 0  # piece graphs replayed (a counter for tests and the bench)
        self.graph_steps = 0  # forwards that ran as graphs
        self.ungraphed_steps = 0  # steps above the largest size: the pieces ran without graphs
        self.capture_s = 0.0
        self.pool_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def size_for(self, num_tokens: int) -> int | None:
        """The captured size a step of ``num_tokens`` replays at, or None (no graphs)."""
        return padded_size(self.captured, num_tokens)

    @contextlib.contextmanager
    def running(self, size: int, *, capture: bool = False) -> Iterator[None]:
        """Around one forward at ``size`` tokens: pieces replay (or, ``capture``, record)
        their graphs of that size."""
        if not capture and size not in self.captured:
            raise RuntimeError(f"no piecewise graphs of {size} tokens")
        self._size, self._capturing = size, capture
        try:
            yield
        finally:
            self._size, self._capturing = None, False
        if not capture:
            self.graph_steps += 1

    def run_piece(self, index: int, fn: Callable[..., Any], args: Sequence[Any],
                  fed: frozenset[int]) -> Any:
        """Piece ``index`` (``fn``: its compiled code) on ``args``: as a graph replay while a
        forward runs at a size, plainly otherwise."""
        size = self._size
        if size is None:
            return fn(*args)
        if self._capturing:
            return self._capture(index, fn, args, fed, size)
        entry = self._entries.get((index, size))
        if entry is None:
            raise RuntimeError(f"piece {index} has no graph of {size} tokens")
        return self._replay(entry, args)

    def _staging_for(self, slot: int, t: torch.Tensor) -> torch.Tensor:
        key = (slot, t.dtype, t.device, tuple(t.shape[1:]))
        buf = self._staging.get(key)
        if buf is None:
            # (Zeros: the rows past a step's tokens are read by the graphs, results dropped.)
            buf = self._staging[key] = torch.zeros((self.sizes[-1], *t.shape[1:]),
                                                   dtype=t.dtype, device=t.device)
        return buf

    def _make_graph(self) -> PieceGraph:
        if self._new_graph is not None:
            return self._new_graph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream()
        assert self._stream is not None
        return CudaPieceGraph(self._pool, self._stream)

    def _capture(self, index: int, fn: Callable[..., Any], args: Sequence[Any],
                 fed: frozenset[int], size: int) -> Any:
        static = list(args)
        copies: list[tuple[int, torch.Tensor]] = []
        pinned: list[tuple[int, int]] = []
        ints: list[tuple[int, int]] = []
        slot = 0
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if i in fed:
                    if a.shape[0] != size:
                        raise RuntimeError(f"piece {index}: attention output of {a.shape[0]} "
                                           f"rows at capture size {size}")
                    rows = self._staging_for(slot, a)[:size]
                    slot += 1
                    rows.copy_(a)
                    static[i] = rows
                    copies.append((i, rows))
                elif not isinstance(a, torch.nn.Parameter):
                    pinned.append((i, a.data_ptr()))
            elif isinstance(a, int):
                ints.append((i, a))
        graph = self._make_graph()
        out = graph.capture(fn, static)
        graph.replay()  # real outputs for what follows, and the graph's upload paid here
        self._entries[(index, size)] = _Entry(graph, copies, pinned, ints,
                                              _map(out, weak_ref) if self._weak else out)
        return out

    def _replay(self, e: _Entry, args: Sequence[Any]) -> Any:
        for i, rows in e.copies:
            a = args[i]
            n = a.shape[0]  # the step's tokens: attention computed those rows only
            if a.data_ptr() != rows.data_ptr():
                rows[:n].copy_(a)
        for i, ptr in e.pinned:
            if args[i].data_ptr() != ptr:
                raise RuntimeError(f"piecewise graph input {i} moved since capture (a step "
                                   "must pass the fixed step buffers, padded)")
        for i, value in e.sizes:
            if args[i] != value:
                raise RuntimeError(f"piecewise graph of {value} tokens called with {args[i]}")
        e.graph.replay()
        self.replays += 1
        return list(e.output) if isinstance(e.output, list) else e.output

    def capture_all(self, forward: Callable[[int, bool], Any]) -> None:
        """Capture every size, largest first: ``forward(size, graphs)`` runs the compiled
        model over a dummy step of ``size`` tokens, first without graphs (the warm-up), then
        once more while the pieces record theirs."""
        on_gpu = self._new_graph is None
        t0 = time.perf_counter()
        reserved = torch.cuda.memory_reserved() if on_gpu else 0
        for size in reversed(self.sizes):
            forward(size, False)
            if on_gpu:
                torch.cuda.synchronize()
            with self.running(size, capture=True):
                out = forward(size, True)
            del out  # (its memory goes back to the pool for the next sizes)
            self.captured.append(size)
        self.captured.sort()
        if on_gpu:
            torch.cuda.synchronize()
            self.pool_bytes = torch.cuda.memory_reserved() - reserved
        self.capture_s = time.perf_counter() - t0
        logger.info("captured %d piecewise CUDA graphs (%d sizes, %d..%d tokens) in %.2f s, "
                    "%.0f MiB", len(self), len(self.captured), self.captured[0],
                    self.captured[-1], self.capture_s, self.pool_bytes / 2**20)

    def clear(self) -> None:
        """Drop every graph, the staging buffers and the pool (an engine shutting down in a
        longer-lived process: Dynamo's cache may outlive the model's compiled forward)."""
        self._entries.clear()
        self._staging.clear()
        self.captured = []
        self._pool = None
        self._stream = None

    def describe(self) -> str:
        if not self.captured:
            return "piecewise graphs: none captured"
        return (f"{len(self)} piecewise graphs, {len(self.captured)} sizes "
                f"{self.captured[0]}..{self.captured[-1]} tokens, "
                f"{self.pool_bytes / 2**20:.0f} MiB, {self.capture_s:.2f} s")
