"""The Responses API's ``truncation: "auto"``: a conversation (chained by
``previous_response_id``, or sent whole) that with the requested output does not fit the
model's context drops its oldest turns until it does.

What stays: the instructions and the system / developer messages the conversation opens with,
then the latest turns whole. A turn starts at a user message (with the system / developer
messages right before it: a follow-up's own instructions stay with its question), so a dropped
turn takes its assistant answers, tool calls and tool results with it and no tool result is
left without its call. The fewest turns are dropped: the cut is found by bisection over the turn starts, one
chat-template render per probe. If even the last turn alone does not fit, the request is the
400 it would be without truncation (the prompt of that last turn named). What is stored for a
follow-up is the whole conversation: the next response truncates it again for itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

Render = Callable[[list[dict[str, Any]]], Awaitable[list[int]]]

MODES = ("auto", "disabled")
_PINNED_ROLES = ("system", "developer")


def fits(n_prompt: int, max_tokens: int | None, max_model_len: int) -> bool:
    """Whether a prompt of ``n_prompt`` tokens leaves room for the output (as
    ``prompts.check_context`` decides)."""
    return n_prompt < max_model_len and (max_tokens is None
                                         or n_prompt + max_tokens <= max_model_len)


def turn_starts(messages: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """``(pinned, starts)``: how many leading messages are pinned (system / developer), and
    the indices after them where a turn starts that a cut may begin at: a user message, or the
    system / developer messages right before one (the first turn's start excluded: cutting
    there drops nothing)."""
    pinned = 0
    while pinned < len(messages) and messages[pinned].get("role") in _PINNED_ROLES:
        pinned += 1
    starts = []
    for i in range(pinned + 1, len(messages)):
        if messages[i].get("role") != "user":
            continue
        start = i
        while start > pinned and messages[start - 1].get("role") in _PINNED_ROLES:
            start -= 1
        if start > pinned and (not starts or start > starts[-1]):
            starts.append(start)
    return pinned, starts


async def truncate(messages: list[dict[str, Any]], ids: list[int], render: Render,
                   max_tokens: int | None,
                   max_model_len: int) -> tuple[list[dict[str, Any]], list[int], int]:
    """``(messages, ids, dropped)``: ``messages`` (rendered as ``ids``) with the fewest oldest
    turns dropped for the prompt and ``max_tokens`` to fit ``max_model_len``; unchanged
    (``dropped`` 0) if they fit already or no turn can go. The shortest candidate is returned
    if none fits (its context error is the caller's 400)."""
    if fits(len(ids), max_tokens, max_model_len):
        return messages, ids, 0
    pinned, starts = turn_starts(messages)
    if not starts or (max_tokens is not None and max_tokens >= max_model_len):
        return messages, ids, 0  # nothing can go, or no cut could leave room for the output

    rendered: dict[int, list[int]] = {}

    async def probe(start: int) -> tuple[list[dict[str, Any]], list[int], int]:
        candidate = messages[:pinned] + messages[start:]
        if start not in rendered:
            rendered[start] = await render(candidate)
        return candidate, rendered[start], start - pinned

    # Bisection over the turn starts: dropping more turns never makes the prompt longer.
    lo, hi = 0, len(starts) - 1
    best: tuple[list[dict[str, Any]], list[int], int] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        candidate = await probe(starts[mid])
        if fits(len(candidate[1]), max_tokens, max_model_len):
            best = candidate
            hi = mid - 1
        else:
            lo = mid + 1
    return best if best is not None else await probe(starts[-1])
