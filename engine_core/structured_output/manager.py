"""The EngineCore's side of constrained decoding.

A constrained request's grammar compiles in a thread pool (the engine loop never waits on a
compile); meanwhile the scheduler prefills the request's prompt up to its last token
(``Request.grammar_wait``), and it samples once its grammar is ready. A compile error fails
that request alone. Compiled grammars are cached by (kind, spec), and
each sequence gets its own copy of a matcher (``n`` > 1 arrives as separate requests); a grammar
many requests share has several templates compiled apart (``_TEMPLATES_PER_GRAMMAR``: copies of
one llguidance matcher fill their masks slowly side by side).

Each step, for the scheduled requests that sample, the matchers fill one int32 bitmask (one bit
per vocabulary id) that travels with the scheduler output; the sampler masks the logits with it
on the device. Sampled tokens advance the matchers when the step's results come back; a request
whose grammar is complete stops there. Under async scheduling the fill job of the next masks
does the advancing instead (``begin_fill``'s ``tokens``), and the engine reads its verdicts
when it collects that next step: a request its grammar completed then ends with an output of
no tokens.

Why the EngineCore and not the workers: the tokens are known here in order (preemption and
recompute re-feed nothing: the matcher has consumed exactly the request's output tokens), one
process compiles (not every tensor-parallel rank), and a compile never stalls a worker's step.
The cost is that a constrained request's next mask needs its previous token: under async
scheduling its step is launched first and sampled once the mask is filled (the worker in this
process, or tensor-parallel workers told by a second message: `FinishSample`). The fill runs
on a fill thread (``begin_fill``, fill_thread.py) while the engine thread goes on; with the
worker in this process the step is sampled only when the next step's device work starts
(``ModelRunner.sample_lazily``). An executor
without that would leave it out of the step after each of its own (the scheduler skips it
while its token is in flight); with pipeline stages there is no async scheduling, and every
request waits for its step in flight. With speculative decoding a
request's drafts are cut to what its grammar allows and each verify position gets its own
mask (``valid_drafts``, ``fill_draft_bitmask``).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tidal.engine_core import envs
from tidal.engine_core.config import ModelConfig, check_backend
from tidal.engine_core.reasoning_formats import ReasoningFormat
from tidal.engine_core.structured_output import spec
from tidal.engine_core.structured_output.fill_thread import FillJob, FillThread
from tidal.engine_core.structured_output.reasoning_gate import ReasoningGate, ReasoningMarkers

if TYPE_CHECKING:
    from tidal.engine_core.protocol import SchedulerStats
    from tidal.engine_core.request import Request
    from tidal.engine_core.structured_output.router import BackendRouter

logger = logging.getLogger(__name__)

_MAX_CACHED_GRAMMARS = 512
# llguidance's copies of one matcher share state, and filling their masks in parallel contends
# on it: on a 16-core H200 host, 256 copies of one matcher filled in 3.1 ms with 12 threads
# (slower than with one thread, 2.2 ms), 256 matchers compiled apart in 0.8 ms, and copies of
# 12 templates in 1.0 ms. So the first requests of a grammar each compile a template, up to this
# many, and later ones copy them in turn (llguidance fills on 80 % of the cores).
_TEMPLATES_PER_GRAMMAR = max(1, min(16, (os.cpu_count() or 1) * 4 // 5))
# A request whose own template is still compiling this long copies one that is done instead.
_TEMPLATE_WAIT_S = 0.005
_MAX_TIMINGS = 4096


@dataclass(slots=True, frozen=True)
class _Compiled:
    """A compile's result: the template matcher requests copy, and when it was ready."""

    matcher: Any
    done_at: float  # perf_counter


