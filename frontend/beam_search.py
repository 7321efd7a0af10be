"""Beam search on top of ordinary generation, as vLLM does it.

Every step extends each live beam by one token: the beams of all prompts go to the engine as one
batch of requests (prompt + beam tokens, ``max_tokens=1``, ``logprobs=2 * beam_width``), so the
engine schedules them together and its prefix cache serves the shared prefix; only the tail past
the last full block is recomputed. Each beam's top ``2 * beam_width`` tokens are its candidates.
A candidate that is an EOS token (unless ``ignore_eos``) is a finished sequence; the best
``beam_width`` others, by cumulative log-probability, are the next step's beams. When the search
ends, the finished sequences and the beams still open (``finish_reason="length"``) are ranked by

    score = cumulative_logprob / (seq_len ** length_penalty)

where ``seq_len`` counts the prompt and the generated tokens, without the EOS token (vLLM's
definition; Hugging Face counts the generated tokens only, which ranks the same whenever the
sequences compared are equally long). The best ``beam_width`` are returned, best first.

``early_stopping`` (Hugging Face's and vLLM V0's values):

* ``"never"`` (default; the result of vLLM's current beam search, which always runs
  ``max_tokens`` steps): stop only once no open beam can still rank among the best
  ``beam_width``, which never changes the result;
* ``True``: stop once ``beam_width`` sequences have finished;
* ``False``: stop once the best open beam, scored at its current length, ranks below the
  ``beam_width`` best finished ones (a heuristic: a later, longer sequence may have won).

``temperature`` scales the distribution the candidates are scored under (log-softmax of
``logits / temperature``; 0 means 1, the model's own distribution). The search itself is
deterministic: unlike vLLM, no token is sampled into the candidates.

:class:`BeamSearch` is one prompt's search state and does no I/O; ``LLM.beam_search`` drives it
with the offline engine, :class:`AsyncBeamSearchRun` with ``AsyncLLM`` (and the API server).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tidal.engine_core.sampling_params import (
    MAX_LOGPROBS,
    OutputKind,
    SamplingParamError,
    SamplingParams,
)
from tidal.frontend.detokenizer import create_detokenizer
from tidal.frontend.output_processor import OutputCollector
from tidal.frontend.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from tidal.frontend.prompt_inputs import parse_prompt, with_salt

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

EarlyStopping = bool | Literal["never"]
MAX_LENGTH_PENALTY = 10.0


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``, plus ``early_stopping``, ``logprobs`` (the top-N
    log-probabilities of each generated position, as ``SamplingParams.logprobs``) and
    ``skip_special_tokens`` (for the generated text)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: EarlyStopping = "never"
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check(self.beam_width >= 1, "beam_width", f"must be >= 1, got {self.beam_width}")
        _check(2 * self.beam_width <= MAX_LOGPROBS, "beam_width",
               f"must be <= {MAX_LOGPROBS // 2} (each beam takes 2 * beam_width candidates "
               f"from the top-{MAX_LOGPROBS} log-probabilities), got {self.beam_width}")
        _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature",
               f"must be a finite number >= 0, got {self.temperature}")
        # Bounded so that seq_len ** length_penalty stays a finite, non-zero float.
        _check(math.isfinite(self.length_penalty)
               and abs(self.length_penalty) <= MAX_LENGTH_PENALTY, "length_penalty",
               f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], got "
               f"{self.length_penalty}")
        _check(self.early_stopping in (True, False, "never")
               and isinstance(self.early_stopping, bool | str), "early_stopping",
               f"must be true, false or \"never\", got {self.early_stopping!r}")
        if self.logprobs is not None:
            _check(0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
                   f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def step_params(self) -> SamplingParams:
        """What each beam's one-token engine request runs with."""
        return SamplingParams(
            max_tokens=1,
            temperature=self.temperature,
            logprobs=max(2 * self.beam_width, self.logprobs or 0),
            # EOS is a candidate like any other here; the search decides what it ends.
            ignore_eos=True,
            output_kind=OutputKind.FINAL_ONLY,
        )


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned sequence, shaped as vLLM's: ``tokens`` and ``text`` cover the prompt too
    (``output_token_ids`` / ``output_text`` are the generated part alone)."""

    tokens: list[int]
    cum_logprob: float
    logprobs: list[PositionLogprobs] | None = None  # per generated position (params.logprobs)
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS), "length" or "abort"
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    output_text: str | None = None
    score: float = 0.0  # the length-penalised score it was ranked by

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at the first step


@dataclass(slots=True)
class Beam:
    """A beam or a finished candidate: its generated tokens (an EOS token included only with
    ``include_stop_str_in_output``) and their total log-probability."""

    tokens: list[int]
    cum_logprob: float
    length: int  # generated tokens counted by the length penalty (no EOS)
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None


def beam_score(cum_logprob: float, seq_len: int, length_penalty: float) -> float:
    """The length-penalised score beams are ranked by (``seq_len`` includes the prompt)."""
    return cum_logprob / (max(seq_len, 1) ** length_penalty)


class BeamSearch:
    """The search state of one prompt: which sequences to run next, and what their
    candidates make of the beams. Pure (no engine, no tokenizer)."""

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Sequence[int], max_model_len: int | None = None) -> None:
        self.prompt = list(prompt_token_ids)
        self.params = params
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.max_steps = params.max_tokens
        if max_model_len is not None:
            # The last step's request holds prompt + max_steps - 1 tokens and adds one.
            self.max_steps = max(0, min(self.max_steps, max_model_len - len(self.prompt)))
        self.live: list[Beam] = [Beam([], 0.0, 0, [] if params.logprobs is not None else None)]
        self.completed: list[Beam] = []
        self.steps = 0
        self.stopped_early = False
        self.aborted = False
        self.done = self.max_steps == 0
        self.num_cached_tokens = 0

    def score(self, beam: Beam) -> float:
        return beam_score(beam.cum_logprob, len(self.prompt) + beam.length,
                          self.params.length_penalty)

    def step_prompts(self) -> list[list[int]]:
        """The sequences to extend by one token this step (one per live beam)."""
        return [self.prompt + b.tokens for b in self.live]

    def advance(self, positions: Sequence[PositionLogprobs | None]) -> None:
        """Apply one step: ``positions[i]`` holds live beam ``i``'s next-token
        log-probabilities (None: the engine could not extend it; the beam is dropped)."""
        assert not self.done and len(positions) == len(self.live)
        width = self.params.beam_width
        top = 2 * width
        keep = self.params.logprobs
        candidates: list[Beam] = []
        for beam, pos in zip(self.live, positions):
            if pos is None:
                continue
            for tok, lp in pos.items():
                if lp.rank is None or lp.rank > top:
                    continue  # the sampled token, outside the top 2 * width
                cum = beam.cum_logprob + lp.logprob
                ends = tok in self.eos
                if ends and not self.params.include_stop_str_in_output:
                    # Returned without its EOS token (nor that position's log-probabilities).
                    self.completed.append(Beam(beam.tokens, cum, beam.length, beam.logprobs,
                                               "stop"))
                    continue
                lps = None if beam.logprobs is None else [*beam.logprobs, _trim(pos, tok, keep)]
                if ends:
                    self.completed.append(Beam([*beam.tokens, tok], cum, beam.length, lps, "stop"))
                else:
                    candidates.append(Beam([*beam.tokens, tok], cum, beam.length + 1, lps))
        # Beams of one prompt are equally long: the score orders them as cum_logprob does.
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.live = candidates[:width]
        self.steps += 1
        # The stop test first: a search that stops returns its finished sequences only (as
        # Hugging Face's does), also at the last step.
        if self.live and self._can_stop():
            self.done = self.stopped_early = True
        elif self.steps >= self.max_steps or not self.live:
            self.done = True

    def abort(self) -> None:
        """End the search now: the open beams finish with ``abort``."""
        if not self.done:
            self.done = self.aborted = True

    def _can_stop(self) -> bool:
        width = self.params.beam_width
        if len(self.completed) < width:
            return False
        mode = self.params.early_stopping
        if mode is True:
            return True
        lp = self.params.length_penalty
        worst = sorted((self.score(b) for b in self.completed), reverse=True)[width - 1]
        best_cum = self.live[0].cum_logprob
        cur_len = len(self.prompt) + self.live[0].length
        if mode is False or lp <= 0.0:
            # Log-probabilities only add up to less; with lp <= 0 a longer sequence scores
            # lower still, so the current length gives the best any open beam can reach.
            bound = beam_score(best_cum, cur_len, lp)
        else:
            bound = beam_score(best_cum, len(self.prompt) + self.max_steps, lp)
        return worst >= bound

    def best(self) -> list[Beam]:
        """The best ``beam_width`` sequences, best first."""
        pool = list(self.completed)
        if not self.stopped_early:
            reason = "abort" if self.aborted else "length"
            pool.extend(Beam(b.tokens, b.cum_logprob, b.length, b.logprobs, reason)
                         for b in self.live)
        pool.sort(key=self.score, reverse=True)
        return pool[:self.params.beam_width]

    def sequences(self, tokenizer: Any) -> list[BeamSearchSequence]:
        """The result in vLLM's shape; texts are decoded if there is a tokenizer."""
        out = []
        for b in self.best():
            seq = BeamSearchSequence(
                tokens=self.prompt + b.tokens, cum_logprob=b.cum_logprob, logprobs=b.logprobs,
                finish_reason=b.finish_reason, num_prompt_tokens=len(self.prompt),
                score=self.score(b))
            if tokenizer is not None:
                seq.text = tokenizer.decode(seq.tokens)
                seq.output_text = _output_text(tokenizer, self.prompt, b.tokens,
                                               self.params.skip_special_tokens)
            out.append(seq)
        return out


