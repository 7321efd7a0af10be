"""Progress of an offline batch (``LLM.generate``): a live tqdm bar on a terminal, one plain line
at the end anywhere else.

A log file or a pipe gets no carriage-return redraws (``\\r``), which only a terminal can
render; it gets one summary line once the batch is done. On a terminal the finished bar is
drawn once, by ``close()``: tqdm would otherwise draw the last update and then draw the same
line again when closed.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from tqdm.auto import tqdm


def _live(file: IO[str]) -> bool:
    # tqdm.auto picks a notebook widget inside Jupyter, whose stderr is no terminal.
    if any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__):
        return True
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty())


class ProgressBar:
    """``update`` after each finished item (optionally with a postfix such as throughput),
    ``close`` once at the end (also after an error)."""

    __slots__ = ("_bar", "_closed", "_desc", "_enabled", "_file", "_n", "_postfix", "_start",
                 "_total")

    def __init__(self, total: int, desc: str, enabled: bool = True,
                 file: IO[str] | None = None) -> None:
        self._file = sys.stderr if file is None else file
        self._total = total
        self._desc = desc
        self._enabled = enabled
        self._n = 0
        self._postfix = ""
        self._closed = False
        self._start = time.perf_counter()
        self._bar = None
        if enabled and _live(self._file):
            self._bar = tqdm(total=total, desc=desc, dynamic_ncols=True, file=self._file)

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self._n += n
        if postfix is not None:
            self._postfix = postfix
        bar = self._bar
        if bar is None:
            return
        if postfix is not None:
            bar.set_postfix_str(postfix, refresh=False)
        if self._n >= self._total:
            bar.n = self._n  # close() draws the finished line; an update would draw it too
        else:
            bar.update(n)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            return
        if not self._enabled or not self._n:
            return
        elapsed = time.perf_counter() - self._start
        postfix = f", {self._postfix}" if self._postfix else ""
        self._file.write(f"{self._desc}: {self._n}/{self._total} in {elapsed:.2f} s"
                         f"{postfix}\n")
        self._file.flush()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
