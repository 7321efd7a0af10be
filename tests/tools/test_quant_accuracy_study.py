"""``tools/quant_accuracy_study.py`` (the study behind issue 23's perplexity figures beyond the
fixed text): its GPTQ, on a random layer with correlated inputs, keeps each group's weights on
its 4-bit grid and leaves a smaller input-weighted output error than round-to-nearest; its FP8
rounding keeps every block's values on the e4m3 grid of that block's own scale."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import quant_accuracy_study as study  # noqa: E402


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_round_to_nearest_on_the_layer_output(act_order):
    gen = torch.Generator().manual_seed(0)
    n, k, g, tokens = 48, 256, 64, 2048
    w = torch.randn(n, k, generator=gen, dtype=torch.float64)
    mix = torch.randn(k, k, generator=gen, dtype=torch.float64) / k ** 0.5
    x = torch.randn(tokens, k, generator=gen, dtype=torch.float64) @ (torch.eye(k) + mix)
    h = 2 * x.T @ x / tokens
    q_gptq = study.gptq(w, h, g, act_order)
    q_rtn = study.rtn(w, g)

    def output_error(q):
        d = q - w
        return torch.einsum("nk,kl,nl->", d, h, d).item()

    assert output_error(q_gptq) < 0.8 * output_error(q_rtn)  # measured 0.56
    if not act_order:  # each row's group holds at most 16 levels, one scale apart
        for c in range(0, k, g):
            for row in q_gptq[:, c:c + g]:
                levels = row.unique()
                assert len(levels) <= 16
                steps = levels.diff()
                assert torch.allclose(steps / steps.min(), (steps / steps.min()).round(),
                                      atol=1e-6)


@pytest.mark.parametrize("rows,cols", [(1, 0), (1, 128), (128, 128)])
def test_fp8_weight_blocks_have_their_own_scale(rows, cols):
    gen = torch.Generator().manual_seed(1)
    # Columns of very different sizes, and blocks cut short at both edges (200 x 320).
    w = torch.randn(200, 320, generator=gen) * torch.logspace(-2, 1, 320)
    q = study.fp8_weight(w, rows, cols)
    step_r = rows if rows > 1 else w.shape[0]
    for r in range(0, w.shape[0], step_r):
        for c in range(0, w.shape[1], cols or w.shape[1]):
            blk = w[r:r + step_r, c:c + (cols or w.shape[1])]
            qb = q[r:r + step_r, c:c + (cols or w.shape[1])]
            amax = blk.abs().amax(1, keepdim=True) if rows == 1 else blk.abs().amax()
            scale = amax / study.F8_MAX
            # On the e4m3 grid of this block's own scale, the largest value kept, and every
            # value within half an e4m3 step (3 mantissa bits; 2^-9 apart below the normals).
            assert torch.equal((qb / scale).to(study.F8).float() * scale, qb)
            assert torch.allclose(qb.abs().amax(1, keepdim=True) if rows == 1
                                  else qb.abs().amax(), amax, rtol=1e-6)
            assert ((qb - blk).abs() <= torch.maximum(blk.abs() * 2 ** -4, scale * 2 ** -10)
                    * (1 + 1e-6)).all()
    per_token = study.fp8_input(w, 128)
    assert torch.equal(per_token[:, :128], study.fp8_weight(w[:, :128], 1, 0))
