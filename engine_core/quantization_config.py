"""Which weight quantization a model runs with, validated once at start-up.

``build_quant_config(requested, hf_config, family)`` reads ``--quantization`` (vLLM's name) and
the checkpoint's own ``quantization_config`` and returns a frozen ``QuantConfig`` (None: the
weights stay in the model dtype). tidal implements one scheme so far: FP8 e4m3 weights with a
float32 scale per output channel and activations quantized per token (W8A8), either quantized
from a 16/32-bit checkpoint as it loads or read as they are from a compressed-tensors FP8
checkpoint or an ``fp8`` one (AutoFP8's per-tensor scales); block-wise FP8 checkpoints
(``quant_method: fp8`` with ``weight_block_size``, as Qwen3-*-FP8 and DeepSeek-V3 ship): e4m3
weights with a float32 scale per weight block, activations quantized per token and per block
of input channels (compressed-tensors' ``block`` strategy too), or ``--fp8-group-size`` on a
16/32-bit checkpoint (a scale per row and group of input channels, quantized on load); and INT4
AWQ / GPTQ checkpoints (int4_config.py). Everything else is
refused here, naming what was asked for, rather than loaded in a way that would silently
differ from what the checkpoint means.
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
    # Block-wise FP8 (``fp8`` checkpoints with ``weight_block_size``, or ``--fp8-group-size``
    # on a 16/32-bit one: one-row blocks, quantized on load): (output rows, input channels)
    # per weight scale; activations scaled per token and per ``weight_block[1]`` input
    # channels (worker/layers/fp8_block.py). None: per-row weight scales.
    weight_block: tuple[int, int] | None = None
    # The checkpoint's name for the block scale: ``weight_scale_inv`` (``fp8`` checkpoints) or
    # ``weight_scale`` (compressed-tensors); the layer's parameter is ``weight_scale_inv``.
    block_scale_name: str = "weight_scale_inv"

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
    # The LM head is never quantized here; other unquantized layers would need a per-layer
    # choice tidal does not make yet.
    _only_lm_head_ignored(qc.get("ignore"), "ignore")
    static = False
    blocks: set[tuple[int, int] | None] = set()
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise QuantConfigError(f"quantization_config: config group {name!r} is not an "
                                   "object")
        weights = _fp8_args(group.get("weights"), f"config group {name!r} weights")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "block"):
            raise QuantConfigError(
                f"quantization_config: FP8 weights with strategy {strategy!r} (config group "
                f"{name!r}) are not yet implemented in tidal (per-tensor, per-channel or "
                "block only)")
        if weights.get("symmetric", True) is not True:
            raise QuantConfigError("quantization_config: asymmetric FP8 weights are not yet "
                                   "implemented in tidal")
        acts = group.get("input_activations")
        if acts is None:
            raise QuantConfigError(
                f"quantization_config: config group {name!r} has no input_activations "
                "(weight-only FP8, W8A16) is not yet implemented in tidal")
        acts = _fp8_args(acts, f"config group {name!r} input_activations")
        block = None
        if strategy == "block":
            block = _block_size(weights.get("block_structure"), "block_structure")
            if (not acts.get("dynamic", False) or acts.get("strategy") != "group"
                    or acts.get("group_size") != block[1]):
                raise QuantConfigError(
                    f"quantization_config: block FP8 weights (config group {name!r}) need "
                    f"dynamic activations of strategy 'group' with group_size {block[1]}, "
                    f"got {acts.get('strategy')!r} / {acts.get('group_size')!r} / dynamic "
                    f"{acts.get('dynamic', False)!r}")
        elif not acts.get("dynamic", False):
            if acts.get("strategy", "tensor") != "tensor":
                raise QuantConfigError("quantization_config: static activation scales other "
                                       "than per-tensor are not yet implemented in tidal")
            static = True
        elif acts.get("strategy", "token") not in ("token", "tensor"):
            raise QuantConfigError(
                f"quantization_config: dynamic activations of strategy "
                f"{acts.get('strategy')!r} with per-tensor or per-channel weights are not yet "
                "implemented in tidal (per token)")
        blocks.add(block)
    if len(blocks) > 1:
        raise QuantConfigError("quantization_config: config groups with different FP8 weight "
                               "strategies are not yet implemented in tidal (one for all)")
    block = blocks.pop()
    if block is not None:
        return QuantConfig(prequantized=True, weight_block=block,
                           block_scale_name="weight_scale")
    return QuantConfig(prequantized=True, static_activations=static)


_FP8_KINDS = ("fp8", "compressed-tensors")
MAX_BLOCK = 1024  # a weight block's side (checkpoints use 128)


def _only_lm_head_ignored(names: Any, key: str) -> None:
    others = [n for n in (names or []) if not str(n).endswith("lm_head")]
    if others:
        raise QuantConfigError(f"quantization_config: {key} {others!r} is not yet implemented "
                               "in tidal (only the LM head may stay unquantized)")


def _fp8_checkpoint(qc: dict[str, Any]) -> QuantConfig:
    """``quant_method: fp8`` (transformers' fine-grained FP8 / vLLM's ``Fp8Config``): e4m3
    weights with ``weight_scale_inv`` per block when ``weight_block_size`` is given, else
    AutoFP8's per-tensor ``weight_scale`` (and a static ``input_scale``)."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantConfigError(f"quantization_config: FP8 format {fmt!r} is not yet implemented "
                               "in tidal (only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantConfigError(f"quantization_config: activation_scheme must be 'dynamic' or "
                               f"'static', got {scheme!r}")
    for key in ("ignored_layers", "modules_to_not_convert"):
        _only_lm_head_ignored(qc.get(key), key)
    raw = qc.get("weight_block_size")
    if raw is None:
        return QuantConfig(prequantized=True, static_activations=scheme == "static")
    block = _block_size(raw, "weight_block_size")
    if scheme != "dynamic":
        raise QuantConfigError("quantization_config: block-wise FP8 weights with static "
                               "activation scales are not a format tidal knows (block-wise "
                               "checkpoints quantize activations dynamically)")
    return QuantConfig(prequantized=True, weight_block=block)


