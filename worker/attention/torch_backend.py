"""Plain-torch paged attention: the CPU backend and the reference every kernel is tested against.

It loops over requests in Python (one SDPA call each), which is exact and simple; speed on the
GPU comes from the Triton and CUDA backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.attention.fp8_kv import dequantize_kv, is_fp8, quantize_kv


def write_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows into the paged cache; slots < 0 are padding and skipped. An FP8
    cache stores them quantized with the layer's scales (``attention.fp8_kv``)."""
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_flat = kv_cache[0].view(-1, *kv_cache.shape[3:])
    v_flat = kv_cache[1].view(-1, *kv_cache.shape[3:])
    if is_fp8(kv_cache):
        # (As bytes: index_copy_ has no float8 kernel on the CPU.)
        k_flat.view(torch.uint8).index_copy_(0, slot_mapping,
                                             quantize_kv(key, k_scale).view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slot_mapping,
                                             quantize_kv(value, v_scale).view(torch.uint8))
        return
    k_flat.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int, first: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's positions ``first .. seq_len - 1``, ``[seq_len - first,
    num_kv_heads, head_dim]`` each, read through its blocks. Blocks wholly before ``first`` are
    not read (a sliding-window KV group has given them back: their entries are stale)."""
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    b0 = first // block_size
    blocks = block_table_row[b0:n_blocks].long()
    skip = first - b0 * block_size
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[skip:seq_len - b0 * block_size]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[skip:seq_len - b0 * block_size]
    return k, v


def attend_dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    first_key_pos: int,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of ``q [H, q_len, D]`` over ``k, v [Hkv, n, D]``, the keys at positions
    ``first_key_pos .. first_key_pos + n - 1``; the queries are the last ``q_len`` positions of
    that run. Causal, windowed and soft-capped as ``AttentionImpl.forward`` describes."""
    q_len, n = q.shape[1], k.shape[1]
    kv_len = first_key_pos + n
    mask = None
    if q_len > 1 or (sliding_window is not None and n > sliding_window):
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        k_pos = torch.arange(first_key_pos, kv_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
        )
    # SDPA has no hook between the scores and the softmax, so the capped path spells it out.
    acc = torch.promote_types(q.dtype, torch.float32)
    if k.shape[0] != q.shape[0]:
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.to(acc)).to(q.dtype)


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    fp8 = is_fp8(kv_cache)
    qsl = meta.query_start_loc_cpu
    seq_lens = meta.seq_lens_cpu
    for i in range(meta.num_reqs):
        start, end = int(qsl[i]), int(qsl[i + 1])
        q_len, kv_len = end - start, int(seq_lens[i])
        if q_len == 0 or kv_len == 0:
            continue
        # Keys before the first query's window are invisible to every query: don't read them.
        first = 0 if sliding_window is None else max(0, kv_len - q_len - sliding_window + 1)
        q = query[start:end].transpose(0, 1)  # [H, q, D]
        if fp8:  # gathered as bytes (not every device indexes float8), then widened
            k, v = gather_kv(kv_cache.view(torch.uint8), meta.block_table[i], kv_len, first)
            k = dequantize_kv(k.view(kv_cache.dtype), k_scale, q.dtype)
            v = dequantize_kv(v.view(kv_cache.dtype), v_scale, q.dtype)
        else:
            k, v = gather_kv(kv_cache, meta.block_table[i], kv_len, first)
        k = k.transpose(0, 1).to(q.dtype)  # [Hkv, kv, D]
        v = v.transpose(0, 1).to(q.dtype)
        o = attend_dense(q, k, v, scale, first, sliding_window, logits_soft_cap)
        out[start:end] = o.transpose(0, 1)


class TorchAttention:
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        write_kv_reference(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        paged_attention_reference(
            query, kv_cache, meta, scale, out, sliding_window, logits_soft_cap, k_scale, v_scale
        )
