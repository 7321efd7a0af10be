"""The attention layer: writes this step's K/V into its paged cache and attends through it
(``attend``: the K/V are already written, by the fused rotary kernel)."""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.attention.backend import (
    AttentionImpl,
    AttentionMetadata,
    kv_cache_shape,
)
from tidal.worker.attention.fp8_kv import FP8_KV_DTYPE, new_scale
from tidal.worker.compilation.attention_op import attention as attention_op


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 impl: AttentionImpl, *, sliding_window: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0, got {logits_soft_cap}")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.impl = impl
        # Per-layer constants: a CUDA graph captures them with the launch, nothing per step.
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # Bound by the model runner once the cache is allocated, with the KV group whose block
        # table and slot mapping address it (``engine_core.kv_groups``).
        self.kv_cache = torch.empty(0)
        self.kv_group = 0
        # Set when the model is compiled (``worker.compilation``): the layer's index for the
        # opaque ``tidal::attention`` op, which the traced graph (run with no metadata) calls,
        # and splits at, instead of tracing into the backend.
        self.op_index: int | None = None
        # FP8 KV cache scales (attention/fp8_kv.py): read only when the cache is FP8; loaded
        # from the checkpoint or left at 1.0. Buffers so they live on the model's device.
        self.register_buffer("k_scale", new_scale(), persistent=False)
        self.register_buffer("v_scale", new_scale(), persistent=False)

    def cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of this layer's cache tensor (what the model runner allocates)."""
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def _fp8_scales(self) -> dict[str, torch.Tensor]:
        # Only an FP8 cache hands the backend its scales: a backend (or plugin) written before
        # FP8 KV caches keeps its signature.
        if self.kv_cache.dtype != FP8_KV_DTYPE:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def group_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """This layer's view of the step's metadata (its KV group's block table and slots)."""
        return meta if meta.groups is None else meta.groups[self.kv_group]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata | None) -> torch.Tensor:
        if meta is None:  # inside the compiled model: the op finds the step's metadata
            assert self.op_index is not None, "a compiled model numbers its attention layers"
            return attention_op(q, k, v, self.op_index)
        return self.eager_forward(q, k, v, meta)

    def eager_forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        n = q.shape[0]
        # (reshape: inside a compiled graph the op may receive a strided slice of q/k/v)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        meta = self.group_meta(meta)
        self.impl.write_kv(k, v, self.kv_cache, meta, **self._fp8_scales())
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the cache alone: this step's K/V must already be in it (the fused
        q/k-norm + rotary + K/V-write kernel put them there)."""
        n = q.shape[0]
        q = q.view(n, self.num_heads, self.head_dim)
        out = torch.empty_like(q)
        meta = self.group_meta(meta)
        self.impl.forward(q, self.kv_cache, meta, self.scale, out,
                          sliding_window=self.sliding_window,
                          logits_soft_cap=self.logits_soft_cap, **self._fp8_scales())
        return out.view(n, self.num_heads * self.head_dim)