def _trim(pos: PositionLogprobs, chosen: int, top_n: int | None) -> PositionLogprobs:
    """What a returned position keeps: the chosen token and the top ``top_n``."""
    out = {chosen: pos[chosen]}
    for tok, lp in pos.items():
        if tok != chosen and lp.rank is not None and lp.rank <= (top_n or 0):
            out[tok] = lp
    return out


def _output_text(tokenizer: Any, prompt: list[int], tokens: list[int],
                 skip_special_tokens: bool) -> str:
    # As a streamed completion of the same tokens reads (the prompt's tail gives context).
    detok = create_detokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    return detok.update(tokens) + detok.flush()


def step_position(out: RequestOutput) -> PositionLogprobs | None:
    """The next-token log-probabilities in a step request's output (None if it has none)."""
    c = out.outputs[0] if out.outputs else None
    if c is None or not c.logprobs or c.finish_reason in ("abort", "error"):
        return None
    return c.logprobs[0]


def check_beam_width(params: BeamSearchParams, max_logprobs: int) -> None:
    """The engine's own log-probability limit bounds the width (``SamplingParamError``)."""
    needed = max(2 * params.beam_width, params.logprobs or 0)
    if needed > max_logprobs:
        param = "beam_width" if 2 * params.beam_width > max_logprobs else "logprobs"
        raise SamplingParamError(param, f"needs {needed} log-probabilities per step but this "
                                 f"engine's limit (max_logprobs) is {max_logprobs}; "
                                 f"beam_width can be at most {max_logprobs // 2}")


