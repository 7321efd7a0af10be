"""Reading a PEFT LoRA adapter folder: its config, its tensors' names and shapes, checked
against the base model.

Shared by the EngineCore (``AddLora`` validates an adapter from the safetensors header alone,
reading no weights) and the workers (``worker/lora/peft_loader.py`` then loads the tensors it
names). Anything tidal cannot serve exactly is refused with an ``LoRAAdapterError`` that names
the field, tensor or shape, never approximated.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

from tidal.engine_core.lora_config import SUPPORTED_TARGETS
from tidal.engine_core.model_arch import ArchSpec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILES = ("adapter_model.bin", "adapter_model.pt")
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not an adapter's
_FLOAT_DTYPES = ("F16", "BF16", "F32")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's saved names; the
# adapter name is stripped on save).
_TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\."
                     r"(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# Config fields whose features tidal does not implement: refused when set (truthy).
_UNSUPPORTED_FIELDS = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "trainable_token_indices": "trainable_token_indices",
    "lora_bias": "lora_bias",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "layer_replication": "layer_replication",
    "use_qalora": "QALoRA (use_qalora)",
    "use_bdlora": "use_bdlora",
}


class LoRAAdapterError(ValueError):
    """The adapter cannot be served; the message names the problem."""


@dataclass(frozen=True, slots=True)
class ModuleSpec:
    layer: int
    proj: str  # one of SUPPORTED_TARGETS
    rank: int
    scaling: float  # folded into B on load
    a_name: str
    b_name: str


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    path: str
    weights_file: str
    max_rank: int
    modules: tuple[ModuleSpec, ...]


def expected_shapes(arch: ArchSpec, proj: str) -> tuple[int, int]:
    """(out, in) features of a projection of the unsharded base model."""
    h, d = arch.hidden_size, arch.head_dim
    q, kv, inter = arch.num_heads * d, arch.num_kv_heads * d, arch.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter)}[proj]


def read_safetensors_header(path: str) -> dict[str, Any]:
    """The tensor table of a safetensors file (name -> {dtype, shape, data_offsets})."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise LoRAAdapterError(f"{path}: not a safetensors file (too short)")
            (size,) = struct.unpack("<Q", raw)
            if size > _MAX_HEADER:
                raise LoRAAdapterError(f"{path}: not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except OSError as exc:
        raise LoRAAdapterError(f"cannot read {path}: {exc.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise LoRAAdapterError(f"{path}: not a safetensors file (bad header)") from None
    if not isinstance(header, dict):
        raise LoRAAdapterError(f"{path}: not a safetensors file (bad header)")
    header.pop("__metadata__", None)
    return header


def _read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a directory")
    if not os.path.isfile(cfg_path):
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAAdapterError(f"cannot read {cfg_path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRAAdapterError(f"{cfg_path} is not a JSON object")
    return cfg


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    # PEFT's rule (peft.utils.other.get_pattern_key): the first key matching a suffix of the
    # module's name.
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _number(cfg: dict[str, Any], name: str, default: Any) -> float:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise LoRAAdapterError(f"{CONFIG_FILE}: {name} must be a positive number, got {value!r}")
    return value


def inspect_adapter(path: str, arch: ArchSpec, max_lora_rank: int) -> AdapterSpec:
    """Check the adapter at ``path`` against ``arch`` (reading only the safetensors header);
    raises ``LoRAAdapterError`` naming the problem."""
    cfg = _read_config(path)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{CONFIG_FILE}: peft_type {peft_type!r} is not LORA")
    for field_name, what in _UNSUPPORTED_FIELDS.items():
        if cfg.get(field_name):
            raise LoRAAdapterError(f"{CONFIG_FILE}: {what} is not yet supported by tidal")
    if cfg.get("bias", "none") not in ("none", None):
        raise LoRAAdapterError(f"{CONFIG_FILE}: bias {cfg['bias']!r} (trained biases) is not "
                               "yet supported by tidal; only 'none'")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for t in targets:
            if t in ("embed_tokens", "lm_head"):
                raise LoRAAdapterError(f"{CONFIG_FILE}: target_modules {t!r}: LoRA on the "
                                       "embedding / LM head is not yet supported by tidal")
            if t not in SUPPORTED_TARGETS:
                raise LoRAAdapterError(f"{CONFIG_FILE}: target_modules {t!r} is not supported "
                                       f"(supported: {', '.join(SUPPORTED_TARGETS)})")
    r = int(_number(cfg, "r", 8))
    alpha = _number(cfg, "lora_alpha", 8)
    rslora = bool(cfg.get("use_rslora", False))
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    if not isinstance(rank_pattern, dict) or not isinstance(alpha_pattern, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE}: rank_pattern and alpha_pattern must be objects")

    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        pickled = [f for f in PICKLE_FILES if os.path.isfile(os.path.join(path, f))]
        if pickled:
            raise LoRAAdapterError(
                f"LoRA adapter {path!r} has only {pickled[0]} (a pickle, which tidal never "
                f"loads); save it as {WEIGHTS_FILE} (PEFT's save_pretrained default)")
        raise LoRAAdapterError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE}")
    header = read_safetensors_header(weights)

    found: dict[tuple[int, str], dict[str, tuple[str, list[int]]]] = {}
    for name, info in header.items():
        m = _TENSOR.match(name)
        if m is None:
            if "embed_tokens" in name or "lm_head" in name:
                raise LoRAAdapterError(f"tensor {name!r}: LoRA on the embedding / LM head is not "
                                       "yet supported by tidal")
            raise LoRAAdapterError(f"tensor {name!r} is not a LoRA A/B weight of a supported "
                                   f"projection ({', '.join(SUPPORTED_TARGETS)})")
        layer, proj, ab = int(m.group(1)), m.group(3), m.group(4)
        if proj not in SUPPORTED_TARGETS:
            raise LoRAAdapterError(f"tensor {name!r}: target module {proj!r} is not supported "
                                   f"(supported: {', '.join(SUPPORTED_TARGETS)})")
        if layer >= arch.num_layers:
            raise LoRAAdapterError(f"tensor {name!r}: layer {layer} but the base model has "
                                   f"{arch.num_layers} layers")
        if info.get("dtype") not in _FLOAT_DTYPES:
            raise LoRAAdapterError(f"tensor {name!r}: dtype {info.get('dtype')!r} (expected one "
                                   f"of {', '.join(_FLOAT_DTYPES)})")
        found.setdefault((layer, proj), {})[ab] = (name, list(info.get("shape", [])))

    if not found:
        raise LoRAAdapterError(f"{weights} holds no LoRA weights")
    modules = []
    max_rank = 0
    for (layer, proj), parts in sorted(found.items()):
        if "A" not in parts or "B" not in parts:
            missing = "lora_A" if "A" not in parts else "lora_B"
            raise LoRAAdapterError(f"layer {layer} {proj}: {missing} is missing")
        (a_name, a_shape), (b_name, b_shape) = parts["A"], parts["B"]
        out_f, in_f = expected_shapes(arch, proj)
        module = f"model.layers.{layer}.{'self_attn' if proj in SUPPORTED_TARGETS[:4] else 'mlp'}" \
                 f".{proj}"
        rank = int(_pattern_value(rank_pattern, module, r))
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != in_f or b_shape[0] != out_f \
                or a_shape[0] != b_shape[1]:
            raise LoRAAdapterError(
                f"layer {layer} {proj}: shapes lora_A {a_shape} / lora_B {b_shape} do not fit "
                f"the base model (expected [r, {in_f}] / [{out_f}, r]); is it an adapter of "
                "another model?")
        if a_shape[0] != rank:
            raise LoRAAdapterError(f"layer {layer} {proj}: rank {a_shape[0]} in the weights "
                                   f"but {rank} in {CONFIG_FILE}")
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"layer {layer} {proj}: rank {rank} exceeds --max-lora-rank "
                                   f"{max_lora_rank}")
        a = _pattern_value(alpha_pattern, module, alpha)
        scaling = a / math.sqrt(rank) if rslora else a / rank
        modules.append(ModuleSpec(layer, proj, rank, float(scaling), a_name, b_name))
        max_rank = max(max_rank, rank)
    return AdapterSpec(path=path, weights_file=weights, max_rank=max_rank,
                       modules=tuple(modules))
