"""A reasoning model's thinking, followed token by token in the EngineCore.

With ``--reasoning-parser NAME`` a request that has a grammar, or a thinking budget, gets a
gate: while the model thinks it samples unconstrained and its grammar matcher is left alone;
once the end marker (``</think>``) is generated, the matcher starts from the token after it. A
thinking budget ends the thinking by forcing the format's end sequence ("\\n</think>\\n\\n"):
each forced token is the only one the next-token mask allows, so forcing rides on the bitmask
the step already carries (built, like any constrained request's mask, once the previous token
is known, so the count of thinking tokens is exact). Under speculative decoding the drafts are
followed on a ``fork`` of the gate, one mask per verify position.

The markers come from ``tidal.engine_core.reasoning_formats`` (the frontend's parsers use the
same table) tokenized by the engine's tokenizer, and are matched as token-id sequences: a model
that spells ``</think>`` with other tokens than the tokenizer does is not seen ending.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tidal.engine_core.reasoning_formats import ReasoningFormat

logger = logging.getLogger(__name__)

# Phases of a gate.
AWAIT = "await"  # the first token decides: the start marker opens reasoning, else it is answer
REASONING = "reasoning"
FORCING = "forcing"  # the budget ran out: the forced end sequence is being written
ANSWER = "answer"

# A marker at the prompt's end may be followed by this many tokens of whitespace (Qwen3's
# template with enable_thinking false ends "<think>\n\n</think>\n\n").
_PROMPT_TAIL = 8


def _rfind(ids: Sequence[int], marker: tuple[int, ...]) -> int:
    n = len(marker)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i:i + n]) == marker:
            return i
    return -1


def _set_bit(row: np.ndarray, token: int) -> None:
    words = row.view(np.uint32)
    words[token >> 5] |= np.uint32(1 << (token & 31))


@dataclass(slots=True, frozen=True)
class ReasoningMarkers:
    """A format's markers as token ids of this engine's tokenizer."""

    fmt: ReasoningFormat
    start: tuple[int, ...]
    end: tuple[int, ...]
    forced: tuple[int, ...]
    blank: Callable[[list[int]], bool]  # whether ids decode to whitespace only

    @classmethod
    def from_tokenizer(cls, fmt: ReasoningFormat, tokenizer: Any) -> ReasoningMarkers:
        def ids(text: str) -> tuple[int, ...]:
            out = tuple(tokenizer.encode(text, add_special_tokens=False))
            if not out:
                raise ValueError(f"the tokenizer encodes the {fmt.name} marker {text!r} to "
                                 "no tokens")
            return out

        def blank(tokens: list[int]) -> bool:
            return not tokens or not tokenizer.decode(tokens).strip()

        markers = cls(fmt, ids(fmt.start), ids(fmt.end), ids(fmt.forced_end), blank)
        logger.info("reasoning markers of %s: start %s, end %s, forced end %s", fmt.name,
                    markers.start, markers.end, markers.forced)
        return markers

    @property
    def opens_in_output(self) -> bool:
        """The output's first token tells whether there is reasoning at all (a one-token start
        marker and a format whose reasoning is not implied). A longer start marker is treated
        as implied, as vLLM does: the grammar waits for the end marker."""
        return not self.fmt.implicit_start and len(self.start) == 1

    def prompt_phase(self, prompt: Sequence[int]) -> str:
        """Where the output starts. The prompt ended the thinking when it ends with the end
        marker plus whitespace (Qwen3's ``enable_thinking: false``); it opened the thinking
        when it ends with the start marker plus whitespace (DeepSeek-R1's template). Only the
        prompt's last tokens count: an earlier turn's closed thinking says nothing about this
        one (vLLM looks for an end marker after the last start marker anywhere in the prompt,
        which a multi-turn history with kept reasoning fools)."""
        tail = list(prompt[-(max(len(self.start), len(self.end)) + _PROMPT_TAIL):])
        for marker, phase in ((self.end, ANSWER), (self.start, REASONING)):
            i = _rfind(tail, marker)
            if i >= 0 and self.blank(tail[i + len(marker):]):
                return phase
        return AWAIT if self.opens_in_output else REASONING


@dataclass(slots=True)
class ReasoningGate:
    """One request's place in its reasoning (engine loop only)."""

    markers: ReasoningMarkers
    budget: int | None  # thinking tokens before the end is forced; None: no limit
    phase: str
    thinking: int = 0  # tokens generated inside the reasoning
    forced: int = 0  # tokens of the forced end written so far
    recent: list[int] = field(default_factory=list)  # the last tokens, for the end marker

    @classmethod
    def start(cls, markers: ReasoningMarkers, prompt: Sequence[int],
              budget: int | None) -> ReasoningGate:
        gate = cls(markers, budget, markers.prompt_phase(prompt))
        gate._check_budget()
        return gate

    @property
    def grammar_applies(self) -> bool:
        """The grammar's mask is part of the next token's mask (in AWAIT together with the
        start marker: the first token either opens the reasoning or begins the answer)."""
        return self.phase in (AWAIT, ANSWER)

    def needs_mask(self, has_grammar: bool) -> bool:
        return self.phase == FORCING or (has_grammar and self.grammar_applies)

    def shape_mask(self, row: np.ndarray) -> None:
        """Adjust ``row`` (int32 words: the grammar's mask, or all ones) to this phase."""
        if self.phase == AWAIT:
            _set_bit(row, self.markers.start[0])
        elif self.phase == FORCING:
            row[:] = 0
            _set_bit(row, self.markers.forced[self.forced])

    def allows(self, token: int) -> bool | None:
        """Whether this phase's mask allows ``token`` on its own (True / False), or None when
        the grammar's mask decides (the answer; the first token, unless it opens reasoning)."""
        phase = self.phase
        if phase == REASONING:
            return True
        if phase == FORCING:
            return token == self.markers.forced[self.forced]
        if phase == AWAIT and token == self.markers.start[0]:
            return True
        return None

    def fork(self) -> ReasoningGate:
        """A copy to follow draft tokens on (speculative decoding), leaving this one as is."""
        return replace(self, recent=list(self.recent))

    def feed(self, tokens: Sequence[int]) -> list[int]:
        """Follow the request's new output tokens; returns those its grammar must consume (the
        ones after the reasoning)."""
        m = self.markers
        for i, token in enumerate(tokens):
            phase = self.phase
            if phase == ANSWER:
                return list(tokens[i:])
            if phase == AWAIT:
                if token != m.start[0]:
                    self.phase = ANSWER
                    return list(tokens[i:])
                self.phase = REASONING
            elif phase == FORCING:
                self.forced += 1
                if self.forced == len(m.forced):
                    self.phase = ANSWER
                continue
            else:
                self.thinking += 1
                recent = self.recent
                recent.append(token)
                if len(recent) > len(m.end):
                    del recent[0]
                if tuple(recent) == m.end:
                    self.phase = ANSWER
                    continue
            self._check_budget()
        return []

    def _check_budget(self) -> None:
        if self.phase == REASONING and self.budget is not None and self.thinking >= self.budget:
            self.phase = FORCING
            self.forced = 0
