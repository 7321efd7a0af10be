"""Stream tensors out of an HF folder's ``*.safetensors`` files (single or sharded).

With ``lazy=True`` each tensor comes as a `LazyTensor`: nothing is read until the weight loader
asks, and a tensor-parallel rank that narrows it to its shard reads only that shard's bytes from
the (memory-mapped) file, never the whole tensor.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class LazyTensor:
    """A checkpoint tensor not read yet: ``shape``, ``narrow`` (reads just that slice) and
    ``materialize`` (reads it all). Valid only while the iterator that produced it has not
    moved on to the next file."""

    __slots__ = ("_slice", "_handle", "name", "shape")

    def __init__(self, handle: Any, name: str) -> None:
        self._handle = handle
        self._slice = handle.get_slice(name)
        self.name = name
        self.shape = torch.Size(self._slice.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        index = tuple(slice(None) if d != dim else slice(start, start + length)
                      for d in range(len(self.shape)))
        return self._slice[index]

    def materialize(self) -> torch.Tensor:
        return self._handle.get_tensor(self.name)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={tuple(self.shape)})"


def materialize(t: torch.Tensor | LazyTensor) -> torch.Tensor:
    """The whole tensor, reading it if it is lazy."""
    return t if isinstance(t, torch.Tensor) else t.materialize()


def safetensors_files(folder: str) -> list[Path]:
    root = Path(folder)
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{index}: unreadable shard index: {exc}") from exc
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard files that are missing: "
                                    f"{', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no *.safetensors weight files (use "
                                "load_format='dummy' for random weights)")
    return files


def iter_safetensors(folder: str, lazy: bool = False
                     ) -> Iterator[tuple[str, torch.Tensor | LazyTensor, str]]:
    """Yields ``(tensor name, tensor, file it came from)`` one tensor at a time: a CPU tensor,
    or with ``lazy`` a `LazyTensor` to be consumed before the next one is asked for."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, (LazyTensor(f, name) if lazy else f.get_tensor(name)), str(path)
