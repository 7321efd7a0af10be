"""Multi-head latent attention (DeepSeek-V2): the attention block and its paged latent cache.

Each token's K and V for every head are up-projections of one compressed latent ``c``
(``kv_lora_rank`` values, after ``kv_a_layernorm``) plus one rotated rope key ``k_rope``
(``qk_rope_head_dim``) shared by all heads. Only ``[c, k_rope]`` is cached: one row of
``kv_lora_rank + qk_rope_head_dim`` values per token per layer (576 for V2 and V2-Lite, against
2 x heads x head_dim for the same model with multi-head attention).

``kv_b_proj``'s weight, viewed per head, is ``W_UK [nope, r]`` (keys) then ``W_UV [v, r]``
(values). Two formulations of the same attention:

- prefill (expanded): up-project the cached latents of the request's context into per-head
  ``k_nope`` and ``v``, and attend with ``q = [q_nope, q_rope]``, ``k = [k_nope, k_rope]``;
- decode (absorbed): move the query into latent space instead, ``q_latent = q_nope @ W_UK``, so
  a score is ``q_latent . c + q_rope . k_rope`` against the cached row as it is and the output
  is ``(softmax @ c) @ W_UV^T``: no per-token up-projection of the context
  (``Kernels.mla_decode``: the Triton kernel on the GPU).

Tensor parallelism shards the heads (q and ``kv_b_proj`` column-parallel, ``o_proj``
row-parallel); the latent projection and the cache are replicated on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.attention.torch_backend import attend_dense
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding, yarn_mscale
from tidal.worker.ops.mla_torch import gather_latent, latent_cache_shape


def mla_softmax_scale(arch: ArchSpec) -> float:
    """DeepSeek's softmax scale: ``(qk_nope + qk_rope) ** -0.5``, times ``mscale(factor,
    mscale_all_dim) ** 2`` under YaRN rope scaling that sets ``mscale_all_dim``."""
    scale = (arch.qk_nope_head_dim + arch.qk_rope_head_dim) ** -0.5
    s = arch.rope_scaling or {}
    if s.get("rope_type") == "yarn" and s.get("mscale_all_dim"):
        m = yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


def mla_kv_bytes_per_token(arch: ArchSpec, elem: int) -> int:
    """KV cache bytes one token takes over all layers with MLA: one latent row per layer."""
    return arch.num_layers * (arch.kv_lora_rank + arch.qk_rope_head_dim) * elem


class MLAAttention(nn.Module):
    """DeepSeek-V2's attention block. It is also the layer the model runner binds a cache to
    (``attention_layers()``): ``kv_cache`` / ``kv_group`` are set there, in the shape
    ``cache_shape`` gives."""

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        if arch.num_heads % tp.world_size:
            raise ValueError(f"{arch.num_heads} heads do not split over {tp.world_size} ranks")
        self.num_heads = arch.num_heads // tp.world_size
        self.nope = arch.qk_nope_head_dim
        self.rope = arch.qk_rope_head_dim
        self.v_dim = arch.v_head_dim
        self.rank = arch.kv_lora_rank
        qk = self.nope + self.rope
        hidden, heads, eps = arch.hidden_size, arch.num_heads, arch.rms_norm_eps
        self.q_lora = arch.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hidden, arch.q_lora_rank, False, dtype, tp)
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, eps, dtype)
            self.q_b_proj = ColumnParallelLinear(arch.q_lora_rank, heads * qk, False, dtype, tp)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, False, dtype, tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope, False, dtype,
                                                   tp)
        self.kv_a_layernorm = RMSNorm(self.rank, eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), False,
                                              dtype, tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, False, dtype, tp)
        self.rotary_emb = rotary_emb
        self.scale = mla_softmax_scale(arch)
        self.kernels = current_kernels()
        # What the warm-up reads of a cache-bound layer: the cache holds one "head" of
        # kv_lora_rank + rope values per token.
        self.num_kv_heads = 1
        self.head_dim = self.rank + self.rope
        self.kv_cache = torch.empty(0)
        self.kv_group = 0

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return latent_cache_shape(num_blocks, block_size, self.rank, self.rope)

    def group_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        return meta if meta.groups is None else meta.groups[self.kv_group]

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj``'s weight per head: ``W_UK [H, nope, r]`` and ``W_UV [H, v, r]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        else:
            q = self.q_proj(hidden)
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary_emb(positions, q_rope.contiguous(),
                                         k_rope.reshape(n, 1, self.rope).contiguous())
        meta = self.group_meta(meta)
        self.kernels.mla_write_latent(latent, k_rope, self.kv_cache, meta.slot_mapping)
        out = torch.zeros(n, self.num_heads, self.v_dim, dtype=hidden.dtype,
                          device=hidden.device)
        num_decodes = meta.num_reqs if meta.max_query_len <= 1 else meta.num_decodes
        if num_decodes > 0:
            self._decode(q_nope, q_rope, meta, num_decodes, out)
        if num_decodes < meta.num_reqs:
            self._prefill(q_nope, q_rope, meta, num_decodes, out)
        return self.o_proj(out.view(n, self.num_heads * self.v_dim))

    def _decode(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                num_decodes: int, out: torch.Tensor) -> None:
        """The absorbed formulation for the leading ``num_decodes`` requests (one row each)."""
        w_uk, w_uv = self._w_uk_uv()
        # [H, B, nope] @ [H, nope, r] -> the queries in latent space.
        q_lat = torch.bmm(q_nope[:num_decodes].transpose(0, 1), w_uk).transpose(0, 1)
        q = torch.cat((q_lat, q_rope[:num_decodes].to(q_lat.dtype)), dim=-1)
        o_lat = self.kernels.mla_decode(q, self.kv_cache, meta.block_table[:num_decodes],
                                        meta.seq_lens[:num_decodes], self.scale, self.rank)
        # [H, B, r] @ [H, r, v] -> each head's value output.
        out[:num_decodes] = torch.bmm(o_lat.transpose(0, 1),
                                      w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata,
                 first: int, out: torch.Tensor) -> None:
        """The expanded formulation, one request at a time over its whole context (the cached
        prefix and this step's tokens, all read back from the latent cache)."""
        qsl, seq_lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        q_all = torch.cat((q_nope, q_rope.to(q_nope.dtype)), dim=-1)
        for i in range(first, meta.num_reqs):
            start, end = int(qsl[i]), int(qsl[i + 1])
            kv_len = int(seq_lens[i])
            if end == start or kv_len == 0:
                continue
            rows = gather_latent(self.kv_cache, meta.block_table[i], kv_len).to(q_all.dtype)
            latent, k_rope = rows.split([self.rank, self.rope], dim=-1)
            kv = self.kv_b_proj(latent).view(kv_len, self.num_heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat((k_nope, k_rope[:, None, :].expand(-1, self.num_heads, -1)), dim=-1)
            o = self._attend(q_all[start:end].transpose(0, 1), k.transpose(0, 1),
                             v.transpose(0, 1))
            out[start:end] = o.transpose(0, 1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not q.is_cuda:
            return attend_dense(q, k, v, self.scale, 0)
        return attend_causal_padded(q, k, v, self.scale)


def attend_causal_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float, max_scores: int = 1 << 27) -> torch.Tensor:
    """Causal attention of ``q [H, s, D]`` (the last ``s`` positions) over ``k [H, n, D]``,
    ``v [H, n, Dv]``, with V zero-padded to D so that SDPA can take a fused kernel on the GPU
    (the padded columns come out zero and are cut off), in query chunks of at most
    ``max_scores`` attention scores: the profiling pass of a 16k-token step peaked at 38 GiB
    on DeepSeek-V2-Lite (an H100) where SDPA fell back to its unfused path, whose ``[H, s, n]``
    float scores crowded out the KV cache; chunked, that path stays within ~0.5 GiB."""
    h, s, n, dv = q.shape[0], q.shape[1], k.shape[1], v.shape[-1]
    if dv < k.shape[-1]:
        v = F.pad(v, (0, k.shape[-1] - dv))
    # A batch dimension: SDPA's fused kernels take [B, H, L, D].
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    rows = max(1, max_scores // max(1, h * n))
    if rows >= s:
        if s == n:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:  # a chunk after a cached prefix: the last query sees every key
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s, n),
                                               scale=scale)
        return o[0, ..., :dv]
    out = q.new_empty(h, s, dv)
    for a in range(0, s, rows):
        b = min(s, a + rows)
        keys = n - s + b  # query b - 1 sees keys up to its own position
        o = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :keys], v[:, :, :keys],
                                           attn_mask=causal_lower_right(b - a, keys),
                                           scale=scale)
        out[:, a:b] = o[0, ..., :dv]
    return out
