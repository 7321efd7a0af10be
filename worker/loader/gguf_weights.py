"""Stream a GGUF checkpoint's tensors as float32 torch tensors under their HF transformers names.

Tensors are produced one at a time, straight from a read-only memory map of the file, so peak
memory is one dequantized tensor rather than a state dict. Dequantization is the ``gguf``
library's; this module only locates bytes, renames, and undoes llama.cpp's Q/K row permutation
for the llama architecture.

Every tensor's name and type is checked before the first one is produced, so a file tidal cannot
load fails before the caller has copied anything.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata as importlib_metadata

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tidal.engine_core.gguf_config import (
    GGUFHeader,
    GGUFTensorInfo,
    gguf_head_counts,
    header_family,
    read_gguf_header,
)
from tidal.engine_core.model_registry import GGUFFamily

logger = logging.getLogger(__name__)

_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Tensors with no HF parameter. rope_freqs holds Llama 3.1-style per-frequency rope factors
# (transformers drops it too; gguf_config warns that the scaling is not applied).
_SKIPPED_NAMES = frozenset({"rope_freqs.weight"})


@dataclass(frozen=True)
class _Entry:
    info: GGUFTensorInfo
    hf_name: str
    qtype: GGMLQuantizationType
    # Heads to undo llama.cpp's rotary row permutation over; None when stored in HF order.
    unpermute_heads: int | None
    # Added to the weights on load (undoes llama.cpp's ``1 +`` on Gemma-style norms).
    offset: float = 0.0


def iter_gguf_weights(path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterate ``(hf_name, tensor)`` over every tensor in a GGUF file, dequantized to float32.

    Shapes are HF's ([out_features, in_features] for linears). A tied ``lm_head.weight`` is not
    in the file and is not yielded. The file is checked by this call, before any tensor is
    read: ``ValueError`` for an unsupported architecture, an unknown tensor name, or a tensor
    type the ``gguf`` library cannot dequantize (only a truncated file is found later).
    """
    header = read_gguf_header(path)
    entries = _plan(header)
    _log_plan(header, entries)
    return _stream(header, entries)


