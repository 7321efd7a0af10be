"""Every environment setting tidal reads, in one typed place.

Each function reads the environment when called, so two engines in one process see the same
thing and tests can set them. Settings that pick a kernel variant are read once by the module
that uses them, into a module-level constant (the check sits on the decode hot path, and
benchmarks flip those constants directly).

Only this module reads ``os.environ`` (``tests/test_structure.py`` checks it). Code elsewhere
may *set* variables for the processes it starts or for libraries that read them (Triton,
gloo, prometheus_client); the check keeps a list of those files and why.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def _flag(name: str, default: bool) -> bool:
    # The knobs' historical rule: "0" is off for a default-on flag, only "1" is on for a
    # default-off one.
    if default:
        return os.environ.get(name, "1") != "0"
    return os.environ.get(name, "0") == "1"


# --- general --------------------------------------------------------------------------------


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


def api_key() -> str | None:
    """``$TIDAL_API_KEY``: the server's bearer token when ``--api-key`` is not given."""
    return os.environ.get("TIDAL_API_KEY") or None


# --- other programs' settings tidal honours -------------------------------------------------


def prometheus_multiproc_dir() -> str | None:
    """``$PROMETHEUS_MULTIPROC_DIR`` as set (prometheus_client's multiprocess mode), else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def gloo_socket_ifname() -> str | None:
    """``$GLOO_SOCKET_IFNAME``: the interface the user chose for gloo, or None."""
    return os.environ.get("GLOO_SOCKET_IFNAME")


def triton_cache_dir() -> str | None:
    """``$TRITON_CACHE_DIR`` if set and non-empty."""
    return os.environ.get("TRITON_CACHE_DIR") or None


def triton_home() -> str | None:
    """``$TRITON_HOME`` if set and non-empty."""
    return os.environ.get("TRITON_HOME") or None


def torch_extensions_dir() -> str | None:
    """``$TORCH_EXTENSIONS_DIR`` if set and non-empty."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or None


def forwarded(names: Iterable[str]) -> dict[str, str]:
    """Those of ``names`` set here, for a child that does not inherit this environment (Ray)."""
    return {name: os.environ[name] for name in names if name in os.environ}


# --- kernel variants (read once, at import, by the module that uses each) -------------------


def decode_kernels() -> bool:
    """``$TIDAL_DECODE_KERNELS`` (default 1): 0 turns off the fused Triton decode ops."""
    return _flag("TIDAL_DECODE_KERNELS", True)


def gemv() -> bool:
    """``$TIDAL_GEMV`` (default 1): 0 turns off only the one-row GEMV and its fusions."""
    return _flag("TIDAL_GEMV", True)


def gemv_max_bytes() -> float:
    """``$TIDAL_GEMV_MAX_MB`` in bytes: larger weights stay on cuBLAS (default: no limit)."""
    return float(os.environ.get("TIDAL_GEMV_MAX_MB", "inf")) * 2**20


def gemv_stream() -> bool:
    """``$TIDAL_GEMV_STREAM`` (default 1): 0 loads GEMV weights with the default L2 policy."""
    return _flag("TIDAL_GEMV_STREAM", True)


def gemv_configs() -> str:
    """``$TIDAL_GEMV_CONFIGS``: GEMV launch-shape overrides (``triton_decode`` parses them)."""
    return os.environ.get("TIDAL_GEMV_CONFIGS", "")


def norm_apart() -> bool:
    """``$TIDAL_NORM_APART`` (default 1): 0 always fuses the RMSNorm into the GEMV prologue."""
    return _flag("TIDAL_NORM_APART", True)


def pdl() -> bool:
    """``$TIDAL_PDL`` (default 1): 0 turns off programmatic dependent launch."""
    return _flag("TIDAL_PDL", True)


def attn_fused_merge() -> bool:
    """``$TIDAL_ATTN_FUSED_MERGE`` (default 0): 1 merges split-decode partials in-kernel."""
    return _flag("TIDAL_ATTN_FUSED_MERGE", False)


def attn_preload() -> bool:
    """``$TIDAL_ATTN_PRELOAD`` (default 1): 0 loads a split's first tile after the PDL wait."""
    return _flag("TIDAL_ATTN_PRELOAD", True)


def attn_split_stages() -> int:
    """``$TIDAL_ATTN_SPLIT_STAGES`` (default 1): software-pipeline stages of split decode."""
    return int(os.environ.get("TIDAL_ATTN_SPLIT_STAGES", "1"))


# --- tensor-parallel all-reduce (read when the all-reduce is set up) ------------------------


def symm_allreduce() -> bool:
    """``$TIDAL_SYMM_ALLREDUCE`` (default 1): 0 leaves every all-reduce to NCCL."""
    return _flag("TIDAL_SYMM_ALLREDUCE", True)


def symm_allreduce_max_bytes() -> int:
    """``$TIDAL_SYMM_ALLREDUCE_MAX_BYTES`` (default 2 MiB): largest one-shot all-reduce."""
    return int(os.environ.get("TIDAL_SYMM_ALLREDUCE_MAX_BYTES", str(2 << 20)))


def lamport_allreduce() -> bool:
    """``$TIDAL_LAMPORT_ALLREDUCE`` (default 1): 0 turns off the Lamport-flag all-reduce."""
    return _flag("TIDAL_LAMPORT_ALLREDUCE", True)


def push_allreduce() -> bool:
    """``$TIDAL_PUSH_ALLREDUCE`` (default 0): 1 fuses the all-reduce into decode GEMVs."""
    return _flag("TIDAL_PUSH_ALLREDUCE", False)
