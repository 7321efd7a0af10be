"""Stop strings: cut a request's streamed text at the first stop string, without retractions.

The engine stops only on token ids; stop strings are matched here, on the detokenized text. A stop
string can arrive split over several deltas, so text that could still be the start of one is held
back until it is known not to be; streamed text is never taken back.

Which match wins: the occurrence that starts earliest in the text; of several starting at the same
place, the shortest (it completes first). The result is ``text[:start]`` (plus the stop string when
``include_stop_str_in_output``), the same as searching the complete text at once. To guarantee
that, a complete match is not acted on while an earlier-starting, longer stop string may still
complete (stops ``["abcd", "bc"]`` on ``"abc"`` wait for the next character); those are at most
``len(longest stop) - 1`` characters of waiting.

Usage per sequence::

    matcher = StopStringMatcher(["\\nUser:", "</answer>"])
    for ids in engine_outputs:
        check = matcher.feed(detokenizer.update(ids))
        send(check.text)
        if check.stopped:
            abort_request(); break          # finish_reason "stop", check.stop is the string
    else:
        check = matcher.feed(detokenizer.flush())
        send(check.text)
        if not check.stopped:
            check = matcher.finish()        # releases the held text (or a deferred match)
            send(check.text)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

__all__ = ["StopCheck", "StopStringMatcher"]


@dataclass(slots=True, frozen=True)
class StopCheck:
    """What one :meth:`StopStringMatcher.feed` / :meth:`~StopStringMatcher.finish` decided."""

    text: str
    """Text safe to emit now."""
    stop: str | None = None
    """The stop string that ended the output, or None."""

    @property
    def stopped(self) -> bool:
        return self.stop is not None


@dataclass(slots=True, eq=False)
class StopStringMatcher:
    """Matches stop strings over one sequence's text deltas.

    Hot path cost: each :meth:`feed` scans the new text plus the held tail, which is at most
    ``len(longest stop) - 1`` characters. Empty stop strings are dropped (one would end every
    request before its first character, which no client means); duplicates are ignored.
    """

    stop: Sequence[str]
    """A str is one stop string; normalised to a tuple without empty strings or duplicates."""
    include_stop_str_in_output: bool = False
    _held: str = field(default="", init=False)
    _matched: str | None = field(default=None, init=False)
    _max_len: int = field(default=0, init=False)
    # first characters of the stop strings: a position can start a match only with one of them
    _first_chars: frozenset[str] = field(default=frozenset(), init=False)

    def __post_init__(self) -> None:
        # the OpenAI API accepts a single string; iterating it would give one stop per character
        stops = (self.stop,) if isinstance(self.stop, str) else (self.stop or ())
        # dict.fromkeys dedups in order: order only matters for logs, matching does not depend on it
        self.stop = tuple(dict.fromkeys(s for s in stops if s))
        self._max_len = max(map(len, self.stop), default=0)
        self._first_chars = frozenset(s[0] for s in self.stop)

    @property
    def matched(self) -> str | None:
        """The stop string that matched, once one has."""
        return self._matched

    @property
    def held_text(self) -> str:
        """Text received but not emitted yet (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> StopCheck:
        """Takes the next text delta; returns the text safe to emit and whether a stop matched.

        After a match every call returns no text and the same stop string.
        """
        if self._matched is not None:
            return StopCheck("", self._matched)
        if not self.stop:
            return StopCheck(delta)
        if not delta:
            return StopCheck("")
        return self._scan(self._held + delta, final=False)

    def finish(self) -> StopCheck:
        """Ends the text (the request finished for another reason): releases the held text, or
        truncates at a match that was waiting on an earlier, longer candidate."""
        if self._matched is not None:
            return StopCheck("", self._matched)
        held, self._held = self._held, ""
        if not held:
            return StopCheck("")
        return self._scan(held, final=True)

    def _scan(self, buf: str, final: bool) -> StopCheck:
        # buf = held tail + new text. Nothing before it can start a match: whatever was emitted
        # was, when emitted, no prefix of any stop string.
        best_start = -1
        best_stop = ""
        for s in self.stop:
            i = buf.find(s)
            if i >= 0 and (best_start < 0 or i < best_start
                           or (i == best_start and len(s) < len(best_stop))):
                best_start, best_stop = i, s
        hold_from = len(buf) if final else self._partial_start(buf)
        if best_start >= 0 and hold_from >= best_start:
            self._matched = best_stop
            self._held = ""
            logger.debug("stop string %r matched", best_stop)
            end = best_start + len(best_stop) if self.include_stop_str_in_output else best_start
            return StopCheck(buf[:end], best_stop)
        # no match yet, or one that a longer candidate starting earlier may still pre-empt
        self._held = buf[hold_from:]
        return StopCheck(buf[:hold_from])

    def _partial_start(self, buf: str) -> int:
        """Start of the longest suffix of ``buf`` that is a proper prefix of some stop string
        (``len(buf)`` if none): the text from there on must be held."""
        n = len(buf)
        first_chars = self._first_chars
        for j in range(max(0, n - self._max_len + 1), n):
            if buf[j] not in first_chars:
                continue
            tail = buf[j:]
            remaining = n - j
            for s in self.stop:
                if len(s) > remaining and s.startswith(tail):
                    return j
        return n
