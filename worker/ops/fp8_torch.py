"""FP8 (e4m3) W8A8 linear in plain torch: the reference every other FP8 path is tested against,
and what CPU workers run.

Weights are quantized per output channel: ``W ~= W_q * s_w`` with ``s_w = amax(row) / 448``.
Activations are quantized per token (row) the same way, or with one static scale from the
checkpoint. The product is ``(q(x) * s_x) @ (W_q * s_w).T``, accumulated in float32 and cast
to the activation dtype.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# Scales never go below this, so quantizing never divides by zero: an all-zero row gets it (its
# values quantize to 0 whatever the scale); any row with amax above 448e-12 keeps amax / 448.
MIN_SCALE = 1e-12


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(t_q, scale)``: ``t`` [rows, cols] in e4m3 with a float32 scale [rows, 1] per row,
    ``t ~= t_q * scale``."""
    t32 = t.float()
    scale = (t32.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (t32 / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_static(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``t`` in e4m3 with one given scale (a checkpoint's static activation scale)."""
    return (t.float() / scale.float()).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_activations(x: torch.Tensor, input_scale: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q [M, K], scale [M, 1] float32)`` for the 2-D ``x``: per token, or static."""
    if input_scale is None:
        return quantize_rows(x)
    scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return quantize_static(x, input_scale), scale


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] (16/32-bit) times the FP8 weight ``w_q`` [N, K] with float32 scales
    ``w_scale`` [N, 1]: the dequantized product in float32, cast to ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_activations(x2, input_scale)
    a = x_q.float() * x_scale
    b = w_q.float() * w_scale.float().reshape(-1, 1)
    y = a @ b.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, w_q.shape[0])


def fp8_weight_only_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] as it is times the dequantized FP8 weight (W8A16), float32 accumulate,
    cast to ``x.dtype``: what the one-row FP8 GEMV computes (``triton_decode.gemv``), where
    quantizing the activation would save no bytes and lose precision."""
    b = w_q.float() * w_scale.float().reshape(-1, 1)
    y = x.float() @ b.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
