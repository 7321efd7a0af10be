"""Block-wise FP8 (e4m3) W8A8 linear in plain torch: the reference the Triton kernels are
tested against, and what CPU workers run.

The weight ``W`` [N, K] is stored as ``W_q`` e4m3 with one float32 scale per block of
``block_n`` rows by ``block_k`` input channels (checkpoints: ``weight_scale_inv``
[ceil(N / block_n), ceil(K / block_k)], ``W ~= W_q * s``). tidal keeps that scale repeated
for every row (``[N, ceil(K / block_k)]``: a fused or tensor-parallel layer's rows then shard
as its weight's do, and a kernel reads a row's scale without dividing by ``block_n``).
Activations are quantized per token and per ``block_k`` input channels (``amax / 448`` of each
group), so each ``block_k`` slice of the product is one scale pair times an e4m3 dot product:
``y[m, n] = sum_b sx[m, b] * sw[n, b] * (x_q[m, b-th slice] . W_q[n, b-th slice])``,
accumulated in float32 and cast to the activation dtype.
"""

from __future__ import annotations

import torch

from tidal.worker.ops.fp8_torch import FP8_DTYPE, FP8_MAX, MIN_SCALE


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q, scale)``: ``x`` [M, K] in e4m3 with a float32 scale [M, ceil(K / group)] per
    token and group of ``group`` columns (the last group may be shorter)."""
    m, k = x.shape
    groups = -(-k // group)
    x32 = x.float()
    # (No pad where the groups tile K, every real model's case: padding a tensor of
    # data-dependent rows stops torch.compile's graph.)
    if k % group:
        x32 = torch.nn.functional.pad(x32, (0, groups * group - k))
    tiles = x32.view(m, groups, group)
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, groups * group)[:, :k], scale


def expand_block_scale(scale: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """A checkpoint's block scale [ceil(rows / block_n), KB] repeated for each of ``rows``
    rows: tidal's per-row layout [rows, KB]."""
    if scale.dim() != 2 or scale.shape[0] != -(-rows // block_n):
        raise ValueError(f"a block scale for {rows} rows in blocks of {block_n} has "
                         f"{-(-rows // block_n)} rows, got shape {tuple(scale.shape)}")
    return scale.float().repeat_interleave(block_n, dim=0)[:rows]


def quantize_weight_blocks(w: torch.Tensor, block_n: int, block_k: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_q, scale)``: ``w`` [N, K] in e4m3 with a checkpoint-layout float32 scale
    [ceil(N / block_n), ceil(K / block_k)] (``amax / 448`` of each block). What a block-wise
    FP8 checkpoint holds; used for random weights and by tests."""
    n, k = w.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    w32 = torch.nn.functional.pad(w.float(), (0, kb * block_k - k, 0, nb * block_n - n))
    tiles = w32.view(nb, block_n, kb, block_k)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (tiles / scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * block_n, kb * block_k)[:n, :k].contiguous(), scale


def dequantize_weight(w_q: torch.Tensor, w_scale: torch.Tensor, block_k: int) -> torch.Tensor:
    """``w_q`` [N, K] times its per-row block scale [N, ceil(K / block_k)], in float32."""
    k = w_q.shape[1]
    return w_q.float() * w_scale.float().repeat_interleave(block_k, dim=1)[:, :k]


def fp8_block_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, block_k: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] (16/32-bit) times the block-wise FP8 weight ``w_q`` [N, K] with its
    per-row block scale ``w_scale`` [N, ceil(K / block_k)]: activations quantized per token
    and group of ``block_k``, the dequantized product in float32, cast to ``x.dtype``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    k = x2.shape[1]
    x_q, x_scale = quantize_groups(x2, block_k)
    if k % block_k:
        a = x_q.float() * x_scale.repeat_interleave(block_k, dim=1)[:, :k]
    else:
        a = (x_q.float().view(-1, k // block_k, block_k) * x_scale[..., None]).view(-1, k)
    y = a @ dequantize_weight(w_q, w_scale, block_k).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, w_q.shape[0])
