"""Start-up phase timings, logged in one format by the EngineCore and by every worker rank.

    start-up: rank 0 model load in 1.21 s (Qwen3ForCausalLM, 1.12 GiB)
    start-up: rank 0 graph capture in 8.40 s (35 graphs, decode batches 1..256; 31 JIT compiles)
    start-up: rank 0 warm-up in 3.02 s (41 steps; 12 JIT compiles)
    start-up: engine EngineCore ready in 14.80 s (52000 KV blocks x 16 tokens, ...)

The phases are also kept by name (``StartupLog.phases``) so tools read them without parsing
logs (``tools/bench_startup.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class PhaseNote:
    """What a phase adds to its log line, set while it runs."""

    detail: str = ""


@dataclass(slots=True)
class StartupLog:
    who: str  # "engine", "rank 0", ...
    log: logging.Logger
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in order

    @contextmanager
    def phase(self, name: str) -> Iterator[PhaseNote]:
        """Time the block as phase ``name``; logged when it completes (a failing phase raises
        and is reported by whoever handles the error)."""
        note = PhaseNote()
        start = time.perf_counter()
        yield note
        self.record(name, time.perf_counter() - start, note.detail)

    def record(self, name: str, seconds: float, detail: str = "", label: str = "") -> None:
        """Phase ``name`` took ``seconds``; ``label`` words it in the log instead of ``name``."""
        self.phases[name] = self.phases.get(name, 0.0) + seconds
        self.log.info("start-up: %s %s in %.2f s%s", self.who, label or name, seconds,
                      f" ({detail})" if detail else "")
