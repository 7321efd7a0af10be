"""Triton kernels of multi-head latent attention (DeepSeek-V2) over the paged latent cache: the
absorbed-formulation decode (flash-decoding, split over the context) and the latent write.

Cache layout and semantics are ``mla_torch``'s (its functions are the references). Every head of
a request reads the same cached rows, so a program owns ``BLOCK_H`` heads of one request: each
latent tile is loaded once for the whole head group and feeds one ``[BLOCK_H, BLOCK_N]`` score
tile (``q_latent . c + q_rope . k_rope`` as two dots) and one ``[BLOCK_H, R]`` accumulation
(``p @ c``: the values are the latents themselves). A decode batch with too few requests to fill
the GPU cuts each context into ``num_splits`` ranges of whole tiles; their partial outputs merge
by log-sum-exp in torch. The number of splits depends only on the batch shape, never on the
sequence lengths, so a captured CUDA graph replays correctly as contexts grow.

This module imports triton at import time: import it only where triton runs (a CUDA device, or
the interpreter under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.attention_plan import decode_num_splits, next_pow2

# The latent cache's splits at most: the setting its measurements were taken with (the
# dense attention's MAX_SPLITS went to 32 on measurements of its own kernel).
MLA_MAX_SPLITS = 16

_LOG2E = 1.4426950408889634
BLOCK_H = 16  # heads per program (tl.dot needs >= 16 rows; fewer heads are masked)
BLOCK_N = 32  # context positions per inner-loop step (16 in float32: shared memory)


@triton.jit
def _attend_tile(t, t0, t1, seq_len, q_c, q_p, m_i, l_i, acc, bt_row, cache_ptr, stride_cblk,
                 stride_ctok, offs_r, r_ok, offs_p, p_ok, scale_log2, R: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE: tl.constexpr, IEEE: tl.constexpr):
    """One tile of BLOCK_N context positions into the online softmax of every head."""
    pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (pos < seq_len) & (t >= t0) & (t < t1)
    blk = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    row = cache_ptr + blk * stride_cblk + (pos % PAGE) * stride_ctok
    c = tl.load(row[:, None] + offs_r[None, :], mask=ok[:, None] & r_ok[None, :], other=0.0)
    kp = tl.load(row[:, None] + R + offs_p[None, :], mask=ok[:, None] & p_ok[None, :],
                 other=0.0)
    if IEEE:  # float32 models: no TF32 rounding in the scores (greedy ties would flip)
        s = tl.dot(q_c, tl.trans(c), input_precision="ieee") + tl.dot(
            q_p, tl.trans(kp), input_precision="ieee")
    else:
        s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_p, tl.trans(kp))
    s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a wholly masked tile (HOST)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
    return m_new, l_i, acc


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_cblk, stride_ctok,
    stride_btb,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    num_heads, scale_log2,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HOST: tl.constexpr, HOST_TILES: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    hg = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    heads = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    offs_p = tl.arange(0, BLOCK_DR)
    p_ok = offs_p < DR
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)

    # This split's range of whole tiles.
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per = tl.cdiv(tiles, NUM_SPLITS)
    t0 = sp * per
    t1 = tl.minimum(t0 + per, tiles)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = bt_ptr + b * stride_btb
    # The CPU interpreter hands out program ids (and all that derives from them) as 1-element
    # arrays, which ``range`` cannot take: there (HOST) the loop runs over every tile the block
    # table can hold and the tiles outside the split are masked.
    if HOST:
        for t in range(0, HOST_TILES):
            m_i, l_i, acc = _attend_tile(t, t0, t1, seq_len, q_c, q_p, m_i, l_i, acc, bt_row,
                                         cache_ptr, stride_cblk, stride_ctok, offs_r, r_ok,
                                         offs_p, p_ok, scale_log2, R, BLOCK_N, PAGE, IEEE)
    else:
        for t in range(t0, t1):
            m_i, l_i, acc = _attend_tile(t, t0, t1, seq_len, q_c, q_p, m_i, l_i, acc, bt_row,
                                         cache_ptr, stride_cblk, stride_ctok, offs_r, r_ok,
                                         offs_p, p_ok, scale_log2, R, BLOCK_N, PAGE, IEEE)

    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    o_row = o_ptr + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os
    tl.store(o_row + offs_r[None, :], out, mask=h_ok[:, None] & r_ok[None, :])
    tl.store(lse_ptr + b * stride_lb + heads * stride_lh + sp, lse, mask=h_ok)


def _splits(batch: int, head_groups: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter (tests): exercise the merge
    return decode_num_splits(batch, head_groups, device, max_splits=MLA_MAX_SPLITS)


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
               num_splits: int | None = None) -> torch.Tensor:
    """``mla_torch.mla_decode`` as a Triton kernel: ``q [B, H, r + dr]`` -> ``[B, H, r]``."""
    b, h, d = q.shape
    r = kv_lora_rank
    dr = d - r
    if cache.shape[-1] != d or cache.stride(-1) != 1:
        raise ValueError(f"latent cache rows of {cache.shape[-1]} values do not match the "
                         f"query's {d}")
    q = q.contiguous()
    groups = triton.cdiv(h, BLOCK_H)
    splits = num_splits or _splits(b, groups, q.device)
    partial = torch.empty(b, h, splits, r, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    host = q.device.type != "cuda"
    fp32 = q.dtype == torch.float32
    block_n = BLOCK_N // 2 if fp32 else BLOCK_N
    if b > 0:
        _mla_decode_kernel[(b, groups, splits)](
            q, cache, block_table, seq_lens, partial, lse,
            q.stride(0), q.stride(1),
            cache.stride(0), cache.stride(1),
            block_table.stride(0),
            partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1),
            h, scale * _LOG2E,
            # tl.dot needs every dimension >= 16 on the GPU; the masks cover the padding.
            R=r, DR=dr, BLOCK_R=max(16, next_pow2(r)), BLOCK_DR=max(16, next_pow2(dr)),
            BLOCK_H=BLOCK_H, BLOCK_N=block_n, PAGE=cache.shape[1],
            NUM_SPLITS=splits,
            HOST=host, HOST_TILES=triton.cdiv(block_table.shape[1] * cache.shape[1], block_n)
            if host else 0, IEEE=fp32,
            num_warps=4 if r <= 256 else 8, num_stages=1 if fp32 else 2,
        )
    if splits == 1:
        return partial[:, :, 0].to(q.dtype)
    # Log-sum-exp merge of the splits (an empty split has lse -inf and weight 0; a padding
    # request has no split with context, and comes out as zeros).
    top = lse.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp2(lse - top)
    den = w.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    return ((partial * (w / den).unsqueeze(-1)).sum(dim=2)).to(q.dtype)


@triton.jit
def _write_latent_kernel(latent_ptr, rope_ptr, cache_ptr, slot_ptr,
                         stride_lt, stride_rt, stride_cblk, stride_ctok,
                         R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_DR: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        dst = cache_ptr + (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ctok
        offs_r = tl.arange(0, BLOCK_R)
        c = tl.load(latent_ptr + t * stride_lt + offs_r, mask=offs_r < R)
        tl.store(dst + offs_r, c.to(cache_ptr.dtype.element_ty), mask=offs_r < R)
        offs_p = tl.arange(0, BLOCK_DR)
        kp = tl.load(rope_ptr + t * stride_rt + offs_p, mask=offs_p < DR)
        tl.store(dst + R + offs_p, kp.to(cache_ptr.dtype.element_ty), mask=offs_p < DR)


def write_latent(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """``mla_torch.write_latent`` as a Triton kernel (no host sync: CUDA-graph safe)."""
    n = slot_mapping.shape[0]
    r = latent.shape[-1]
    k_rope = k_rope.reshape(latent.shape[0], -1)
    dr = k_rope.shape[-1]
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if k_rope.stride(-1) != 1:
        k_rope = k_rope.contiguous()
    if n == 0:
        return
    _write_latent_kernel[(n,)](
        latent, k_rope, cache, slot_mapping,
        latent.stride(0), k_rope.stride(0), cache.stride(0), cache.stride(1),
        R=r, DR=dr, BLOCK_R=next_pow2(r), BLOCK_DR=next_pow2(dr), PAGE=cache.shape[1],
    )
