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
from tidal.engine_core.structured_output import spec

if TYPE_CHECKING:
    from tidal.engine_core.request import Request
    from tidal.engine_core.structured_output.backend_guidance import GuidanceBackend

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 512
_MAX_TIMINGS = 4096


@dataclass(slots=True)
class GrammarState:
    matcher: Any  # llguidance.LLMatcher: this sequence's own
    kind: str
    submitted: float  # perf_counter when the request arrived (time to first mask)
    masks: int = 0


@dataclass(slots=True)
class StructuredStats:
    """Timings kept for the benchmark and the logs (bounded)."""

    compile_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    first_mask_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    # (sequences, seconds) per bitmask fill
    fills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    requests_by_kind: dict[str, int] = field(default_factory=dict)


class StructuredOutputManager:
    def __init__(self, model: ModelConfig, backend: str = "auto", num_threads: int = 2) -> None:
        self.backend_name = check_backend(backend)
        self.model = model
        self._num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None  # started with the first request
        self._backend: GuidanceBackend | None = None
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
        params = req.sampling_params.structured_outputs
        assert params is not None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="tidal-grammar")
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
            if not fut.done():
                continue
            del self.pending[rid]
            exc = fut.exception()
            if exc is not None:
                self._submitted.pop(rid, None)
                failed.append((req, f"structured output grammar failed to compile: {exc}"))
                continue
            kind = req.sampling_params.structured_outputs.kind  # type: ignore[union-attr]
            self.states[rid] = GrammarState(fut.result().deep_copy(), kind,
                                            self._submitted.pop(rid, time.perf_counter()))
            ready.append(req)
        return ready, failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` for a compile to finish (only when nothing else can run)."""
        if self.pending:
            wait([f for _, f in self.pending.values()], timeout, FIRST_COMPLETED)

    def drop(self, request_ids: list[str] | tuple[str, ...] | Any) -> None:
        for rid in request_ids:
            self.pending.pop(rid, None)
            self.states.pop(rid, None)
            self._submitted.pop(rid, None)

    # --- compile (pool threads) ---------------------------------------------------------------

    def _get_backend(self) -> GuidanceBackend:
        with self._backend_lock:
            if self._backend is None:
                from tidal.engine_core.structured_output.backend_guidance import GuidanceBackend

                self._backend = GuidanceBackend(self.model)
            return self._backend

    def _compile(self, params: Any) -> Any:
        backend = self._get_backend()
        start = time.perf_counter()
        grammar = spec.to_grammar(params)
        matcher = backend.compile(grammar)
        elapsed = time.perf_counter() - start
        self.stats.compile_s.append(elapsed)
        self._unreported_compiles.append(elapsed)
        return matcher

    # --- per step (engine loop) ---------------------------------------------------------------

    def fill_bitmask(self, request_ids: list[str]) -> np.ndarray:
        """int32 [len(request_ids), words]: each request's next-token mask."""
        backend = self._backend
        assert backend is not None
        states = [self.states[rid] for rid in request_ids]
        out = np.empty((len(states), backend.words), dtype=np.int32)
        start = time.perf_counter()
        backend.fill([s.matcher for s in states], out)
        now = time.perf_counter()
        self.stats.fills.append((len(states), now - start))
        for s in states:
            if not s.masks:
                self.stats.first_mask_s.append(now - s.submitted)
            s.masks += 1
        return out

    def advance(self, request_id: str, tokens: list[int]) -> str | None:
        """Feed a request's new tokens to its matcher. Returns None to go on, "stop" when the
        grammar is complete, or an error message (a token the mask did not allow)."""
        state = self.states.get(request_id)
        if state is None:
            return None
        m = state.matcher
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
