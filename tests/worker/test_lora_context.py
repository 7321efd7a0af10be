"""``LoRAContext``'s shrink scratch (``worker/lora/layers.py``): each layer's block of one
buffer, zeroed once per forward pass by its first user, handed out only inside a pass, and
never twice between two zeroings (a block written twice would sum two products)."""

from __future__ import annotations

import torch

from tidal.worker.kernel_policy import reference_kernels
from tidal.worker.lora.layers import LoRAContext, LoRALayer


def _layers(ctx: LoRAContext, ranks: list[int], max_rows: int = 4,
            max_bytes: int = 1 << 20) -> list[LoRALayer]:
    layers = [LoRALayer(("p",), (4,), 8, 2, r, torch.float32, torch.device("cpu"), ctx,
                        reference_kernels()) for r in ranks]
    ctx.use_scratch(layers, max_rows, max_bytes)
    return layers


def test_blocks_are_disjoint_aligned_and_zeroed_once_per_pass():
    ctx = LoRAContext(8, torch.device("cpu"))
    l0, l1, l2 = _layers(ctx, [4, 6, 1])  # (6 and 1 columns: padded to 8 and 4)
    assert [layer.scratch_at for layer in (l0, l1, l2)] == [0, 4, 12]
    assert ctx.scratch_width == 16 and ctx.scratch.numel() == 4 * 16
    ctx.scratch.fill_(float("nan"))
    assert ctx.zeroed(l0, 3) is None  # no pass open yet
    ctx.begin_forward()
    blocks = [ctx.zeroed(layer, 3) for layer in (l0, l1, l2)]
    assert [tuple(b.shape) for b in blocks] == [(3, 4), (3, 6), (3, 1)]
    assert [b.storage_offset() for b in blocks] == [0, 12, 36]
    assert all(not b.any() for b in blocks)
    for k, b in enumerate(blocks):
        b.fill_(k + 1)  # the shrinks' sums
    # Side by side in the zeroed prefix, each its own (the padding stays zero).
    assert ctx.scratch[:12].eq(1).all() and ctx.scratch[12:30].eq(2).all()
    assert ctx.scratch[36:39].eq(3).all() and not ctx.scratch[30:36].any()
    assert ctx.scratch[48:].isnan().all()
    # The same layer again in the pass: no block (it zeroes an output of its own).
    assert ctx.zeroed(l1, 3) is None
    # After the pass: none, even for a layer that took none in it.
    ctx.end_forward()
    l2.scratch_pass = 0
    assert ctx.zeroed(l2, 3) is None
    # The next pass zeroes again, for its own row count.
    ctx.begin_forward()
    b1 = ctx.zeroed(l1, 2)
    assert tuple(b1.shape) == (2, 6) and not ctx.scratch[:32].any()
    # Another row count within the pass, or more rows than the scratch holds: none.
    assert ctx.zeroed(l0, 1) is None
    ctx.begin_forward()
    assert ctx.zeroed(l0, 5) is None and ctx.zeroed(l0, 0) is None


def test_rows_bounded_by_bytes():
    ctx = LoRAContext(8, torch.device("cpu"))
    (layer,) = _layers(ctx, [8], max_rows=256, max_bytes=3 * 8 * 4)
    assert ctx.scratch_rows == 3
    ctx.begin_forward()
    assert ctx.zeroed(layer, 4) is None and ctx.zeroed(layer, 3) is not None
    _layers(ctx, [8], max_rows=256, max_bytes=16)  # not one row fits: no scratch
    ctx.begin_forward()
    assert ctx.scratch is None and ctx.zeroed(layer, 1) is None
