"""The on-disk compile cache: Inductor's compiled pieces of a model, kept between starts.

An entry is a folder ``<cache_dir>/<key>/`` whose ``key`` hashes everything that changes the
compiled code (``cache_key``): the model's architecture and dtype, the parallel layout and
this rank, the resolved kernel policy, the tidal / torch / triton versions and the
compilation config. A changed key is another folder, so nothing stale is ever read. Inside,
``manifest.json`` lists each piece's file with its size and sha256, written after the file
(atomically, by rename); a piece whose file is missing, of another size or hash, or that
torch cannot load is *corrupt*: it is dropped, compiled again and saved over (counted in
``CompileStats.cache_rebuilt``).

The pieces are ``torch._inductor.standalone_compile`` artifacts (``CompiledArtifact.save`` /
``load``, binary format), loaded without Inductor. torch's own precompile path
(``torch.compiler``'s ``aot_compile``) serialises only backends it knows, so the entry also
holds ``warm.json``, the split graph's plan (``warm_start``): a start that finds it (and every
piece) rebuilds the compiled forward without a Dynamo trace. The kernels' binaries (C++
``.so`` files, Triton cubins) stay in Inductor's own cache folder: on a machine without them a
load builds the saved kernel sources again (gcc / Triton), still skipping Inductor's lowering.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import torch

from tidal.worker.compilation.piecewise_backend import CompileStats

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PLAN = "warm.json"  # the split graph's plan for a start without Dynamo (warm_start)
FORMAT_VERSION = 1  # of this folder layout


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def key_parts(*, arch: Any, dtype: str, parallel: Any, rank: int, policy: Any,
              compilation: Any, device: str, aux_hidden: Any = None) -> dict[str, str]:
    """Everything the compiled code depends on, as text (what the key hashes, and what the
    manifest records so a person can see why two folders differ)."""
    def text(obj: Any) -> str:
        if isinstance(obj, msgspec.Struct):
            return msgspec.json.encode(obj).decode()
        return repr(obj)

    return {
        "format": str(FORMAT_VERSION),
        "arch": text(arch),
        "dtype": dtype,
        "parallel": text(parallel),
        "rank": str(rank),
        "device": device,
        "kernel_policy": text(policy),
        # (EAGLE-3's targets copy chosen layers' hidden states out inside the forward)
        "aux_hidden": text(aux_hidden),
        # (cache_dir names where the entry lives, not what is in it; the CUDA graphs are
        # captured at start-up around the same pieces whatever their mode and sizes)
        "compilation": text(msgspec.structs.replace(compilation, cache_dir=None,
                                                    cudagraph_mode=None,
                                                    cudagraph_capture_sizes=None)),
        "tidal": _version("tidal"),
        "torch": torch.__version__,
        "triton": _triton_version(),
    }


def cache_key(parts: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(f"{name}={parts[name]}\n".encode())
    return h.hexdigest()[:24]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class CompileCache:
    """One cache entry (the folder of one key) of ``root``; a ``piecewise_backend.PieceStore``."""

    def __init__(self, root: str | Path, key: str, parts: dict[str, str]) -> None:
        self.root = Path(root).expanduser()
        self.key = key
        self.dir = self.root / key
        self.parts = parts
        # (Writable by this user only whatever the umask: a warm start runs the entry's plan
        # only from such a folder, warm_start.untrusted.)
        self.dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        self._pieces: dict[str, dict[str, Any]] = self._read_manifest()

    def _read_manifest(self) -> dict[str, dict[str, Any]]:
        path = self.dir / MANIFEST
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
            if data.get("key") != self.key or not isinstance(data.get("pieces"), dict):
                raise ValueError("another key or no pieces")
            return data["pieces"]
        except (OSError, ValueError) as exc:
            logger.warning("compile cache %s: unreadable manifest (%s); rebuilding the entry",
                           self.dir, exc)
            return {}

    def _write_manifest(self) -> None:
        # Another process of the same key may have added pieces meanwhile: keep those too.
        merged = dict(self._read_manifest())
        merged.update(self._pieces)
        self._pieces = merged
        body = {"key": self.key, "parts": self.parts, "pieces": merged}
        _write_atomic(self.dir / MANIFEST, json.dumps(body, indent=1, sort_keys=True).encode())

    def _drop(self, piece: str, why: str, stats: CompileStats) -> None:
        logger.warning("compile cache %s: piece %s is %s; compiling it again", self.dir, piece,
                       why)
        stats.cache_rebuilt += 1
        self._pieces.pop(piece, None)
        (self.dir / f"{piece}.bin").unlink(missing_ok=True)

    def load(self, key: str, stats: CompileStats) -> Any | None:
        entry = self._pieces.get(key)
        if entry is None:
            return None
        path = self.dir / f"{key}.bin"
        try:
            size = path.stat().st_size
        except OSError:
            self._drop(key, "missing", stats)
            return None
        if size != entry.get("bytes") or _sha256(path) != entry.get("sha256"):
            self._drop(key, "corrupt (size or sha256 differs from the manifest)", stats)
            return None
        try:
            from torch._inductor import CompiledArtifact  # (imports Inductor: only here)

            return CompiledArtifact.load(path=str(path), format="binary")
        except Exception as exc:  # noqa: BLE001 - any failure to load means: compile again
            self._drop(key, f"unloadable ({type(exc).__name__}: {exc})", stats)
            return None

    def save(self, key: str, artifact: Any) -> None:
        path = self.dir / f"{key}.bin"
        tmp = self.dir / f".{key}.bin.tmp{os.getpid()}"
        try:
            artifact.save(path=str(tmp), format="binary")
            os.replace(tmp, path)
            self._pieces[key] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            self._write_manifest()
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be written costs time only
            tmp.unlink(missing_ok=True)
            logger.warning("compile cache %s: could not save piece %s (%s: %s)", self.dir, key,
                           type(exc).__name__, exc)

    def load_plan(self) -> bytes | None:
        """The warm-start plan's bytes (``warm_start``), if this entry has one."""
        try:
            return (self.dir / PLAN).read_bytes()
        except OSError:
            return None

    def save_plan(self, data: bytes) -> None:
        try:
            _write_atomic(self.dir / PLAN, data)
        except OSError as exc:  # costs the next start a trace, nothing else
            logger.warning("compile cache %s: could not save the warm-start plan (%s)",
                           self.dir, exc)

    def drop_plan(self) -> None:
        (self.dir / PLAN).unlink(missing_ok=True)

    def piece_files(self) -> list[Path]:
        """The saved pieces' files (what a test corrupts)."""
        return sorted(self.dir / f"{k}.bin" for k in self._pieces)