@dataclass(slots=True)
class GrammarState:
    matcher: Any  # backend.Matcher: this sequence's own; None: a thinking budget alone
    kind: str
    submitted: float  # perf_counter when the request arrived (time to first mask)
    first_due: bool = True  # no mask filled yet (StructuredOutputManager._count_masks)
    admitted: float = 0.0  # perf_counter when the engine took its grammar (it may sample)
    compiled: float = 0.0  # perf_counter when the template it copies was compiled
    # With --reasoning-parser: where the request is in its thinking (reasoning_gate.py).
    gate: ReasoningGate | None = None

    @property
    def needs_mask(self) -> bool:
        return self.gate is None or self.gate.needs_mask(self.matcher is not None)


def _advance_and_fill(backend: Any, steps: list[tuple[Any, int]] | None, matchers: list[Any],
                      target: np.ndarray, fill: _Fill,
                      upload: Callable[[], None] | None = None) -> None:
    """The fill job: the matchers of ``steps`` consume their tokens (``fill.accepted``: which
    took them), then ``matchers`` fill ``target``, then ``upload`` starts its copy to the
    device. Both native calls release the GIL."""
    start = time.perf_counter()
    if steps:
        fill.accepted = backend.advance(steps)
    mid = time.perf_counter()
    backend.fill(matchers, target)
    fill.ended = time.perf_counter()
    fill.advance_s, fill.fill_s = mid - start, fill.ended - mid
    if upload is not None:
        upload()


def _refused(tokens: list[int], m: Any) -> str:
    return f"structured output: token(s) {tokens} rejected by the grammar: {m.get_error()}"


def _allows(gate: ReasoningGate | None, m: Any, token: int) -> bool:
    """Whether the next-token mask of matcher ``m`` (None: no grammar) and ``gate`` allows
    ``token`` (what ``StructuredOutputManager._fill`` would write, for one token)."""
    if gate is not None:
        allowed = gate.allows(token)
        if allowed is not None:
            return allowed
    return m is None or m.validate_tokens([token]) == 1


@dataclass(slots=True)
class _Fill:
    """A mask fill under way (``StructuredOutputManager._start_fill``)."""

    manager: StructuredOutputManager
    gates: list[ReasoningGate | None] | None  # each row's (None: no row has one)
    rows: list[int]  # the rows the grammar fills
    out: np.ndarray
    part: np.ndarray | None = None  # the grammar rows' masks, when not every row is one
    job: FillJob | None = None  # on the fill thread
    # With ``advance``: whether each advanced matcher took its token (written by the job).
    accepted: list[bool] = field(default_factory=list)
    advance_s: float = 0.0  # the job's two parts, timed apart
    fill_s: float = 0.0
    ended: float = 0.0  # perf_counter when the masks were filled (0: no grammar row)

    def finish(self) -> list[int]:
        """Wait for the grammar's rows, then apply the reasoning gates; returns the rows."""
        if self.job is not None:
            self.job.wait()
            self.job = None
            self.manager._record(self)
        out = self.out
        if self.part is not None:
            out[self.rows] = self.part
        if self.gates is not None:
            for i, gate in enumerate(self.gates):
                if gate is not None:
                    gate.shape_mask(out[i])
        return self.rows


@dataclass(slots=True)
class PendingFill:
    """``StructuredOutputManager.begin_fill``'s result: ``wait()`` returns the masks."""

    manager: StructuredOutputManager
    request_ids: list[str]
    states: list[GrammarState]
    fill: _Fill
    done: bool = False
    # The matchers the fill advanced first and their tokens; their rows (None: every row).
    adv_matchers: list[Any] = field(default_factory=list)
    adv_tokens: list[int] = field(default_factory=list)
    adv_rows: list[int] | None = None

    def wait(self) -> np.ndarray:
        if not self.done:
            self.done = True
            masked = self.fill.finish()
            self.manager._count_masks(self.states, masked, self.fill.ended)
        return self.fill.out

    def verdicts(self) -> list[tuple[str, str]]:
        """``advance``'s verdicts on the tokens the fill advanced the matchers by, for the
        requests that have one (the grammar complete: "stop"; a token refused: the error) and
        are still the same requests (not aborted meanwhile). Waits for the fill."""
        if not self.adv_matchers:
            return []
        self.wait()
        accepted = self.fill.accepted
        # (This runs for every row of every step: the calls go through C loops.)
        stopped = list(map(_IS_STOPPED, self.adv_matchers))
        if all(accepted) and not any(stopped):
            return []
        flagged = [k for k, (ok, done) in enumerate(zip(accepted, stopped)) if done or not ok]
        rows = self.adv_rows
        states = self.manager.states
        found = []
        for k in flagged:
            i = k if rows is None else rows[k]
            rid, state = self.request_ids[i], self.states[i]
            if states.get(rid) is not state:
                continue
            m = state.matcher
            if not accepted[k]:
                found.append((rid, _refused([self.adv_tokens[k]], m)))
            else:
                found.append((rid, "stop"))
        return found


