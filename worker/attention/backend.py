"""The contract between the model's attention layers and an attention implementation.

A step's batch is a flat run of tokens: request ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]`` and, after this step's K/V are written, has
``seq_lens[i]`` tokens of context in the paged cache. Its queries are the *last* rows of that
context (a prefill chunk, a whole prompt, or one decode token all look the same), so the causal
mask of query row ``j`` of request ``i`` admits context positions ``<= seq_lens[i] - q_len_i + j``.

KV cache of one layer: a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V).
Token ``t`` of request ``i`` lives at slot ``block_table[i, t // block_size] * block_size +
t % block_size``; ``slot_mapping`` holds the slot of every new token (``-1``: padding, not written).

Padding rows (CUDA-graph batches padded to a captured size) have ``seq_lens == 0`` and a zero-length
query range or slot ``-1``; a backend must leave them harmless and must not read past ``seq_lens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int  # rows of the flat batch that are real (the rest are padding)
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], on the device
    seq_lens: torch.Tensor  # int32 [num_reqs], on the device
    block_table: torch.Tensor  # int32 [num_reqs, max_blocks_per_req], on the device
    slot_mapping: torch.Tensor  # int64 [num_tokens], on the device
    # Host copies, for backends (torch) and planners that loop or decide on the CPU.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    num_decodes: int = 0  # requests whose query length is 1 (they come first when sorted)
    # Several KV groups (``engine_core.kv_groups``): each group's metadata (its block table
    # and slot mapping, the rest shared; entry 0 is this one). None: one group.
    groups: tuple[AttentionMetadata, ...] | None = None

    def for_group(self, group: int) -> AttentionMetadata:
        groups = self.groups
        return self if groups is None else groups[group]


class AttentionImpl(Protocol):
    """One attention implementation, shared by every layer of a model."""

    name: str

    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """``k_scale`` / ``v_scale``: the layer's float32 one-element scales, passed (by the
        attention layer) only when ``kv_cache`` is FP8 (``attention.fp8_kv``: stored =
        clamp(x / scale) as e4m3); a backend without FP8 support need not take them."""
        ...

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Attention of each query row over its causal context. ``sliding_window`` W: the row at
        position p sees only keys at k with p - W < k <= p. ``logits_soft_cap`` c: the scaled
        scores become c * tanh(scores / c) before the mask and softmax (Gemma 2). An FP8
        ``kv_cache`` is read as ``entry * k_scale`` / ``entry * v_scale``."""
        ...


def kv_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    return (2, num_blocks, block_size, num_kv_heads, head_dim)
