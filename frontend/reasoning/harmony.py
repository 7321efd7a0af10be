"""The pieces of gpt-oss's harmony format that the ``gpt_oss`` reasoning parser and the
``openai`` tool parser share, written from the format's public description.

An assistant turn is a run of messages, each ``<|start|>assistant`` (left out for the first:
the generation prompt ends with it), a header, ``<|message|>``, the body and a terminator:
``<|end|>``, ``<|call|>`` (a tool call) or ``<|return|>`` (the last). The header names the
channel (``<|channel|>analysis`` for the chain of thought, ``commentary`` for tool calls and
preambles, ``final`` for the answer) and, for a tool call, the recipient
(``to=functions.NAME``, before or after the channel), maybe with ``<|constrain|>json``.

These markers are special tokens: the text holds them only when the output is detokenized
with ``skip_special_tokens: false``. ``<|call|>`` and ``<|return|>`` stop generation, so they
are usually missing at the end: the end of the text ends the last message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tidal.frontend.reasoning.text_stream import partial_suffix

START = "<|start|>"
CHANNEL = "<|channel|>"
MESSAGE = "<|message|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"

HEADER_STARTS = (START, CHANNEL)
# What ends a message body (a new <|start|> without an <|end|> first ends it too).
BODY_ENDS = (END, CALL, RETURN, START)

_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def find_first(text: str, markers: Iterable[str], pos: int) -> tuple[int, str]:
    """(index, marker) of the earliest of ``markers`` at or after ``pos``; (-1, "") if none."""
    best, found = -1, ""
    for marker in markers:
        i = text.find(marker, pos)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    return best, found


def held_back(text: str, pos: int, markers: Iterable[str]) -> int:
    """Characters at the end of ``text[pos:]`` that may still become one of ``markers``."""
    rest = text[pos:]
    return max((partial_suffix(rest, m) for m in markers), default=0)


def parse_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header; None where it names none."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return (channel.group(1) if channel else None, recipient.group(1) if recipient else None)


def call_header(recipient: str) -> str:
    """A tool call's header as the ``gpt_oss`` reasoning parser hands it on (one spelling, so
    the tool parser sees the same text whatever the model's header looked like)."""
    return f"{START}assistant{CHANNEL}commentary to={recipient}{MESSAGE}"


def leading_recipient(text: str, final: bool) -> bool | None:
    """Whether an output opens with a recipient (`` to=functions.f<|channel|>...``: the
    generation prompt's ``<|start|>assistant`` began that header); None: not known yet."""
    rest = text.lstrip()
    if rest.startswith("to="):
        return True
    if not final and "to=".startswith(rest):
        return None
    return False
