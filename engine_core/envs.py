"""The few environment settings tidal reads, in one typed place (read when asked, never cached,
so two engines in one process see the same thing and tests can set them)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where tidal keeps derived files (converted tokenizers, built kernels):
    ``$TIDAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tidal``, else ``~/.cache/tidal``."""
    explicit = os.environ.get("TIDAL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tidal"


def log_level() -> str:
    """``$TIDAL_LOG_LEVEL`` (default INFO)."""
    return os.environ.get("TIDAL_LOG_LEVEL", "INFO").upper()


def warmup_enabled() -> bool:
    """``$TIDAL_WARMUP`` (default 1): 0 skips the start-up warm-up (``tidal.worker.warmup``),
    so the first requests pay for the kernel compiles instead (for measuring exactly that)."""
    return os.environ.get("TIDAL_WARMUP", "1") != "0"
