"""What the structured-output manager needs from a grammar backend (llguidance, xgrammar).

A backend is built once per engine, in a compile thread, from the model config (it loads the
tokenizer and builds its token tables). ``compile`` turns a request's spec into a template
matcher at the grammar's start; the manager caches templates and hands each sequence its own
``deep_copy``. ``fill`` writes a batch of next-token masks into one int32 array laid out the
same for every backend: row i, bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed,
``words = ceil(model vocab / 32)`` (the logits' width, not the tokenizer's length: ids the
tokenizer lacks are never allowed). worker/sample/grammar_mask.py applies it unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

    from tidal.engine_core.sampling_params import StructuredOutputsParams


class Matcher(Protocol):
    """One sequence's grammar state (llguidance's ``LLMatcher`` has this shape already)."""

    def consume_tokens(self, tokens: list[int]) -> bool: ...  # False: a token was rejected
    # How many of ``tokens``, from the first, would be accepted (the state is unchanged).
    def validate_tokens(self, tokens: list[int]) -> int: ...
    # Undo the last ``num_tokens`` consumed (speculative decoding's per-draft masks).
    def rollback(self, num_tokens: int) -> None: ...
    def is_stopped(self) -> bool: ...  # the grammar ended (end-of-sequence consumed)
    def get_error(self) -> str: ...
    def deep_copy(self) -> Matcher: ...


class GrammarBackend(Protocol):
    name: str  # "guidance" | "xgrammar"
    vocab_size: int  # the model's (the logits' width)
    words: int  # int32 words per mask row: ceil(vocab_size / 32)

    def compile(self, params: StructuredOutputsParams) -> Matcher:
        """A template matcher for ``params``; raises ValueError (the reason) when the spec
        does not compile with this backend."""
        ...

    def advance(self, steps: list[tuple[Matcher, int]]) -> list[bool]:
        """Each matcher consumes its token; whether each took it (``consume_tokens``)."""
        ...

    def fill(self, matchers: list[Matcher], out: np.ndarray) -> None:
        """Row i of ``out`` (int32 [len(matchers), words]) = matchers[i]'s next-token mask;
        a matcher that stopped or refused a token (``advance``) gets a mask too."""
        ...
