"""``tools/quant_accuracy_study.py`` (the study behind issue 23's perplexity figures beyond the
fixed text): its GPTQ, on a random layer with correlated inputs, keeps each group's weights on
its 4-bit grid and leaves a smaller input-weighted output error than round-to-nearest; its FP8
cases are the engine's own quantizers at each granularity."""

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


def test_fp8_granularities_compose_the_engines_quantizers():
    """The study's FP8 cases: a scale per row is the engine's on-load quantizer's, a scale per
    row and 128 channels is that applied to each slice, per token likewise for activations."""
    from tidal.worker.ops.fp8_torch import quantize_rows

    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 320, generator=gen) * torch.logspace(-2, 1, 320)  # a ragged last slice
    q, s = quantize_rows(w)
    assert torch.equal(study.fp8_weight(w, 1, 0), q.float() * s)
    grouped = study.fp8_weight(w, 1, 128)
    for c in range(0, 320, 128):
        assert torch.equal(grouped[:, c:c + 128], study.fp8_weight(w[:, c:c + 128], 1, 0))
    assert not torch.equal(grouped, study.fp8_weight(w, 1, 0))
    assert torch.equal(study.fp8_input(w.reshape(4, 50, 320), 128).reshape(200, 320), grouped)
