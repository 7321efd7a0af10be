"""Block-wise FP8 linear layers: ``fp8`` checkpoints with ``weight_block_size`` (Qwen3-*-FP8,
DeepSeek-V3 style) loaded as they are, and ``--fp8-group-size`` G on a 16/32-bit checkpoint:
one-row blocks of G input channels, each weight quantized as it loads (whole rows, so a
row-parallel rank's groups are those of one rank).

A layer built under ``fp8.quantizing(config)`` with ``config.weight_block`` keeps ``weight`` as
e4m3 [out, in] (sharded like a 16-bit weight) and ``weight_scale_inv`` float32
[out, ceil(in / block_k)]: the checkpoint's per-block scale repeated for each row of its block
(``ops/fp8_block_torch.py``), so the fused q/k/v and gate/up parts and the column-parallel
ranks take their rows of it exactly as they take the weight's, whatever the block height. A
row-parallel rank takes whole blocks of input channels: a tensor-parallel size that would
split one is refused at start-up. ``weight_scale`` stays None: the per-row FP8 paths (GEMV,
fused norms, push all-reduce) never see these layers; their matmul is
``Kernels.fp8_block_linear``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.engine_core.quantization_config import QuantConfig
from tidal.worker.loader.safetensors_weights import materialize
from tidal.worker.ops.fp8_block_torch import expand_block_scale, quantize_weight_blocks
from tidal.worker.ops.fp8_torch import FP8_DTYPE

if TYPE_CHECKING:
    from tidal.worker.layers.linear import LinearBase


class Fp8BlockLoadError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Fp8BlockLayout:
    block_n: int  # output rows per weight scale (the checkpoint's blocks)
    block_k: int  # input channels per weight scale and per activation scale


def attach(layer: LinearBase, config: QuantConfig) -> Fp8BlockLayout:
    """Give ``layer`` (its ``weight`` already e4m3; ``in_features`` this rank's) the block
    scale and the loaders; returns the layout."""
    assert config.weight_block is not None
    block_n, block_k = config.weight_block
    k = layer.in_features
    if layer.input_sharded and layer.tp.world_size > 1 and k % block_k:
        raise Fp8BlockLoadError(
            f"tensor-parallel size {layer.tp.world_size} splits the "
            f"{k * layer.tp.world_size} input features of a row-parallel block-wise FP8 layer "
            f"into {k} per rank, which splits a block of {block_k}; use a tensor-parallel size "
            "that keeps whole blocks")
    layout = Fp8BlockLayout(block_n, block_k)
    layer.weight.weight_loader = partial(  # type: ignore[attr-defined]
        _load_weight if config.prequantized else _quantize_weight, layer, layout)
    layer.register_parameter("weight_scale", None)
    layer.register_parameter("input_scale", None)
    layer.weight_scale_inv = nn.Parameter(
        torch.ones(layer.out_features, -(-k // block_k), dtype=torch.float32),
        requires_grad=False)
    layer.weight_scale_inv.weight_loader = partial(  # type: ignore[attr-defined]
        _load_scale, layer, layout)
    if not config.prequantized:
        # Computed as the weight loads: the checkpoint has no such tensor.
        layer.weight_scale_inv.derived_on_load = True  # type: ignore[attr-defined]
    return layout


def matmul(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    layout = layer.fp8_block
    return layer.kernels.fp8_block_linear(x, layer.weight, layer.weight_scale_inv,
                                          layout.block_k, bias)


def gated_matmul(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
                 act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``matmul`` over a fused ``[gate; up]`` layer (1-8 rows on the GPU:
    the activation is the few-row product's epilogue)."""
    return layer.kernels.fp8_block_gated_linear(x, layer.weight, layer.weight_scale_inv,
                                                layer.fp8_block.block_k, bias, act)


def _load_weight(layer: LinearBase, layout: Fp8BlockLayout, param: nn.Parameter,
                 loaded: Any, shard_id: object = None) -> None:
    # (A lazy checkpoint tensor tells its dtype by a one-row read; the rank's shard is read
    # by the layer's own loader.)
    dtype = (loaded if isinstance(loaded, torch.Tensor) else loaded.narrow(0, 0, 1)).dtype
    if dtype != FP8_DTYPE:
        raise Fp8BlockLoadError(f"the block-wise FP8 checkpoint holds this weight as {dtype}, "
                                "not float8_e4m3fn")
    layer.weight_loader(param, loaded, shard_id)


def _quantize_weight(layer: LinearBase, layout: Fp8BlockLayout, param: nn.Parameter,
                     loaded: Any, shard_id: object = None) -> None:
    """A 16/32-bit checkpoint tensor quantized by block on the parameter's device, whole
    before any sharding; its scales go where the weight's rows go (``_load_scale``)."""
    t = materialize(loaded)
    if t.dtype == FP8_DTYPE:
        raise Fp8BlockLoadError("an FP8 weight in a checkpoint without a quantization_config "
                                "(its scales are unknown)")
    q, scale = quantize_weight_blocks(t.to(param.device), layout.block_n, layout.block_k)
    del t
    layer.weight_loader(param, q, shard_id)
    _load_scale(layer, layout, layer.weight_scale_inv, scale, shard_id)


def _load_scale(layer: LinearBase, layout: Fp8BlockLayout, param: nn.Parameter, loaded: Any,
                shard_id: object = None) -> None:
    s = materialize(loaded)
    if not s.is_floating_point():
        raise Fp8BlockLoadError(f"weight_scale_inv must be floating point, got {s.dtype}")
    rows = layer.checkpoint_rows(shard_id)
    try:
        per_row = expand_block_scale(s, rows, layout.block_n)
    except ValueError as exc:
        raise Fp8BlockLoadError(str(exc)) from None
    layer.weight_loader(param, per_row, shard_id)


@torch.no_grad()
def dummy_fill(layer: nn.Module, low: float, high: float, gen: torch.Generator) -> None:
    """Random weights for ``--load-format dummy``: drawn in float32, quantized by block."""
    w = layer.weight
    layout: Fp8BlockLayout = layer.fp8_block
    tmp = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    tmp.uniform_(low, high, generator=gen)
    q, scale = quantize_weight_blocks(tmp, layout.block_n, layout.block_k)
    w.copy_(q)
    layer.weight_scale_inv.copy_(expand_block_scale(scale, w.shape[0], layout.block_n))
