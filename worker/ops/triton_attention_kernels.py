"""Triton kernels of paged attention: one kernel for a whole mixed batch, a merge kernel for
split contexts, and the K/V cache write.

Batch layout and masking rules are those of ``tidal.worker.attention.backend``. A program owns
``BLOCK_Q`` query positions of one request and every query head of one KV head (GQA packing:
``BLOCK_M = BLOCK_Q * QPK`` rows, row ``m`` is position ``m // QPK`` of head ``m % QPK``), so each
K/V tile it reads feeds all heads that share it. In a decode-only batch (``SPLIT_KV``) the
context of a request is cut into ``num_splits`` ranges of whole tiles, one program each, and a
second kernel merges the partial results (flash-decoding).

Per-layer options, each a constexpr so a layer without it compiles to the plain kernel:
``WINDOW`` (sliding window W: the row at position p sees keys p - W < k <= p; tiles wholly
before the first row's window are never read, tiles straddling a row's window start are
masked) and ``SOFT_CAP`` (scores c * tanh(scores / c) before the softmax).

This module imports triton at import time: import it only when a CUDA device and triton exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops.attention_plan import MAX_SPLITS, TritonAttentionPlan, next_pow2
from tidal.worker.ops.triton_probe import stamp

@triton.jit
def fp8_quantize(x, scale):
    """``clamp(x / scale, +-448)`` in float32, ready for the e4m3 cast of the store (the KV
    cache's semantics: ``attention.fp8_kv.quantize_kv``)."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -448.0), 448.0)  # e4m3fn's largest finite value

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(qsl_ptr, q_block_idx, num_reqs, BLOCK_Q: tl.constexpr):
    """The last request whose first query block is <= q_block_idx.

    Request i's query blocks start at (qsl[i] - qsl[0]) // BLOCK_Q + i, a bound that leaves every
    request at least as many blocks as it needs, so a flat grid of
    num_tokens // BLOCK_Q + num_reqs programs covers any batch of that many tokens and requests.
    """
    base = tl.load(qsl_ptr)
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = (tl.load(qsl_ptr + mid) - base) // BLOCK_Q + mid
        if first_block <= q_block_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_v(v_cache_ptr, tok_off, offs_d, d_ok, pos_ok, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    if MASKED:
        v = tl.load(
            v_cache_ptr + tok_off[:, None] + offs_d[None, :],
            mask=pos_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
    elif EVEN_D:
        v = tl.load(v_cache_ptr + tok_off[:, None] + offs_d[None, :])
    else:
        v = tl.load(v_cache_ptr + tok_off[:, None] + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    return v


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    t,
    kv_end,
    row_pos,
    k_cache_ptr,
    v_cache_ptr,
    bt_row,
    head_off,
    stride_kv_blk,
    stride_kv_tok,
    scale_log2,
    offs_d,
    d_ok,
    window,
    softcap_log2,
    PAGE_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    EARLY_V: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """One online-softmax step over context tile ``t``; returns the new (max, sum, acc).

    ``EARLY_V`` issues the V load together with K's (decode: a program often owns one or two
    tiles, so the second memory round trip is latency nobody hides); prefill tiles keep V's
    registers free during the QK^T product."""
    pos = t * TILE_N + tl.arange(0, TILE_N)
    pos_ok = pos < kv_end  # used only when MASKED
    if MASKED:
        blk = tl.load(bt_row + pos // PAGE_SIZE, mask=pos_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // PAGE_SIZE).to(tl.int64)
    tok_off = blk * stride_kv_blk + (pos % PAGE_SIZE).to(tl.int64) * stride_kv_tok + head_off
    if MASKED:
        k = tl.load(
            k_cache_ptr + tok_off[None, :] + offs_d[:, None],
            mask=pos_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
    elif EVEN_D:
        k = tl.load(k_cache_ptr + tok_off[None, :] + offs_d[:, None])
    else:
        k = tl.load(k_cache_ptr + tok_off[None, :] + offs_d[:, None], mask=d_ok[:, None], other=0.0)
    if EARLY_V:
        v = _load_v(v_cache_ptr, tok_off, offs_d, d_ok, pos_ok, MASKED, EVEN_D)
    else:
        v = k  # not used: _attend_kv loads V itself
    return _attend_kv(
        q, acc, m_i, l_i, k, v, pos, pos_ok, row_pos, v_cache_ptr, tok_off, scale_log2, offs_d,
        d_ok, window, softcap_log2, MASKED, EVEN_D, IEEE_DOT, EARLY_V, WINDOW, SOFT_CAP, KV_FP8,
    )  # fmt: skip


# How an FP8 cache's tiles become tensor-core operands (the kernel's KV_FP8; the plan's
# ``fp8_widen``): converted to the query's dtype, or the query made float16 once and the tiles
# converted to float16 (e4m3 -> f16 is exact and cheaper than -> bf16). Moving e4m3's bits into
# float16's places instead (2^-8 of the value, the scales taking it back) measured slower than
# either (H200, batch 256 x 1024: 282.6 us against 201.2 for "f16" and 277.5 for "query").
# "f16_vt" loads V as K is loaded ([D, TILE_N], a position's entries along the first axis),
# widens it and transposes it in registers: in the sm_90 SASS of the "f16" loop the transpose
# the P V product needs reads single bytes from shared memory (one LDS.U8 per V entry, 5.45
# instructions per K/V entry at 128-position tiles and 3 stages); this one has no shared-memory
# byte loads (4.95; bf16 caches 3.46; tools/sass_loop_mix.py attn-decode), yet measured 10-13 %
# slower than "f16" (H200, Llama-3.1-8B heads: batch 256 x 1024 221.9 against 202.1 us, batch
# 64 x 4096 206.8 against 183.5): no plan picks it; kept for tools/bench_attention_decode.py.
FP8_AS_QUERY = tl.constexpr(1)
FP8_F16 = tl.constexpr(2)
FP8_F16_VT = tl.constexpr(3)
_FP8_WIDEN_MODES = {"query": FP8_AS_QUERY.value, "f16": FP8_F16.value,
                    "f16_vt": FP8_F16_VT.value}


@triton.jit
def _load_v_f16_t(v_cache_ptr, tok_off, pos_ok, D: tl.constexpr, MASKED: tl.constexpr):
    """An FP8 cache's V tile as float16 [TILE_N, D] (``FP8_F16_VT``; every column real),
    loaded as [D, TILE_N] and transposed after widening."""
    offs_d = tl.arange(0, D)
    ptr = v_cache_ptr + tok_off[None, :] + offs_d[:, None]
    if MASKED:
        vt = tl.load(ptr, mask=pos_ok[None, :], other=0.0)
    else:
        vt = tl.load(ptr)
    return tl.trans(vt.to(tl.float16))


@triton.jit
def _attend_kv(
    q,
    acc,
    m_i,
    l_i,
    k,
    v,
    pos,
    pos_ok,
    row_pos,
    v_cache_ptr,
    tok_off,
    scale_log2,
    offs_d,
    d_ok,
    window,
    softcap_log2,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    HAVE_V: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    """The online-softmax step of ``_attend_tile`` on a loaded K tile (``k [D, TILE_N]``) and,
    with ``HAVE_V``, V tile (else V is loaded here, after the QK^T product). ``KV_FP8``: the
    tiles are e4m3, widened here; their scales are folded into ``scale_log2`` (K) and the
    final normalisation (V) by the caller."""
    if KV_FP8:
        k = k.to(q.dtype)
    if IEEE_DOT:
        s = tl.dot(q, k, input_precision="ieee")
    else:
        s = tl.dot(q, k)
    if SOFT_CAP:
        # Here scale_log2 is scale / c and softcap_log2 is c * log2(e): c * tanh(scale * s / c)
        # in the exp2 domain. tanh(x) = 1 - 2 / (e^2x + 1) saturates cleanly at +-1.
        x = s * scale_log2
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * softcap_log2
    else:
        s = s * scale_log2
    if MASKED:
        keep = pos_ok[None, :] & (pos[None, :] <= row_pos[:, None])
        if WINDOW:
            keep = keep & (pos[None, :] > row_pos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that see nothing yet keep max -inf: subtract 0 so p stays 0 rather than NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every entry of s is
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if not HAVE_V and KV_FP8 == FP8_F16_VT and EVEN_D:
        v = _load_v_f16_t(v_cache_ptr, tok_off, pos_ok, offs_d.shape[0], MASKED)
    else:
        if not HAVE_V:
            v = _load_v(v_cache_ptr, tok_off, offs_d, d_ok, pos_ok, MASKED, EVEN_D)
        if KV_FP8:
            v = v.to(q.dtype)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    counter_ptr,
    block_table_ptr,
    seq_lens_ptr,
    qsl_ptr,
    k_scale_ptr,  # FP8 cache (KV_FP8): the layer's float32 K and V scales
    v_scale_ptr,
    num_reqs,
    num_splits,
    scale_log2,
    window,  # sliding window (WINDOW only)
    softcap_log2,  # soft-cap c * log2(e) (SOFT_CAP only; scale_log2 is then scale / c)
    stride_q_tok: tl.int64,
    stride_q_head: tl.int64,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    stride_kv_blk: tl.int64,
    stride_kv_tok: tl.int64,
    stride_kv_head: tl.int64,
    stride_bt: tl.int64,
    times_ptr,
    NUM_HEADS: tl.constexpr,
    QPK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    FUSED_MERGE: tl.constexpr,
    SPLITS_P: tl.constexpr,
    EARLY_V: tl.constexpr,
    PDL: tl.constexpr,
    QPK_P: tl.constexpr,
    # Split decode: the program's first tile (block table entries, K and V) is loaded before
    # waiting for the previous kernel, since only the newest position of each request is
    # written in this step (by the K/V write before); that one position is loaded again after
    # the wait. Saves the block-table and cache round trips after the wait.
    PRELOAD: tl.constexpr,
    # Time stamps per program (triton_probe.stamp, into times_ptr): entry, past the wait,
    # query loaded, math done, stores issued; with PRELOAD also the preloaded tile landed and
    # the newest position reloaded. For tools/bench_decode_chain.py; off, nothing is compiled
    # in.
    TIMES: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    # FP8 e4m3 cache (non-zero: how the tiles widen, ``FP8_AS_QUERY`` / ``FP8_F16`` /
    # ``FP8_F16_VT``): entries times k_scale / v_scale. K's scale multiplies the scores
    # (folded into scale_log2), V's the normalised output; both read through pointers at run
    # time.
    KV_FP8: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if TIMES:
        prog = (pid_q * tl.num_programs(1) + kv_head) * tl.num_programs(2) + split
        stamp(times_ptr, prog, 0, split)
    if DECODE_ONLY:
        req = pid_q
        q_block = 0
    else:
        req = _find_request(qsl_ptr, pid_q, num_reqs, BLOCK_Q)
        q_block = pid_q - ((tl.load(qsl_ptr + req) - tl.load(qsl_ptr)) // BLOCK_Q + req)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    head_off = kv_head.to(tl.int64) * stride_kv_head
    if KV_FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    if PRELOAD:
        # Decode only (one query per request): the context is seq_len positions, the split's
        # tiles as computed below. A padding request (seq_len 0) or an empty split loads nothing.
        if WINDOW:
            # As the split ranges below: they cover the tiles from the window's first one.
            first0 = tl.maximum(seq_len - window, 0) // TILE_N
        else:
            first0 = 0
        per0 = ((seq_len + TILE_N - 1) // TILE_N - first0 + num_splits - 1) // num_splits
        pos0 = (first0 + split * per0) * TILE_N + tl.arange(0, TILE_N)
        ok0 = pos0 < seq_len
        blk0 = tl.load(bt_row + pos0 // PAGE_SIZE, mask=ok0, other=0).to(tl.int64)
        off0 = blk0 * stride_kv_blk + (pos0 % PAGE_SIZE).to(tl.int64) * stride_kv_tok + head_off
        k0 = tl.load(k_cache_ptr + off0[None, :] + offs_d[:, None],
                     mask=ok0[None, :] & d_ok[:, None], other=0.0)
        v0 = tl.load(v_cache_ptr + off0[:, None] + offs_d[None, :],
                     mask=ok0[:, None] & d_ok[None, :], other=0.0)
    if PDL:
        # Launched early (programmatic dependent launch): the step metadata above is the
        # runner's, but the query and this step's K/V come from the previous kernel. Every
        # program waits, padding ones too, so that this grid completes after its predecessor.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if TIMES:
        stamp(times_ptr, prog, 1, split)
    if q_block * BLOCK_Q >= q_len:
        return
    ctx_before = seq_len - q_len  # context positions before the first query of this request

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + offs_m // QPK
    head = kv_head * QPK + offs_m % QPK
    row_ok = (offs_m < BLOCK_Q * QPK) & (q_idx < q_len)
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if KV_FP8 >= FP8_F16:
        q = q.to(tl.float16)  # (_attend_kv widens the tiles to the query's dtype)
    if TIMES:
        stamp(times_ptr, prog, 2, tl.sum(tl.sum(q.to(tl.float32), axis=1), axis=0))

    # Causal bound: the block's last query row sees positions up to ctx_before + its index.
    kv_end = tl.minimum(ctx_before + tl.minimum((q_block + 1) * BLOCK_Q, q_len), seq_len)
    kv_end = tl.maximum(kv_end, 0)
    num_tiles = (kv_end + TILE_N - 1) // TILE_N
    if WINDOW:
        # Tiles that end before the first row's window starts are seen by no row: skipped.
        tile_first = tl.maximum(ctx_before + q_block * BLOCK_Q - window + 1, 0) // TILE_N
    else:
        tile_first = 0
    if SPLIT_KV:
        per_split = (num_tiles - tile_first + num_splits - 1) // num_splits
        tile_lo = tile_first + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
    else:
        tile_lo = tile_first
        tile_hi = num_tiles

    row_pos = ctx_before + q_idx  # context position of each query row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P], tl.float32)
    if PRELOAD:
        if TIMES:
            stamp(times_ptr, prog, 5, tl.sum(tl.sum(k0.to(tl.float32), axis=1), axis=0)
                  + tl.sum(tl.sum(v0.to(tl.float32), axis=1), axis=0))
        # The newest position, written by the kernel before: loaded again now (one row).
        new0 = ok0 & (pos0 == seq_len - 1)
        # .cg: the stale line read before the wait must not be served from L1.
        k0 = tl.where(new0[None, :], tl.load(k_cache_ptr + off0[None, :] + offs_d[:, None],
                                             mask=new0[None, :] & d_ok[:, None], other=0.0,
                                             cache_modifier=".cg"), k0)
        v0 = tl.where(new0[:, None], tl.load(v_cache_ptr + off0[:, None] + offs_d[None, :],
                                             mask=new0[:, None] & d_ok[None, :], other=0.0,
                                             cache_modifier=".cg"), v0)
        if TIMES:
            stamp(times_ptr, prog, 6, tl.sum(tl.sum(k0.to(tl.float32), axis=1), axis=0)
                  + tl.sum(tl.sum(v0.to(tl.float32), axis=1), axis=0))
        m_i, l_i, acc = _attend_kv(
            q, acc, m_i, l_i, k0, v0, pos0, ok0, row_pos, v_cache_ptr, off0, scale_log2, offs_d,
            d_ok, window, softcap_log2, True, HEAD_DIM == HEAD_DIM_P, IEEE_DOT, True, WINDOW,
            SOFT_CAP, KV_FP8,
        )  # fmt: skip
        tile_lo += 1
    # Tiles that end at or before the first row's position are visible to every row and lie
    # inside the context: no masks. Only the tiles on the causal diagonal (and the ragged last
    # tile) pay for masking.
    n_full = (ctx_before + q_block * BLOCK_Q + 1) // TILE_N
    if WINDOW:
        # With a window the unmasked tiles must also start at or after the last row's window
        # start; the tiles before that straddle some row's window and are masked.
        last_row = ctx_before + tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
        n_lo = (tl.maximum(last_row - window + 1, 0) + TILE_N - 1) // TILE_N
        for t in range(tile_lo, tl.minimum(n_lo, tile_hi)):
            m_i, l_i, acc = _attend_tile(
                q, acc, m_i, l_i, t, kv_end, row_pos, k_cache_ptr, v_cache_ptr, bt_row,
                head_off, stride_kv_blk, stride_kv_tok, scale_log2, offs_d, d_ok, window,
                softcap_log2, PAGE_SIZE, TILE_N, True, HEAD_DIM == HEAD_DIM_P, IEEE_DOT, EARLY_V,
                WINDOW, SOFT_CAP, KV_FP8,
            )  # fmt: skip
        tile_lo = tl.maximum(n_lo, tile_lo)
        n_full = tl.maximum(n_full, n_lo)
    for t in range(tile_lo, tl.minimum(n_full, tile_hi)):
        m_i, l_i, acc = _attend_tile(
            q, acc, m_i, l_i, t, kv_end, row_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off,
            stride_kv_blk, stride_kv_tok, scale_log2, offs_d, d_ok, window, softcap_log2,
            PAGE_SIZE, TILE_N, False, HEAD_DIM == HEAD_DIM_P, IEEE_DOT, EARLY_V, WINDOW, SOFT_CAP,
            KV_FP8,
        )  # fmt: skip
    for t in range(tl.maximum(n_full, tile_lo), tile_hi):
        m_i, l_i, acc = _attend_tile(
            q, acc, m_i, l_i, t, kv_end, row_pos, k_cache_ptr, v_cache_ptr, bt_row, head_off,
            stride_kv_blk, stride_kv_tok, scale_log2, offs_d, d_ok, window, softcap_log2,
            PAGE_SIZE, TILE_N, True, HEAD_DIM == HEAD_DIM_P, IEEE_DOT, EARLY_V, WINDOW, SOFT_CAP,
            KV_FP8,
        )  # fmt: skip

    # seq_len 0 (padding) or an empty split: acc and l are 0 and the output row is 0.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if KV_FP8:
        o = o * tl.load(v_scale_ptr)
    if TIMES:
        stamp(times_ptr, prog, 3, tl.sum(tl.sum(o, axis=1), axis=0))
    if SPLIT_KV:
        part = (tok * NUM_HEADS + head) * num_splits + split
        tl.store(
            part_out_ptr + part[:, None] * HEAD_DIM_P + offs_d[None, :], o, mask=row_ok[:, None]
        )
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        if FUSED_MERGE:
            # The last of this (request, KV head)'s split programs to finish merges them all,
            # saving the merge kernel's launch. The barrier orders every thread's partial stores
            # before the (single-thread, release) counter increment; the acquire side reads
            # the other programs' partials through L2 (.cg). The merger re-arms the counter.
            tl.debug_barrier()
            cnt_ptr = counter_ptr + req * tl.num_programs(1) + kv_head
            done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if done == num_splits - 1:
                _merge_group(
                    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, q_start, kv_head * QPK,
                    num_splits, stride_o_tok, stride_o_head, NUM_HEADS, QPK,
                    QPK_P, HEAD_DIM, HEAD_DIM_P, SPLITS_P,
                )  # fmt: skip
                tl.atomic_xchg(cnt_ptr, 0)
    else:
        tl.store(
            out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    if TIMES:
        stamp(times_ptr, prog, 4, split)


@triton.jit
def _merge_group(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    tok,
    head0,
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    QPK: tl.constexpr,
    QPK_P: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
):
    """``_merge_head`` for heads ``head0 .. head0 + QPK - 1`` at once (one round of loads,
    through L2: the partials were written by other programs of this launch)."""
    offs_h = tl.arange(0, QPK_P)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM_P)
    h_ok = offs_h < QPK
    s_ok = offs_s < num_splits
    ok2 = h_ok[:, None] & s_ok[None, :]
    rows = (tok.to(tl.int64) * NUM_HEADS + head0 + offs_h)[:, None] * num_splits + offs_s[None, :]
    m = tl.load(part_max_ptr + rows, mask=ok2, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_sum_ptr + rows, mask=ok2, other=0.0, cache_modifier=".cg")
    o = tl.load(
        part_out_ptr + rows[:, :, None] * HEAD_DIM_P + offs_d[None, None, :],
        mask=ok2[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    m_all = tl.max(m, axis=1)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(l > 0.0, tl.exp2(m - m_use[:, None]) * l, 0.0)
    den = tl.sum(w, axis=1)
    res = tl.sum(o * w[:, :, None], axis=1) / tl.where(den > 0.0, den, 1.0)[:, None]
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_o_tok + (head0 + offs_h)[:, None] * stride_o_head
        + offs_d[None, :],
        res.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@triton.jit
def _merge_head(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    tok,
    head,
    num_splits,
    stride_o_tok,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
    FROM_L2: tl.constexpr,
):
    """out[tok, head] = sum_s w_s * o_s / sum_s w_s with w_s = 2^(max_s - max) * sum_s."""
    offs_s = tl.arange(0, SPLITS_P)
    s_ok = offs_s < num_splits
    base = (tok.to(tl.int64) * NUM_HEADS + head) * num_splits
    offs_d = tl.arange(0, HEAD_DIM_P)
    d_ok = offs_d < HEAD_DIM
    o_ptrs = part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM_P + offs_d[None, :]
    if FROM_L2:
        m = tl.load(part_max_ptr + base + offs_s, mask=s_ok, other=float("-inf"),
                    cache_modifier=".cg")
        l = tl.load(part_sum_ptr + base + offs_s, mask=s_ok, other=0.0, cache_modifier=".cg")
        o = tl.load(o_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
    else:
        m = tl.load(part_max_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
        l = tl.load(part_sum_ptr + base + offs_s, mask=s_ok, other=0.0)
        o = tl.load(o_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m_all = tl.max(m, axis=0)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.where(l > 0.0, tl.exp2(m - m_use) * l, 0.0)
    den = tl.sum(w, axis=0)
    res = tl.sum(o * w[:, None], axis=0) / tl.where(den > 0.0, den, 1.0)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=d_ok,
    )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    qsl_ptr,
    num_splits,
    stride_o_tok: tl.int64,
    stride_o_head: tl.int64,
    times_ptr,  # as the attention kernel's (TIMES): entry, past the wait, stores issued
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    SPLITS_P: tl.constexpr,
    PDL: tl.constexpr,
    TIMES: tl.constexpr,
):
    """The split merge as its own launch; one program per (decode request, head). With PDL it
    is resident before the attention kernel ends and waits for it."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    if TIMES:
        prog = req * tl.num_programs(1) + head
        stamp(times_ptr, prog, 0, head)
    tok = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - tok
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the partials come from the attention kernel
    if TIMES:
        stamp(times_ptr, prog, 1, head)
    if q_len != 1:
        return
    _merge_head(
        out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, tok, head, num_splits, stride_o_tok,
        stride_o_head, NUM_HEADS, HEAD_DIM, HEAD_DIM_P, SPLITS_P, False,
    )  # fmt: skip
    if TIMES:
        stamp(times_ptr, prog, 4, head)


# Split counters of the fused merge, one int32 per (request, KV head), per device. Zero between
# launches: each merging program re-arms its own. Allocated on first use outside a graph
# capture (a capture's warm-up runs eagerly first) and kept for the process.
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_MAX_COUNTERS = 8192
# Off by default: on H100 (Qwen3 / Llama-8B heads, batch 1, context 1024) the attention kernel
# followed by the merge kernel, both launched early (PDL), beat the in-kernel merge, whose
# GPU-scope fence + counter atomic + partial reload sit on the critical path. (Measured at 16
# splits; at MAX_SPLITS 32 its merge tile doubles, and Qwen3-30B-A3B's batch 1 took 3.033 ms
# with it against 2.999 / 3.006 without.)
# KernelConfig.attn_fused_merge (TIDAL_ATTN_FUSED_MERGE=1) turns it on.
FUSED_MERGE = False
# Split decodes load their first tile before the dependent-launch wait (``PRELOAD``);
# KernelConfig.attn_preload off (TIDAL_ATTN_PRELOAD=0) loads it after, as every other tile.
PRELOAD = True


def configure(*, fused_merge: bool, preload: bool) -> None:
    """The variants of this worker's ``KernelPolicy`` (``kernel_policy.apply_tuning``): set
    once at start-up, before any attention kernel compiles or a graph is captured."""
    global FUSED_MERGE, PRELOAD
    FUSED_MERGE = fused_merge
    PRELOAD = preload


def _pdl_enabled(device: torch.device) -> bool:
    from tidal.worker.ops.triton_decode import pdl_enabled

    return pdl_enabled(device)


def _split_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    if needed > _MAX_COUNTERS:
        return None
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = torch.zeros(_MAX_COUNTERS, dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    plan: TritonAttentionPlan,
    fused_merge: bool | None = None,
    times: tuple[torch.Tensor, torch.Tensor] | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Attention of ``query [T, H, D]`` over the paged caches ``[blocks, page, Hkv, D]``.

    Split decodes are merged by a second kernel, or, with ``fused_merge`` (default:
    ``FUSED_MERGE``, env ``TIDAL_ATTN_FUSED_MERGE=1``), inside the attention kernel by the last
    split program of each request and KV head (not when no counter buffer can be had: first
    use inside a graph capture). ``times``: int64 buffers of ``triton_probe.STAMPS`` per
    program for the attention and the merge kernel, filled with their time stamps.
    ``sliding_window`` / ``logits_soft_cap``: see ``AttentionImpl.forward``. FP8 caches
    (``float8_e4m3fn``) are read as entry * ``k_scale`` / ``v_scale`` (float32 one-element
    tensors; None: 1.0)."""
    if num_reqs == 0 or query.shape[0] == 0:
        return
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if kv_fp8:
        k_scale, v_scale = _scales(k_scale, v_scale, query.device)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    qpk = num_heads // num_kv_heads
    head_dim_p = max(16, next_pow2(head_dim))
    split = plan.num_splits > 1
    if split:
        part_out = torch.empty(
            (num_tokens, num_heads, plan.num_splits, head_dim_p),
            dtype=torch.float32,
            device=query.device,
        )
        part_max = torch.empty(
            (num_tokens, num_heads, plan.num_splits), dtype=torch.float32, device=query.device
        )
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused by the kernel in this mode
    counters = None
    if split and (FUSED_MERGE if fused_merge is None else fused_merge):
        counters = _split_counters(query.device, plan.grid0 * num_kv_heads)
    # Decode steps launch early behind the previous kernel (see triton_decode.pdl_enabled);
    # the merge kernel, when it runs, is an ordinary launch.
    pdl = plan.decode_only and _pdl_enabled(query.device)
    grid = (plan.grid0, num_kv_heads, plan.num_splits)
    args = (
        out,
        query,
        key_cache,
        value_cache,
        part_out,
        part_max,
        part_sum,
        counters if counters is not None else seq_lens,
        block_table,
        seq_lens,
        query_start_loc,
        k_scale if kv_fp8 else seq_lens,
        v_scale if kv_fp8 else seq_lens,
        num_reqs,
        plan.num_splits,
        scale * _LOG2E if logits_soft_cap is None else scale / logits_soft_cap,
        sliding_window or 0,
        0.0 if logits_soft_cap is None else logits_soft_cap * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_table.stride(0),
        times[0] if times is not None else seq_lens,
    )
    consts = dict(
        NUM_HEADS=num_heads,
        QPK=qpk,
        HEAD_DIM=head_dim,
        HEAD_DIM_P=head_dim_p,
        PAGE_SIZE=key_cache.shape[1],
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        TILE_N=plan.tile_n,
        DECODE_ONLY=plan.decode_only,
        SPLIT_KV=split,
        IEEE_DOT=query.dtype == torch.float32,
        FUSED_MERGE=counters is not None,
        EARLY_V=split and plan.decode_only and plan.early_v,
        SPLITS_P=max(2, next_pow2(max(MAX_SPLITS, plan.num_splits))),
        QPK_P=max(2, next_pow2(qpk)),
        PRELOAD=split and plan.decode_only and PRELOAD,
        TIMES=times is not None,
        WINDOW=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        KV_FP8=(0 if not kv_fp8 else FP8_AS_QUERY.value if query.dtype == torch.float32
                else _FP8_WIDEN_MODES[plan.fp8_widen]),
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    if pdl:
        from tidal.worker.ops.triton_decode import launch

        launch(_paged_attention_kernel, grid, args, consts, True)
    else:
        _paged_attention_kernel[grid](*args, **consts, PDL=False)
    if split and counters is None:
        margs = (out, part_out, part_max, part_sum, query_start_loc, plan.num_splits,
                 out.stride(0), out.stride(1), times[1] if times is not None else seq_lens)
        # One warp for heads up to 128 wide: each thread then holds every split of its few
        # head dimensions, so the sums over the splits stay in its registers (no shared
        # memory, no barrier). H100, context 1024, same call: Qwen3-30B-A3B batch 1 3.010 /
        # 3.011 -> 2.938 / 2.940 ms a step (2 warps: 3.002 / 3.004), Qwen3-0.6B batch 8
        # 1.798 / 1.828 -> 1.708 ms. Wider heads keep four (one warp would hold 256 floats a
        # thread of a 32 x 256 tile: spills; not measured).
        mconsts = dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P=head_dim_p,
                       SPLITS_P=max(2, next_pow2(max(MAX_SPLITS, plan.num_splits))),
                       TIMES=times is not None, num_warps=1 if head_dim_p <= 128 else 4)
        if pdl:
            from tidal.worker.ops.triton_decode import launch

            launch(_merge_splits_kernel, (num_reqs, num_heads), margs, mconsts, True)
        else:
            _merge_splits_kernel[(num_reqs, num_heads)](*margs, **mconsts, PDL=False)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,  # FP8 cache (KV_FP8): stored = clamp(x / scale, +-448) as e4m3
    v_scale_ptr,
    stride_k_tok: tl.int64,
    stride_k_head: tl.int64,
    stride_v_tok: tl.int64,
    stride_v_head: tl.int64,
    stride_c_blk: tl.int64,
    stride_c_tok: tl.int64,
    stride_c_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr,
    HEAD_DIM_P: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    h = tl.arange(0, HEADS_P)
    d = tl.arange(0, HEAD_DIM_P)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    dst = blk * stride_c_blk + off * stride_c_tok + h[:, None] * stride_c_head + d[None, :]
    k = tl.load(key_ptr + t * stride_k_tok + h[:, None] * stride_k_head + d[None, :], mask=mask)
    if KV_FP8:
        k = fp8_quantize(k, tl.load(k_scale_ptr))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_v_tok + h[:, None] * stride_v_head + d[None, :], mask=mask)
    if KV_FP8:
        v = fp8_quantize(v, tl.load(v_scale_ptr))
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Scatter ``key/value [T, Hkv, D]`` into the paged caches at ``slot_mapping`` (< 0: skip);
    FP8 caches store them quantized with ``k_scale`` / ``v_scale`` (None: 1.0)."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    kv_fp8 = key_cache.dtype == torch.float8_e4m3fn
    if kv_fp8:
        k_scale, v_scale = _scales(k_scale, v_scale, key.device)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    heads_p = next_pow2(num_kv_heads)
    head_dim_p = next_pow2(head_dim)
    # Wide rows (many KV heads x 128) want more warps to keep enough loads in flight.
    num_warps = 4 if heads_p * head_dim_p <= 2048 else 8
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale if kv_fp8 else slot_mapping,
        v_scale if kv_fp8 else slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P=heads_p,
        HEAD_DIM_P=head_dim_p,
        PAGE_SIZE=key_cache.shape[1],
        KV_FP8=kv_fp8,
        num_warps=num_warps,
    )


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's scales as float32 device tensors (None: 1.0, made here: not inside a graph
    capture, where every caller passes its layer's own)."""
    one = None
    if k_scale is None or v_scale is None:
        one = torch.ones(1, dtype=torch.float32, device=device)
    return (one if k_scale is None else k_scale), (one if v_scale is None else v_scale)

