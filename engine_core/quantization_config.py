"""Which weight quantization a model runs with, validated once at start-up.

``build_quant_config(requested, hf_config, family)`` reads ``--quantization`` (vLLM's name) and
the checkpoint's own ``quantization_config`` and returns a frozen ``QuantConfig`` (None: the
weights stay in the model dtype). tidal implements one scheme so far: FP8 e4m3 weights with a
float32 scale per output channel and activations quantized per token (W8A8), either quantized
from a 16/32-bit checkpoint as it loads or read as they are from a compressed-tensors FP8
checkpoint. Everything else is refused here, naming what was asked for, rather than loaded in
a way that would silently differ from what the checkpoint means.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Dense decoder families whose linear layers take FP8 weights; the others (Gemma, Phi-3, MoE
# experts, MLA, EAGLE-3 heads, encoders) have projections or fused weights not wired for it yet.
FP8_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Mixture-of-experts families whose experts (and other linears) take FP8 quantized on load
# (layers/fused_moe.py); their FP8 checkpoints are not read yet.
FP8_MOE_FAMILIES = ("mixtral", "qwen3_moe")
_ACCEPTED = (None, "fp8", "compressed-tensors", "awq", "gptq")
INT4_METHODS = ("awq", "gptq")


class QuantConfigError(ValueError):
    """An unsupported quantization request or checkpoint; the message names it."""


class QuantConfig(msgspec.Struct, frozen=True, kw_only=True):
    # "fp8": FP8 e4m3 W8A8; "awq" / "gptq": INT4 weight-only (W4A16) checkpoints, read as they
    # are (int4_config.py checks them; worker/layers/int4.py holds the layout).
    method: str = "fp8"
    # True: the checkpoint already holds FP8 weights and their scales (compressed-tensors);
    # False: 16/32-bit weights are quantized as each one loads.
    prequantized: bool = False
    # A compressed-tensors checkpoint with static activation scales (``input_scale``);
    # otherwise each token's activations are scaled by their own amax.
    static_activations: bool = False
    # INT4 only: input channels per scale/zero group (-1: one group per whole input row),
    # GPTQ act-order (``g_idx`` maps each input channel to its group), and the GPTQ format's
    # zero points stored minus one (``checkpoint_format`` "gptq", not "gptq_v2").
    group_size: int = 0
    desc_act: bool = False
    zeros_minus_one: bool = False

    @property
    def int4(self) -> bool:
        return self.method in INT4_METHODS


def _fp8_args(args: Any, what: str) -> dict[str, Any]:
    """A compressed-tensors weights/input_activations block, checked to be FP8 e4m3."""
    if not isinstance(args, dict):
        raise QuantConfigError(f"quantization_config: {what} must be an object, got {args!r}")
    kind, bits = args.get("type", "float"), args.get("num_bits")
    if kind != "float" or bits != 8:
        raise QuantConfigError(
            f"quantization_config: compressed-tensors {what} of type {kind!r} with "
            f"{bits} bits is not yet implemented in tidal (only FP8: type 'float', 8 bits)")
    return args


def _compressed_tensors(qc: dict[str, Any]) -> QuantConfig:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise QuantConfigError("quantization_config: compressed-tensors without config_groups")
    ignore = qc.get("ignore") or []
    others = [n for n in ignore if not str(n).endswith("lm_head")]
    if others:
        # The LM head is never quantized here; other unquantized layers would need a
        # per-layer choice tidal does not make yet.
        raise QuantConfigError(f"quantization_config: ignore {others!r} is not yet implemented "
                               "in tidal (only the LM head may stay unquantized)")
    static = False
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise QuantConfigError(f"quantization_config: config group {name!r} is not an "
                                   "object")
        weights = _fp8_args(group.get("weights"), f"config group {name!r} weights")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel"):
            raise QuantConfigError(
                f"quantization_config: FP8 weights with strategy {strategy!r} (config group "
                f"{name!r}) are not yet implemented in tidal (per-tensor or per-channel only)")
        if weights.get("symmetric", True) is not True:
            raise QuantConfigError("quantization_config: asymmetric FP8 weights are not yet "
                                   "implemented in tidal")
        acts = group.get("input_activations")
        if acts is None:
            raise QuantConfigError(
                f"quantization_config: config group {name!r} has no input_activations "
                "(weight-only FP8, W8A16) is not yet implemented in tidal")
        acts = _fp8_args(acts, f"config group {name!r} input_activations")
        if not acts.get("dynamic", False):
            if acts.get("strategy", "tensor") != "tensor":
                raise QuantConfigError("quantization_config: static activation scales other "
                                       "than per-tensor are not yet implemented in tidal")
            static = True
    return QuantConfig(prequantized=True, static_activations=static)


def build_quant_config(requested: str | None, hf_config: dict[str, Any],
                       family: str, dummy: bool = False) -> QuantConfig | None:
    """The quantization of a model of ``family`` with HF config ``hf_config`` when the user
    asked for ``requested`` (``--quantization``; None: whatever the checkpoint says).
    ``dummy``: random weights (``--load-format dummy``), which need no INT4 checkpoint."""
    if requested not in _ACCEPTED:
        raise QuantConfigError(f"quantization {requested!r} is not yet implemented in tidal "
                               "(accepted: fp8, compressed-tensors for FP8 checkpoints, awq "
                               "and gptq for INT4 checkpoints)")
    qc = hf_config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if requested in INT4_METHODS or method in INT4_METHODS:
        from tidal.engine_core.int4_config import int4_quant_config

        config = int4_quant_config(requested, qc, dummy)
    elif qc is not None:
        if method != "compressed-tensors":
            raise QuantConfigError(f"the checkpoint's quantization_config quant_method "
                                   f"{method!r} is not yet implemented in tidal (only FP8 "
                                   "compressed-tensors checkpoints load)")
        config: QuantConfig | None = _compressed_tensors(qc)
    elif requested == "compressed-tensors":
        raise QuantConfigError("quantization 'compressed-tensors' needs a checkpoint whose "
                               "config.json has a compressed-tensors quantization_config")
    elif requested == "fp8":
        config = QuantConfig()
    else:
        config = None
    if (config is not None and family in FP8_MOE_FAMILIES and config.method == "fp8"
            and not config.prequantized):
        return config
    if config is not None and family not in FP8_FAMILIES:
        what = "INT4 (AWQ/GPTQ)" if config.int4 else "FP8"
        raise QuantConfigError(f"{what} quantization of model family {family!r} is not yet "
                               f"implemented in tidal (families: {', '.join(FP8_FAMILIES)})")
    return config
