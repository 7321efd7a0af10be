"""Gated activation of the MLP: silu(gate) * up over a fused [gate | up] input."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
