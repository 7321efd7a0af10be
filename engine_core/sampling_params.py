"""Per-request sampling parameters: a wire type, validated when built (and when decoded)."""

from __future__ import annotations

import enum
import json as _json
from typing import Any

import msgspec


class OutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the previous one
    FINAL_ONLY = 2  # one output, when the request finishes


# Hard ceilings that hold whatever the deployment; servers set tighter limits at their edge.
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # above any vocabulary in use
MAX_GRAMMAR_CHARS = 1 << 17  # a schema, regex or grammar, as text
MAX_CHOICES = 1024
MAX_THINKING_TOKENS = 1 << 31
MAX_LOGITS_PROCESSORS = 16


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Constrain the output: exactly one of a JSON schema (a dict or its JSON text), any JSON
    object, a regular expression, one of a list of strings, a grammar (Lark in llguidance's
    dialect, or GBNF), or a structural tag (free text with schema-constrained tagged
    sections: structured_output/spec.py). The engine compiles it (llguidance or xgrammar:
    ``backend``, or the engine's choice) and masks every sampled token to what the constraint
    allows; the request stops when the constraint is complete. A dict schema is turned into
    its JSON text when built (one form on the wire)."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None  # JSON text (structured_output/spec.py)
    # "guidance" | "xgrammar"; None: the engine's --structured-outputs-backend decides.
    backend: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in ("json", "regex", "choice", "grammar", "structural_tag")
                if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        _check(len(set_) == 1, "structured_outputs",
               f"needs exactly one of json, json_object, regex, choice, grammar, "
               f"structural_tag; got {', '.join(set_) or 'none'}")
        _check(self.backend in (None, "guidance", "xgrammar"), "structured_outputs.backend",
               f"must be guidance or xgrammar, got {str(self.backend)[:64]!r}")
        if isinstance(self.json, dict):
            self.json = _json.dumps(self.json, ensure_ascii=False)
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                _check(0 < len(value) <= MAX_GRAMMAR_CHARS, f"structured_outputs.{name}",
                       f"must be 1 to {MAX_GRAMMAR_CHARS} characters, got {len(value)}")
        if self.choice is not None:
            _check(0 < len(self.choice) <= MAX_CHOICES, "structured_outputs.choice",
                   f"must hold 1 to {MAX_CHOICES} strings, got {len(self.choice)}")
            _check(all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", "choices must be non-empty strings")
            _check(sum(map(len, self.choice)) <= MAX_GRAMMAR_CHARS, "structured_outputs.choice",
                   f"the choices hold more than {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        """json | json_object | regex | choice | grammar | structural_tag (metrics, the
        compile cache key)."""
        for name in ("json", "regex", "choice", "grammar", "structural_tag"):
            if getattr(self, name) is not None:
                return name
        return "json_object"


class SamplingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """How to sample one request. ``temperature == 0`` means greedy.

    ``top_k`` of 0 or -1 disables top-k. ``max_tokens=None`` generates until the model's context
    is full. ``logprobs=N`` returns the top-N log-probabilities of every sampled position plus the
    sampled token's own; ``prompt_logprobs=N`` does the same for the prompt tokens. Log-probabilities
    are those of the processed distribution: after the allowed_token_ids mask, logit bias,
    penalties, min_tokens masking and temperature (1.0 for greedy), before top-k/top-p/min-p
    truncation; prompt log-probabilities are those of the model's raw distribution.

    ``allowed_token_ids`` restricts sampling to those ids: every other logit is masked to -inf
    before anything else is applied.

    ``structured_outputs`` constrains the output to a grammar (``StructuredOutputsParams``):
    its next-token mask applies first of all, and the request stops where the grammar ends.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    # Constrained decoding (engine_core/structured_output); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None
    # With a reasoning parser (EngineArgs.reasoning_parser): after this many tokens of thinking
    # the engine forces the end of it (structured_output/reasoning_gate.py); None: no limit.
    thinking_token_budget: int | None = None
    # The output begins with the model's reasoning when the engine has a reasoning parser (a
    # chat reply): the grammar then applies after it. Set by the chat paths (chat completions,
    # Messages, Responses, ``LLM.chat``); a raw completion's output is all answer.
    reasoning_first: bool = False
    # Logits processors by entry-point name (group ``tidal.logits_processors``), applied in the
    # worker (worker/sample/logits_processors.py); only names travel, never callables.
    logits_processors: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        _check(1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}], got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            f"must be in [-2, 2], got {self.presence_penalty}",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            f"must be in [-2, 2], got {self.frequency_penalty}",
        )
        _check(
            0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            f"must be in (0, 10], got {self.repetition_penalty}",
        )
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(
                    0 <= value <= MAX_LOGPROBS, name, f"must be in [0, {MAX_LOGPROBS}], got {value}"
                )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            "stop",
            f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}",
        )
        _check(all(self.stop), "stop", "stop strings must be non-empty")
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "token ids must be >= 0",
        )
        if self.logit_bias is not None:
            _check(
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                "logit_bias",
                f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}",
            )
            for tok, bias in self.logit_bias.items():
                _check(tok >= 0, "logit_bias", f"token id must be >= 0, got {tok}")
                _check(
                    -100.0 <= bias <= 100.0,
                    "logit_bias",
                    f"bias must be in [-100, 100], got {bias} for token {tok}",
                )

        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0, "allowed_token_ids",
                   "must hold at least one token id (null allows every token)")
            _check(
                len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS,
                "allowed_token_ids",
                f"at most {MAX_ALLOWED_TOKEN_IDS} ids, got {len(self.allowed_token_ids)}",
            )
            _check(min(self.allowed_token_ids) >= 0, "allowed_token_ids",
                   "token ids must be >= 0")
        if self.logits_processors is not None:
            _check(len(self.logits_processors) <= MAX_LOGITS_PROCESSORS, "logits_processors",
                   f"at most {MAX_LOGITS_PROCESSORS} names, got {len(self.logits_processors)}")
            _check(all(isinstance(n, str) and 0 < len(n) <= 200 for n in self.logits_processors),
                   "logits_processors", "names must be non-empty strings of at most 200 "
                   "characters")
        if self.thinking_token_budget is not None:
            _check(0 <= self.thinking_token_budget <= MAX_THINKING_TOKENS,
                   "thinking_token_budget",
                   f"must be in [0, {MAX_THINKING_TOKENS}] (or -1 / null for no limit), got "
                   f"{self.thinking_token_budget}")
            # The forced end is the one token the mask allows: a whitelist without it would
            # leave nothing to sample.
            _check(self.allowed_token_ids is None, "thinking_token_budget",
                   "cannot be combined with allowed_token_ids")
        if self.structured_outputs is not None:
            # The grammar may leave only the end-of-sequence token allowed: banning it would
            # leave nothing to sample.
            _check(self.min_tokens == 0, "min_tokens",
                   "must be 0 with structured outputs (the grammar decides where output ends)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def max_vocab_id_used(self) -> int:
        """Largest token id this request mentions (checked against the vocabulary)."""
        ids = list(self.stop_token_ids)
        if self.logit_bias:
            ids.extend(self.logit_bias)
        if self.allowed_token_ids:
            ids.extend(self.allowed_token_ids)
        return max(ids, default=-1)

    def child(self, index: int) -> SamplingParams:
        """Parameters of the ``index``-th of ``n`` samples: n=1, and a distinct seed if seeded."""
        seed = None if self.seed is None else self.seed + index
        return msgspec.structs.replace(self, n=1, seed=seed)


class SamplingParamError(ValueError):
    """A sampling parameter is out of range; ``param`` names it (the API reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamError(param, message)
