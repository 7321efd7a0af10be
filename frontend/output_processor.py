"""Turns engine outputs (token ids) into ``RequestOutput``s: detokenizes incrementally, matches
stop strings, converts logprobs, and folds the ``n`` samples of a request back into one result.

Shared by ``LLM`` and ``AsyncLLM``. A request with ``n > 1`` runs in the engine as ``n``
independent child requests (``{request_id}#{i}``, each with its own seed if seeded).

One ``OutputBatch`` (one engine step) is processed in one pass: each row's tokens are appended,
detokenized and stop-checked into the sequence's state; no output object is built per token.
A request whose consumer reads through an ``OutputCollector`` (``AsyncLLM``) is only marked ready
there; the consumer builds its output when it reads, covering every step since its last read.
So a consumer that falls behind (a slow client, a busy event loop) gets the text of several steps
in one output, in order, instead of a queue of per-step outputs. Requests without a collector
(``LLM``) get their outputs in the return value, as they are made.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    LogprobsArrays,
    OutputBatch,
)
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.detokenizer import IncrementalDetokenizer, create_detokenizer, decode_token
from tidal.frontend.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from tidal.frontend.stop_strings import StopStringMatcher

logger = logging.getLogger(__name__)

_KIND_DELTA = OutputKind.DELTA
_KIND_FINAL = OutputKind.FINAL_ONLY


@dataclass(slots=True, eq=False)
class SeqState:
    """One of the ``n`` samples of a request."""

    index: int
    engine_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer | None  # None: no tokenizer, token ids only
    stop: StopStringMatcher | None
    # Text not delivered yet (DELTA), or all of it (other kinds; joined on delivery).
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    sent_tokens: int = 0  # what DELTA outputs have delivered
    # No one reads the text before the sequence ends (FINAL_ONLY, no stop strings): it is
    # decoded once then (``IncrementalDetokenizer.decode_all``), not token by token.
    text_at_end: bool = False
    finish_sent: bool = False
    # For metrics: on the engine's clock (its ``OutputBatch.timestamp``), when this sequence
    # was queued and first scheduled there (0: not told) and the steps that brought its first
    # and its latest tokens; on this process's clock, when it finished here.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_cached_tokens: int = 0
    finished_time: float = 0.0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def has_news(self) -> bool:
        """Something a DELTA output has not delivered yet."""
        return (len(self.token_ids) > self.sent_tokens or bool(self.text_parts)
                or (self.finish_reason is not None and not self.finish_sent))

    def completion(self, delta: bool) -> CompletionOutput:
        parts = self.text_parts
        text = parts[0] if len(parts) == 1 else "".join(parts)
        if delta:
            parts.clear()
            tok_from = self.sent_tokens
            self.sent_tokens = len(self.token_ids)
        else:
            if len(parts) > 1:
                parts[:] = [text]
            tok_from = 0
        if self.finish_reason is not None:
            self.finish_sent = True
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=self.token_ids[tok_from:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[tok_from:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    metrics: RequestMetrics
    collector: OutputCollector | None = None
    num_open: int = 0  # sequences not finished yet
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False
    is_embedding: bool = False
    embedding: EmbeddingOutput | None = None
    kv_transfer_params: dict[str, object] | None = None  # the KV connector's, once finished

    @property
    def finished(self) -> bool:
        return self.num_open == 0

    def take_output(self) -> RequestOutput | EmbeddingOutput | None:
        """The output a consumer gets now: for DELTA what is new since its last one (None if
        nothing is), for FINAL_ONLY the result once finished, else everything so far."""
        if self.embedding is not None:
            return self.embedding
        kind = self.params.output_kind
        finished = self.num_open == 0
        if kind == _KIND_FINAL and not finished:
            return None
        delta = kind == _KIND_DELTA
        if delta:
            completions = [s.completion(True) for s in self.seqs if s.has_news]
            if not completions:
                return None
        else:
            completions = [s.completion(False) for s in self.seqs]
        prompt_lp = self.prompt_logprobs
        if delta and self.prompt_logprobs_sent:
            prompt_lp = None
        self.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            kv_transfer_params=self.kv_transfer_params,
        )


class OutputCollector:
    """Where the output processor hands one consumer its requests' news (one request, or the
    prompts of one API request): requests are marked ready, and ``get`` builds their outputs
    when the consumer asks, so nothing queues up per step. Belongs to one event loop."""

    __slots__ = ("_ready", "_waiter", "_error")

    def __init__(self) -> None:
        self._ready: dict[RequestState, None] = {}  # an ordered set
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None

    def notify(self, state: RequestState) -> None:
        self._ready[state] = None
        self._wake()

    def fail(self, error: BaseException) -> None:
        """``get`` raises ``error`` once the ready outputs are taken."""
        if self._error is None:
            self._error = error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def take(self) -> list[RequestOutput | EmbeddingOutput]:
        """The outputs ready now (possibly none); raises the failure once nothing is left."""
        if self._ready:
            ready = self._ready
            self._ready = {}
            outs = []
            for state in ready:
                out = state.take_output()
                if out is not None:
                    outs.append(out)
            if outs:
                return outs
        if self._error is not None:
            raise self._error
        return []

    async def get(self) -> list[RequestOutput | EmbeddingOutput]:
        """Wait until there is something to read; at least one output."""
        while True:
            outs = self.take()
            if outs:
                return outs
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


@dataclass(slots=True)
class FinishedSequence:
    """One of a finished request's ``n`` sequences, for metrics (vLLM counts each as a request).

    The phases are intervals on the engine's clock, as vLLM defines them: queue (queued ->
    first scheduled), prefill (first scheduled -> first token), decode (first -> last token),
    inference (first scheduled -> last token); None when the engine reported no schedule or no
    token came (a rejected request)."""

    finish_reason: str
    e2e_latency: float  # arrival here -> finished here
    num_generation_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None
    prefill_time: float | None = None
    decode_time: float | None = None
    inference_time: float | None = None


@dataclass(slots=True)
class FinishedRequest:
    """A request that finished, for metrics."""

    request_id: str
    e2e_latency: float
    finish_reasons: list[str]  # one per sequence
    num_prompt_tokens: int
    num_generation_tokens: int
    n: int
    max_tokens: int | None
    sequences: list[FinishedSequence] = field(default_factory=list)


@dataclass(slots=True)
class StepRecord:
    """What one engine step did to this frontend's requests (latencies for metrics)."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    engine_index: int = 0
    # Prompts of the sequences whose first token came this step (vLLM's prompt token counts):
    # their tokens, and how many of those the prefix cache supplied.
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(slots=True)
class ProcessedOutputs:
    # Outputs of requests without a collector (those with one were notified).
    request_outputs: list[RequestOutput | EmbeddingOutput]
    # Engine request ids that finished here (stop strings) and must be aborted in the engine.
    abort_engine_ids: list[str]
    record: StepRecord


