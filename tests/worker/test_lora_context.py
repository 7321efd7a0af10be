"""``LoRAContext``'s shrink scratch (``worker/lora/layers.py``): each layer's block of one
buffer, zeroed once per forward pass by its first user, and never handed out twice between
two zeroings (a block written twice would sum two products)."""

from __future__ import annotations

import torch

from tidal.worker.lora.layers import LoRAContext, LoRALayer
from tidal.worker.ops.kernels import Kernels


def _layers(ctx: LoRAContext, widths: list[int]) -> list[LoRALayer]:
    layers, at = [], 0
    for w in widths:
        layer = LoRALayer(("p",), (4,), 8, 2, w, torch.float32, torch.device("cpu"), ctx,
                          Kernels.__new__(Kernels))
        layer.scratch_at, at = at, at + w
        layers.append(layer)
    ctx.use_scratch(at, 4)
    return layers


def test_blocks_are_disjoint_and_zeroed_once_per_pass():
    ctx = LoRAContext(8, torch.device("cpu"))
    l0, l1, l2 = _layers(ctx, [2, 3, 1])
    ctx.scratch.fill_(float("nan"))
    ctx.begin_forward()
    blocks = [ctx.zeroed(layer, 3) for layer in (l0, l1, l2)]
    assert [tuple(b.shape) for b in blocks] == [(3, 2), (3, 3), (3, 1)]
    assert all(not b.any() for b in blocks)
    for k, b in enumerate(blocks):
        b.fill_(k + 1)  # the shrinks' sums
    # Side by side in the zeroed prefix, each its own.
    assert ctx.scratch[:18].tolist() == [1.0] * 6 + [2.0] * 9 + [3.0] * 3
    assert ctx.scratch[18:].isnan().all()
    # The same layer again in the pass (or a pass never begun): no block, it zeroes its own.
    assert ctx.zeroed(l1, 3) is None
    # The next pass zeroes again, for its own row count.
    ctx.begin_forward()
    b1 = ctx.zeroed(l1, 2)
    assert tuple(b1.shape) == (2, 3) and not b1.any() and not ctx.scratch[:12].any()
    # Another row count within the pass, or more rows than the scratch holds: none.
    assert ctx.zeroed(l0, 1) is None
    ctx.begin_forward()
    assert ctx.zeroed(l0, 5) is None and ctx.zeroed(l0, 0) is None


def test_no_scratch_no_blocks():
    ctx = LoRAContext(8, torch.device("cpu"))
    (layer,) = _layers(ctx, [2])
    ctx.use_scratch(2, 0)
    ctx.begin_forward()
    assert ctx.scratch is None and ctx.zeroed(layer, 1) is None
