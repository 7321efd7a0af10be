"""Every environment setting tidal reads, in one typed place.

Each function reads the environment when called, so two engines in one process see the same
thing and tests can set them. Settings that pick a kernel or a kernel variant are defaults of
the engine config's kernel section (``tidal.engine_core.kernel_config``): read once, when the
config is built, and never by worker code (which gets them resolved, in its ``KernelPolicy``).

Only this module reads ``os.environ`` (``tests/test_structure.py`` checks it). Code elsewhere
may *set* variables for the processes it starts or for libraries that read them (Triton,
gloo, prometheus_client); the check keeps a list of those files and why.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


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


def grammar_fill_threads() -> int | None:
    """``$TIDAL_GRAMMAR_FILL_THREADS``: threads llguidance fills a step's masks with (default:
    its own choice, 80 % of the CPUs up to 32)."""
    value = os.environ.get("TIDAL_GRAMMAR_FILL_THREADS")
    return int(value) if value else None


def grammar_compile_threads() -> int:
    """``$TIDAL_GRAMMAR_COMPILE_THREADS``: threads compiling grammars (default: half the CPUs,
    2 to 8). A burst of distinct schemas queues on them: each request's first mask waits for
    the compiles ahead of it (llguidance releases the GIL while it compiles: on 2 cores, 100
    corpus schemas took 42 ms on one thread and 23 ms on two)."""
    value = os.environ.get("TIDAL_GRAMMAR_COMPILE_THREADS")
    if value:
        return max(1, int(value))
    return max(2, min(8, (os.cpu_count() or 2) // 2))


def grammar_switch_interval() -> float:
    """``$TIDAL_GRAMMAR_SWITCH_INTERVAL_US`` (default 100): once a mask fill thread runs,
    the process's GIL switch interval (``sys.setswitchinterval``) is lowered to this (if
    larger), so the fill job gets the GIL back soon after each native call; 0 leaves it."""
    return float(os.environ.get("TIDAL_GRAMMAR_SWITCH_INTERVAL_US", "100")) / 1e6


def grammar_fill_handoff() -> bool:
    """``$TIDAL_GRAMMAR_FILL_HANDOFF`` (default 0): 1 makes the engine thread wait, as it
    hands a mask fill to the fill thread, until that thread has started it (the fill starts at
    once; the engine thread pays two thread wake-ups, about 65 us a step on a 2-core VM)."""
    return os.environ.get("TIDAL_GRAMMAR_FILL_HANDOFF", "0") != "0"


def grammar_advance_parallel() -> bool:
    """``$TIDAL_GRAMMAR_ADVANCE_PARALLEL`` (default 1): llguidance advances a step's matchers
    on the fill's threads; 0: on one thread of its own (the GIL released either way)."""
    return os.environ.get("TIDAL_GRAMMAR_ADVANCE_PARALLEL", "1") != "0"


def grammar_advance_in_fill() -> bool:
    """``$TIDAL_GRAMMAR_ADVANCE_IN_FILL`` (default 1): a constrained step's fill job also feeds
    each request its previous token, off the engine thread; 0 feeds them on the engine thread
    as the step is collected (the request then ends with its last token, not one output
    later)."""
    return os.environ.get("TIDAL_GRAMMAR_ADVANCE_IN_FILL", "1") != "0"


def grammar_fill_early() -> bool:
    """``$TIDAL_GRAMMAR_FILL_EARLY`` (default 1): with the fill advancing the matchers, its job
    starts as soon as the previous step's tokens reach the host, before the scheduler's update
    of them; 0: after it (and after the matchers of other requests advanced)."""
    return os.environ.get("TIDAL_GRAMMAR_FILL_EARLY", "1") != "0"


def kv_auth_key() -> str | None:
    """``$TIDAL_KV_AUTH_KEY``: the secret a P2P KV consumer sends with every message and a
    producer requires (both engines set it; unset: none is asked, for a loopback port)."""
    return os.environ.get("TIDAL_KV_AUTH_KEY") or None


def api_key() -> str | None:
    """``$TIDAL_API_KEY``: the server's bearer token when ``--api-key`` is not given."""
    return os.environ.get("TIDAL_API_KEY") or None


def plugins() -> list[str] | None:
    """``$TIDAL_PLUGINS``: a comma-separated allow-list of the entry-point plugins to load (by
    entry-point name, in every group); None (unset) loads every installed one, "" none."""
    raw = os.environ.get("TIDAL_PLUGINS")
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def allow_runtime_lora_updating() -> bool:
    """``$TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1`` (or true): the server takes
    ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (off by default, as vLLM:
    whoever can reach the server could load any adapter folder on its host)."""
    return os.environ.get("TIDAL_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true")


# --- other programs' settings tidal honours -------------------------------------------------


def prometheus_multiproc_dir() -> str | None:
    """``$PROMETHEUS_MULTIPROC_DIR`` as set (prometheus_client's multiprocess mode), else None."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def cuda_visible_devices() -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as set (data-parallel ranks split these), else None."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


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


# --- kernel choices: defaults of the engine config's kernel section ------------------------

# KernelConfig field -> the environment variable that gives its default. Only
# ``tidal.engine_core.kernel_config.build_kernel_config`` reads these (once, when the engine
# config is built); flags and ``--kernel-config`` JSON override them. Values are returned raw:
# the builder parses and validates them, naming the variable on an error.
KERNEL_ENV: dict[str, str] = {
    "decode_kernels": "TIDAL_DECODE_KERNELS",
    "gemv": "TIDAL_GEMV",
    "gemv_max_mb": "TIDAL_GEMV_MAX_MB",
    "gemv_stream": "TIDAL_GEMV_STREAM",
    "gemv_rows": "TIDAL_GEMV_ROWS",
    "gemv_rows_pdl": "TIDAL_GEMV_ROWS_PDL",
    "skinny_w4a16": "TIDAL_SKINNY_W4A16",
    "skinny_fp8_block": "TIDAL_SKINNY_FP8_BLOCK",
    "gemv_configs": "TIDAL_GEMV_CONFIGS",
    "norm_apart": "TIDAL_NORM_APART",
    "pdl": "TIDAL_PDL",
    "attn_fused_merge": "TIDAL_ATTN_FUSED_MERGE",
    "attn_preload": "TIDAL_ATTN_PRELOAD",
    "attn_split_stages": "TIDAL_ATTN_SPLIT_STAGES",
    "symm_allreduce": "TIDAL_SYMM_ALLREDUCE",
    "symm_allreduce_max_bytes": "TIDAL_SYMM_ALLREDUCE_MAX_BYTES",
    "lamport_allreduce": "TIDAL_LAMPORT_ALLREDUCE",
    "push_allreduce": "TIDAL_PUSH_ALLREDUCE",
    "lora_grouped_min_tokens": "TIDAL_LORA_GROUPED_MIN_TOKENS",
    "moe_direct_max_pairs": "TIDAL_MOE_DIRECT_MAX_PAIRS",
}


def kernel_env() -> dict[str, tuple[str, str]]:
    """The kernel knobs set in the environment: ``{field: (variable, raw value)}``."""
    return {field: (name, os.environ[name]) for field, name in KERNEL_ENV.items()
            if name in os.environ}
