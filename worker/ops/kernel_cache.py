"""Where compiled kernels persist between starts, and whether that cache was warm.

Triton writes every compiled kernel to its on-disk cache, and tidal's CUDA extension is built
into a folder keyed by a hash of its sources (``cuda_ext``); a second start that finds them
loads in milliseconds what a first start compiled in seconds. Both live under tidal's cache
folder (``envs.cache_dir()``: ``$TIDAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/tidal``, else
``~/.cache/tidal``): ``triton/`` and ``cuda_ext/``. A user's own ``TRITON_CACHE_DIR`` or
``TRITON_HOME`` (for Triton) and ``TORCH_EXTENSIONS_DIR`` (for the extension) win.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tidal.engine_core import envs


@dataclass(slots=True, frozen=True)
class CacheState:
    path: str
    entries: int  # kernels (Triton) or builds (extension) found at start-up
    chosen_by: str  # "tidal" or the environment variable the user set

    @property
    def warm(self) -> bool:
        return self.entries > 0

    def describe(self) -> str:
        state = f"warm, {self.entries} entries" if self.warm else "cold"
        return f"{self.path} ({state}; {self.chosen_by})"


def _entries(path: Path) -> int:
    try:
        with os.scandir(path) as it:
            return sum(1 for e in it if e.is_dir())
    except OSError:
        return 0


def triton_cache_dir() -> tuple[Path, str]:
    """Triton's cache folder and who chose it."""
    explicit = envs.triton_cache_dir()
    if explicit:
        return Path(explicit), "TRITON_CACHE_DIR"
    home = envs.triton_home()
    if home:
        return Path(home) / ".triton" / "cache", "TRITON_HOME"
    return envs.cache_dir() / "triton", "tidal"


def use_tidal_triton_cache() -> CacheState:
    """Point Triton's cache at tidal's folder unless the user chose one (Triton reads
    ``TRITON_CACHE_DIR`` at each compile, so this works whenever it runs before the first
    one); returns the folder and how many kernels it already holds."""
    path, chosen_by = triton_cache_dir()
    if chosen_by == "tidal":
        os.environ["TRITON_CACHE_DIR"] = str(path)
    return CacheState(str(path), _entries(path), chosen_by)


def extension_cache_root() -> tuple[Path, str]:
    """Where the CUDA extension is built (one sub-folder per source hash and arch)."""
    explicit = envs.torch_extensions_dir()
    if explicit:
        return Path(explicit) / "tidal", "TORCH_EXTENSIONS_DIR"
    return envs.cache_dir() / "cuda_ext", "tidal"


def extension_cache_state() -> CacheState:
    root, chosen_by = extension_cache_root()
    return CacheState(str(root), _entries(root), chosen_by)
