"""A stat logger: one JSON line per engine step it is told about, in ``$TIDAL_TEST_STATS_FILE``."""

from __future__ import annotations

import json
import os
from typing import Any


class FileStatLogger:
    def __init__(self, config: Any) -> None:
        self.path = os.environ.get("TIDAL_TEST_STATS_FILE")

    def record(self, stats: Any, step: Any) -> None:
        if self.path is None:
            return
        line = {"generation_tokens": stats.num_generation_tokens if stats else 0,
                "prompt_tokens": stats.num_prompt_tokens if stats else 0,
                "finished": len(step.finished)}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
