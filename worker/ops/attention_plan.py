"""Launch planning shared by the Triton and CUDA attention backends.

Every decision here depends only on shapes fixed before a launch (token count, request count,
head counts, the maximum query length bucket) and on the device, never on sequence lengths, so a
decode step captured in a CUDA graph replays correctly whatever the contexts grow to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.worker.ops.gpu_info import device_index, num_sms

# Flash-decoding splits per (request, KV head) at most; the Triton merge kernel's width. A
# split takes whole tiles (64 positions), and the plan cannot look at context lengths (CUDA
# graphs): at 16, a 1.1k context was 18 tiles, so 9 splits of 2 tiles each ran and 7 idled.
# At 32 every split has one tile up to 2k positions. H100, batch 1, context 1024, same call:
# Qwen3-30B-A3B 3.030 / 3.035 -> 2.999 / 3.006 ms a step, Llama-3.1-8B 5.271 -> 5.223 ms.
MAX_SPLITS = 32
# Programs per SM that splitting aims for. Measured on H100 (Qwen3-0.6B attention shape, context
# 1024): the CUDA kernel keeps gaining up to ~4 blocks per SM (batch 16: 4 splits 31 us vs 1
# split 47 us), the Triton kernel peaks near 2 (its programs already keep more loads in flight).
TRITON_PROGRAMS_PER_SM = 2
CUDA_PROGRAMS_PER_SM = 4
# The CUDA decode kernel's split cap (the setting it was measured at; its reduce takes 64).
CUDA_MAX_SPLITS = 16
# Software-pipeline stages of split-decode attention (KernelConfig.attn_split_stages, set by
# ``kernel_policy.apply_tuning``; TIDAL_ATTN_SPLIT_STAGES). Batch-1 chain
# of Llama-3.1-8B heads on H100 (tools/bench_decode_chain.py, context 128): 1 stage took a
# layer from 22.3 to 20.6 us at TP2's heads and from 35.8 to 34.0 at TP1's; at context 4096
# (four tiles per split, at 16 splits) the two were level. Whole decode steps on 2xH200:
# attention 5.8 -> 3.9 us a layer, TP1 3.881 -> 3.825 ms, TP2 2.340 -> 2.280 ms.
SPLIT_STAGES = 1


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def decode_num_splits(
    num_reqs: int,
    num_kv_heads: int,
    device: torch.device,
    programs_per_sm: int = TRITON_PROGRAMS_PER_SM,
    max_splits: int | None = None,
) -> int:
    """How many programs share one request's context in a decode-only batch (at most
    ``max_splits``, default ``MAX_SPLITS``).

    Splitting pays only when (requests x KV heads) leaves SMs idle; each split costs a partial
    result write and a share of the merge kernel.
    """
    programs = max(1, num_reqs * num_kv_heads)
    sms = num_sms(device_index(device))
    if programs >= sms:
        return 1
    cap = MAX_SPLITS if max_splits is None else max_splits
    return max(1, min(cap, -(-programs_per_sm * sms // programs)))


@dataclass(frozen=True, slots=True)
class TritonAttentionPlan:
    decode_only: bool
    block_q: int  # query positions per program
    block_m: int  # rows of the program's tile: block_q positions x queries_per_kv heads (padded)
    tile_n: int  # context positions per inner-loop step
    num_splits: int
    num_warps: int
    num_stages: int
    grid0: int  # programs along the query axis
    # Split decodes: issue each tile's V load with its K load (a split program owns one tile up
    # to 2k positions, a few beyond, so there is no loop to pipeline the second round trip
    # behind).
    early_v: bool = True
    # FP8 caches: how the tiles widen for the tensor cores: "query" (to the query's dtype),
    # "f16" (the query made float16 once, the tiles converted to it) or "f16_vt" (the same,
    # V transposed in registers; measured slower); see triton_attention_kernels.FP8_F16.
    fp8_widen: str = "query"


def plan_triton_attention(
    num_tokens: int,
    num_reqs: int,
    max_query_len: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_dtype: torch.dtype | None = None,
) -> TritonAttentionPlan:
    """``kv_dtype``: the caches' element type where it differs from ``dtype`` (FP8)."""
    qpk = num_heads // num_kv_heads
    fp32 = dtype == torch.float32
    fp8 = kv_dtype == torch.float8_e4m3fn
    if max_query_len <= 1:
        # One program per (request, KV head, split): the query tile is the KV group's heads.
        block_m = max(16, next_pow2(qpk))
        splits = decode_num_splits(num_reqs, num_kv_heads, device)
        # H100 sweep (batch 64/256 x 1024): tile 64, 4 warps, 2 stages reads KV at 93-100% of
        # the device-to-device copy rate; 3-4 stages lost 15-20% at batch 64. Split programs
        # (few requests) own one tile up to 32 x 64 positions, and the pipelined loop's
        # set-up then costs more than it hides (see SPLIT_STAGES).
        tile_n = 32 if fp32 else 64
        stages = SPLIT_STAGES if splits > 1 else 2
        widen = "query"
        if fp8 and not fp32 and head_dim <= 128:
            # An FP8 tile carries half the bytes of a 16-bit one for the same work, and its
            # widening costs instructions: H200, Llama-3.1-8B heads, batch 256 x 1024
            # (tools/bench_attention_decode.py --kv-dtype fp8): the 16-bit plan 233.9 us,
            # float16 widening 219.9, with 128-position tiles and 3 stages 199.8 (bf16 cache:
            # 245.8); batch 64 x 4096 242.5 -> 184.3; split batch-1 decodes keep their tile
            # and stages, float16 widening 11.9 -> 10.7 us. (A query beyond float16's range,
            # 65504, would overflow: no served model's post-rotary queries come near it.)
            widen = "f16"
            if splits == 1:
                tile_n, stages = 128, 3
        return TritonAttentionPlan(
            decode_only=True,
            block_q=1,
            block_m=block_m,
            tile_n=tile_n,
            num_splits=splits,
            # 256-wide heads (Gemma) fill 8 warps: H100, batch 1, 16 / 8 heads, context 2048
            # (tools/bench_attention_decode.py): 12.1 -> 11.0 us, and 8.3 -> 6.9 us over a
            # 1024-token window. 128-wide heads lose with 8 (Llama-3.1-8B's 9.1 -> 10.5).
            num_warps=8 if head_dim > 128 else 4,
            num_stages=stages,
            grid0=num_reqs,
            fp8_widen=widen,
        )
    # Mixed or prefill batch: tiles of block_q query positions; short queries (a few
    # speculative tokens) get small tiles, long prompts get 128 rows to feed the tensor cores.
    cap = 64 if fp32 or head_dim > 128 else 128
    block_m = min(cap, max(16, next_pow2(max_query_len * qpk)))
    block_m = max(block_m, next_pow2(qpk))
    block_q = max(1, block_m // qpk)
    # H100 sweep (4 x 2048-token prompts, head 128): 128 x 128 tiles, 8 warps, 2 stages gave
    # 253 TFLOP/s against 245 for 128 x 64 with 3 stages; 32-wide tiles fell to 177.
    wide = not fp32 and block_m >= 128 and head_dim <= 128
    return TritonAttentionPlan(
        decode_only=False,
        block_q=block_q,
        block_m=block_m,
        tile_n=32 if fp32 else (128 if wide else 64),
        num_splits=1,
        num_warps=8 if block_m >= 128 else 4,
        num_stages=2 if fp32 or wide else 3,
        # Upper bound on the query blocks of all requests: request i starts its blocks at
        # query_start_loc[i] // block_q + i (see the kernel's request search).
        grid0=num_tokens // block_q + num_reqs,
    )
