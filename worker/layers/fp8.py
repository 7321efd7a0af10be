"""FP8 (e4m3) weights for the linear layers of a model built under ``quantizing(config)``.

A quantized layer keeps ``weight`` as ``torch.float8_e4m3fn`` [out, in] (sharded like the 16-bit
weight), a float32 ``weight_scale`` [out, 1] (one per output row, whole rows on every rank that
holds them) and, for checkpoints with static activation scales, a float32 ``input_scale`` [1].
Its weight loader quantizes each 16/32-bit checkpoint tensor as it arrives (``fp8_torch``
``quantize_rows``: amax / 448 per row, over the whole row before any column sharding), so the
load never holds more than one tensor in 16/32 bits; a compressed-tensors FP8 checkpoint's
tensors and scales are copied as they are (a per-tensor scale broadcast to every row).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.engine_core.quantization_config import QuantConfig
from tidal.worker.ops.fp8_torch import FP8_DTYPE, quantize_rows

if TYPE_CHECKING:
    from tidal.worker.layers.linear import LinearBase

_QUANT: ContextVar[QuantConfig | None] = ContextVar("tidal_quant_building", default=None)


@contextlib.contextmanager
def quantizing(config: QuantConfig | None) -> Iterator[None]:
    """Linear layers constructed inside store FP8 weights (``config`` None: 16/32-bit)."""
    token = _QUANT.set(config)
    try:
        yield
    finally:
        _QUANT.reset(token)


def current_quant() -> QuantConfig | None:
    return _QUANT.get()


class Fp8LoadError(ValueError):
    pass


def attach(layer: LinearBase, config: QuantConfig) -> None:
    """Give ``layer`` (its ``weight`` already FP8) its scales and the FP8 weight loaders."""
    out = layer.weight.shape[0]
    layer.weight_scale = nn.Parameter(torch.ones(out, 1, dtype=torch.float32),
                                      requires_grad=False)
    layer.weight.weight_loader = partial(_load_weight, layer, config)  # type: ignore[attr-defined]
    layer.weight_scale.weight_loader = partial(_load_scale, layer)  # type: ignore[attr-defined]
    if not config.prequantized:
        # Computed as the weight loads: the checkpoint has no such tensor.
        layer.weight_scale.derived_on_load = True  # type: ignore[attr-defined]
    if config.static_activations:
        layer.input_scale = nn.Parameter(torch.zeros(1, dtype=torch.float32),
                                         requires_grad=False)
        layer.input_scale.weight_loader = _load_input_scale  # type: ignore[attr-defined]
    else:
        layer.register_parameter("input_scale", None)


def _materialize(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.materialize()


def _load_weight(layer: LinearBase, config: QuantConfig, param: nn.Parameter, loaded: Any,
                 shard_id: object = None) -> None:
    t = _materialize(loaded)
    if config.prequantized:
        if t.dtype != FP8_DTYPE:
            raise Fp8LoadError(f"the FP8 checkpoint holds this weight as {t.dtype}, not "
                               "float8_e4m3fn")
        layer.weight_loader(param, t, shard_id)
        return
    if t.dtype == FP8_DTYPE:
        raise Fp8LoadError("an FP8 weight in a checkpoint without a compressed-tensors "
                           "quantization_config (its scales are unknown)")
    # Quantized on the parameter's device (a GPU does it in microseconds), whole rows first:
    # a row-parallel rank's scale is the full row's, as on one rank.
    q, scale = quantize_rows(t.to(param.device))
    del t
    layer.weight_loader(param, q, shard_id)
    _store_scale(layer, layer.weight_scale, scale, shard_id)


def _load_scale(layer: LinearBase, param: nn.Parameter, loaded: Any,
                shard_id: object = None) -> None:
    s = _materialize(loaded).float()
    if s.numel() == 1:  # per-tensor: the same scale for every row of this part
        s = s.reshape(1, 1).expand(layer.checkpoint_rows(shard_id), 1)
    elif s.dim() == 1:
        s = s.reshape(-1, 1)
    _store_scale(layer, param, s, shard_id)


def _store_scale(layer: LinearBase, param: nn.Parameter, scale: torch.Tensor,
                 shard_id: object) -> None:
    if layer.input_sharded:
        # Row-parallel: every rank holds every output row, so all of the scales.
        layer.copy_checked(param.data, scale, "weight scale")
    else:
        # Output rows shard (and fuse) exactly as the weight's rows do.
        layer.weight_loader(param, scale, shard_id)


def _load_input_scale(param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
    s = _materialize(loaded).float().reshape(-1)
    if s.numel() != 1:
        raise Fp8LoadError(f"input_scale must be one value (per-tensor), got shape "
                           f"{tuple(s.shape)}")
    # The q/k/v (gate/up) parts read the same activations: one scale, the largest, covers all.
    param.data.copy_(torch.maximum(param.data, s.to(param.device)))


@torch.no_grad()
def dummy_fill(layer: nn.Module, low: float, high: float, gen: torch.Generator) -> None:
    """Random weights for ``--load-format dummy``, drawn in float32 and quantized."""
    w = layer.weight
    tmp = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    tmp.uniform_(low, high, generator=gen)
    q, scale = quantize_rows(tmp)
    w.copy_(q)
    layer.weight_scale.copy_(scale)
