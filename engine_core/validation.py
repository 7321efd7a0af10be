"""Checks a request must pass before it may reach the scheduler.

Frontends call this before sending (so validation errors never reach the engine); the EngineCore
calls it again on arrival, so a buggy or hostile frontend can fail only its own request.
"""

from __future__ import annotations

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.sampling_params import SamplingParamError, SamplingParams


class RequestValidationError(ValueError):
    """A request is invalid; ``param`` names the offending field, as OpenAI's API reports it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def validate_request(
    prompt_token_ids: list[int], params: SamplingParams, config: EngineConfig,
    check_grammar: bool = True,
) -> None:
    """``check_grammar``: also check that a structured-outputs spec compiles (frontends do; the
    EngineCore compiles it off its loop instead, failing that request alone)."""
    max_len = config.model.max_model_len
    vocab = config.model.vocab_size
    n = len(prompt_token_ids)
    if n == 0:
        raise RequestValidationError("the prompt is empty: give at least one token", "prompt")
    # Generation needs one free position for its first new token; an encoder's does not.
    if n > max_len or (n == max_len and config.model.task == "generate"):
        raise RequestValidationError(
            f"the prompt has {n} tokens but the model's context (max_model_len) is {max_len} "
            "tokens, which leaves no room to generate: shorten the prompt",
            "prompt",
        )
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestValidationError(
            f"token id {bad} in the prompt is outside the vocabulary [0, {vocab})", "prompt"
        )
    top = params.max_vocab_id_used()
    if top >= vocab:
        if top in params.stop_token_ids:
            where = "stop_token_ids"
        elif params.logit_bias and top in params.logit_bias:
            where = "logit_bias"
        else:
            where = "allowed_token_ids"
        raise RequestValidationError(
            f"token id {top} in {where} is outside the vocabulary [0, {vocab})", where
        )
    if params.structured_outputs is not None and check_grammar:
        from tidal.engine_core.structured_output.spec import validate

        try:
            # With the backend this engine would compile it with (spec.choose_backend).
            validate(params.structured_outputs, config.scheduler.structured_outputs_backend)
        except SamplingParamError as exc:
            raise RequestValidationError(str(exc), exc.param) from None
    limit = config.runner.max_logprobs
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limit:
            raise RequestValidationError(
                f"{name}={value} exceeds this server's limit of {limit}", name
            )
    if params.logits_processors:
        _check_logits_processors(params.logits_processors)
    if config.speculative is not None:
        _check_speculative(params)


def _check_logits_processors(names: list[str]) -> None:
    # Only installed entry points (never import strings: a request must not make the worker
    # import an arbitrary module).
    from tidal.engine_core.plugins import LOGITS_PROCESSORS, plugin_names

    known = plugin_names(LOGITS_PROCESSORS)
    for name in names:
        if name not in known:
            shown = name if len(name) <= 100 else name[:100] + "..."
            raise RequestValidationError(
                f"unknown logits processor {shown!r}; this server has "
                f"{', '.join(known) or 'none'} (entry points of {LOGITS_PROCESSORS})",
                "logits_processors")


def _check_speculative(params: SamplingParams) -> None:
    """What speculative decoding does not combine with yet: refused, never run inexactly."""
    if params.logits_processors:
        raise RequestValidationError(
            "logits_processors are not supported yet with speculative decoding "
            "(--speculative-config)", "logits_processors")


__all__ = ["RequestValidationError", "SamplingParamError", "validate_request"]
