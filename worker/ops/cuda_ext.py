"""Builds and loads tidal's CUDA extension (the sources in ``csrc/``) on first use.

The extension is compiled just in time with ``torch.utils.cpp_extension.load`` for the compute
capability of the current device (``-gencode arch=compute_XY,code=sm_XY``, so sm_90 on Hopper)
into ``<tidal cache>/cuda_ext/<name>`` (``kernel_cache.extension_cache_root``: tidal's cache
folder, ``$TIDAL_CACHE_DIR`` or ``~/.cache/tidal``, unless ``TORCH_EXTENSIONS_DIR`` is set), where
``<name>`` carries the arch and a hash of the sources, flags and torch/CUDA versions: a rebuilt
source or a new torch gets a fresh build, an unchanged one loads in well under a second.

Any failure (no GPU, no nvcc, no ninja, a compile error) is logged as ONE warning per process and
reported as "unavailable"; callers then use the Triton or torch kernels. Nothing is built at
import time.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = (
    "bindings.cpp",
    "norm_kernels.cu",
    "activation_kernels.cu",
    "rotary_kernels.cu",
    "cache_kernels.cu",
    "paged_attention.cu",
    "skinny_gemm.cu",
)
HEADERS = ("common.cuh", "launchers.h")


def source_dir() -> Path:
    import tidal.csrc

    return Path(tidal.csrc.__file__).resolve().parent


def cache_root() -> Path:
    from tidal.worker.ops.kernel_cache import extension_cache_root

    return extension_cache_root()[0]


@dataclass(frozen=True, slots=True)
class BuildResult:
    module: ModuleType | None
    error: str | None
    seconds: float
    build_dir: str | None
    arch: str | None
    cached: bool = False  # the build was already in the cache (a warm start)


def _cuda_flags(arch: str) -> list[str]:
    # Naming the arch ourselves also stops cpp_extension from adding its own (it skips its
    # defaults when a flag mentions 'arch').
    return [
        "-O3",
        f"-gencode=arch=compute_{arch},code=sm_{arch}",
        "-lineinfo",
    ]


def _digest(src: Path, arch: str, flags: list[str]) -> str:
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode())
        h.update((src / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
    return h.hexdigest()[:16]


def _build() -> BuildResult:
    start = time.perf_counter()
    arch: str | None = None
    build_dir: str | None = None
    cached = False
    try:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device")
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            raise RuntimeError("nvcc not found (CUDA_HOME unset)")
        major, minor = torch.cuda.get_device_capability()
        arch = f"{major}{minor}"
        src = source_dir()
        flags = _cuda_flags(arch)
        name = f"tidal_C_sm{arch}_{_digest(src, arch, flags)}"
        path = cache_root() / name
        cached = (path / f"{name}.so").exists()
        path.mkdir(parents=True, exist_ok=True)
        build_dir = str(path)
        module = cpp_extension.load(
            name=name,
            sources=[str(src / s) for s in SOURCES],
            extra_cflags=["-O3"],
            extra_cuda_cflags=flags,
            extra_include_paths=[str(src)],
            build_directory=build_dir,
            verbose=False,
        )
    except Exception as exc:  # never crash the engine over an optional fast path
        seconds = time.perf_counter() - start
        logger.warning(
            "tidal CUDA kernels unavailable (%s: %s); using Triton/torch kernels instead",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
        )
        return BuildResult(None, f"{type(exc).__name__}: {exc}", seconds, build_dir, arch)
    seconds = time.perf_counter() - start
    logger.info("tidal CUDA kernels ready for sm_%s in %.1f s (%s, %s)", arch, seconds,
                "loaded from the cache" if cached else "built: the cache was cold", build_dir)
    return BuildResult(module, None, seconds, build_dir, arch, cached)


class _ExtensionLoader:
    """One build attempt per process; later calls return the cached outcome."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._result: BuildResult | None = None

    def result(self) -> BuildResult:
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = _build()
        return self._result


# The compiled module is a per-process resource (like the CUDA context), so one loader per
# process is the right scope; it holds no engine state.
_LOADER = _ExtensionLoader()


def load_extension() -> ModuleType | None:
    """The extension module, building it on the first call; None when unavailable."""
    return _LOADER.result().module


def build_result() -> BuildResult:
    """Outcome of the (possibly just triggered) build, with timing, for tools and logs."""
    return _LOADER.result()


def require_extension() -> ModuleType:
    module = load_extension()
    if module is None:
        raise RuntimeError(f"tidal CUDA extension unavailable: {_LOADER.result().error}")
    return module