_IS_STOPPED = operator.methodcaller("is_stopped")


@dataclass(slots=True)
class _Templates:
    """One grammar's compiled templates: its first requests each compile one, up to
    ``_TEMPLATES_PER_GRAMMAR`` (in the pool, side by side), and later ones copy them in turn."""

    futures: list[Future[Any]] = field(default_factory=list)
    served: int = 0

    def next(self, compile_one: Any) -> Future[Any]:
        """The template the next request copies (compiling a new one while there are fewer
        than the limit)."""
        if len(self.futures) < _TEMPLATES_PER_GRAMMAR:
            self.futures.append(compile_one())
            fut = self.futures[-1]
        else:
            fut = self.futures[self.served % len(self.futures)]
        self.served += 1
        return fut

    def done_template(self) -> Future[Any] | None:
        """A template that compiled, if any (the most recent, to spread the copies)."""
        for fut in reversed(self.futures):
            if fut.done() and fut.exception() is None:
                return fut
        return None

    def failed(self) -> bool:
        first = self.futures[0] if self.futures else None
        return first is not None and first.done() and first.exception() is not None


@dataclass(slots=True)
class StructuredStats:
    """Timings kept for the benchmark and the logs (bounded)."""

    # Per compile (llguidance's: its first mask included, ``GuidanceBackend.compile``).
    compile_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    # From a request's arrival to its first mask read by the sampler, and its parts: to its
    # admission (its grammar compiled and taken by the engine loop: it may sample from then
    # on) and to that mask being filled (the rest: its step's forward pass, then sampling).
    first_mask_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    admit_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    # (Of admit_s: to the compile of the template it copies done, its first mask computed
    # with llguidance, which builds its lexer lazily: the grammar's time to first mask; the
    # rest waits for the engine loop to take it, at its next step.)
    compiled_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    first_filled_s: deque[float] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    # (sequences, seconds) per bitmask fill
    fills: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    # (sequences, seconds) per fill job's advance of the matchers (begin_fill's ``tokens``)
    advances: deque[tuple[int, float]] = field(
        default_factory=lambda: deque(maxlen=_MAX_TIMINGS))
    requests_by_kind: dict[str, int] = field(default_factory=dict)


