"""INT4 weight-only (W4A16) checkpoints: the AWQ and GPTQ ``quantization_config`` blocks that
tidal loads as they are, checked once at start-up.

Accepted: AWQ "gemm" checkpoints (4 bits, zero points, groups of 32, 64 or 128 input channels)
and GPTQ checkpoints in the classic or v2 format (4 bits, groups of 32/64/128 or one group per
row, with or without act-order, symmetric or not). Everything else (other bit widths, AWQ's
GEMV / exllama / Marlin layouts, Marlin-format GPTQ, per-module overrides, a quantized LM head)
is refused naming the value, rather than loaded in a way that would differ from what the
checkpoint means.
"""

from __future__ import annotations

from typing import Any

from tidal.engine_core.quantization_config import QuantConfig, QuantConfigError

AWQ_GROUP_SIZES = (32, 64, 128)
GPTQ_GROUP_SIZES = (32, 64, 128, -1)


def int4_quant_config(requested: str | None, qc: Any, dummy: bool = False) -> QuantConfig:
    """The ``QuantConfig`` of an AWQ / GPTQ checkpoint whose config.json holds ``qc`` (None:
    it has none), when ``--quantization`` is ``requested``. ``dummy`` (random weights, for
    benchmarks): without ``qc``, INT4 in groups of 128 as the common checkpoints have."""
    if qc is None and dummy:
        return QuantConfig(method=str(requested), group_size=128)
    if qc is None:
        # tidal reads INT4 checkpoints; it does not quantize 16-bit weights to 4 bits itself.
        raise QuantConfigError(
            f"quantization {requested!r} needs a checkpoint whose config.json has a "
            f"quantization_config with quant_method {requested!r} (quantizing a 16/32-bit "
            "checkpoint to INT4 on load is not yet implemented in tidal)")
    if not isinstance(qc, dict):
        raise QuantConfigError(f"quantization_config must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if requested not in (None, method):
        raise QuantConfigError(f"quantization {requested!r} of a checkpoint whose "
                               f"quantization_config quant_method is {method!r} is not yet "
                               f"implemented in tidal (leave --quantization out, or pass "
                               f"{method!r})")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise QuantConfigError(f"{method} with bits {bits!r} is not yet implemented in tidal "
                               "(INT4 only: bits 4)")
    if method == "awq":
        return _awq(qc)
    return _gptq(qc)


def _awq(qc: dict[str, Any]) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise QuantConfigError(f"AWQ version {qc.get('version')!r} is not yet implemented in "
                               "tidal (only 'gemm' checkpoints load)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if group not in AWQ_GROUP_SIZES:
        raise QuantConfigError(f"AWQ group_size {group!r} is not yet implemented in tidal "
                               f"(accepted: {', '.join(map(str, AWQ_GROUP_SIZES))})")
    if qc.get("zero_point", True) is not True:
        raise QuantConfigError(f"AWQ zero_point {qc.get('zero_point')!r} is not yet "
                               "implemented in tidal (only zero_point true)")
    skipped = qc.get("modules_to_not_convert") or []
    if skipped:
        raise QuantConfigError(f"AWQ modules_to_not_convert {skipped!r} is not yet implemented "
                               "in tidal (every decoder linear must be quantized)")
    return QuantConfig(method="awq", prequantized=True, group_size=group)


def _gptq(qc: dict[str, Any]) -> QuantConfig:
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise QuantConfigError(f"GPTQ checkpoint_format {fmt!r} is not yet implemented in "
                               "tidal (accepted: gptq, gptq_v2)")
    group = qc.get("group_size")
    if group not in GPTQ_GROUP_SIZES:
        raise QuantConfigError(f"GPTQ group_size {group!r} is not yet implemented in tidal "
                               f"(accepted: {', '.join(map(str, GPTQ_GROUP_SIZES))})")
    desc_act = qc.get("desc_act", False)
    sym = qc.get("sym", True)
    for key, value in (("desc_act", desc_act), ("sym", sym)):
        if not isinstance(value, bool):
            raise QuantConfigError(f"GPTQ {key} must be true or false, got {value!r}")
    if qc.get("lm_head", False):
        raise QuantConfigError("GPTQ lm_head true (a quantized LM head) is not yet implemented "
                               "in tidal")
    if qc.get("dynamic"):
        raise QuantConfigError(f"GPTQ dynamic {qc.get('dynamic')!r} (per-module overrides) is "
                               "not yet implemented in tidal")
    # (``sym`` needs nothing more: the zero points in the checkpoint say 8 for it.)
    return QuantConfig(method="gptq", prequantized=True, group_size=group, desc_act=desc_act,
                       zeros_minus_one=fmt == "gptq")
