"""FP8 (e4m3) W8A8 linear through cuBLASLt (``torch._scaled_mm``) with row-wise scales, for
GPUs of compute capability 8.9 and up (Ada, Hopper). The semantics are ``fp8_torch.fp8_linear``'s;
shapes cuBLASLt does not take go to that reference.
"""

from __future__ import annotations

import torch

from tidal.worker.ops import fp8_torch

# cuBLASLt's FP8 GEMM wants the reduction and output dimensions in multiples of 16.
_ALIGN = 16


def supported(x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` runs ``x`` [..., K] times ``w_q`` [N, K] on cuBLASLt."""
    n, k = w_q.shape
    return (x.is_cuda and w_q.is_cuda and k % _ALIGN == 0 and n % _ALIGN == 0
            and x.shape[-1] == k and w_q.is_contiguous())


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
    if not supported(x, w_q):
        return fp8_torch.fp8_linear(x, w_q, w_scale, bias, input_scale)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    x_q, x_scale = fp8_torch.quantize_activations(x2, input_scale)
    return mm_quantized(x_q, x_scale, w_q, w_scale, bias, x.dtype).reshape(*lead, w_q.shape[0])


def mm_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                 w_scale: torch.Tensor, bias: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """Already quantized activations ``x_q`` [M, K] (e4m3, scales ``x_scale`` [M, 1]) times
    ``w_q`` [N, K]: ``[M, N]`` in ``out_dtype``. Shapes as ``supported`` takes them."""
    # Row-wise scaling gives bfloat16 out on every torch that has it; other activation
    # dtypes are cast from it.
    y = torch._scaled_mm(x_q, w_q.t(), scale_a=x_scale.contiguous(),
                         scale_b=w_scale.float().reshape(1, -1).contiguous(),
                         out_dtype=torch.bfloat16)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(out_dtype)
