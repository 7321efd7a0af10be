"""INT4 weight-only (W4A16) linear layers: AWQ and GPTQ checkpoints loaded as they are.

A layer built under ``fp8.quantizing(config)`` with an AWQ / GPTQ ``config`` has no 16-bit
``weight``; it holds tidal's one INT4 layout (``ops/int4_torch.py``): ``qweight`` int32
[N, K / 8], ``scales`` [N, G] in the model dtype, ``qzeros`` uint8 [N, G] and, for GPTQ,
``g_idx`` int32 [K] (used only with act-order). Each checkpoint tensor is converted to that
layout whole as it arrives, then goes through the layer's own weight loader, so tensor-parallel
sharding and the fused q/k/v and gate/up parts work as for a 16-bit weight: a column-parallel
rank takes a range of output rows, a row-parallel rank a range of whole packed words and of
whole groups. Act-order and one-group-per-row (``group_size`` -1) layers keep every group on a
row-parallel rank (a rank's input channels may belong to any group) and the rank's slice of
``g_idx``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.engine_core.quantization_config import QuantConfig
from tidal.worker.ops import int4_torch
from tidal.worker.ops.int4_torch import PACK

if TYPE_CHECKING:
    from tidal.worker.layers.linear import LinearBase


class Int4LoadError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Int4Layout:
    """What a layer's INT4 tensors mean beyond their shapes."""

    method: str  # "awq" | "gptq"
    group_size: int  # input channels per group (the whole row for GPTQ's -1)
    act_order: bool  # GPTQ desc_act: ``g_idx`` maps input channels to groups
    # Row-parallel ranks keep every group (act-order, one group per row).
    all_groups: bool
    zeros_minus_one: bool


