"""Prompt inputs of the API (text, token ids, or a batch of either) to token ids, with the
context-length check that must hold before anything reaches the engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tidal.frontend.server.errors import bad_request

if TYPE_CHECKING:
    from tidal.frontend.server.state import ServerState


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # None: given as token ids


def split_prompts(value: Any, param: str, max_prompts: int) -> list[str | list[int]]:
    """One API prompt field -> a list of prompts (each text or token ids)."""
    if value is None:
        raise bad_request(f"{param} is required", param)
    if isinstance(value, str):
        prompts: list[str | list[int]] = [value]
    elif not value:
        raise bad_request(f"{param} is empty: give a string, a list of strings, token ids or "
                          "a list of token-id lists", param)
    elif all(isinstance(v, int) for v in value):
        prompts = [list(value)]
    elif all(isinstance(v, str) for v in value):
        prompts = list(value)
    elif all(isinstance(v, list) for v in value):
        prompts = list(value)
    else:
        raise bad_request(f"{param} mixes types: give a string, a list of strings, token ids or "
                          "a list of token-id lists", param)
    if len(prompts) > max_prompts:
        raise bad_request(f"{param} has {len(prompts)} prompts; the limit is {max_prompts} "
                          "per request", param)
    for p in prompts:
        if len(p) == 0:
            raise bad_request(f"{param} contains an empty prompt", param)
    return prompts


async def tokenize_prompts(state: ServerState, prompts: list[str | list[int]], param: str,
                           add_special_tokens: bool = True) -> list[Prompt]:
    vocab = state.engine.config.model.vocab_size
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids = await tokenize_text(state, p, add_special_tokens)
            out.append(Prompt(ids, p))
            continue
        bad = next((t for t in p if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} in {param} is outside the vocabulary [0, {vocab})",
                              param)
        out.append(Prompt(list(p), None))
    return out


async def tokenize_text(state: ServerState, text: str,
                        add_special_tokens: bool = True) -> list[int]:
    if add_special_tokens:
        return await state.engine.tokenize(text)
    tok = state.tokenizer
    if len(text) <= 2048:
        return list(tok.encode(text, add_special_tokens=False))
    loop = asyncio.get_running_loop()
    return list(await loop.run_in_executor(None, lambda: tok.encode(text,
                                                                   add_special_tokens=False)))


TRUNCATION_SIDES = ("left", "right")


def truncated(ids: list[int], req: Any, max_model_len: int) -> list[int]:
    """The prompt's token ids cut to the request's ``truncate_prompt_tokens`` (vLLM's): its
    last k tokens (``truncation_side`` "left", the default) or its first k ("right"); -1 is
    the model's context length; unset leaves the prompt whole. (The cut prompt must still
    leave room for the output: ``check_context``.)"""
    k = getattr(req, "truncate_prompt_tokens", None)
    side = getattr(req, "truncation_side", None)
    if side is not None and side not in TRUNCATION_SIDES:
        raise bad_request(f"truncation_side must be \"left\" or \"right\", got "
                          f"{str(side)[:20]!r}", "truncation_side")
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if not 1 <= k <= max_model_len:
        raise bad_request(f"truncate_prompt_tokens must be -1 (the context length) or 1 to "
                          f"{max_model_len}, got {k}", "truncate_prompt_tokens")
    if len(ids) <= k:
        return ids
    return ids[-k:] if side in (None, "left") else ids[:k]


def truncate_prompts(prompts: list[Prompt], req: Any, max_model_len: int) -> list[Prompt]:
    """``truncated`` of each prompt; a cut prompt's text is dropped (echo decodes the ids)."""
    out = []
    for p in prompts:
        ids = truncated(p.token_ids, req, max_model_len)
        out.append(p if ids is p.token_ids else Prompt(ids, None))
    return out


def check_context(n_prompt: int, max_tokens: int | None, max_model_len: int,
                  max_tokens_param: str = "max_tokens", prompt_param: str = "prompt") -> None:
    """A prompt and its completion must fit the model's context; the 400 gives both numbers."""
    if n_prompt >= max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                          f"the prompt has {n_prompt} tokens, which leaves no room to generate; "
                          "shorten the prompt", prompt_param, code="context_length_exceeded")
    if max_tokens is not None and n_prompt + max_tokens > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                          f"{n_prompt + max_tokens} were requested ({n_prompt} in the prompt + "
                          f"{max_tokens} in {max_tokens_param}); shorten the prompt or lower "
                          f"{max_tokens_param}", max_tokens_param, code="context_length_exceeded")
