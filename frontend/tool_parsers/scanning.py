"""Where a JSON or Python bracketed value ends, found without parsing it: a stream can tell a
finished call from one still arriving, and the same position comes out however the text was
split. The scan resumes where it stopped, so a call streamed in many pieces costs one pass."""

from __future__ import annotations

from dataclasses import dataclass, field

_CLOSE = {"[": "]", "{": "}", "(": ")"}


@dataclass(slots=True)
class BracketScan:
    """The scan of the bracketed value opening at ``start``; ``advance`` reads what arrived."""

    start: int
    python: bool = False  # single-quoted strings too
    i: int = -1  # next index to read
    stack: list[str] = field(default_factory=list)
    quote: str = ""  # the open string's quote, "" outside strings
    escaped: bool = False
    end: int | None = None

    def advance(self, text: str) -> int | None:
        """Index just past the closing bracket, or None while it has not arrived. A mismatched
        closer ends the value there (parsing that slice then fails)."""
        if self.end is not None:
            return self.end
        if self.i < 0:
            self.stack.append(_CLOSE[text[self.start]])
            self.i = self.start + 1
        quotes = "\"'" if self.python else "\""
        i, n = self.i, len(text)
        while i < n:
            ch = text[i]
            i += 1
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = ""
            elif ch in quotes:
                self.quote = ch
            elif ch in _CLOSE:
                self.stack.append(_CLOSE[ch])
            elif ch in ")]}":
                if ch != self.stack.pop() or not self.stack:
                    self.end = i
                    break
        self.i = i
        return self.end


def bracket_end(text: str, start: int, python: bool = False) -> int | None:
    """``BracketScan`` in one go."""
    return BracketScan(start, python).advance(text)


def string_end(text: str, start: int) -> int | None:
    """Index just past the JSON string opening at ``text[start]`` (a ``"``); None while its
    closing quote has not arrived."""
    i, n = start + 1, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "\"":
            return i + 1
        i += 1
    return None
