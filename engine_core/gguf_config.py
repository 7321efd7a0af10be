"""An HF ``config.json``-style dict from a GGUF file's metadata.

The GGUF header (metadata key/values and tensor descriptions) is parsed here with a small reader
of our own instead of ``gguf.GGUFReader``: the library decodes every element of the tokenizer
arrays (vocabulary, merges, scores) into numpy views, which costs seconds for a 50k-token
vocabulary, while a config needs only their lengths. Nothing is dequantized and no tensor data
is read; the worker's weight loader reuses :func:`read_gguf_header` to find the tensors.

Only little-endian GGUF v2/v3 files are read (what llama.cpp has written since 2023).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

from gguf import GGUFValueType

from tidal.engine_core.model_registry import GGUFFamily, gguf_architectures, gguf_family

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_SUPPORTED_VERSIONS = (2, 3)
# llama.cpp's default when ``general.alignment`` is absent.
_DEFAULT_ALIGNMENT = 32
# Longer arrays (vocabulary, merges, scores) are skipped and only their length is kept: decoding
# them is what makes a full metadata read slow, and no config field needs their contents.
_MAX_DECODED_ARRAY = 1024

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}

# llama.cpp's converters default the rope base to this when the HF config has none.
_DEFAULT_ROPE_THETA = 10000.0

# GGUF ``{arch}.rope.scaling.*`` suffix -> HF rope_scaling key (and the type to store it as).
_ROPE_SCALING_KEYS: dict[str, tuple[str, type]] = {
    "factor": ("factor", float),
    "original_context_length": ("original_max_position_embeddings", int),
    "attn_factor": ("attention_factor", float),
    "yarn_beta_fast": ("beta_fast", float),
    "yarn_beta_slow": ("beta_slow", float),
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file; no data is read."""

    name: str
    # Outermost dimension first, as numpy and torch order them. GGUF lists dimensions innermost
    # first, so this is the file's list reversed; for a linear layer it is [out, in] like HF.
    shape: tuple[int, ...]
    type_id: int  # a ggml type id; may be one this gguf library does not know
    offset: int  # absolute byte offset of the tensor's data in the file


@dataclass(frozen=True)
class GGUFHeader:
    path: str
    version: int
    # Scalars and short arrays (as lists); long arrays are absent here, see ``array_lengths``.
    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset: int

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def tensor(self, name: str) -> GGUFTensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)


class _Cursor:
    """Sequential little-endian reads from a byte buffer."""

    def __init__(self, buf: mmap.mmap | bytes, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        try:
            values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        except struct.error as exc:
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}") from exc
        self.pos += struct.calcsize("<" + fmt)
        return values

    def u32(self) -> int:
        return self.unpack("I")[0]

    def u64(self) -> int:
        return self.unpack("Q")[0]

    def string(self) -> str:
        length = self.u64()
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError(f"{self.path}: truncated GGUF header at byte {self.pos}")
        raw = bytes(self.buf[self.pos : end])
        self.pos = end
        return raw.decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        length = self.u64()  # read first: ``self.pos += self.u64()`` would drop the advance
        self.pos += length

    def value(self, type_id: int) -> Any:
        if type_id == GGUFValueType.STRING:
            return self.string()
        if type_id == GGUFValueType.ARRAY:
            item_type, length = self.unpack("IQ")
            return [self.value(item_type) for _ in range(length)]
        return self.unpack(self._format(type_id))[0]

    def skip_array_items(self, item_type: int, length: int) -> None:
        if item_type == GGUFValueType.STRING:
            for _ in range(length):
                self.skip_string()
        elif item_type == GGUFValueType.ARRAY:
            for _ in range(length):
                nested_type, nested_length = self.unpack("IQ")
                self.skip_array_items(nested_type, nested_length)
        else:
            self.pos += length * struct.calcsize("<" + self._format(item_type))

    def _format(self, type_id: int) -> str:
        fmt = _SCALAR_FORMATS.get(type_id)
        if fmt is None:
            raise ValueError(f"{self.path}: unknown GGUF value type {type_id} at byte {self.pos}")
        return fmt


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor descriptions (cheap: reads only the header)."""
    path_str = os.fspath(path)
    try:
        with open(path_str, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:
                raise ValueError(f"{path_str}: too small to be a GGUF file")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_header(_Cursor(buf, path_str))
    except OSError as exc:
        raise ValueError(f"{path_str}: cannot read GGUF file: {exc}") from exc


def _parse_header(cur: _Cursor) -> GGUFHeader:
    magic = bytes(cur.buf[0:4])
    if magic != GGUF_MAGIC:
        raise ValueError(f"{cur.path}: not a GGUF file (magic {magic!r})")
    cur.pos = 4
    version = cur.u32()
    if version not in _SUPPORTED_VERSIONS:
        # A byte-swapped small number means the file was written big-endian.
        swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
        detail = "big-endian GGUF files" if swapped in _SUPPORTED_VERSIONS else f"version {version}"
        raise ValueError(f"{cur.path}: {detail} are not supported (GGUF v2/v3 little-endian only)")
    n_tensors, n_kv = cur.unpack("QQ")
    metadata, array_lengths = _parse_metadata(cur, n_kv)
    infos = [_parse_tensor_info(cur) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = tuple(
        GGUFTensorInfo(name=name, shape=shape, type_id=type_id, offset=data_offset + rel)
        for name, shape, type_id, rel in infos
    )
    return GGUFHeader(
        path=cur.path,
        version=version,
        metadata=metadata,
        array_lengths=array_lengths,
        tensors=tensors,
        data_offset=data_offset,
    )


def _parse_metadata(cur: _Cursor, n_kv: int) -> tuple[dict[str, Any], dict[str, int]]:
    metadata: dict[str, Any] = {}
    array_lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = cur.string()
        type_id = cur.u32()
        if type_id != GGUFValueType.ARRAY:
            metadata[key] = cur.value(type_id)
            continue
        item_type, length = cur.unpack("IQ")
        array_lengths[key] = length
        if length <= _MAX_DECODED_ARRAY:
            metadata[key] = [cur.value(item_type) for _ in range(length)]
        else:
            cur.skip_array_items(item_type, length)
    return metadata, array_lengths


def _parse_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.string()
    n_dims = cur.u32()
    dims = cur.unpack(f"{n_dims}Q") if n_dims else ()
    type_id, rel_offset = cur.unpack("IQ")
    return name, tuple(reversed(dims)), type_id, rel_offset


def gguf_architecture(header: GGUFHeader) -> str:
    """The file's ``general.architecture``; ``ValueError`` unless tidal supports it."""
    return header_family(header).arch


