"""``LLM.generate``'s progress: a file or pipe gets one plain line and no terminal redraws; a
terminal gets a live bar whose finished line is drawn exactly once."""

from __future__ import annotations

import io
import time

from tidal.frontend.progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(file: io.StringIO, total: int, enabled: bool = True) -> str:
    bar = ProgressBar(total, "Processed prompts", enabled=enabled, file=file)
    for i in range(total):
        # Past tqdm's redraw interval, so an update that redraws would show up.
        time.sleep(0.12)
        bar.update(1, f"out: {i + 1} tok/s")
    bar.close()
    bar.close()  # a second close (an error path) writes nothing more
    return file.getvalue()


def test_a_log_file_gets_one_plain_line():
    text = _run(io.StringIO(), 3)
    assert "\r" not in text and "\x1b" not in text
    lines = text.splitlines()
    assert len(lines) == 1 and text.endswith("\n")
    assert lines[0].startswith("Processed prompts: 3/3 in ") and lines[0].endswith("out: 3 tok/s")


def test_disabled_writes_nothing():
    assert _run(io.StringIO(), 2, enabled=False) == ""
    assert _run(_Terminal(), 2, enabled=False) == ""


def test_a_terminal_draws_the_finished_line_once():
    for total in (1, 3):
        text = _run(_Terminal(), total)
        frames = [f for f in text.split("\r") if f]
        finished = [f for f in frames if f"{total}/{total}" in f]
        assert len(finished) == 1, frames
        assert finished[0].rstrip("\n").endswith(f"out: {total} tok/s]")
        assert text.endswith("\n") and text.count("\n") == 1
        if total == 3:  # the bar is live: the steps in between were drawn
            assert any("1/3" in f for f in frames)