def attach(layer: LinearBase, config: QuantConfig, dtype: torch.dtype) -> Int4Layout:
    """Give ``layer`` (its ``in_features`` / ``out_features`` this rank's) the INT4 parameters
    and their loaders; returns their layout."""
    k, n = layer.in_features, layer.out_features
    world = layer.tp.world_size if layer.input_sharded else 1
    k_total = k * world
    group = k_total if config.group_size == -1 else config.group_size
    all_groups = config.desc_act or config.group_size == -1
    if k % PACK:
        raise Int4LoadError(f"INT4 weights need input features in multiples of {PACK}; this "
                            f"layer has {k} per rank")
    if world > 1 and not all_groups and k % group:
        raise Int4LoadError(
            f"tensor-parallel size {world} splits the {k_total} input features of a "
            f"row-parallel INT4 layer into {k} per rank, which splits a group of {group}; use "
            "a tensor-parallel size that keeps whole groups")
    groups = -(-(k_total if all_groups else k) // group)
    layout = Int4Layout(config.method, group, config.desc_act, all_groups,
                        config.zeros_minus_one)

    def param(shape: tuple[int, ...], dt: torch.dtype, loader: Any) -> nn.Parameter:
        p = nn.Parameter(torch.empty(shape, dtype=dt), requires_grad=False)
        p.weight_loader = partial(loader, layer, layout)  # type: ignore[attr-defined]
        return p

    layer.qweight = param((n, k // PACK), torch.int32, _load_qweight)
    layer.scales = param((n, groups), dtype, _load_scales)
    layer.qzeros = param((n, groups), torch.uint8, _load_qzeros)
    if config.method == "gptq":
        layer.g_idx = param((k,), torch.int32, _load_g_idx)
    else:
        layer.register_parameter("g_idx", None)
    return layout


def matmul(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    layout = layer.w4a16
    return layer.kernels.w4a16_linear(x, layer.qweight, layer.scales, layer.qzeros,
                                      layout.group_size,
                                      layer.g_idx if layout.act_order else None, bias)


def gated_matmul(layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
                 act: str) -> torch.Tensor:
    """``act(gate) * up`` of ``matmul`` over a fused ``[gate; up]`` layer (one row on the
    GPU: the activation is the GEMV's epilogue)."""
    layout = layer.w4a16
    return layer.kernels.w4a16_gated_linear(x, layer.qweight, layer.scales, layer.qzeros,
                                            layout.group_size,
                                            layer.g_idx if layout.act_order else None, bias,
                                            act)


def _materialize(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t.materialize()


def _int32(t: Any, what: str) -> torch.Tensor:
    t = _materialize(t)
    if t.dtype not in (torch.int32, torch.uint32):
        raise Int4LoadError(f"INT4 {what} must be int32, the checkpoint has {t.dtype}")
    return t.view(torch.int32) if t.dtype == torch.uint32 else t


def _row_parallel_check(layer: LinearBase, cols: int, what: str) -> None:
    world = layer.tp.world_size
    if layer.input_sharded and cols % world:
        raise Int4LoadError(f"{what}: {cols} columns (packed words or groups of input "
                            f"channels) do not split over tensor-parallel size {world}")


def _load_qweight(layer: LinearBase, layout: Int4Layout, param: nn.Parameter, loaded: Any,
                  shard_id: object = None) -> None:
    t = _int32(loaded, "qweight")
    w = int4_torch.awq_qweight(t) if layout.method == "awq" else int4_torch.gptq_qweight(t)
    _row_parallel_check(layer, w.shape[1], "qweight")
    layer.weight_loader(param, w.to(param.device), shard_id)


def _store_groups(layer: LinearBase, layout: Int4Layout, param: nn.Parameter,
                  t: torch.Tensor, what: str, shard_id: object) -> None:
    if layer.input_sharded and layout.all_groups:
        # Every rank's input channels may fall in any group: all of them on every rank.
        layer.copy_checked(param.data, t, what)
        return
    _row_parallel_check(layer, t.shape[1], what)
    layer.weight_loader(param, t, shard_id)


def _load_scales(layer: LinearBase, layout: Int4Layout, param: nn.Parameter, loaded: Any,
                 shard_id: object = None) -> None:
    t = _materialize(loaded)
    if not t.is_floating_point():
        raise Int4LoadError(f"INT4 scales must be floating point, the checkpoint has {t.dtype}")
    _store_groups(layer, layout, param, t.t().to(param.device, param.dtype), "scales",
                  shard_id)


def _load_qzeros(layer: LinearBase, layout: Int4Layout, param: nn.Parameter, loaded: Any,
                 shard_id: object = None) -> None:
    t = _int32(loaded, "qzeros")
    z = int4_torch.zeros_of(t, layout.method == "awq", layout.zeros_minus_one)
    _store_groups(layer, layout, param, z.to(param.device), "qzeros", shard_id)


def _load_g_idx(layer: LinearBase, layout: Int4Layout, param: nn.Parameter, loaded: Any,
                shard_id: object = None) -> None:
    g = _materialize(loaded).to(torch.int32).reshape(-1)
    k_total = layer.in_features * (layer.tp.world_size if layer.input_sharded else 1)
    if g.numel() != k_total:
        raise Int4LoadError(f"g_idx has {g.numel()} entries for {k_total} input features")
    if not layout.act_order:
        # Without act-order the kernels compute the group as k // group_size: hold the
        # checkpoint to it rather than silently reading other groups.
        plain = torch.arange(k_total, dtype=torch.int32) // layout.group_size
        if not torch.equal(g.cpu(), plain):
            raise Int4LoadError("g_idx is not input channel // group_size, but the "
                                "quantization_config says desc_act false")
    groups = -(-k_total // layout.group_size)
    if int(g.min()) < 0 or int(g.max()) >= groups:
        raise Int4LoadError(f"g_idx values must lie in 0..{groups - 1} (the groups of "
                            f"{k_total} input channels in {layout.group_size}s)")
    if layer.input_sharded:
        rank, k = layer.tp.rank, layer.in_features
        g = g[rank * k:(rank + 1) * k]
    g = g.to(param.device)
    if getattr(param, "loaded_parts", None):
        # The parts of a fused layer read the same activations: one g_idx must serve all.
        if not torch.equal(param.data, g):
            raise Int4LoadError(f"g_idx of part {shard_id!r} differs from the other parts of "
                                "this fused layer (q/k/v or gate/up), which tidal runs as "
                                "one INT4 matmul")
    else:
        param.data.copy_(g)
    param.loaded_parts = True  # type: ignore[attr-defined]


@torch.no_grad()
def dummy_fill(layer: nn.Module, low: float, high: float, gen: torch.Generator) -> None:
    """Random weights for ``--load-format dummy``: drawn in float32, rounded to INT4."""
    layout: Int4Layout = layer.w4a16
    q = layer.qweight
    w = torch.empty(q.shape[0], q.shape[1] * PACK, dtype=torch.float32, device=q.device)
    w.uniform_(low, high, generator=gen)
    qweight, scales, zeros = int4_torch.quantize_rtn(w, layout.group_size)
    q.copy_(qweight)
    g = scales.shape[1]
    # (A row-parallel rank holding every group fills only its own; the rest stay unused.)
    layer.scales.zero_()
    layer.scales[:, :g].copy_(scales)
    layer.qzeros.zero_()
    layer.qzeros[:, :g].copy_(zeros)
    if layer.g_idx is not None:
        layer.g_idx.copy_(torch.arange(layer.g_idx.shape[0], device=q.device)
                          // layout.group_size)
