"""CUDA C++ paged-attention backend (``csrc/paged_attention.cu``).

Decode requests (query length 1) run the partitioned flash-decoding kernel of the extension; the
other requests of a mixed batch (prefill chunks, prompts) go to the Triton kernel, or to the
torch reference when triton is missing. Requests are sorted decodes-first by the model runner
(``meta.num_decodes`` of them), so the two launches see contiguous slices of the metadata and
write disjoint rows of ``out``. The split count depends only on shapes, so decode steps can be
captured in CUDA graphs.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.attention.torch_backend import paged_attention_reference, write_kv_reference
from tidal.worker.ops.attention_plan import (CUDA_MAX_SPLITS, CUDA_PROGRAMS_PER_SM,
                                             decode_num_splits)
from tidal.worker.ops.cuda_ext import require_extension
from tidal.worker.ops.gpu_info import triton_available

logger = logging.getLogger(__name__)


def _aligned16(t: torch.Tensor) -> bool:
    vec = 16 // t.element_size()
    return t.data_ptr() % 16 == 0 and all(s % vec == 0 for s in t.stride()[:-1])


def _no_fp8(kv_cache: torch.Tensor) -> None:
    # The config refuses --kv-cache-dtype fp8 with this backend; fail loudly if it gets one.
    if kv_cache.dtype == torch.float8_e4m3fn:
        raise ValueError("the cuda attention backend has no FP8 KV cache kernels; use the "
                         "triton or torch backend")


class CudaAttention:
    name = "cuda"

    def __init__(self) -> None:
        self._ext = require_extension()  # raises when the extension can't be built
        self._triton = None
        if triton_available():
            from tidal.worker.attention.triton_attn import TritonAttention

            self._triton = TritonAttention()

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
        _no_fp8(kv_cache)
        slots = meta.slot_mapping
        if (
            key.dtype != kv_cache.dtype
            or value.dtype != kv_cache.dtype
            or key.dim() != 3
            or value.dim() != 3
            or key.stride(-1) != 1
            or value.stride(-1) != 1
        ):
            write_kv_reference(key, value, kv_cache, slots)
            return
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        self._ext.reshape_and_cache(key, value, kv_cache[0], kv_cache[1], slots)

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
        _no_fp8(kv_cache)
        if sliding_window is not None or logits_soft_cap is not None:
            # The selector never pairs this backend with such a layer; fail loudly if it is.
            raise ValueError(
                "the cuda attention backend has no sliding-window or soft-cap kernel; "
                "use the triton or torch backend"
            )
        num_reqs = meta.num_reqs
        if num_reqs == 0:
            return
        num_kv_heads = kv_cache.shape[3]
        num_decodes = num_reqs if meta.max_query_len <= 1 else meta.num_decodes
        decode_ok = (
            self._ext.paged_attention_decode_supported(query, num_kv_heads)
            and query.stride(-1) == 1
            and out.stride(-1) == 1
            and kv_cache.stride(-1) == 1
            and _aligned16(query)
            and _aligned16(kv_cache)
        )
        if not decode_ok:
            num_decodes = 0
        if num_decodes > 0:
            self._decode(query, kv_cache, meta, num_decodes, scale, out)
        if num_decodes < num_reqs:
            self._rest(query, kv_cache, meta, num_decodes, scale, out)

    def _decode(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        num_decodes: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        num_tokens, num_heads, head_dim = query.shape
        splits = decode_num_splits(
            num_decodes, kv_cache.shape[3], query.device, programs_per_sm=CUDA_PROGRAMS_PER_SM,
            max_splits=CUDA_MAX_SPLITS,
        )
        part_out = part_max = part_sum = None
        if splits > 1:
            part_out = torch.empty(
                (num_tokens, num_heads, splits, head_dim), dtype=torch.float32, device=query.device
            )
            part_max = torch.empty(
                (num_tokens, num_heads, splits), dtype=torch.float32, device=query.device
            )
            part_sum = torch.empty_like(part_max)
        self._ext.paged_attention_decode(
            out,
            query,
            kv_cache[0],
            kv_cache[1],
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            num_decodes,
            float(scale),
            splits,
            part_out,
            part_max,
            part_sum,
        )

    def _rest(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        first: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Requests ``first..num_reqs-1`` (prefills, or everything the decode kernel can't do)."""
        if self._triton is not None:
            self._triton.run(
                query,
                kv_cache,
                meta.query_start_loc[first:],
                meta.seq_lens[first:],
                meta.block_table[first:],
                meta.num_reqs - first,
                meta.max_query_len,
                scale,
                out,
            )
            return
        tail = AttentionMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            num_reqs=meta.num_reqs - first,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            query_start_loc=meta.query_start_loc[first:],
            seq_lens=meta.seq_lens[first:],
            block_table=meta.block_table[first:],
            slot_mapping=meta.slot_mapping,
            query_start_loc_cpu=np.asarray(meta.query_start_loc_cpu[first:]),
            seq_lens_cpu=np.asarray(meta.seq_lens_cpu[first:]),
        )
        paged_attention_reference(query, kv_cache, tail, scale, out)