def request_output(request_id: str, search: BeamSearch, prompt_text: str | None,
                   tokenizer: Any) -> RequestOutput:
    """A finished search as ``AsyncLLM`` outputs read: one completion per returned beam."""
    outputs = [
        CompletionOutput(index=i, text=s.output_text or "", token_ids=s.output_token_ids,
                         cumulative_logprob=s.cum_logprob, logprobs=s.logprobs,
                         finish_reason=s.finish_reason, stop_reason=s.stop_reason)
        for i, s in enumerate(search.sequences(tokenizer))
    ]
    return RequestOutput(request_id=request_id, prompt=prompt_text,
                         prompt_token_ids=search.prompt, outputs=outputs, finished=True,
                         num_cached_tokens=search.num_cached_tokens)


class _Aborted(Exception):
    """Wakes the step's wait when the run is aborted."""


@dataclass(slots=True, eq=False)
class AsyncBeamSearchRun:
    """Runs the searches of one request (one per prompt) on ``AsyncLLM``, one engine step per
    search step, all their beams in one batch. ``abort()`` ends it early (the open beams finish
    with ``abort``); cancelling ``run()`` stops its engine requests."""

    engine: AsyncLLM
    request_id: str
    searches: list[BeamSearch]
    cache_salt: str | None = None
    aborted: bool = False
    _collector: OutputCollector = field(default_factory=OutputCollector)
    _open: set[str] = field(default_factory=set)
    _step: int = 0

    @property
    def num_steps(self) -> int:
        """Engine steps started so far."""
        return self._step

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            for s in self.searches:
                s.abort()
            self.close()
            self._collector.fail(_Aborted())

    def close(self) -> None:
        """Stop whatever this run still has in the engine."""
        if self._open:
            open_ids, self._open = list(self._open), set()
            self.engine.abort_quietly(open_ids)

    async def run(self, on_step: Callable[[], None] | None = None) -> None:
        """Search until every prompt's search is done; ``on_step`` after each step."""
        try:
            while not self.aborted:
                live = [s for s in self.searches if not s.done]
                if not live:
                    return
                if not await self._run_step(live):
                    return
                if on_step is not None:
                    on_step()
        finally:
            self.close()

    async def _run_step(self, live: list[BeamSearch]) -> bool:
        from tidal.frontend.async_llm import RequestFailedError

        ids: list[list[str]] = []
        for k, search in enumerate(live):
            params = search.params.step_params()
            row = []
            for i, tokens in enumerate(search.step_prompts()):
                rid = f"{self.request_id}/beam{self._step}.{k}.{i}"
                await self.engine.add_request(rid, tokens, params, collector=self._collector,
                                              cache_salt=self.cache_salt)
                self._open.add(rid)
                row.append(rid)
            ids.append(row)
        self._step += 1
        results: dict[str, RequestOutput] = {}
        while self._open:
            try:
                outs = self._collector.take() or await self._collector.get()
            except _Aborted:
                return False
            for out in outs:
                assert isinstance(out, RequestOutput)
                c = out.outputs[0] if out.outputs else None
                if c is not None and c.finish_reason == "error" and c.error is not None:
                    raise RequestFailedError(c.error)
                if out.finished:
                    self._open.discard(out.request_id)
                    results[out.request_id] = out
        for search, row in zip(live, ids):
            if search.steps == 0 and row:
                search.num_cached_tokens = results[row[0]].num_cached_tokens
            search.advance([step_position(results[rid]) for rid in row])
        return True


