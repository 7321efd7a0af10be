"""``tools/int4_calibration_study.py``'s GPTQ (the study behind the INT4 perplexity figures of
issue 23): on a random layer with correlated inputs its weights lie on each group's 4-bit grid
and its output error, weighted by the inputs' Hessian, is below round-to-nearest's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import int4_calibration_study as study  # noqa: E402


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

    assert output_error(q_gptq) < 0.8 * output_error(q_rtn)
    if not act_order:  # each row's group holds at most 16 levels, one scale apart
        for c in range(0, k, g):
            for row in q_gptq[:, c:c + g]:
                levels = row.unique()
                assert len(levels) <= 16
                steps = levels.diff()
                assert torch.allclose(steps / steps.min(), (steps / steps.min()).round(),
                                      atol=1e-6)
