"""Gated activations of the MLP over a fused [gate | up] input: silu(gate) * up (SwiGLU) and
gelu_tanh(gate) * up (GeGLU)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers import fp8_block, int4


class GatedActivation(nn.Module):
    """``act(gate) * up`` over a fused ``[gate | up]`` input; ``act`` names it for
    ``Kernels.gated_linear``."""

    act = ""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = current_kernels()

    def project(self, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``self(linear(x))`` for a fused ``[gate | up]`` linear layer, as one op where the
        layer's weight is a plain one (no bias, no FP8 weights), INT4 or block-wise FP8: for
        one row on the GPU (block-wise FP8: 1-8 rows), the GEMV or few-row product with this
        activation as its epilogue; with LoRA adapters, the shrink, then that GEMV adding
        their products before the activation (``LoRALayer.gemv``)."""
        if linear.lora is not None:
            if linear.bias is None and linear.lora_gemv_applies(x, act=self.act):
                return linear.lora.gemv(x, linear.weight, act=self.act)[0]
            return self(linear(x))
        if linear.w4a16 is not None:
            return int4.gated_matmul(linear, x, linear.bias, self.act)
        if linear.fp8_block is not None:
            return fp8_block.gated_matmul(linear, x, linear.bias, self.act)
        if linear.bias is None and linear.plain_weight:
            return self.kernels.gated_linear(x, linear.weight, self.act)
        return self(linear(x))


class SiluAndMul(GatedActivation):
    act = "silu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(x)


class GeluTanhAndMul(GatedActivation):
    """GeGLU of Gemma: gelu(gate, tanh approximation) * up over a fused [gate | up] input."""

    act = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gelu_tanh_and_mul(x)
