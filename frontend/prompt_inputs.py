"""The prompt forms ``LLM`` and ``AsyncLLM`` take, as vLLM spells them.

A prompt is text, a list of token ids, or a dict: ``{"prompt": "text"}`` or
``{"prompt_token_ids": [...]}`` (with an optional ``"prompt"`` too: the text those ids stand for,
reported back in the output), each with an optional ``"cache_salt"`` that keeps the request's
prefix-cache blocks apart from requests with another (or no) salt. Keys this engine does not
implement (``multi_modal_data``, ``mm_processor_kwargs``, ...) are an error naming the key, never
silently dropped.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")

# What a caller may pass as one prompt.
PromptType = str | Sequence[int] | Mapping[str, Any]


@dataclass(slots=True, frozen=True)
class ParsedPrompt:
    text: str | None  # the text, if given (tokenized unless token_ids is given too)
    token_ids: list[int] | None  # None: tokenize ``text``
    cache_salt: str | None = None


def parse_prompt(prompt: object) -> ParsedPrompt:
    """One prompt in any accepted form; ``ValueError`` says what is wrong with it."""
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, Mapping):
        return _parse_dict(prompt)
    if isinstance(prompt, list | tuple):
        return ParsedPrompt(None, _token_ids(prompt, "a token-id prompt"))
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict with "
                     f"'prompt' or 'prompt_token_ids', got {type(prompt).__name__}")


def parse_prompts(prompts: object) -> list[ParsedPrompt]:
    """One prompt or a batch of them (a list of ints is one token-id prompt)."""
    if isinstance(prompts, str | Mapping):
        return [parse_prompt(prompts)]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got "
                         f"{type(prompts).__name__}")
    items = list(prompts)
    if items and all(_is_int(t) for t in items):
        return [parse_prompt(items)]
    out = []
    for i, p in enumerate(items):
        try:
            out.append(parse_prompt(p))
        except ValueError as exc:
            raise ValueError(f"prompt {i}: {exc}") from None
    return out


def with_salt(parsed: ParsedPrompt, cache_salt: str | None) -> str | None:
    """The salt of a request given both a prompt dict and a ``cache_salt=`` argument."""
    if cache_salt is None:
        return parsed.cache_salt
    if parsed.cache_salt is not None and parsed.cache_salt != cache_salt:
        raise ValueError("the prompt's 'cache_salt' differs from the cache_salt argument; "
                         "give one of them")
    return cache_salt


def _parse_dict(d: Mapping[str, Any]) -> ParsedPrompt:
    for key in d:
        if key not in PROMPT_KEYS:
            shown = repr(key)[:60]
            raise ValueError(f"unsupported prompt key {shown}: this engine takes "
                             f"{', '.join(repr(k) for k in PROMPT_KEYS)}")
    text = d.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
    ids = None
    if d.get("prompt_token_ids") is not None:
        ids = _token_ids(d["prompt_token_ids"], "'prompt_token_ids'")
    elif text is None:
        raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
    salt = d.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"'cache_salt' must be a string, got {type(salt).__name__}")
    return ParsedPrompt(text, ids, salt)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(value: object, what: str) -> list[int]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a list of token ids, got {type(value).__name__}")
    ids = list(value)
    bad = next((t for t in ids if not _is_int(t)), None)
    if bad is not None:
        raise ValueError(f"{what} must hold integers only, got {type(bad).__name__}")
    return [int(t) for t in ids]