class OutputProcessor:
    def __init__(self, tokenizer: Any, stream_interval: int = 1) -> None:
        """``stream_interval``: a DELTA request with a collector is marked ready at its first
        token, every ``stream_interval`` tokens after that, and when it finishes."""
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.requests: dict[str, RequestState] = {}
        self._by_engine_id: dict[str, tuple[RequestState, SeqState]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None,
                    collector: OutputCollector | None = None) -> list[EngineCoreRequest]:
        """Register a request; returns the engine requests to send (``n`` of them)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt, prompt_token_ids, params, [],
                             RequestMetrics(arrival_time=arrival), collector, params.n)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(prompt_token_ids)
        engine_reqs = []
        for i in range(params.n):
            child = params if params.n == 1 else params.child(i)
            engine_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seq = SeqState(
                index=i,
                engine_id=engine_id,
                params=child,
                detok=None if self.tokenizer is None else create_detokenizer(
                    self.tokenizer, prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens),
                stop=StopStringMatcher(params.stop, params.include_stop_str_in_output)
                if params.stop else None,
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                text_at_end=params.output_kind == _KIND_FINAL and not params.stop,
            )
            state.seqs.append(seq)
            self._by_engine_id[engine_id] = (state, seq)
            engine_reqs.append(EngineCoreRequest(engine_id, prompt_token_ids, child,
                                                 arrival_time=arrival, cache_salt=cache_salt))
        self.requests[request_id] = state
        return engine_reqs

    def add_embedding_request(self, request_id: str, prompt: str | None,
                              prompt_token_ids: list[int], arrival_time: float | None = None,
                              collector: OutputCollector | None = None) -> EngineCoreRequest:
        """Register a request of an embedding model; its one output is an EmbeddingOutput."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        (req,) = self.add_request(request_id, prompt, prompt_token_ids, params, arrival_time,
                                  collector=collector)
        self.requests[request_id].is_embedding = True
        return req

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine ids still running (to abort in the engine)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.seqs:
            self._by_engine_id.pop(seq.engine_id, None)
        return [s.engine_id for s in state.seqs if not s.finished]

    def finish_aborted(self, request_id: str) -> list[str]:
        """End a request early: its open sequences finish with ``abort`` and its consumer gets
        that final output. Returns the engine ids to abort in the engine."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        engine_ids = self.abort_request(request_id)
        for seq in state.seqs:
            if not seq.finished:
                _decode_at_end(seq, flush=False)
                seq.finish_reason = str(FinishReason.ABORT)
        state.num_open = 0
        if state.collector is not None:
            state.collector.notify(state)
        return engine_ids

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """The engine died: finish every request with an error; consumers with a collector
        get ``error`` raised, the others an output (returned)."""
        outs = []
        message = str(error)
        for state in list(self.requests.values()):
            if state.collector is not None:
                # What arrived before still reads as it was; then ``error`` is raised.
                state.collector.fail(error)
                continue
            for seq in state.seqs:
                if not seq.finished:
                    _decode_at_end(seq, flush=False)
                    seq.finish_reason, seq.error = "error", message
            state.num_open = 0
            if (out := state.take_output()) is not None and isinstance(out, RequestOutput):
                outs.append(out)
        self.requests.clear()
        self._by_engine_id.clear()
        return outs

    # --- the per-step pass --------------------------------------------------------------------

    def process_outputs(self, batch: OutputBatch) -> ProcessedOutputs:
        result = ProcessedOutputs([], [], StepRecord(engine_index=batch.engine_index))
        now = time.monotonic()
        ts = batch.timestamp
        by_id = self._by_engine_id
        details = {d.request_id: d for d in batch.details} if batch.details else None
        if batch.req_ids:
            assert batch.token_ids is not None
            flat = batch.token_ids.tolist()
            counts = None if batch.token_counts is None else batch.token_counts.tolist()
            pos = 0
            for i, rid in enumerate(batch.req_ids):
                if counts is None:
                    new = flat[i:i + 1]
                else:
                    new = flat[pos:pos + counts[i]]
                    pos += counts[i]
                entry = by_id.get(rid)
                if entry is None:
                    continue  # aborted meanwhile
                detail = details.pop(rid, None) if details else None
                self._apply(entry[0], entry[1], new, detail, now, ts, result)
        if details:
            for rid, detail in details.items():
                entry = by_id.get(rid)
                if entry is not None:
                    self._apply(entry[0], entry[1], [], detail, now, ts, result)
        return result

    def _apply(self, state: RequestState, seq: SeqState, new_ids: list[int],
               detail: EngineCoreOutput | None, now: float, ts: float,
               result: ProcessedOutputs) -> None:
        """``now``: this process's clock; ``ts``: the engine's, for this step."""
        if state.is_embedding:
            if detail is not None:
                self._finish_embedding(state, seq, detail, result)
            return
        if detail is not None and detail.new_prompt_logprobs is not None \
                and state.prompt_logprobs is not None:
            self._add_prompt_logprobs(state, detail.prompt_logprobs_start,
                                      detail.new_prompt_logprobs)
        finished_now = detail is not None and detail.finish_reason is not None
        if not new_ids and not finished_now:
            return  # prompt logprobs alone travel with the first token
        m = state.metrics
        if new_ids:
            if m.first_token_time is None:
                m.first_token_time = now
                result.record.time_to_first_tokens.append(now - m.arrival_time)
            elif m.last_token_time is not None and m.last_token_time != now:
                # (The n samples of a request share its metrics: one gap per step.)
                result.record.inter_token_latencies.append(now - m.last_token_time)
            m.last_token_time = now
            if not seq.token_ids:  # its first tokens (``_update_seq`` appends them below)
                seq.first_token_ts = ts
                if detail is not None and detail.scheduled_ts:
                    seq.queued_ts, seq.scheduled_ts = detail.queued_ts, detail.scheduled_ts
                    seq.num_cached_tokens = detail.num_cached_tokens
                record = result.record
                record.prompt_tokens += len(state.prompt_token_ids)
                record.cached_prompt_tokens += seq.num_cached_tokens
            seq.last_token_ts = ts
        if self._update_seq(seq, new_ids, detail):
            result.abort_engine_ids.append(seq.engine_id)
        if finished_now:
            state.num_cached_tokens = max(state.num_cached_tokens, detail.num_cached_tokens)
            if detail.kv_transfer_params is not None:
                state.kv_transfer_params = detail.kv_transfer_params
        if seq.finished:
            seq.finished_time = now
            self._by_engine_id.pop(seq.engine_id, None)
            state.num_open -= 1
            if state.num_open == 0:
                m.finished_time = now
                self.requests.pop(state.request_id, None)
                result.record.finished.append(_finished_record(state, now))
        self._deliver(state, seq, result)

    def _deliver(self, state: RequestState, seq: SeqState, result: ProcessedOutputs) -> None:
        collector = state.collector
        if collector is None:
            out = state.take_output()
            if out is not None:
                result.request_outputs.append(out)
            return
        kind = state.params.output_kind
        if kind == _KIND_FINAL:
            if state.num_open == 0:
                collector.notify(state)
            return
        interval = self.stream_interval
        if (interval == 1 or seq.finish_reason is not None or seq.sent_tokens == 0
                or len(seq.token_ids) - seq.sent_tokens >= interval):
            collector.notify(state)

    def _finish_embedding(self, state: RequestState, seq: SeqState, detail: EngineCoreOutput,
                          result: ProcessedOutputs) -> None:
        self._by_engine_id.pop(seq.engine_id, None)
        self.requests.pop(state.request_id, None)
        seq.finish_reason = str(detail.finish_reason)
        state.num_open = 0
        vector = [] if detail.pooled is None else detail.pooled.astype(np.float32).tolist()
        state.embedding = EmbeddingOutput(state.request_id, state.prompt_token_ids, vector,
                                          detail.error)
        if state.collector is not None:
            state.collector.notify(state)
        else:
            result.request_outputs.append(state.embedding)

    def _update_seq(self, seq: SeqState, new_ids: list[int],
                    detail: EngineCoreOutput | None) -> bool:
        """Apply one step's tokens (and details); True if a stop string ended the sequence here
        (so the engine, which does not know, must be told to stop it)."""
        finished = detail is not None and detail.finish_reason is not None
        if new_ids:
            seq.token_ids.extend(new_ids)
            if detail is not None and detail.new_logprobs is not None \
                    and seq.logprobs is not None:
                self._add_logprobs(seq, detail.new_logprobs, len(new_ids))
        text = ""
        if seq.text_at_end:
            if finished:
                _decode_at_end(seq)
        elif seq.detok is not None:
            text = seq.detok.update(new_ids) if new_ids else ""
            if finished:
                text += seq.detok.flush()
        if seq.stop is not None:
            check = seq.stop.feed(text)
            text = check.text
            if not check.stopped and finished:
                check = seq.stop.finish()
                text += check.text
            if check.stopped:
                if text:
                    seq.text_parts.append(text)
                seq.finish_reason, seq.stop_reason = "stop", check.stop
                return not finished
        if text:
            seq.text_parts.append(text)
        if finished:
            assert detail is not None
            seq.finish_reason = str(detail.finish_reason)
            seq.stop_reason = detail.stop_reason
            seq.error = detail.error
        return False

    def _position_logprobs(self, ids: np.ndarray, vals: np.ndarray, rank: int,
                           width: int) -> PositionLogprobs:
        entry: PositionLogprobs = {}
        for j in range(min(width, len(ids))):
            tok = int(ids[j])
            if tok in entry:
                continue
            text = None if self.tokenizer is None else decode_token(self.tokenizer, tok)
            entry[tok] = Logprob(float(vals[j]), rank if j == 0 else j, text)
        return entry

    def _add_logprobs(self, seq: SeqState, arrays: LogprobsArrays, n: int) -> None:
        assert seq.logprobs is not None and seq.params.logprobs is not None
        width = 1 + seq.params.logprobs
        for i in range(min(n, len(arrays.ranks))):
            seq.logprobs.append(self._position_logprobs(arrays.token_ids[i], arrays.logprobs[i],
                                                        int(arrays.ranks[i]), width))
            seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + float(arrays.logprobs[i, 0])

    def _add_prompt_logprobs(self, state: RequestState, start: int,
                             arrays: LogprobsArrays) -> None:
        assert state.prompt_logprobs is not None and state.params.prompt_logprobs is not None
        width = 1 + state.params.prompt_logprobs
        for i in range(len(arrays.ranks)):
            pos = start + i
            if 0 < pos < len(state.prompt_logprobs):
                state.prompt_logprobs[pos] = self._position_logprobs(
                    arrays.token_ids[i], arrays.logprobs[i], int(arrays.ranks[i]), width)


def _decode_at_end(seq: SeqState, flush: bool = True) -> None:
    """The whole text of a ``text_at_end`` sequence, as it ends (once; ``flush=False``: cut
    short, a character still incomplete is dropped, as the stream of the other kinds drops
    it)."""
    if seq.text_at_end and seq.detok is not None:
        seq.text_at_end = False
        text = seq.detok.decode_all(seq.token_ids, flush)
        if text:
            seq.text_parts.append(text)


def _finished_record(state: RequestState, now: float) -> FinishedRequest:
    return FinishedRequest(
        request_id=state.request_id,
        e2e_latency=max(0.0, now - state.metrics.arrival_time),
        finish_reasons=[s.finish_reason or "abort" for s in state.seqs],
        num_prompt_tokens=len(state.prompt_token_ids),
        num_generation_tokens=sum(len(s.token_ids) for s in state.seqs),
        n=state.params.n,
        max_tokens=state.params.max_tokens,
        sequences=[_finished_sequence(s, state.metrics.arrival_time, now) for s in state.seqs],
    )


def _finished_sequence(seq: SeqState, arrival: float, now: float) -> FinishedSequence:
    done = FinishedSequence(
        finish_reason=seq.finish_reason or "abort",
        e2e_latency=max(0.0, (seq.finished_time or now) - arrival),
        num_generation_tokens=len(seq.token_ids),
        num_cached_tokens=seq.num_cached_tokens,
    )
    if seq.scheduled_ts and seq.token_ids:
        # (A preemption in between counts in the phase it interrupted, as in vLLM.)
        done.queue_time = max(0.0, seq.scheduled_ts - seq.queued_ts)
        done.prefill_time = max(0.0, seq.first_token_ts - seq.scheduled_ts)
        done.decode_time = max(0.0, seq.last_token_ts - seq.first_token_ts)
        done.inference_time = max(0.0, seq.last_token_ts - seq.scheduled_ts)
    return done
