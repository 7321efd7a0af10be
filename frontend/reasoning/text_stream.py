"""Small pieces shared by the streaming parsers: held-back tag prefixes and whitespace."""

from __future__ import annotations

from dataclasses import dataclass


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``: those
    characters may still become the tag, so a stream holds them back."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(slots=True)
class Stripper:
    """Streams ``str.strip()`` of everything fed: leading whitespace is dropped, a trailing run
    of whitespace is held until more text shows it was inner, and dropped at the end."""

    started: bool = False
    held: str = ""

    def feed(self, text: str) -> str:
        if not text:
            return ""
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        body = text.rstrip()
        self.held = text[len(body):]
        return body
