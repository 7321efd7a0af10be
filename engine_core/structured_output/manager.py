"""The EngineCore's side of constrained decoding.

A constrained request is held here until its grammar is compiled (in a thread pool: the engine
loop never waits on a compile, and the scheduler never sees the request before it can run);
a compile error fails that request alone. Compiled grammars are cached by (kind, spec), and
each sequence gets its own copy of the matcher (``n`` > 1 arrives as separate requests).

Each step, for the scheduled requests that sample, the matchers fill one int32 bitmask (one bit
per vocabulary id) that travels with the scheduler output; the sampler masks the logits with it
on the device. Sampled tokens advance the matchers when the step's results come back; a request
whose grammar is complete stops there.

Why the EngineCore and not the workers: the tokens are known here in order (preemption and
recompute re-feed nothing: the matcher has consumed exactly the request's output tokens), one
process compiles (not every tensor-parallel rank), and a compile never stalls a worker's step.
The cost is that a constrained request's next mask needs its previous token, so under async
scheduling a constrained request sits out the step after each of its own (the scheduler skips
it while its token is in flight) — unconstrained requests keep the full overlap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tidal.engine_core.config import ModelConfig, check_backend
from tidal.engine_core.reasoning_formats import ReasoningFormat
from tidal.engine_core.structured_output import spec
from tidal.engine_core.structured_output.reasoning_gate import ReasoningGate, ReasoningMarkers

if TYPE_CHECKING:
    from tidal.engine_core.request import Request
    from tidal.engine_core.structured_output.router import BackendRouter

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 512
_MAX_TIMINGS = 4096


@dataclass(slots=True)
class GrammarState:
    matcher: Any  # backend.Matcher: this sequence's own; None: a thinking budget alone
    kind: str
    submitted: float  # perf_counter when the request arrived (time to first mask)
    masks: int = 0
    # With --reasoning-parser: where the request is in its thinking (reasoning_gate.py).
    gate: ReasoningGate | None = None

    @property
    def needs_mask(self) -> bool:
        return self.gate is None or self.gate.needs_mask(self.matcher is not None)


@dataclass(slots=True)
class StructuredStats:
    """Timings kept for the benchmark and the logs (bounded)."""

    compile_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    first_mask_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    # (sequences, seconds) per bitmask fill
    fills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    requests_by_kind: dict[str, int] = field(default_factory=dict)


class StructuredOutputManager:
    def __init__(self, model: ModelConfig, backend: str = "auto", num_threads: int = 2,
                 reasoning: ReasoningFormat | None = None) -> None:
        self.backend_name = check_backend(backend)
        self.model = model
        # --reasoning-parser: grammars wait for the thinking to end; budgets force its end.
        self.reasoning = reasoning
        self._markers: Future[ReasoningMarkers] | None = None  # tokenized on first use
        self._gated: set[str] = set()  # pending requests that get a gate
        self._num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first request
        self._backend: BackendRouter | None = None  # the grammar backends (router.py)
        self._backend_lock = threading.Lock()
        self._cache: dict[tuple[str, str], Future[Any]] = {}
        # Requests whose grammar is compiling: id -> (request, compile).
        self.pending: dict[str, tuple[Request, Future[Any]]] = {}
        # Requests in the scheduler with a grammar: id -> state.
        self.states: dict[str, GrammarState] = {}
        self.stats = StructuredStats()
        self._submitted: dict[str, float] = {}
        # Not yet reported (SchedulerStats): compile times (appended by pool threads), kinds.
        self._unreported_compiles: deque[float] = deque(maxlen=_MAX_TIMINGS)
        self._unreported_kinds: list[str] = []

    # --- intake (engine loop) -----------------------------------------------------------------

    def submit(self, req: Request) -> None:
        """Hold ``req`` until its grammar is compiled (and, with a reasoning parser, the
        markers are tokenized). A request with a thinking budget and no grammar comes here too
        (``core.add_request`` checked that there is a reasoning parser)."""
        params = req.sampling_params.structured_outputs
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="tidal-grammar")
        sp = req.sampling_params
        # A gate follows the reasoning of a chat reply, and any request with a thinking budget.
        if self.reasoning is not None and (sp.reasoning_first
                                           or sp.thinking_token_budget is not None):
            if self._markers is None or (self._markers.done()
                                         and self._markers.exception() is not None):
                self._markers = self._pool.submit(self._load_markers)
            self._gated.add(req.request_id)
        if params is None:
            assert self._markers is not None, "a thinking budget needs a reasoning parser"
            self.pending[req.request_id] = (req, self._markers)
            self._submitted[req.request_id] = time.perf_counter()
            return
        key = spec.cache_key(params)
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self._compile, params)
            self._cache[key] = fut
            if len(self._cache) > _MAX_CACHED_GRAMMARS:
                del self._cache[next(iter(self._cache))]  # the oldest
        else:  # most recently used last
            self._cache[key] = self._cache.pop(key)
        self.pending[req.request_id] = (req, fut)
        self._submitted[req.request_id] = time.perf_counter()
        kinds = self.stats.requests_by_kind
        kinds[params.kind] = kinds.get(params.kind, 0) + 1
        self._unreported_kinds.append(params.kind)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile finished: (ready to schedule, failed with why)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        for rid, (req, fut) in list(self.pending.items()):
            gated = rid in self._gated
            markers = self._markers if gated else None
            if not fut.done() or (markers is not None and not markers.done()):
                continue
            del self.pending[rid]
            self._gated.discard(rid)
            exc = fut.exception()
            if exc is None and markers is not None and markers.exception() is not None:
                self._submitted.pop(rid, None)
                failed.append((req, f"reasoning markers: {markers.exception()}"))
                continue
            if exc is not None:
                self._submitted.pop(rid, None)
                failed.append((req, f"structured output grammar failed to compile: {exc}"))
                continue
            params = req.sampling_params.structured_outputs
            matcher = None if params is None else fut.result().deep_copy()
            gate = None
            if markers is not None:
                gate = ReasoningGate.start(markers.result(), req.prompt_token_ids,
                                           req.sampling_params.thinking_token_budget)
            self.states[rid] = GrammarState(matcher, "none" if params is None else params.kind,
                                            self._submitted.pop(rid, time.perf_counter()),
                                            gate=gate)
            ready.append(req)
        return ready, failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` for a compile to finish (only when nothing else can run)."""
        if self.pending:
            futures = [f for _, f in self.pending.values() if not f.done()]
            if self._markers is not None and not self._markers.done():
                futures.append(self._markers)
            if futures:
                wait(futures, timeout, FIRST_COMPLETED)

    def drop(self, request_ids: list[str] | tuple[str, ...] | Any) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.states.pop(rid, None)
            self._submitted.pop(rid, None)
            self._gated.discard(rid)

    # --- compile (pool threads) ---------------------------------------------------------------

    def _get_backend(self) -> BackendRouter:
        with self._backend_lock:
            if self._backend is None:
                from tidal.engine_core.structured_output.router import BackendRouter

                self._backend = BackendRouter(self.model, self.backend_name, self._num_threads)
            return self._backend

    def _load_markers(self) -> ReasoningMarkers:
        assert self.reasoning is not None
        # The backends' own tokenizer: loaded once, never by two threads at a time.
        tokenizer = self._get_backend().hf_tokenizer()
        return ReasoningMarkers.from_tokenizer(self.reasoning, tokenizer)

    def _compile(self, params: Any) -> Any:
        backend = self._get_backend()
        start = time.perf_counter()
        matcher = backend.compile(params)  # by the backend chosen for it (router.py)
        elapsed = time.perf_counter() - start
        self.stats.compile_s.append(elapsed)
        self._unreported_compiles.append(elapsed)
        return matcher

    # --- per step (engine loop) ---------------------------------------------------------------

    def fill_bitmask(self, request_ids: list[str]) -> np.ndarray:
        """int32 [len(request_ids), words]: each request's next-token mask."""
        states = [self.states[rid] for rid in request_ids]
        # Rows under their grammar now; the others (thinking, forcing an end) start all ones.
        rows = [i for i, s in enumerate(states)
                if s.matcher is not None and (s.gate is None or s.gate.grammar_applies)]
        out = np.empty((len(states), (self.model.vocab_size + 31) // 32), dtype=np.int32)
        if rows:
            backend = self._backend
            assert backend is not None
            start = time.perf_counter()
            if len(rows) == len(states):
                backend.fill([s.matcher for s in states], out)
            else:
                out.fill(-1)
                part = np.empty((len(rows), out.shape[1]), dtype=np.int32)
                backend.fill([states[i].matcher for i in rows], part)
                out[rows] = part
            now = time.perf_counter()
            self.stats.fills.append((len(rows), now - start))
            for i in rows:
                s = states[i]
                if not s.masks:
                    self.stats.first_mask_s.append(now - s.submitted)
                s.masks += 1
        else:
            out.fill(-1)
        for i, s in enumerate(states):
            if s.gate is not None:
                s.gate.shape_mask(out[i])
        return out

    def advance(self, request_id: str, tokens: list[int]) -> str | None:
        """Feed a request's new tokens to its matcher. Returns None to go on, "stop" when the
        grammar is complete, or an error message (a token the mask did not allow)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        if state.gate is not None:
            tokens = state.gate.feed(tokens)  # only the answer's tokens meet the grammar
            if not tokens:
                return None
        m = state.matcher
        if m is None:
            return None
        if not m.consume_tokens(tokens):
            return f"structured output: token(s) {tokens} rejected by the grammar: " \
                   f"{m.get_error()}"
        if m.is_stopped():
            return "stop"
        return None

    def take_report(self) -> tuple[list[float], list[str]]:
        """(compile times, request kinds) since the previous call, for the step's stats."""
        compiles = []
        while self._unreported_compiles:
            compiles.append(self._unreported_compiles.popleft())
        kinds, self._unreported_kinds = self._unreported_kinds, []
        return compiles, kinds

    @property
    def has_report(self) -> bool:
        return bool(self._unreported_compiles or self._unreported_kinds)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
