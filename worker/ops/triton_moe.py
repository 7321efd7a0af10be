"""The fused MoE op as Triton kernels: ``moe_torch.fused_moe``'s signature and semantics.

Three steps, none of which syncs with the host, and all of fixed size for a given number of
tokens T (so a CUDA graph captures them):

1. ``align``: the T*k (token, slot) pairs grouped by expert, each expert's run padded to a
   multiple of ``block_m`` with a sentinel (T*k), the expert of every M-block, and the padded
   length (``num_tokens_post_padded``, on the device): three small kernels (count, offsets,
   scatter by atomics; ``align_torch`` is their torch reference). The buffers are sized for the
   worst case, ``T*k + min(E, T*k) * (block_m - 1)`` rows.
2. Two grouped GEMMs over the M-blocks (``_moe_gemm_kernel``): each program multiplies the rows
   its block gathers (by ``sorted_token_ids``) with the block's expert's weight tile. The first
   (``w13``) computes the gate and up tiles together and writes ``silu(gate) * up`` ``[T*k, I]``;
   the second (``w2``) multiplies by the router weight and writes float32 ``[T*k, H]``. Blocks
   past the padded length exit at once, so only the routed experts' weights are ever read
   (batch-1 decode reads k experts, not E).
3. The sum over the k slots (a reshape and a float32 sum), cast to the input's dtype.

A few tokens (``moe_configs.use_direct``: at most 32 (token, slot) pairs, few of them sharing
an expert; Qwen3-30B-A3B's decode up to batch 4) take the direct path instead,
``triton_moe_gemv``: two GEMV-style launches with no alignment, no padding and no float32
buffer. ``fused_moe(path=...)`` forces either.

Importing this module imports triton.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton
import triton.language as tl

from tidal.worker.ops import triton_decode, triton_moe_gemv
from tidal.worker.ops.moe_configs import (DirectConfig, GemmConfig, MoeConfig, get_config,
                                          use_direct)
from tidal.worker.ops.moe_torch import check_moe_args, check_moe_scales

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
PATHS = ("direct", "grouped")


def padded_bound(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the expert-sorted, block-padded pair list can need: every expert that got a pair
    (at most ``min(E, pairs)``) wastes at most ``block_m - 1`` rows; rounded to whole blocks."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


def align_torch(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``align`` in torch ops (stable: each expert's pairs in pair order, and sentinels past
    ``num_tokens_post_padded`` too): the reference of the alignment kernels. None of its ops
    reads a device value on the host, but it takes some 25 launches where ``align`` takes 4.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs = flat.numel()
    device = flat.device
    bound = padded_bound(pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    # scatter_add rather than bincount, which reads the max id on the host.
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    firsts = torch.cumsum(counts, 0) - counts  # each expert's first index in the sorted pairs
    sorted_experts, order = torch.sort(flat, stable=True)
    rank = torch.arange(pairs, device=device) - firsts[sorted_experts]
    dest = starts[sorted_experts] + rank
    sorted_ids = torch.full((bound,), pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, bound, block_m, device=device)
    expert_ids = torch.searchsorted(ends, block_starts, right=True)
    expert_ids = expert_ids.clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, ends[-1:].to(torch.int32)


# --- routing ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_tokens"])  # token counts: one compile serves all
def _route_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, counts_ptr, valid_ptr,
                  num_tokens, num_experts, stride_l, scale, TOP_K: tl.constexpr,
                  TOPK_P2: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORM: tl.constexpr, GROUPS: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                  EXPERTS: tl.constexpr, ROWS: tl.constexpr, COUNT: tl.constexpr,
                  HAS_VALID: tl.constexpr, PDL: tl.constexpr):
    """``select_experts`` for ROWS tokens: scores, group mask, top-k by repeated argmax (the
    lowest index wins a tie), renormalisation and scaling, in one pass over the logits.
    ``COUNT``: also add each real token's picks to ``counts_ptr`` (int32 per expert; rows
    from ``*valid_ptr`` on are padding when ``HAS_VALID``: ``layers.expert_load``). ``PDL``:
    launched while the router's kernel drains, and letting the experts' kernel launch while
    this one runs (a batch-1 step has two such launches per MoE layer to hide)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the logits: everything here reads them
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    e = tl.arange(0, EXPERTS)
    rm = rows < num_tokens
    em = e < num_experts
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + e[None, :],
                mask=rm[:, None] & em[None, :], other=float("-inf")).to(tl.float32)
    # Rows past the batch read as zeros, so their (never stored) math stays finite.
    x = tl.where(rm[:, None], x, 0.0)
    if SIGMOID:
        score = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(x, 1)[:, None])
        score = p / tl.sum(p, 1)[:, None]
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=em, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(em[None, :], choice, float("-inf"))
    if GROUPS > 1:
        group = e // (num_experts // GROUPS)
        # Each expert carries its group's score (the max over the group).
        group_score = tl.full((ROWS, EXPERTS), float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            in_g = (group == g)[None, :]
            best_g = tl.max(tl.where(in_g, choice, float("-inf")), 1)
            group_score = tl.where(in_g, best_g[:, None], group_score)
        group_score = tl.where(em[None, :], group_score, float("-inf"))
        keep = tl.zeros((ROWS, EXPERTS), tl.int1)
        for _ in tl.static_range(TOPK_GROUPS):
            cand = tl.where(keep, float("-inf"), group_score)
            best = tl.max(cand, 1)
            first = tl.min(tl.where(cand == best[:, None], e[None, :], EXPERTS), 1)
            keep = keep | (group[None, :] == (first // (num_experts // GROUPS))[:, None])
        choice = tl.where(keep, choice, float("-inf"))
    slots = tl.arange(0, TOPK_P2)
    top_w = tl.zeros((ROWS, TOPK_P2), tl.float32)
    top_i = tl.zeros((ROWS, TOPK_P2), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 1)
        idx = tl.min(tl.where(choice == best[:, None], e[None, :], EXPERTS), 1)
        hit = e[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, score, 0.0), 1)
        top_w = tl.where(slots[None, :] == j, w[:, None], top_w)
        top_i = tl.where(slots[None, :] == j, idx[:, None], top_i)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORM:
        top_w = top_w / (tl.sum(top_w, 1)[:, None] + 1e-20)
    top_w = top_w * scale
    out = rows[:, None] * TOP_K + slots[None, :]
    mask = rm[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)
    if COUNT:
        # (An id of EXPERTS, from a row of NaN logits, names no expert: never an address.)
        real = mask & (top_i < num_experts)
        if HAS_VALID:
            real = real & (rows < tl.load(valid_ptr))[:, None]
        tl.atomic_add(counts_ptr + top_i, tl.full((ROWS, TOPK_P2), 1, tl.int32), mask=real)


def select_experts(router_logits: torch.Tensor, cfg: Any,
                   correction_bias: torch.Tensor | None = None,
                   count: tuple[torch.Tensor, torch.Tensor | None] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers.fused_moe.select_experts`` (``cfg`` a ``RoutingConfig``) in one launch.
    ``count``: ``(counts int32 [E], valid)``: each real token's picks are added to
    ``counts`` in the same launch (``valid``: a one-element int32 tensor, the real token
    count; None: every row)."""
    num_experts = router_logits.shape[-1]
    cfg.check(num_experts)
    logits = router_logits.reshape(-1, num_experts)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    t = logits.shape[0]
    weights = torch.empty((t, cfg.top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, cfg.top_k), dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    experts_p2 = triton.next_power_of_2(num_experts)
    rows = max(1, min(16, 1024 // experts_p2))
    counts, valid = count if count is not None else (ids, None)
    triton_decode.launch(
        _route_kernel, (triton.cdiv(t, rows),),
        (logits, correction_bias if correction_bias is not None else logits, weights, ids,
         counts, valid if valid is not None else ids, t, num_experts, logits.stride(0),
         float(cfg.routed_scaling_factor)),
        dict(TOP_K=cfg.top_k, TOPK_P2=triton.next_power_of_2(cfg.top_k),
             SIGMOID=cfg.scoring == "sigmoid", HAS_BIAS=correction_bias is not None,
             RENORM=cfg.renormalize, GROUPS=cfg.num_groups, TOPK_GROUPS=cfg.topk_groups,
             EXPERTS=experts_p2, ROWS=rows, COUNT=count is not None,
             HAS_VALID=valid is not None),
        triton_decode.pdl_enabled(logits.device))
    return weights, ids


# --- alignment --------------------------------------------------------------------------------

# Pairs, and M-blocks, per program of the alignment's grid kernels (a block's expert is found
# against all E run ends at once: fewer blocks per program keep that in registers).
_ALIGN_BLOCK = 256
_ALIGN_BLOCKS_M = 32


@triton.jit(do_not_specialize=["num_pairs"])
def _count_experts_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    # An id of num_experts or more: an expert on another expert-parallel rank, skipped.
    mask = mask & (expert < num_experts)
    tl.atomic_add(counts_ptr + expert, 1, mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_offsets_kernel(counts_ptr, cursor_ptr, ends_ptr, sorted_ids_ptr, post_padded_ptr,
                           num_experts, num_pairs, BLOCK_M: tl.constexpr,
                           EXPERTS: tl.constexpr):
    """One program: each expert's padded run (start as the scatter's cursor, end), the total,
    and the sentinels in the padding at the end of each run."""
    e = tl.arange(0, EXPERTS)
    em = e < num_experts
    count = tl.load(counts_ptr + e, mask=em, other=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    tl.store(cursor_ptr + e, starts, mask=em)
    tl.store(ends_ptr + e, ends, mask=em)
    tl.store(post_padded_ptr, tl.sum(padded, 0))
    pad = (starts + count)[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ids_ptr + pad, num_pairs, mask=em[:, None] & (pad < ends[:, None]))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _scatter_pairs_kernel(ids_ptr, cursor_ptr, ends_ptr, sorted_ids_ptr, expert_ids_ptr,
                          num_pairs, num_experts, num_blocks, BLOCK: tl.constexpr,
                          BLOCKS_M: tl.constexpr, BLOCK_M: tl.constexpr,
                          EXPERTS: tl.constexpr):
    """Each pair takes the next free row of its expert's run (the order within an expert is
    whatever the atomics give: every row of the GEMMs is computed alone, so the result does not
    depend on it); and each M-block learns its expert (the runs ending at or before it)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < num_pairs
    expert = tl.load(ids_ptr + offs, mask=mask, other=0)
    mask = mask & (expert < num_experts)  # (another expert-parallel rank's expert: skipped)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=mask)
    tl.store(sorted_ids_ptr + row, offs, mask=mask)
    e = tl.arange(0, EXPERTS)
    em = e < num_experts
    ends = tl.load(ends_ptr + e, mask=em, other=0)
    blocks = pid * BLOCKS_M + tl.arange(0, BLOCKS_M)
    before = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & em[None, :]
    expert_of = tl.minimum(tl.sum(before.to(tl.int32), 1), num_experts - 1)
    tl.store(expert_ids_ptr + blocks, expert_of, mask=blocks < num_blocks)


def align(topk_ids: torch.Tensor, num_experts: int,
          block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids int32 [P], expert_ids int32 [P / block_m], num_tokens_post_padded
    int32 [1])`` for ``topk_ids [T, k]``, ``P = padded_bound(T*k, E, block_m)``.

    ``sorted_token_ids`` lists the pair indices (``token * k + slot``) expert by expert, each
    expert's run padded to a multiple of ``block_m`` with ``T*k``; ``expert_ids`` names each
    M-block's expert. Entries at or past ``num_tokens_post_padded`` are unused and left
    unwritten (the GEMMs' programs there exit at once). Four launches (a memset and three
    small kernels), none of which the host waits for.
    """
    flat = topk_ids.reshape(-1)
    if flat.dtype != torch.int32:
        flat = flat.to(torch.int32)
    pairs = flat.numel()
    device = flat.device
    bound = padded_bound(pairs, num_experts, block_m)
    num_blocks = bound // block_m
    experts_p2 = triton.next_power_of_2(num_experts)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(bound, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    post_padded = torch.empty(1, dtype=torch.int32, device=device)
    _count_experts_kernel[(triton.cdiv(pairs, _ALIGN_BLOCK),)](
        flat, counts, pairs, num_experts, BLOCK=_ALIGN_BLOCK)
    _expert_offsets_kernel[(1,)](
        counts, cursor, ends, sorted_ids, post_padded, num_experts, pairs, BLOCK_M=block_m,
        EXPERTS=experts_p2)
    grid = (max(triton.cdiv(pairs, _ALIGN_BLOCK), triton.cdiv(num_blocks, _ALIGN_BLOCKS_M)),)
    _scatter_pairs_kernel[grid](
        flat, cursor, ends, sorted_ids, expert_ids, pairs, num_experts, num_blocks,
        BLOCK=_ALIGN_BLOCK, BLOCKS_M=_ALIGN_BLOCKS_M, BLOCK_M=block_m, EXPERTS=experts_p2)
    return sorted_ids, expert_ids, post_padded


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: the tokens (w13: row = pair // TOP_K) or the pairs (w2)
    b_ptr,  # [E, N (x2 with SILU), K]
    c_ptr,  # [pairs, N]
    weight_ptr,  # [pairs] router weights (MUL_WEIGHT)
    sorted_ids_ptr,
    expert_ids_ptr,
    post_padded_ptr,
    N,
    num_pairs,
    padded_rows,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    K: tl.constexpr,  # H or I: fixed per model, and a constant trip count for the pipeliner
    A_DIV: tl.constexpr,
    SILU: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    # FP8 (e4m3) weights: converted to the activations' dtype in registers (exact: e4m3 fits
    # in 16 bits), and each output column's float32 scale (scale_ptr [E, N (x2)]) applied once
    # to the accumulated sum. Weight-only: the activations are not quantized.
    scale_ptr,
    stride_se,
    W_SCALE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(padded_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # M-blocks of one expert sit next to each other: launching GROUP_M of them per N column
    # together keeps that expert's weight tiles in L2 while they are reused.
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_size
    pid_n = (pid % in_group) // group_size
    if pid_m * BLOCK_M >= tl.load(post_padded_ptr):
        return  # a block no expert needed (the buffers are sized for the worst case)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    valid = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    a_row = (pair // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + \
        offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SILU:
        up_ptrs = b_ptrs + N * stride_bn
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # A trip count of constants (the Triton interpreter cannot loop to a runtime bound).
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if W_SCALE:
            b = b.to(a_ptr.dtype.element_ty)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if SILU:
            u = tl.load(up_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if W_SCALE:
                u = u.to(a_ptr.dtype.element_ty)
            if UPCAST:
                u = u.to(tl.float32)
            if IEEE:
                acc_up += tl.dot(a, u, input_precision="ieee")
            else:
                acc_up += tl.dot(a, u)
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    out_ty = c_ptr.dtype.element_ty
    if W_SCALE:
        s_row = scale_ptr + expert * stride_se
        acc = acc * tl.load(s_row + offs_n, mask=n_mask, other=0.0)[None, :]
        if SILU:
            acc_up = acc_up * tl.load(s_row + N + offs_n, mask=n_mask, other=0.0)[None, :]
    if SILU:
        # Rounded where torch rounds (the projections, then silu, then the product), so the
        # kernel tracks the torch path in half precision.
        g = acc.to(out_ty).to(tl.float32)
        u = acc_up.to(out_ty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(out_ty).to(tl.float32)
        acc = s * u
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=valid, other=0.0)
        acc = acc * w.to(tl.float32)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(out_ty), mask=valid[:, None] & n_mask[None, :])


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, weights: torch.Tensor | None,
          sorted_ids: torch.Tensor, expert_ids: torch.Tensor, post_padded: torch.Tensor,
          n: int, a_div: int, silu: bool, block_m: int, cfg: GemmConfig,
          scale: torch.Tensor | None = None) -> None:
    k = a.shape[1]
    rows = sorted_ids.numel()
    # CPU tensors come here only under the Triton interpreter, whose bfloat16 dot is wrong
    # (numpy has no bfloat16): it multiplies in float32 instead, as the GPU's tensor cores do.
    upcast = not a.is_cuda and a.dtype == torch.bfloat16
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, cfg.block_n),)
    _moe_gemm_kernel[grid](
        a, b, c, weights if weights is not None else c, sorted_ids, expert_ids, post_padded,
        n, c.shape[0], rows, a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        K=k, A_DIV=a_div, SILU=silu, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32 or upcast, UPCAST=upcast, BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, scale_ptr=scale if scale is not None else c,
        stride_se=scale.stride(0) if scale is not None else 0, W_SCALE=scale is not None,
    )


def _contiguous(scale: torch.Tensor | None) -> torch.Tensor | None:
    """A scale table ``[E, N]`` with unit stride along N (the kernel indexes it so)."""
    if scale is None or scale.stride(-1) == 1:
        return scale
    return scale.contiguous()


def _fp32_config(cfg: MoeConfig) -> MoeConfig:
    """The configs are sized for 2-byte weights; float32 tiles (tests, references) take twice
    the shared memory per pipeline stage, so they get at most two stages."""
    def cap(g: GemmConfig) -> GemmConfig:
        return dataclasses.replace(g, num_stages=min(g.num_stages, 2))

    return MoeConfig(cfg.block_m, cap(cfg.w13), cap(cfg.w2))


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: MoeConfig | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, partial: bool = False, *,
              path: str | None = None,
              direct_config: DirectConfig | None = None) -> torch.Tensor:
    """``moe_torch.fused_moe`` on the GPU (``config``: the grouped path's launch config
    instead of the table's, for tuning and tests). FP8 weights come with their scales
    (``moe_torch``). ``partial``: some ids are E, experts of another expert-parallel rank,
    whose pairs add nothing (their rows are zeroed, as no GEMM writes them).

    ``path``: ``"direct"`` (``triton_moe_gemv``, launch shapes ``direct_config`` or the
    table's), ``"grouped"`` (align + grouped GEMMs), or None: ``moe_configs.use_direct``
    decides from T, E and k alone, so a CUDA graph captured for a batch size keeps its path.
    """
    if path is not None and path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None, got {path!r}")
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    check_moe_scales(w13, w2, w13_scale, w2_scale)
    fp8 = w13_scale is not None
    if hidden.dtype not in _DTYPES or (not fp8 and (w13.dtype != hidden.dtype
                                                     or w2.dtype != hidden.dtype)):
        raise ValueError(f"fused_moe takes one of {_DTYPES} for hidden and weights alike "
                         f"(or FP8 weights), got {hidden.dtype}, {w13.dtype}, {w2.dtype}")
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    e, i = w13.shape[0], w13.shape[1] // 2
    if t == 0:
        return hidden.new_zeros((0, h))
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    w13 = w13 if w13.stride(2) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(2) == 1 else w2.contiguous()
    if path == "direct" or (path is None and use_direct(t, e, top_k)):
        # (Direct pairs of another rank's expert are skipped in the kernels: nothing to zero.)
        return triton_moe_gemv.fused_moe_direct(
            x, w13, w2, topk_weights, topk_ids, direct_config, _contiguous(w13_scale),
            _contiguous(w2_scale))
    cfg = config or get_config(t, e, h, i, top_k)
    if hidden.dtype == torch.float32:
        cfg = _fp32_config(cfg)
    sorted_ids, expert_ids, post_padded = align(topk_ids, e, cfg.block_m)
    pairs = t * top_k
    act = torch.empty((pairs, i), dtype=hidden.dtype, device=hidden.device)
    _gemm(x, w13, act, None, sorted_ids, expert_ids, post_padded, i, top_k, True,
          cfg.block_m, cfg.w13, _contiguous(w13_scale))
    out = (torch.zeros if partial else torch.empty)((pairs, h), dtype=torch.float32,
                                                    device=hidden.device)
    weights = topk_weights.reshape(-1).float()
    _gemm(act, w2, out, weights, sorted_ids, expert_ids, post_padded, h, 1, False,
          cfg.block_m, cfg.w2, _contiguous(w2_scale))
    return out.view(t, top_k, h).sum(dim=1).to(hidden.dtype)