async def beam_search_stream(engine: AsyncLLM, prompt: object, params: BeamSearchParams,
                             request_id: str, cache_salt: str | None = None
                             ) -> AsyncIterator[RequestOutput]:
    """``AsyncLLM.beam_search``: one output, when the search has finished (``abort`` ends it
    early, its open beams with finish reason ``abort``)."""
    parsed = parse_prompt(prompt)
    salt = with_salt(parsed, cache_salt)
    ids = parsed.token_ids
    if ids is None:
        assert parsed.text is not None
        if engine.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (this engine was started with "
                             "skip_tokenizer_init)")
        ids = await engine.tokenize(parsed.text)
    config = engine.config
    check_beam_width(params, config.runner.max_logprobs)
    from tidal.engine_core.validation import validate_request

    validate_request(ids, params.step_params(), config)
    if request_id in engine.beam_searches:
        raise ValueError(f"request id {request_id!r} is already in use")
    search = BeamSearch(ids, params, config.model.eos_token_ids, config.model.max_model_len)
    run = AsyncBeamSearchRun(engine, request_id, [search], salt)
    engine.beam_searches[request_id] = run
    try:
        await run.run()
    finally:
        engine.beam_searches.pop(request_id, None)
    yield request_output(request_id, search, parsed.text, engine.tokenizer)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)


__all__ = [
    "AsyncBeamSearchRun",
    "Beam",
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "beam_score",
]
