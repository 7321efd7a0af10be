"""RMSNorm, optionally fused with the residual add that precedes it; and Gemma's (1 + w) one."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers.linear import default_weight_loader, set_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = current_kernels()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, lambda p, t, shard_id=None: default_weight_loader(p, t))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from 1, and the scale is applied in
    float32 before the cast back (Llama casts first), as HF transformers does; in half precision
    the two orders round differently."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.kernels = current_kernels()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        set_weight_loader(self.weight, lambda p, t, shard_id=None: default_weight_loader(p, t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.gemma_rms_norm(x, self.weight, self.eps)

    def add_then(self, x: torch.Tensor, residual: torch.Tensor,
                 next_norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``r = residual + self(x)``; returns ``(next_norm(r), r)`` in one kernel on the GPU
        (a Gemma post-norm, the residual add and the next sub-block's pre-norm)."""
        return self.kernels.gemma_add_norm_norm(x, residual, self.weight, next_norm.weight,
                                                self.eps)
