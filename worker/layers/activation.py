"""Gated activations of the MLP over a fused [gate | up] input: silu(gate) * up (SwiGLU) and
gelu_tanh(gate) * up (GeGLU)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.kernel_policy import current_kernels


class SiluAndMul(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.kernels = current_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """GeGLU of Gemma: gelu(gate, tanh approximation) * up over a fused [gate | up] input."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = current_kernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gelu_tanh_and_mul(x)