class StructuredOutputManager:
    def __init__(self, model: ModelConfig, backend: str = "auto", num_threads: int | None = None,
                 reasoning: ReasoningFormat | None = None) -> None:
        """``num_threads``: the compile pool's (None: ``envs.grammar_compile_threads``)."""
        self.backend_name = check_backend(backend)
        self.model = model
        # --reasoning-parser: grammars wait for the thinking to end; budgets force its end.
        self.reasoning = reasoning
        self._markers: Future[ReasoningMarkers] | None = None  # tokenized on first use
        self._gated: set[str] = set()  # pending requests that get a gate
        self._num_threads = num_threads or envs.grammar_compile_threads()
        self._pool: ThreadPoolExecutor | None = None  # started with the first request
        self._backend: BackendRouter | None = None  # the grammar backends (router.py)
        self._backend_lock = threading.Lock()
        self._fill_thread: FillThread | None = None  # started with the first background fill
        # Per grammar, the templates its requests copy in turn (_TEMPLATES_PER_GRAMMAR).
        self._cache: dict[tuple[str, str], _Templates] = {}
        self._templates_of: dict[str, _Templates] = {}  # pending request -> its grammar's
        # Requests whose grammar is compiling: id -> (request, compile).
        self.pending: dict[str, tuple[Request, Future[Any]]] = {}
        # Requests in the scheduler with a grammar: id -> state.
        self.states: dict[str, GrammarState] = {}
        # Of ``states``: how many have a reasoning gate, and how many no mask yet (each step's
        # work over every row skips what these say none needs).
        self._gated_states = 0
        self._first_due = 0
        self.stats = StructuredStats()
        self._submitted: dict[str, float] = {}
        # Not yet reported (SchedulerStats): (backend, compile seconds) appended by pool threads,
        # (kind, backend) of each request once its compile resolved.
        self._unreported_compiles: deque[tuple[str, float]] = deque(maxlen=_MAX_TIMINGS)
        self._unreported_kinds: list[tuple[str, str]] = []

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
        entry = self._cache.get(key)
        if entry is None or entry.failed():
            entry = self._cache[key] = _Templates()
            if len(self._cache) > _MAX_CACHED_GRAMMARS:
                del self._cache[next(iter(self._cache))]  # the oldest
        else:  # most recently used last
            self._cache[key] = self._cache.pop(key)
        fut = entry.next(lambda: self._pool.submit(self._compile, params))
        self.pending[req.request_id] = (req, fut)
        self._templates_of[req.request_id] = entry
        self._submitted[req.request_id] = time.perf_counter()
        kinds = self.stats.requests_by_kind
        kinds[params.kind] = kinds.get(params.kind, 0) + 1

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """Requests whose compile finished: (ready to sample, failed with why)."""
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        now = time.perf_counter()
        for rid, (req, fut) in list(self.pending.items()):
            gated = rid in self._gated
            markers = self._markers if gated else None
            if markers is not None and not markers.done():
                continue
            if not fut.done():
                # Its own template is still compiling: after a short wait, a copy of one that
                # is done will do (a slow grammar's requests do not queue behind its copies).
                entry = self._templates_of.get(rid)
                if entry is None or now - self._submitted.get(rid, now) < _TEMPLATE_WAIT_S:
                    continue
                done = entry.done_template()
                if done is None:
                    continue
                fut = done
            del self.pending[rid]
            self._templates_of.pop(rid, None)
            self._gated.discard(rid)
            exc = fut.exception()
            params = req.sampling_params.structured_outputs
            if params is not None:  # counted here, where the backend that compiled it is known
                self._unreported_kinds.append((params.kind, self._backend_of(params, fut)))
            if exc is None and markers is not None and markers.exception() is not None:
                self._submitted.pop(rid, None)
                failed.append((req, f"reasoning markers: {markers.exception()}"))
                continue
            if exc is not None:
                self._submitted.pop(rid, None)
                failed.append((req, f"structured output grammar failed to compile: {exc}"))
                continue
            compiled = None if params is None else fut.result()
            matcher = None if compiled is None else compiled.matcher.deep_copy()
            gate = None
            if markers is not None:
                gate = ReasoningGate.start(markers.result(), req.prompt_token_ids,
                                           req.sampling_params.thinking_token_budget)
            self._drop_state(rid)
            self.states[rid] = GrammarState(matcher, "none" if params is None else params.kind,
                                            self._submitted.pop(rid, now), gate=gate,
                                            admitted=now,
                                            compiled=now if compiled is None
                                            else min(now, compiled.done_at))
            self._first_due += 1
            self._gated_states += gate is not None
            ready.append(req)
        return ready, failed

    def _backend_of(self, params: Any, fut: Future[Any]) -> str:
        """The backend that compiled ``params`` (xgrammar's matchers name theirs, llguidance's
        are its own objects); for a failed compile, the one it was meant for."""
        if fut.exception() is None:
            return getattr(fut.result().matcher, "backend", "guidance")
        return spec.choose_backend(params, self.backend_name)[0]

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
            self._templates_of.pop(rid, None)
            self._drop_state(rid)
            self._submitted.pop(rid, None)
            self._gated.discard(rid)

    def _drop_state(self, rid: str) -> None:
        state = self.states.pop(rid, None)
        if state is not None:
            self._gated_states -= state.gate is not None
            if state.first_due:
                state.first_due = False
                self._first_due -= 1

    @property
    def has_gates(self) -> bool:
        """Whether a request in the scheduler has a reasoning gate."""
        return self._gated_states > 0

    def needing_masks(self, request_ids: list[str]) -> list[str]:
        """Those of ``request_ids`` still constrained and under their grammar now (not while
        thinking freely, not finished by their previous token)."""
        states = self.states
        if not self._gated_states:
            return [rid for rid in request_ids if rid in states]
        return [rid for rid in request_ids if rid in states and states[rid].needs_mask]

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

    def _compile(self, params: Any) -> _Compiled:
        backend = self._get_backend()
        start = time.perf_counter()
        matcher = backend.compile(params)  # by the backend chosen for it (router.py)
        done = time.perf_counter()
        self.stats.compile_s.append(done - start)
        self._unreported_compiles.append((getattr(matcher, "backend", "guidance"), done - start))
        return _Compiled(matcher, done)

    # --- per step (engine loop) ---------------------------------------------------------------

    def fill_bitmask(self, request_ids: list[str], out: np.ndarray | None = None) -> np.ndarray:
        """int32 [len(request_ids), words]: each request's next-token mask (written into
        ``out`` when given: the executor's host memory, from which it is copied as it is)."""
        return self.begin_fill(request_ids, out, background=False).wait()

    def begin_fill(self, request_ids: list[str], out: np.ndarray | None = None,
                   background: bool = True, tokens: list[int | None] | None = None,
                   upload: Callable[[], None] | None = None) -> PendingFill:
        """Start ``fill_bitmask``: with ``background``, the backend's native fill runs on the
        fill thread (fill_thread.py) while the caller goes on; ``wait()`` on the result
        finishes it. The requests' matchers must not move in between (the engine advances
        them only when it collects a step, after the wait).

        ``tokens[i]`` (not None): request i's newest token, which its matcher consumes first,
        in the same job (what ``advance`` does, moved off the caller's thread), and
        ``PendingFill.verdicts`` then says what ``advance`` would have. Only for requests
        without a reasoning gate, whose matcher takes every token as it comes.

        ``upload`` (the executor's ``grammar_uploader()`` for ``out``): called by the job once
        the masks are filled, when nothing is left to write into ``out`` after it (no row
        under a reasoning gate or outside its grammar)."""
        states_of = self.states
        states = [states_of[rid] for rid in request_ids]
        out = self._mask_array(len(states), out)
        pending = PendingFill(self, request_ids, states, None)  # type: ignore[arg-type]
        all_matchers = [s.matcher for s in states]
        steps = None
        if tokens is not None:
            if None in tokens:
                rows = [i for i, t in enumerate(tokens) if t is not None]
                pending.adv_rows = rows
                matchers = [all_matchers[i] for i in rows]
                toks = [tokens[i] for i in rows]
            else:  # (the common case: every row)
                rows = None
                matchers = all_matchers
                toks = tokens  # type: ignore[assignment]
            if self._gated_states or None in matchers:
                for k, m in enumerate(matchers):
                    i = k if rows is None else rows[k]
                    if states[i].gate is not None or m is None:
                        raise ValueError(f"request {request_ids[i]}: only a matcher without a "
                                         f"reasoning gate is advanced by its fill")
            pending.adv_matchers, pending.adv_tokens = matchers, toks
            steps = list(zip(matchers, toks))
        pending.fill = self._start_fill(
            all_matchers, [s.gate for s in states] if self._gated_states else None, out,
            background, steps, upload)
        return pending

    def _mask_array(self, rows: int, out: np.ndarray | None) -> np.ndarray:
        shape = (rows, (self.model.vocab_size + 31) // 32)
        if out is None:
            return np.empty(shape, dtype=np.int32)
        if out.shape != shape or out.dtype != np.int32:
            raise ValueError(f"mask buffer {out.shape} {out.dtype}, expected {shape} int32")
        return out

    def _fill(self, matchers: list[Any], gates: list[ReasoningGate | None] | None,
              out: np.ndarray) -> list[int]:
        """Row i of ``out`` = the next-token mask of ``matchers[i]`` (None: no grammar) under
        ``gates[i]`` (None: no reasoning parser; ``gates`` None: none has one). Returns the
        rows the grammar filled."""
        return self._start_fill(matchers, gates, out, background=False).finish()

    def _start_fill(self, matchers: list[Any], gates: list[ReasoningGate | None] | None,
                    out: np.ndarray, background: bool,
                    steps: list[tuple[Any, int]] | None = None,
                    upload: Callable[[], None] | None = None) -> _Fill:
        # Rows under their grammar now; the others (thinking, forcing an end) start all ones.
        # (``steps``' matchers have no gate: their rows are grammar rows.)
        if gates is None:
            rows = (list(range(len(matchers))) if None not in matchers
                    else [i for i, m in enumerate(matchers) if m is not None])
        else:
            rows = [i for i, (m, g) in enumerate(zip(matchers, gates))
                    if m is not None and (g is None or g.grammar_applies)]
        fill = _Fill(self, gates, rows, out)
        if not rows:
            out.fill(-1)
            return fill
        backend = self._backend
        assert backend is not None
        if len(rows) == len(matchers):
            target = out
            if gates is not None:
                upload = None  # (the gates write into ``out`` after the job)
        else:
            upload = None
            out.fill(-1)
            target = fill.part = np.empty((len(rows), out.shape[1]), dtype=np.int32)
            matchers = [matchers[i] for i in rows]
        if background:
            if self._fill_thread is None:
                self._fill_thread = FillThread()
            fill.job = self._fill_thread.submit(_advance_and_fill, backend, steps, matchers,
                                                target, fill, upload)
        else:
            _advance_and_fill(backend, steps, matchers, target, fill, upload)
            self._record(fill)
        return fill

    def _record(self, fill: _Fill) -> None:
        self.stats.fills.append((len(fill.rows), fill.fill_s))
        if fill.accepted:
            self.stats.advances.append((len(fill.accepted), fill.advance_s))

    def _count_masks(self, states: list[GrammarState], rows: list[int] | None = None,
                     filled: float = 0.0) -> None:
        """The time to first mask of those of ``states`` (of its ``rows``, if given) that had
        none yet, and its parts (``filled``: when their masks were filled; 0: unknown)."""
        if not self._first_due:  # (the common case: every step of every request but its first)
            return
        if rows is not None and len(rows) < len(states):
            states = [states[i] for i in rows]
        now = time.perf_counter()
        for s in states:
            if s.first_due:
                s.first_due = False
                self._first_due -= 1
                stats = self.stats
                stats.first_mask_s.append(now - s.submitted)
                stats.admit_s.append(s.admitted - s.submitted)
                stats.compiled_s.append(max(0.0, s.compiled - s.submitted))
                if filled:
                    stats.first_filled_s.append(filled - s.submitted)

    # --- speculative decoding (engine loop) ---------------------------------------------------

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of ``drafts`` whose every token the request's masks allow at its
        position (its thinking followed on a copy of its gate), ending before a token that
        would complete the grammar (a draft after it could never be emitted, and the grammar's
        last token is the step's own sample instead). The matcher ends as it started."""
        state = self.states.get(request_id)
        if state is None or not drafts:
            return drafts
        gate = None if state.gate is None else state.gate.fork()
        m = state.matcher
        consumed = keep = 0
        try:
            for token in drafts:
                if not _allows(gate, m, token):
                    break
                answer = [token] if gate is None else gate.feed([token])
                if answer and m is not None:
                    m.consume_tokens(answer)  # (allowed: one token, accepted)
                    consumed += 1
                    if m.is_stopped():
                        break
                keep += 1
        finally:
            if consumed:
                m.rollback(consumed)
        return drafts[:keep]

    def fill_draft_bitmask(self, request_ids: list[str], drafts: dict[str, list[int]],
                           out: np.ndarray | None = None) -> np.ndarray:
        """The masks of a step that verifies drafts: for each request in order, one row per
        verify position, row j the mask after its first j drafts (``drafts``: the scheduled
        ones, a prefix of what ``valid_drafts`` kept), so ``1 + len(drafts[rid])`` rows. Rows of
        one position across the requests are filled together; the matchers end as they
        started."""
        states = [self.states[rid] for rid in request_ids]
        own = [drafts.get(rid, []) for rid in request_ids]
        first = np.zeros(len(states), dtype=np.int64)
        if len(states) > 1:
            np.cumsum([len(d) + 1 for d in own[:-1]], out=first[1:])
        out = self._mask_array(int(first[-1]) + len(own[-1]) + 1 if states else 0, out)
        gates = [None if s.gate is None else s.gate.fork() for s in states]
        consumed = [0] * len(states)
        broken: dict[int, int] = {}  # request -> the row whose draft its grammar refused
        try:
            for j in range(max((len(d) for d in own), default=0) + 1):
                active = [i for i, d in enumerate(own) if j <= len(d) and i not in broken]
                if not active:
                    break
                rows = first[active] + j
                target = np.empty((len(active), out.shape[1]), dtype=np.int32)
                masked = self._fill([states[i].matcher for i in active],
                                    [gates[i] for i in active], target)
                out[rows] = target
                if j == 0:
                    self._count_masks([states[active[k]] for k in masked])
                for i in active:
                    if j == len(own[i]):
                        continue
                    token, gate, m = own[i][j], gates[i], states[i].matcher
                    if not _allows(gate, m, token):
                        # (valid_drafts keeps only allowed drafts: not expected.) The row
                        # refuses the draft, so the rows after it are never used.
                        broken[i] = int(first[i]) + j
                        continue
                    answer = [token] if gate is None else gate.feed([token])
                    if answer and m is not None:
                        m.consume_tokens(answer)
                        consumed[i] += 1
            for i, row in broken.items():
                logger.warning("request %s: draft %d refused by its grammar while filling "
                               "its masks", request_ids[i], row - int(first[i]))
                out[row + 1:int(first[i]) + len(own[i]) + 1] = out[row]
        finally:
            for s, n in zip(states, consumed):
                if n:
                    s.matcher.rollback(n)
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
            return _refused(tokens, m)
        if m.is_stopped():
            return "stop"
        return None

    def take_report(self, stats: SchedulerStats) -> None:
        """Put the compile times and request kinds since the previous call, each with its
        backend, into the step's ``stats``."""
        compiles = []
        while self._unreported_compiles:
            compiles.append(self._unreported_compiles.popleft())
        kinds, self._unreported_kinds = self._unreported_kinds, []
        stats.grammar_compile_backends = [b for b, _ in compiles]
        stats.grammar_compile_s = [s for _, s in compiles]
        stats.structured_requests = [k for k, _ in kinds]
        stats.structured_request_backends = [b for _, b in kinds]

    @property
    def has_report(self) -> bool:
        return bool(self._unreported_compiles or self._unreported_kinds)

    def shutdown(self) -> None:
        if self._fill_thread is not None:
            self._fill_thread.shutdown()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
