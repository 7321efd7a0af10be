"""Triton paged-attention backend: every request of a mixed batch (prefill chunks, whole
prompts, decodes) in one kernel launch, with flash-decoding splits for small decode batches.

Launch shapes depend only on the number of tokens and requests, the KV head count and the
maximum query length, so the decode path can be captured in a CUDA graph and replayed while the
contexts grow. Importing this module imports triton: go through ``selector`` unless you know
triton is there.
"""

from __future__ import annotations

import logging

import torch

from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.ops import triton_attention_kernels as kernels
from tidal.worker.ops.attention_plan import plan_triton_attention

logger = logging.getLogger(__name__)


def _check_layouts(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> None:
    if query.stride(-1) != 1 or out.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query, out and kv_cache must be contiguous in head_dim")
    if query.shape[1] % kv_cache.shape[3] != 0:
        raise ValueError(
            f"{query.shape[1]} query heads do not group evenly over {kv_cache.shape[3]} KV heads"
        )


class TritonAttention:
    name = "triton"

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
        kernels.write_kv(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping, k_scale,
                         v_scale)

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
        self.run(
            query,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_table,
            meta.num_reqs,
            meta.max_query_len,
            scale,
            out,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def run(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_table: torch.Tensor,
        num_reqs: int,
        max_query_len: int,
        scale: float,
        out: torch.Tensor,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Attention for requests described by raw metadata tensors.

        ``query_start_loc`` need not start at 0: the CUDA backend hands the prefill tail of a
        mixed batch here with its decode requests sliced off.
        """
        if num_reqs == 0:
            return
        _check_layouts(query, kv_cache, out)
        num_tokens, num_heads, head_dim = query.shape
        plan = plan_triton_attention(
            num_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            num_heads=num_heads,
            num_kv_heads=kv_cache.shape[3],
            head_dim=head_dim,
            dtype=query.dtype,
            device=query.device,
            kv_dtype=kv_cache.dtype,
        )
        kernels.paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            block_table,
            seq_lens,
            query_start_loc,
            num_reqs,
            scale,
            out,
            plan,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
