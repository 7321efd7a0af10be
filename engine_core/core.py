"""EngineCore: owns the scheduler and the executor, and runs one step at a time.

It is used in-process (``LLM``, tests) and inside the EngineCore process (see ``core_proc``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from tidal.engine_core import control, envs
from tidal.engine_core.config import EngineConfig
from tidal.engine_core.executor import Deferred, Executor, create_executor
from tidal.engine_core.lora_registry import LoRARegistry
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)
from tidal.engine_core.reasoning_formats import reasoning_format
from tidal.engine_core.request import Request
from tidal.engine_core.scheduler import Scheduler
from tidal.engine_core.startup_log import StartupLog
from tidal.engine_core.stats_logger import StatsLogger
from tidal.engine_core.structured_output.manager import StructuredOutputManager
from tidal.engine_core.validation import RequestValidationError, validate_request

logger = logging.getLogger(__name__)

# How often a busy engine with nothing to run asks its workers whether held KV was sent.
KV_POLL_INTERVAL_S = 0.01


def _grammar_reason(verdict: str) -> FinishReason:
    """How a request whose matcher gave ``verdict`` (``advance``: "stop" or an error) ends."""
    return FinishReason.STOP if verdict == "stop" else FinishReason.ERROR


class NoopExecutor:
    """Runs no model: every request that completes its tokens in a step samples one fixed token.

    Selected with ``distributed_executor_backend="noop"``; it measures the engine's own overhead
    (scheduling, transport, detokenization) without a model (``tools/bench_overhead.py``).
    """

    def __init__(self, config: EngineConfig) -> None:
        eos = set(config.model.eos_token_ids)
        self.token = next(t for t in range(config.model.vocab_size) if t not in eos)
        self.num_blocks = config.cache.num_blocks or 4096
        self._lengths: dict[str, int] = {}  # req_id -> tokens the request holds

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def init_kv_cache(self, num_blocks: int) -> None:
        return None

    def execute_model(self, so: SchedulerOutput, non_block: bool = False) -> Any:
        out = self._execute(so)
        return Deferred(out) if non_block else out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        lengths = self._lengths
        for rid in so.finished_req_ids:
            lengths.pop(rid, None)
        for r in so.new_reqs:
            lengths[r.req_id] = len(r.prompt_token_ids) + len(r.output_token_ids)
        # Batch order: the cached requests, then the new ones.
        computed = so.cached_reqs.num_computed_tokens + [r.num_computed_tokens
                                                         for r in so.new_reqs]
        out = ModelRunnerOutput()
        for rid, c, n in zip(so.req_ids, computed, so.num_scheduled_tokens):
            if c + n >= lengths.get(rid, 0):
                out.req_ids.append(rid)
                out.sampled_token_ids.append([self.token])
                lengths[rid] = lengths.get(rid, 0) + 1
        return out

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self._lengths.clear()


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        # Phases in the workers' format (engine_core.startup_log); each rank logs its own
        # (model load, KV profile and allocation, graph capture, warm-up) inside these.
        self.startup = StartupLog("engine", logger)
        start = time.perf_counter()
        if executor is None:
            noop = config.parallel.distributed_executor_backend == "noop"
            executor = NoopExecutor(config) if noop else create_executor(config)
        self.executor = executor
        self.startup.record("executor", time.perf_counter() - start,
                            label=f"executor {type(executor).__name__} up (model loaded)")
        with self.startup.phase("kv profile") as note:
            num_blocks = self.executor.determine_num_blocks()
            note.detail = f"{num_blocks} blocks"
        self.config = config.with_num_blocks(num_blocks)
        with self.startup.phase("kv init") as note:
            # Returns once every worker allocated its KV cache, captured its graphs and warmed
            # up: from here on serving compiles nothing (control.GetCompileStats checks).
            self.executor.init_kv_cache(num_blocks)
            note.detail = "KV cache allocated, graphs captured, warmed up on every worker"
        self.scheduler = Scheduler(self.config)
        self.lora_registry = LoRARegistry(self.config)
        if config.speculative is not None:
            logger.info("speculative decoding: %s; a step that verifies or proposes drafts "
                        "runs alone (the next is scheduled once its accepted tokens are "
                        "known), other steps pipeline with async scheduling",
                        config.speculative.describe())
        self._eos = frozenset(config.model.eos_token_ids)
        # Constrained requests wait here for their grammar, then run with a mask per step.
        self.structured = StructuredOutputManager(
            config.model, config.scheduler.structured_outputs_backend,
            reasoning=reasoning_format(config.scheduler.reasoning_parser))
        self.stats_logger = StatsLogger(enabled=config.log_stats)
        self._kv_polled = 0.0  # when poll_kv_transfers last ran an empty step
        # Steps launched but not yet collected: (scheduler output, result or pending result).
        self.max_inflight = max(1, getattr(self.executor, "max_concurrent_batches", 1))
        self.batch_queue: deque[tuple[SchedulerOutput, Any]] = deque()
        self.forwards = 0  # steps launched on the workers (dp_lockstep counts them)
        # Called with each step's scheduler output just before the workers get it, empty
        # steps included (dp_lockstep: the engines agree there on how the step runs).
        self.before_forward: Callable[[SchedulerOutput], None] | None = None
        self.speculative = config.speculative is not None
        # With steps in flight and a worker in this process, a constrained request runs every
        # step: its step is launched first, and its mask is filled from its previous token
        # (which arrives meanwhile) while the device runs the forward pass, then sampled with.
        # (Not with speculative decoding: a step that verifies drafts samples as it ends, and
        # its constrained requests' masks, one per draft, are filled when it is scheduled.)
        self.defer_masks = (self.max_inflight > 1 and not self.speculative
                            and getattr(self.executor, "supports_deferred_sample", False))
        self.scheduler.grammar_in_flight_ok = self.defer_masks
        # The step launched last, its constrained requests and their masks filling (a
        # PendingFill, or None when none needs one): sampled by the next call into the engine.
        self._deferred: tuple[Any, list[str], Any] | None = None
        # The masks of a step handed to the executor's `sample_lazily`, until it is collected.
        self._open_fill: Any = None
        # Whether the fill job of a deferred step also advances its requests' matchers by
        # their previous tokens (off the engine thread; their verdicts are read when the step
        # is collected): $TIDAL_GRAMMAR_ADVANCE_IN_FILL.
        self.advance_in_fill = envs.grammar_advance_in_fill()
        # Steps whose fill advanced matchers: (the step's pending result, its PendingFill).
        self._advanced: deque[tuple[Any, Any]] = deque()
        # Whether that fill job starts as soon as the previous step's tokens are on the host,
        # before the scheduler's update (which then overlaps it): $TIDAL_GRAMMAR_FILL_EARLY.
        self.fill_early = self.advance_in_fill and envs.grammar_fill_early()
        # Everything built so far (model, tokenizer tables, caches) lives as long as the engine:
        # take it out of the garbage collector's generations, or every full collection walks it
        # (about 0.2 ms per step at batch 256 on a small CPU).
        gc.collect()
        gc.freeze()
        detail = (f"{num_blocks} KV blocks x {config.cache.block_size} tokens, "
                  f"max_model_len {config.model.max_model_len}")
        compile_stats = getattr(self.executor, "compile_stats", None)  # not without workers
        if compile_stats is not None:
            stats = compile_stats()
            if stats.active:
                detail += f"; {stats.startup} JIT compiles at start-up, none expected after"
        self.startup.record("ready", time.perf_counter() - start, detail,
                            label="EngineCore ready")

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request. Raises ``RequestValidationError`` (a ValueError) if it is invalid,
        and ValueError if its id is already in use; nothing is queued then."""
        validate_request(req.prompt_token_ids, req.sampling_params, self.config,
                         check_grammar=False)
        if req.lora_request is not None:
            self.lora_registry.check_request(req.lora_request)  # LoRAAdapterError: a ValueError
        request = Request.from_engine_request(req, self.config.model.max_model_len, self._eos)
        if req.sampling_params.thinking_token_budget is not None:
            if self.structured.reasoning is None:
                raise RequestValidationError(
                    "thinking_token_budget needs the engine started with --reasoning-parser")
            # Its next mask may force a token, so it waits for its previous one like a
            # constrained request does.
            request.structured = True
        if request.structured:
            rid = request.request_id
            # (Checked first: nothing may be half-queued.)
            if self.scheduler.id_in_use(rid) or rid in self.structured.pending:
                raise ValueError(f"request id {rid!r} is already in use")
            # Its prompt prefills while its grammar compiles (all but its last token: nothing
            # is sampled before its first mask); ``_admit_compiled`` clears the wait.
            request.grammar_wait = True
            self.scheduler.add_request(request)
            self.structured.submit(request)
            return
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        self.scheduler.finish_requests(request_ids, FinishReason.ABORT)
        if self.structured.pending or self.structured.states:
            self.structured.drop(request_ids)

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.batch_queue)
                or bool(self.structured.pending))

    def _inflight_limit(self) -> int:
        """Steps that may be in flight before the next is scheduled. With speculative decoding
        a step that verifies drafts or proposes them runs alone when the next step's drafts
        must come from its output: n-gram drafts (looked up on the host), and constrained
        requests (their drafts are cut to what the grammar allows, their masks filled per
        draft). With a model drafter it pipelines: the next step takes placeholder drafts the
        workers fill from the device (``SchedulerOutput.spec_in_flight``). Steps that do
        neither (the off-switch is off) pipeline as without speculation."""
        queue = self.batch_queue
        if queue and self.max_inflight > 1:
            newest = queue[-1][0]
            if (newest.scheduled_spec_decode_tokens or (
                    self.speculative and newest.propose_drafts)) and not (
                    self.scheduler.async_spec and not self.structured.states):
                return 1
        return self.max_inflight

    def step(self) -> EngineCoreOutputs:
        """Schedule, execute and update once; returns the new outputs (possibly none).

        With a batch queue (async scheduling, pipeline parallelism) the next step is scheduled
        and launched before the oldest one's results are collected, so scheduling overlaps the
        model's work; results still arrive in order.
        """
        start = time.perf_counter()
        self._sample_deferred(lazily=True)
        outputs: list[EngineCoreOutput] = []
        launched = False
        structured = self.structured
        if structured.pending:
            outputs.extend(self._admit_compiled())
        mask_later: list[str] = []  # constrained requests that sample in the step launched
        handed: dict[str, int] = {}  # of those, requests whose fill advances their matcher
        early: tuple[Any, list[str], Any] | None = None  # their fill, begun before the update
        if len(self.batch_queue) < self._inflight_limit() and self.scheduler.has_unfinished():
            sched = self.scheduler.schedule()
            if self.scheduler.connector is not None:
                outputs += self.scheduler.take_kv_rejected()  # failed alone, at admission
            if sched.total_num_scheduled_tokens:
                if structured.states:
                    if self.defer_masks:
                        mask_later = self._sampling_constrained(sched)
                    else:
                        self._attach_grammar_masks(sched)
                if self.before_forward is not None:
                    self.before_forward(sched)
                if mask_later:
                    pending = launched_pending = self.executor.execute_model(
                        sched, non_block=True, defer_sample=True)
                else:
                    pending = (self.executor.execute_model(sched, non_block=True)
                               if self.max_inflight > 1 else self.executor.execute_model(sched))
                self.batch_queue.append((sched, pending))
                launched = True
                self.forwards += 1
        # A step that verifies or proposes drafts is collected in the call that launched it
        # (nothing may be scheduled behind it), not in an empty extra turn of the loop.
        limit = self.max_inflight if mask_later else self._inflight_limit()
        if self.batch_queue and (len(self.batch_queue) >= limit or not launched):
            sched, pending = self.batch_queue.popleft()
            result = pending.result() if self.max_inflight > 1 else pending
            verdicts: list[tuple[str, str]] = []
            if self._advanced and self._advanced[0][0] is pending:
                # (Read before a fill job moves these matchers again.)
                verdicts = self._advanced.popleft()[1].verdicts()
            if self._open_fill is not None:
                # Sampled without its masks (nothing to sample): the fill must be over before
                # its matchers move.
                self._open_fill.wait()
                self._open_fill = None
            if mask_later and self.fill_early:
                early = self._begin_fill_early(launched_pending, mask_later, result, verdicts)
            # Before this step's tokens: a request its grammar ended at the token before them
            # drops them. (Added to the failed compiles' outputs, if any.)
            outputs += self._finish_by_grammar(verdicts)
            outputs += self.scheduler.update_from_output(sched, result)
            if structured.states:
                handed = self._advance_grammars(
                    outputs, set(mask_later) if mask_later and self.advance_in_fill else None)
                if self.speculative:
                    self._trim_drafts()
        if early is not None:
            self._deferred = early
        elif mask_later:
            # Every earlier step of these requests is collected now: their matchers are current
            # (or, those in ``handed``, advanced by the fill job before it fills their masks).
            # Their masks fill on the fill thread while this step's outputs are processed; the
            # next call samples the step before it launches anything (`_sample_deferred`).
            ids = self.structured.needing_masks(mask_later)
            fill = None
            if ids:
                buffer = self.executor.grammar_buffer(len(ids))
                uploader = getattr(self.executor, "grammar_uploader", None)
                fill = structured.begin_fill(
                    ids, buffer, tokens=[handed.get(rid) for rid in ids] if handed else None,
                    upload=None if uploader is None else uploader())
                if handed:
                    self._advanced.append((launched_pending, fill))
            self._deferred = (launched_pending, ids, fill)
        if not launched and not self.batch_queue and structured.pending and not outputs:
            # Only compiles are left: wait for one rather than spin (nothing else can run).
            structured.wait_for_compiles(0.005)
        if not launched and not self.batch_queue and self.scheduler.has_held_kv:
            self.poll_kv_transfers()  # nothing runs: maybe blocks held for a transfer block it
        stats = self.scheduler.make_stats()  # counts the tokens update_from_output appended
        if structured.has_report:
            structured.take_report(stats)
        self.stats_logger.record(stats, time.perf_counter() - start)
        return EngineCoreOutputs(outputs=outputs, timestamp=time.monotonic(),
                                 scheduler_stats=stats)

    def _sample_deferred(self, lazily: bool = False) -> None:
        """Sample the step the last ``step`` launched under its grammar masks, once they are
        filled. Before anything else reaches the executor: its next step's inputs are this
        step's tokens, and its workers wait for this step's `FinishSample` first. ``lazily``
        (the start of a step; a worker in this process): the worker samples it just before
        the next step's device work, so the masks are filled while the next step is scheduled
        and its inputs prepared, not before."""
        deferred = self._deferred
        if deferred is None:
            if not lazily and self._open_fill is not None:
                self.executor.launch_due()
            return
        self._deferred = None
        pending, ids, fill = deferred
        lazy = getattr(self.executor, "sample_lazily", None)
        if lazily and lazy is not None and fill is not None:
            self._open_fill = fill
            lazy(pending, lambda: (ids, fill.wait()))
            return
        self.executor.finish_sample(pending, ids, None if fill is None else fill.wait())

    def empty_forward(self) -> None:
        """A step of no tokens through the workers, for expert parallelism across DP ranks:
        their MoE layers join the other ranks' exchange with no tokens (worker/layers/moe_ep)."""
        self._sample_deferred()
        sched = SchedulerOutput(step_id=-1)
        if self.before_forward is not None:
            self.before_forward(sched)
        self.executor.execute_model(sched)

    def poll_kv_transfers(self, force: bool = False) -> None:
        """Run an empty step so the workers report finished KV sends (a producer's blocks held
        for a consumer go back to the pool) when no step would run otherwise; at most every
        ``KV_POLL_INTERVAL_S`` unless ``force`` (the idle loop's own, slower, cadence)."""
        now = time.monotonic()
        if not force and now - self._kv_polled < KV_POLL_INTERVAL_S:
            time.sleep(0.001)  # the queue waits on these blocks: do not spin flat out
            return
        self._kv_polled = now
        if self.batch_queue:
            return  # a step in flight reports them anyway
        sched = self.scheduler.kv_poll_output()  # (it takes the finished ids it carries)
        if sched is not None:
            self.scheduler.update_from_output(sched, self.executor.execute_model(sched))

    # --- structured outputs ------------------------------------------------------------------

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Let the requests whose grammar compiled sample; fail those whose did not (their
        prefill so far is dropped with them)."""
        ready, failed = self.structured.take_ready()
        for req in ready:
            req.grammar_wait = False
        outs = []
        if failed:
            self.scheduler.finish_requests([req.request_id for req, _ in failed],
                                           FinishReason.ERROR)
        for req, why in failed:
            logger.warning("request %s: %s", req.request_id, why)
            outs.append(EngineCoreOutput(req.request_id, finish_reason=FinishReason.ERROR,
                                         error=why))
        return outs

    def _begin_fill_early(self, launched: Any, mask_later: list[str],
                          result: ModelRunnerOutput, verdicts: list[tuple[str, str]],
                          ) -> tuple[Any, list[str], Any] | None:
        """Begin the fill job of the step just launched straight from the collected step's
        ``result``, before the scheduler's update, so the update and the rest of the engine
        thread's turn run beside it. Its requests' matchers consume their new token in the job
        (as ``_advance_grammars`` would hand it). None, leaving it to the usual order, when a
        request needs the engine thread first: a reasoning gate (its tokens go through the gate),
        several tokens, a failed request, or a KV load to recover (the tokens may change).

        A request that the update then finishes (a stop token, its length) is filled anyway:
        what its step samples is dropped, and its verdict is skipped (its state is gone)."""
        structured = self.structured
        if (structured.has_gates or result.failed or self.scheduler.connector is not None):
            return None
        ended = {rid for rid, _ in verdicts}
        ids = [rid for rid in structured.needing_masks(mask_later) if rid not in ended]
        if not ids:
            return None
        emitted = dict(zip(result.req_ids, result.sampled_token_ids))
        tokens: list[int | None] = []
        for rid in ids:
            new = emitted.get(rid)
            if new and len(new) != 1:
                return None
            tokens.append(new[0] if new else None)
        uploader = getattr(self.executor, "grammar_uploader", None)
        fill = structured.begin_fill(
            ids, self.executor.grammar_buffer(len(ids)), tokens=tokens,
            upload=None if uploader is None else uploader())
        if fill.adv_matchers:
            self._advanced.append((launched, fill))
        return launched, ids, fill

    def _sampling_constrained(self, sched: SchedulerOutput) -> list[str]:
        """The constrained requests of ``sched`` that sample in it (the scheduler gave them a
        placeholder; a request whose previous token is in flight also samples, decoding)."""
        states = self.structured.states
        requests = self.scheduler.requests
        return [rid for rid in sched.req_ids
                if rid in states and requests[rid].num_placeholders > 0]

    def _attach_grammar_masks(self, sched: SchedulerOutput) -> None:
        """The next-token masks of the constrained requests that sample this step (their
        previous tokens are all collected: without deferred sampling, a constrained request
        waits for its token in flight). A request verifying drafts gets one row per verify
        position (``StructuredOutputManager.fill_draft_bitmask``), even while it thinks: its
        drafts may end the thinking."""
        sampling = self._sampling_constrained(sched)
        spec = sched.scheduled_spec_decode_tokens
        if spec and any(rid in spec for rid in sampling):
            states = self.structured.states
            ids = [rid for rid in sampling if rid in spec or states[rid].needs_mask]
            sched.grammar_req_ids = ids
            sched.grammar_bitmask = self.structured.fill_draft_bitmask(ids, spec)
            return
        ids = self.structured.needing_masks(sampling)
        if ids:
            sched.grammar_req_ids = ids
            sched.grammar_bitmask = self.structured.fill_bitmask(ids)

    def _trim_drafts(self) -> None:
        """Cut the drafts just proposed for constrained requests to the prefix their grammar
        allows: a draft it refuses could never be accepted (its mask rules it out), nor could
        any after it, and verifying them would only cost the step."""
        drafts = self.scheduler.drafts
        if not drafts:
            return
        structured = self.structured
        for rid in [rid for rid in drafts if rid in structured.states]:
            kept = structured.valid_drafts(rid, drafts[rid])
            if kept:
                drafts[rid] = kept
            else:
                del drafts[rid]

    def _advance_grammars(self, outputs: list[EngineCoreOutput],
                          later: set[str] | None = None) -> dict[str, int]:
        """Advance the constrained requests' matchers by their new tokens; a request whose
        grammar is complete (or broken) ends here. Those of ``later`` (sampling in the step
        just launched) with one new token and no reasoning gate are left to the fill job of
        their next masks: returns them, id -> token; their verdicts come with that step
        (``_finish_by_grammar``)."""
        structured = self.structured
        states = structured.states
        handed: dict[str, int] = {}
        for out in outputs:
            rid = out.request_id
            state = states.get(rid)
            if state is None or not (out.new_token_ids or out.finished):
                continue  # (nothing to feed: e.g. prompt logprobs alone)
            if (later is not None and rid in later and not out.finished
                    and len(out.new_token_ids) == 1 and state.gate is None
                    and state.matcher is not None):
                handed[rid] = out.new_token_ids[0]
                continue
            verdict = None if out.finished else structured.advance(rid, out.new_token_ids)
            if verdict is not None:
                # The grammar is complete (or, should a masked token slip through, broken):
                # the request ends here rather than sampling past it.
                for req in self.scheduler.finish_requests([rid], _grammar_reason(verdict)):
                    out.finish_reason = _grammar_reason(verdict)
                    out.num_cached_tokens = max(req.num_cached_tokens, 0)
                    if verdict != "stop":
                        out.error = verdict
            if out.finished:
                structured.drop((rid,))
        return handed

    def _finish_by_grammar(self, verdicts: list[tuple[str, str]]) -> list[EngineCoreOutput]:
        """End the requests whose grammar a fill job found complete (or broken) at the token
        before the step being collected: their tokens of that step are dropped, and each
        gets a last output of no tokens that says why it finished."""
        outs = []
        for rid, verdict in verdicts:
            reason = _grammar_reason(verdict)
            for req in self.scheduler.finish_requests([rid], reason):
                outs.append(EngineCoreOutput(
                    rid, finish_reason=reason, num_cached_tokens=max(req.num_cached_tokens, 0),
                    error=None if verdict == "stop" else verdict))
            self.structured.drop((rid,))
        return outs

    def handle_control(self, call: control.ControlCall) -> control.ControlResult:
        """Run a typed control call (``tidal.engine_core.control``) between two steps."""
        self._sample_deferred()
        return control.execute(self, call)

    def shutdown(self) -> None:
        try:
            self._sample_deferred()
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("sampling the last step failed at shutdown")
        self.structured.shutdown()
        self.executor.shutdown()
        self.batch_queue.clear()
        self._advanced.clear()
        # Start-up froze everything alive (gc.freeze above), the model's reference cycles
        # included: frozen cycles are never collected, so an engine shut down inside a
        # longer-lived process would keep its weights and KV cache until the process ends.
        gc.unfreeze()
        gc.collect()
