"""Plain-torch ops over the paged latent cache of multi-head latent attention (MLA): the CPU path
and the reference the Triton kernel (``triton_mla``) is tested against.

Cache of one MLA layer: ``[num_blocks, block_size, kv_lora_rank + rope_dim]``; each token's row
is its normalised latent ``c`` (``kv_lora_rank`` values) then its rotated rope key. Token ``t``
of a request lives at slot ``block_table[t // block_size] * block_size + t % block_size``.

The absorbed decode formulation: a query already in latent space, ``q = [q_nope @ W_UK, q_rope]``
(``kv_lora_rank + rope_dim`` per head), scores each cached row with one dot product, and the
softmax-weighted sum of the rows' latent part is the head's output before ``W_UV``.
"""

from __future__ import annotations

import torch


def latent_cache_shape(num_blocks: int, block_size: int, kv_lora_rank: int,
                       rope_dim: int) -> tuple[int, int, int]:
    return (num_blocks, block_size, kv_lora_rank + rope_dim)


def write_latent(latent: torch.Tensor, k_rope: torch.Tensor, cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Scatter ``latent [T, r]`` and ``k_rope [T, dr]`` (or ``[T, 1, dr]``) into their slots;
    slots < 0 are padding and skipped."""
    n = slot_mapping.shape[0]
    rows = torch.cat((latent[:n], k_rope.reshape(latent.shape[0], -1)[:n]), dim=-1)
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows, slot_mapping = rows[keep], slot_mapping[keep]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, rows.to(cache.dtype))


def gather_latent(cache: torch.Tensor, block_table_row: torch.Tensor,
                  seq_len: int) -> torch.Tensor:
    """The rows of one request's first ``seq_len`` tokens, ``[seq_len, r + dr]``."""
    block_size = cache.shape[1]
    n_blocks = -(-seq_len // block_size)
    blocks = block_table_row[:n_blocks].long()
    return cache[blocks].reshape(-1, cache.shape[-1])[:seq_len]


def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
    """Absorbed-MLA decode: ``q [B, H, r + dr]`` (one query row per request) over each
    request's ``seq_lens[b]`` cached rows -> the latent outputs ``[B, H, r]`` (zeros for a
    request with no context: a padding row). Scores and softmax in float32."""
    b, h, _ = q.shape
    out = torch.zeros(b, h, kv_lora_rank, dtype=q.dtype, device=q.device)
    lens = seq_lens.tolist()
    for i in range(b):
        n = int(lens[i])
        if n <= 0:
            continue
        rows = gather_latent(cache, block_table[i], n).float()  # [n, r + dr]
        s = (q[i].float() @ rows.T) * scale  # [H, n]
        p = torch.softmax(s, dim=-1)
        out[i] = (p @ rows[:, :kv_lora_rank]).to(q.dtype)
    return out