def header_family(header: GGUFHeader) -> GGUFFamily:
    """The registry's GGUF mapping for the file's architecture; ``ValueError`` if it has none."""
    arch = header.architecture
    # llama.cpp writes some MoE families as a dense arch plus an expert count (Mixtral: llama).
    experts = bool(header.metadata.get(f"{arch}.expert_count"))
    fam = gguf_family(arch, experts=experts)
    if fam is None:
        known = ", ".join(gguf_architectures())
        raise ValueError(
            f"{header.path}: unsupported GGUF architecture {header.architecture!r} "
            f"(tidal reads {known})"
        )
    return fam


def gguf_to_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """An HF ``config.json``-style dict for a GGUF file, from its metadata only.

    Besides the HF keys, ``_chat_template`` holds the tokenizer's chat template (or None).
    """
    return hf_config_from_header(read_gguf_header(path))


def gguf_head_counts(header: GGUFHeader) -> tuple[int, int]:
    """``(num_attention_heads, num_key_value_heads)`` of a supported GGUF file."""
    meta = _ArchMetadata(header, gguf_architecture(header))
    num_heads = meta.required_int("attention.head_count")
    return num_heads, meta.optional_int("attention.head_count_kv") or num_heads


def hf_config_from_header(header: GGUFHeader) -> dict[str, Any]:
    """:func:`gguf_to_hf_config` for an already parsed header."""
    fam = header_family(header)
    arch = fam.arch
    meta = _ArchMetadata(header, arch)
    hidden = meta.required_int("embedding_length")
    num_heads, num_kv_heads = gguf_head_counts(header)
    rope_theta = float(meta.get("rope.freq_base", _DEFAULT_ROPE_THETA))
    rope_scaling = _rope_scaling(meta)
    tied = header.tensor("output.weight") is None
    if header.tensor("rope_freqs.weight") is not None:
        # Llama 3.1-style rope scaling is stored as per-frequency factors in a tensor, not as
        # metadata, so this config cannot carry it; the model will rotate slightly wrongly.
        logger.warning(
            "%s: has a rope_freqs tensor (Llama 3.1-style rope scaling) that the config "
            "cannot express; rotary frequencies will be unscaled",
            header.path,
        )
    config: dict[str, Any] = {
        "architectures": [fam.hf_architecture],
        "model_type": fam.model_type,
        "hidden_size": hidden,
        "intermediate_size": meta.required_int("feed_forward_length"),
        "num_hidden_layers": meta.required_int("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": _head_dim(meta, hidden, num_heads),
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # transformers >= 5 folds theta and scaling together under this key.
        "rope_parameters": {
            "rope_type": "default",
            **(rope_scaling or {}),
            "rope_theta": rope_theta,
        },
        "max_position_embeddings": meta.required_int("context_length"),
        "vocab_size": _vocab_size(header, meta),
        "tie_word_embeddings": tied,
        "attention_bias": any(t.name.endswith(".attn_q.bias") for t in header.tensors),
        "mlp_bias": False,
    }
    config.update(fam.config_defaults)
    for suffix, hf_key in fam.metadata_keys.items():
        value = meta.get(suffix)
        if value is not None:
            config[hf_key] = value
    config.update(_token_ids(header))
    template = header.metadata.get("tokenizer.chat_template")
    config["_chat_template"] = template if isinstance(template, str) else None
    logger.debug("%s: GGUF %s config %s", header.path, arch, config)
    return config


class _ArchMetadata:
    """Typed access to the ``{arch}.*`` metadata keys, with errors naming the file."""

    def __init__(self, header: GGUFHeader, arch: str) -> None:
        self.header = header
        self.arch = arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.metadata.get(f"{self.arch}.{key}", default)

    def optional_int(self, key: str) -> int | None:
        value = self.get(key)
        if isinstance(value, list):
            # Some converters write per-layer lists; tidal's layers are uniform.
            if not value or len(set(value)) != 1:
                raise ValueError(
                    f"{self.header.path}: {self.arch}.{key} varies per layer ({value}); "
                    "tidal needs it uniform"
                )
            value = value[0]
        return None if value is None else int(value)

    def required_int(self, key: str) -> int:
        value = self.optional_int(key)
        if value is None:
            raise ValueError(f"{self.header.path}: GGUF metadata lacks {self.arch}.{key}")
        return value


def _head_dim(meta: _ArchMetadata, hidden: int, num_heads: int) -> int:
    # Converters write attention.key_length only when the HF config had an explicit head_dim
    # (Qwen3, some Llamas); rope.dimension_count equals head_dim for these families (no partial
    # rotary), so it is the next best source.
    key_length = meta.optional_int("attention.key_length")
    value_length = meta.optional_int("attention.value_length")
    if key_length is not None and value_length is not None and key_length != value_length:
        raise ValueError(
            f"{meta.header.path}: key_length {key_length} != value_length {value_length}; "
            "tidal needs them equal"
        )
    return key_length or meta.optional_int("rope.dimension_count") or hidden // num_heads


def _rope_scaling(meta: _ArchMetadata) -> dict[str, Any] | None:
    kind = meta.get("rope.scaling.type")
    factor = meta.get("rope.scaling.factor")
    legacy_linear = meta.get("rope.scale_linear")
    if kind is None and legacy_linear is not None:
        kind, factor = "linear", legacy_linear
    if kind is None or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": str(kind)}
    for suffix, (hf_key, cast) in _ROPE_SCALING_KEYS.items():
        value = factor if suffix == "factor" else meta.get(f"rope.scaling.{suffix}")
        if value is not None:
            scaling[hf_key] = cast(value)
    return scaling


def _vocab_size(header: GGUFHeader, meta: _ArchMetadata) -> int:
    embed = header.tensor("token_embd.weight")
    rows = embed.shape[0] if embed is not None and embed.shape else None
    n_tokens = header.array_lengths.get("tokenizer.ggml.tokens")
    # The embedding's row count is what the weights need, so it beats the token list.
    vocab = meta.optional_int("vocab_size") or rows or n_tokens
    if vocab is None:
        raise ValueError(
            f"{header.path}: cannot tell the vocabulary size (no {meta.arch}.vocab_size, "
            "token_embd.weight or tokenizer.ggml.tokens)"
        )
    if rows is not None and rows != vocab:
        logger.warning(
            "%s: vocab_size %s disagrees with token_embd.weight's %s rows", header.path, vocab, rows
        )
    return vocab


def _token_ids(header: GGUFHeader) -> dict[str, Any]:
    meta = header.metadata
    ids: dict[str, Any] = {
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    for gguf_key, hf_key in (("padding", "pad"), ("unknown", "unk")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if value is not None:
            ids[f"{hf_key}_token_id"] = value
    # Chat models often end a turn with an end-of-turn/message token that differs from eos;
    # generation must stop on those too, and HF configs allow a list here.
    extra = [
        meta[key]
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if isinstance(meta.get(key), int)
    ]
    eos = ids["eos_token_id"]
    stops = list(dict.fromkeys(([eos] if eos is not None else []) + extra))
    if len(stops) > 1:
        ids["eos_token_id"] = stops
    return ids
