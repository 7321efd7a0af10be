"""``--speculative-config``: which speculative decoding to run, in vLLM's field names.

Parsed and validated once (``SpeculativeConfig.parse``) into a frozen struct that is part of the
``EngineConfig`` (a msgspec struct like the config's other parts: the config travels to the
EngineCore process and the workers as it is).

Methods: ``ngram`` (prompt lookup: the draft is what followed the latest earlier occurrence of the
sequence's last n tokens). ``draft_model``, ``eagle3`` and ``mtp`` are known names but not built
yet; they are refused rather than silently run as something else.

Acceptance (``rejection_sample_method``): ``standard`` keeps the target model's distribution
exactly (greedy: argmax match; sampled: accept / resample from the residual). ``synthetic``
accepts draft tokens at a configured rate whatever the logits, for measuring the speed envelope
(with random-weight models): its output is the drafts', not the target model's.
"""

from __future__ import annotations

from typing import Any

import msgspec

MAX_SPECULATIVE_TOKENS = 8
MAX_PROMPT_LOOKUP = 64
_METHODS = ("ngram",)
_NOT_YET = ("draft_model", "eagle3", "mtp", "eagle", "medusa", "mlp_speculator", "suffix")
_REJECTION_METHODS = ("standard", "synthetic")
_KNOWN = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
          "rejection_sample_method", "synthetic_acceptance_rate",
          "synthetic_acceptance_rates", "synthetic_acceptance_length")


class SpeculativeConfigError(ValueError):
    """The speculative config is invalid; the message names the field."""


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 1
    rejection_sample_method: str = "standard"
    # Synthetic acceptance: per draft position i, the probability that draft i is accepted
    # given drafts 0..i-1 were (resolved from whichever synthetic_* field was given).
    synthetic_conditional_rates: tuple[float, ...] = ()

    @property
    def synthetic(self) -> bool:
        return self.rejection_sample_method == "synthetic"

    def describe(self) -> str:
        text = f"method {self.method}, {self.num_speculative_tokens} speculative tokens"
        if self.method == "ngram":
            text += f", prompt lookup n-grams {self.prompt_lookup_min}..{self.prompt_lookup_max}"
        if self.synthetic:
            rates = ", ".join(f"{r:.3f}" for r in self.synthetic_conditional_rates)
            text += (f", SYNTHETIC acceptance (per-position conditional rates {rates}): outputs "
                     "are the drafts', not the model's; for speed measurements only")
        else:
            text += ", standard rejection sampling (the target's distribution exactly)"
        return text

    @classmethod
    def parse(cls, raw: dict[str, Any] | None) -> SpeculativeConfig | None:
        """The config from ``--speculative-config``'s JSON object; None when not given."""
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - set(_KNOWN))
        if unknown:
            raise SpeculativeConfigError(
                f"--speculative-config: unknown field(s) {', '.join(unknown)} (known: "
                f"{', '.join(_KNOWN)})")
        method = raw.get("method")
        if method in _NOT_YET:
            raise SpeculativeConfigError(
                f"--speculative-config: method {method!r} is not yet implemented in tidal "
                f"(available: {', '.join(_METHODS)})")
        if method not in _METHODS:
            raise SpeculativeConfigError(
                f"--speculative-config: method must be one of {', '.join(_METHODS)}, "
                f"got {method!r}")
        k = _int(raw, "num_speculative_tokens", None)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise SpeculativeConfigError(
                f"--speculative-config: num_speculative_tokens must be in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        # As vLLM: one bound given stands for both; neither means 5.
        lo_raw, hi_raw = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
        lo = _int(raw, "prompt_lookup_min", hi_raw if hi_raw is not None else 5)
        hi = _int(raw, "prompt_lookup_max", lo_raw if lo_raw is not None else 5)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise SpeculativeConfigError(
                    f"--speculative-config: {name} must be in [1, {MAX_PROMPT_LOOKUP}], "
                    f"got {value}")
        if lo > hi:
            raise SpeculativeConfigError(
                f"--speculative-config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max "
                f"({hi})")
        rejection = raw.get("rejection_sample_method", "standard")
        if rejection not in _REJECTION_METHODS:
            raise SpeculativeConfigError(
                "--speculative-config: rejection_sample_method must be one of "
                f"{', '.join(_REJECTION_METHODS)}, got {rejection!r}")
        synthetic_fields = [n for n in _KNOWN if n.startswith("synthetic_") and n in raw]
        rates: tuple[float, ...] = ()
        if rejection == "synthetic":
            rates = _synthetic_rates(raw, synthetic_fields, k)
        elif synthetic_fields:
            raise SpeculativeConfigError(
                f"--speculative-config: {synthetic_fields[0]} needs rejection_sample_method "
                "'synthetic'")
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo,
                   prompt_lookup_max=hi, rejection_sample_method=rejection,
                   synthetic_conditional_rates=rates)


def _int(raw: dict[str, Any], name: str, default: int | None) -> int:
    value = raw.get(name, default)
    if value is None:
        raise SpeculativeConfigError(f"--speculative-config: {name} is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculativeConfigError(f"--speculative-config: {name} must be an integer, "
                                     f"got {value!r}")
    return value


def _synthetic_rates(raw: dict[str, Any], given: list[str], k: int) -> tuple[float, ...]:
    """Per-position conditional acceptance rates from exactly one of: a rate alpha (each draft
    accepted with probability alpha), vLLM's per-position unconditional rates, or vLLM's mean
    acceptance length."""
    if len(given) != 1:
        raise SpeculativeConfigError(
            "--speculative-config: rejection_sample_method 'synthetic' needs exactly one of "
            "synthetic_acceptance_rate, synthetic_acceptance_rates, synthetic_acceptance_length"
            f" (got {', '.join(given) or 'none'})")
    name = given[0]
    value = raw[name]
    if name == "synthetic_acceptance_rate":
        alpha = _float(value, name)
        if not 0.0 <= alpha <= 1.0:
            raise SpeculativeConfigError(
                f"--speculative-config: {name} must be in [0, 1], got {alpha}")
        return (alpha,) * k
    if name == "synthetic_acceptance_length":
        length = _float(value, name)
        if not 1.0 <= length <= k + 1:
            raise SpeculativeConfigError(
                f"--speculative-config: {name} must be in [1, {k + 1}], got {length}")
        # The least-variance schedule: the first drafts always, one fractional, then none.
        whole = int(length - 1.0)
        frac = (length - 1.0) - whole
        unconditional = [1.0] * whole + [frac] + [0.0] * k
        return _conditional(unconditional[:k])
    if not isinstance(value, list) or len(value) != k:
        raise SpeculativeConfigError(
            f"--speculative-config: {name} must be a list of num_speculative_tokens ({k}) "
            f"numbers, got {value!r}")
    rates = [_float(v, name) for v in value]
    if any(not 0.0 <= r <= 1.0 for r in rates) or any(
            b > a for a, b in zip(rates, rates[1:])):
        raise SpeculativeConfigError(
            f"--speculative-config: {name} must be non-increasing numbers in [0, 1], "
            f"got {rates}")
    return _conditional(rates)


def _conditional(unconditional: list[float]) -> tuple[float, ...]:
    """P(draft i accepted | drafts < i accepted) from P(drafts 0..i all accepted)."""
    out, prev = [], 1.0
    for r in unconditional:
        out.append(r / prev if prev > 0 else 0.0)
        prev = r
    return tuple(out)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpeculativeConfigError(f"--speculative-config: {name} must be a number, "
                                     f"got {value!r}")
    return float(value)