def _stream(header: GGUFHeader, entries: list[_Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    # np.memmap (not mmap.mmap) so the mapping lives exactly as long as views of it do; viewed
    # as a plain ndarray because the memmap subclass's per-view bookkeeping, run on every row
    # group the library splits off, otherwise doubles the load time.
    raw = np.asarray(np.memmap(header.path, dtype=np.uint8, mode="r"))
    for entry in entries:
        yield entry.hf_name, _load(header, raw, entry)


def gguf_tensor_names(path: str | os.PathLike[str]) -> list[str]:
    """The HF names :func:`iter_gguf_weights` yields for ``path``, in order; reads no data."""
    return [entry.hf_name for entry in _plan(read_gguf_header(path))]


def _plan(header: GGUFHeader) -> list[_Entry]:
    # The tensor-name map, rope layout and norm offset are the family's, from the registry.
    fam = header_family(header)
    num_heads, num_kv_heads = gguf_head_counts(header)
    heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
    entries: list[_Entry] = []
    for info in header.tensors:
        if info.name in _SKIPPED_NAMES:
            logger.debug("%s: skipping %s (no HF parameter)", header.path, info.name)
            continue
        stem = info.name.split(".")[-2] if info.name.startswith("blk.") else ""
        unpermute_heads = heads.get(stem) if fam.permuted_qk else None
        is_norm = (stem or info.name.split(".")[0]).endswith("norm")
        entries.append(
            _Entry(
                info=info,
                hf_name=_hf_name(header, fam, info.name),
                qtype=_checked_qtype(header, info),
                unpermute_heads=unpermute_heads,
                offset=-fam.norm_weight_offset if is_norm else 0.0,
            )
        )
        if unpermute_heads is not None and info.shape[0] % (2 * unpermute_heads):
            raise ValueError(
                f"{header.path}: tensor {info.name!r} has {info.shape[0]} rows, not "
                f"{unpermute_heads} heads of an even size"
            )
    return entries


def _hf_name(header: GGUFHeader, fam: GGUFFamily, name: str) -> str:
    top = fam.top_tensors.get(name)
    if top is not None:
        return top
    match = _BLOCK_TENSOR.fullmatch(name)
    module = fam.block_tensors.get(match.group(2)) if match else None
    if match is None or module is None:
        raise ValueError(
            f"{header.path}: tensor {name!r} has no HF equivalent for GGUF architecture "
            f"{header.architecture!r}"
        )
    layer, _, kind = match.groups()
    return f"model.layers.{int(layer)}.{module}.{kind}"


def _checked_qtype(header: GGUFHeader, info: GGUFTensorInfo) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(info.type_id)
    except ValueError:
        raise ValueError(
            f"{header.path}: tensor {info.name!r} has ggml type id {info.type_id}, unknown to "
            f"gguf {_gguf_version()}"
        ) from None
    if not _can_dequantize(qtype):
        raise ValueError(
            f"{header.path}: tensor {info.name!r} has type {qtype.name}, which gguf "
            f"{_gguf_version()} cannot dequantize"
        )
    block_size, _ = GGML_QUANT_SIZES[qtype]
    if not info.shape or info.shape[-1] % block_size:
        raise ValueError(
            f"{header.path}: tensor {info.name!r} of type {qtype.name} has shape "
            f"{list(info.shape)}, whose rows are not whole {block_size}-element blocks"
        )
    return qtype


@functools.cache
def _can_dequantize(qtype: GGMLQuantizationType) -> bool:
    # Ask the library with one all-zero block instead of consulting its private type table.
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


@functools.cache
def _gguf_version() -> str:
    try:
        return importlib_metadata.version("gguf")
    except importlib_metadata.PackageNotFoundError:
        return "(unknown version)"


def _load(header: GGUFHeader, raw: np.ndarray, entry: _Entry) -> torch.Tensor:
    info = entry.info
    block_size, type_size = GGML_QUANT_SIZES[entry.qtype]
    # Same layout GGUFReader hands to dequantize: rows of the innermost dimension, in bytes.
    byte_shape = (*info.shape[:-1], info.shape[-1] // block_size * type_size)
    end = info.offset + math.prod(byte_shape)
    if end > raw.size:
        raise ValueError(
            f"{header.path}: tensor {info.name!r} ends at byte {end}, past the end of the file "
            f"({raw.size} bytes); the file is truncated"
        )
    weights = dequantize(raw[info.offset : end].reshape(byte_shape), entry.qtype)
    if weights.dtype != np.float32:
        weights = weights.astype(np.float32)
    if not weights.flags.writeable:
        # F32 "dequantizes" to a view of the read-only map; detach it from the file.
        weights = weights.copy()
    if entry.unpermute_heads is not None:
        weights = _undo_rotary_permutation(weights, entry.unpermute_heads)
    if entry.offset:
        weights = weights + np.float32(entry.offset)
    return torch.from_numpy(np.ascontiguousarray(weights))


def _undo_rotary_permutation(weights: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from HF's [first half | second half] to
    # interleaved pairs (GPT-J style rotary); view each head as (pairs, 2) and swap back.
    rows, rest = weights.shape[0], weights.shape[1:]
    per_head = weights.reshape(n_heads, rows // n_heads // 2, 2, *rest)
    return per_head.swapaxes(1, 2).reshape(weights.shape)


def _log_plan(header: GGUFHeader, entries: list[_Entry]) -> None:
    counts = Counter(entry.qtype.name for entry in entries)
    logger.info(
        "%s: loading %s tensors (%s)",
        header.path,
        len(entries),
        ", ".join(f"{n} {name}" for name, n in counts.most_common()),
    )
