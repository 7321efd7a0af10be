"""Plain-torch paged attention: the CPU backend and the reference every kernel is tested against.

It loops over requests in Python (one SDPA call each), which is exact and simple; speed on the
GPU comes from the Triton and CUDA backends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.worker.attention.backend import AttentionMetadata


def write_kv_reference(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new K/V rows into the paged cache; slots < 0 are padding and skipped."""
    num_tokens = slot_mapping.shape[0]
    key, value = key[:num_tokens], value[:num_tokens]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_flat = kv_cache[0].view(-1, *kv_cache.shape[3:])
    v_flat = kv_cache[1].view(-1, *kv_cache.shape[3:])
    k_flat.index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request, ``[seq_len, num_kv_heads, head_dim]`` each, read through its blocks."""
    block_size = kv_cache.shape[2]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:n_blocks].long()
    k = kv_cache[0, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    v = kv_cache[1, blocks].reshape(-1, *kv_cache.shape[3:])[:seq_len]
    return k, v


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> None:
    qsl = meta.query_start_loc_cpu
    seq_lens = meta.seq_lens_cpu
    for i in range(meta.num_reqs):
        start, end = int(qsl[i]), int(qsl[i + 1])
        q_len, kv_len = end - start, int(seq_lens[i])
        if q_len == 0 or kv_len == 0:
            continue
        k, v = gather_kv(kv_cache, meta.block_table[i], kv_len)
        q = query[start:end].transpose(0, 1)  # [H, q, D]
        k = k.transpose(0, 1).to(q.dtype)  # [Hkv, kv, D]
        v = v.transpose(0, 1).to(q.dtype)
        mask = None
        if q_len > 1:
            # Queries are the last q_len positions of the context.
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril_(
                diagonal=kv_len - q_len
            )
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[0] != q.shape[0]
        )
        out[start:end] = o.transpose(0, 1)


class TorchAttention:
    name = "torch"

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        write_kv_reference(key, value, kv_cache, meta.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        paged_attention_reference(query, kv_cache, meta, scale, out)
