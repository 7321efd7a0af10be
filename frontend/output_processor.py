"""Turns engine outputs (token ids) into ``RequestOutput``s: detokenizes incrementally, matches
stop strings, converts logprobs, and folds the ``n`` samples of a request back into one result.

Shared by ``LLM`` and ``AsyncLLM``. A request with ``n > 1`` runs in the engine as ``n``
independent child requests (``{request_id}#{i}``, each with its own seed if seeded).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.engine_core.protocol import EngineCoreOutput, EngineCoreRequest, LogprobsArrays
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


@dataclass(slots=True, eq=False)
class SeqState:
    """One of the ``n`` samples of a request."""

    index: int
    engine_id: str
    params: SamplingParams
    detok: IncrementalDetokenizer | None  # None: no tokenizer, token ids only
    stop: StopStringMatcher | None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    # What DELTA outputs have already delivered.
    sent_text: int = 0
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, delta: bool) -> CompletionOutput:
        text_from = self.sent_text if delta else 0
        tok_from = self.sent_tokens if delta else 0
        out = CompletionOutput(
            index=self.index,
            text=self.text[text_from:],
            token_ids=self.token_ids[tok_from:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[tok_from:],
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            error=self.error,
        )
        if delta:
            self.sent_text = len(self.text)
            self.sent_tokens = len(self.token_ids)
        return out


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    prompt_logprobs_sent: bool = False
    is_embedding: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput | EmbeddingOutput]
    # Engine request ids that finished here (stop strings) and must be aborted in the engine.
    abort_engine_ids: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._by_engine_id: dict[str, tuple[RequestState, SeqState]] = {}

    def __len__(self) -> int:
        return len(self.requests)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None,
                    cache_salt: str | None = None) -> list[EngineCoreRequest]:
        """Register a request; returns the engine requests to send (``n`` of them)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        state = RequestState(request_id, prompt, prompt_token_ids, params, [],
                             RequestMetrics(arrival_time=arrival))
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
            )
            state.seqs.append(seq)
            self._by_engine_id[engine_id] = (state, seq)
            engine_reqs.append(EngineCoreRequest(engine_id, prompt_token_ids, child,
                                                 arrival_time=arrival, cache_salt=cache_salt))
        self.requests[request_id] = state
        return engine_reqs

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its engine ids still running (to abort in the engine)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.seqs:
            self._by_engine_id.pop(seq.engine_id, None)
        return [s.engine_id for s in state.seqs if not s.finished]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """The engine died: finish every request with an error."""
        outs = []
        for state in list(self.requests.values()):
            for seq in state.seqs:
                if not seq.finished:
                    seq.finish_reason, seq.error = "error", message
            outs.append(self._make_output(state, None))
        self.requests.clear()
        self._by_engine_id.clear()
        return outs

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs([], [])
        now = time.monotonic()
        for eo in outputs:
            entry = self._by_engine_id.get(eo.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, seq = entry
            if state.is_embedding:
                result.request_outputs.append(self._embedding_output(state, seq, eo))
                continue
            if eo.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                self._add_prompt_logprobs(state, eo.prompt_logprobs_start, eo.new_prompt_logprobs)
            if not eo.new_token_ids and not eo.finished:
                continue
            if eo.new_token_ids:
                if state.metrics.first_token_time is None:
                    state.metrics.first_token_time = now
                state.metrics.last_token_time = now
            if self._update_seq(seq, eo):
                result.abort_engine_ids.append(seq.engine_id)
            if eo.finished:
                state.num_cached_tokens = max(state.num_cached_tokens, eo.num_cached_tokens)
            if seq.finished:
                self._by_engine_id.pop(seq.engine_id, None)
            out = self._make_output(state, seq)
            if out is not None:
                result.request_outputs.append(out)
            if state.finished:
                state.metrics.finished_time = now
                self.requests.pop(state.request_id, None)
        return result

    def add_embedding_request(self, request_id: str, prompt: str | None,
                              prompt_token_ids: list[int],
                              arrival_time: float | None = None) -> EngineCoreRequest:
        """Register a request of an embedding model; its one output is an EmbeddingOutput."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        (req,) = self.add_request(request_id, prompt, prompt_token_ids, params, arrival_time)
        self.requests[request_id].is_embedding = True
        return req

    # --- internals ----------------------------------------------------------------------------

    def _embedding_output(self, state: RequestState, seq: SeqState,
                          eo: EngineCoreOutput) -> EmbeddingOutput:
        self._by_engine_id.pop(seq.engine_id, None)
        self.requests.pop(state.request_id, None)
        seq.finish_reason = str(eo.finish_reason)
        vector = [] if eo.pooled is None else eo.pooled.astype(np.float32).tolist()
        return EmbeddingOutput(state.request_id, state.prompt_token_ids, vector, eo.error)

    def _update_seq(self, seq: SeqState, eo: EngineCoreOutput) -> bool:
        """Apply one engine output; True if a stop string ended the sequence here (so the
        engine, which does not know, must be told to stop it)."""
        new_ids = eo.new_token_ids
        seq.token_ids.extend(new_ids)
        if eo.new_logprobs is not None and seq.logprobs is not None:
            self._add_logprobs(seq, eo.new_logprobs, len(new_ids))
        delta = ""
        if seq.detok is not None:
            delta = seq.detok.update(new_ids) if new_ids else ""
            if eo.finished:
                delta += seq.detok.flush()
        if seq.stop is None:
            seq.text += delta
        else:
            check = seq.stop.feed(delta)
            seq.text += check.text
            if not check.stopped and eo.finished:
                check = seq.stop.finish()
                seq.text += check.text
            if check.stopped:
                seq.finish_reason, seq.stop_reason = "stop", check.stop
                return not eo.finished
        if eo.finished:
            seq.finish_reason = str(eo.finish_reason)
            seq.stop_reason = eo.stop_reason
            seq.error = eo.error
        return False

    def _make_output(self, state: RequestState, seq: SeqState | None) -> RequestOutput | None:
        kind = state.params.output_kind
        finished = state.finished
        if kind == OutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == OutputKind.DELTA
        if delta and seq is not None:
            completions = [seq.completion(delta=True)]
        else:
            completions = [s.completion(delta=delta) for s in state.seqs]
        prompt_lp = state.prompt_logprobs
        if delta and state.prompt_logprobs_sent:
            prompt_lp = None
        state.prompt_logprobs_sent = True
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=state.num_cached_tokens,
            metrics=state.metrics,
        )

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