def _fp8_groups(requested: str | None, hf_config: dict[str, Any], family: str,
                group: Any) -> QuantConfig:
    """``--quantization fp8 --fp8-group-size G``: a 16/32-bit checkpoint quantized on load
    with a scale per output row and G input channels, activations per token and G channels,
    the block-wise layout with one-row blocks (worker/layers/fp8_block.py)."""
    if requested != "fp8":
        raise QuantConfigError(f"--fp8-group-size applies to --quantization fp8 only, got "
                               f"--quantization {requested}")
    if hf_config.get("quantization_config") is not None:
        raise QuantConfigError("--fp8-group-size quantizes a 16/32-bit checkpoint as it loads; "
                               "this checkpoint is already quantized (its own scales are "
                               "used: leave --fp8-group-size unset)")
    if (not isinstance(group, int) or isinstance(group, bool) or not 16 <= group <= MAX_BLOCK
            or group & (group - 1)):
        raise QuantConfigError(f"--fp8-group-size must be a power of two from 16 to "
                               f"{MAX_BLOCK}, got {group!r}")
    if family not in FP8_FAMILIES:
        raise QuantConfigError(f"FP8 groups (--fp8-group-size) for model family {family!r} are "
                               f"not yet implemented in tidal (families: "
                               f"{', '.join(FP8_FAMILIES)})")
    return QuantConfig(weight_block=(1, group))


def _block_size(block: Any, key: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 16 <= b <= MAX_BLOCK
                       and b & (b - 1) == 0 for b in block)):
        raise QuantConfigError(f"quantization_config: {key} must be two powers of two from 16 "
                               f"to {MAX_BLOCK} ([rows, input channels]), got {block!r}")
    return block[0], block[1]


def build_quant_config(requested: str | None, hf_config: dict[str, Any],
                       family: str, dummy: bool = False,
                       fp8_group_size: int | None = None) -> QuantConfig | None:
    """The quantization of a model of ``family`` with HF config ``hf_config`` when the user
    asked for ``requested`` (``--quantization``; None: whatever the checkpoint says).
    ``dummy``: random weights (``--load-format dummy``), which need no INT4 checkpoint.
    ``fp8_group_size`` (``--fp8-group-size``): FP8 quantized on load with a scale per row and
    group of input channels instead of per row."""
    if fp8_group_size is not None:
        return _fp8_groups(requested, hf_config, family, fp8_group_size)
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
        if requested not in (None, method) and not (requested == "fp8" and method in _FP8_KINDS):
            raise QuantConfigError(f"--quantization {requested} asked for, but the checkpoint "
                                   f"is quantized with {method!r}: leave --quantization unset "
                                   "to load it as it is")
        if method == "fp8":
            config: QuantConfig | None = _fp8_checkpoint(qc)
        elif method == "compressed-tensors":
            config = _compressed_tensors(qc)
        else:
            raise QuantConfigError(f"the checkpoint's quantization_config quant_method "
                                   f"{method!r} is not yet implemented in tidal (FP8 "
                                   "checkpoints (compressed-tensors, fp8) and INT4 ones (awq, "
                                   "gptq) load)")
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
