"""Stream tensors out of an HF folder's ``*.safetensors`` files (single or sharded)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


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


def iter_safetensors(folder: str) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yields ``(tensor name, tensor on the CPU, file it came from)`` one tensor at a time."""
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name), str(path)
