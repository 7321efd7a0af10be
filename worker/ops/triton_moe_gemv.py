"""The fused MoE op for a few tokens: two GEMV-style kernels, no alignment, no tensor cores.

At batch-1 decode the grouped path (``triton_moe``) spends more on its fixed costs than on its
arithmetic: four launches to sort the (token, slot) pairs by expert and pad them to ``block_m``
rows, two tensor-core GEMMs whose M tiles are nearly all padding, a float32 ``[T*k, H]``
buffer and a separate sum over the slots. Here every pair is its own GEMV, reading only its
expert's rows:

1. ``_gate_up_kernel``: one program per (pair, ``BLOCK_N`` intermediate rows) reads the
   pair's expert's gate and up rows for its outputs over all of K = H, multiplies them by the
   token's hidden row in float32 (``tl.sum``, no ``tl.dot``) and writes ``silu(gate) * up``
   into ``act [T*k, I]``, rounded where torch rounds.
2. ``_down_kernel``: one program per (token, ``BLOCK_N`` hidden rows) reads those rows of
   all the token's k experts' ``w2`` as one tile per K chunk, accumulates ``router weight *
   (w2[expert] rows . act[pair])`` in float32 and writes ``out [T, H]`` in the hidden dtype:
   the top-k sum without a float32 buffer or another launch.

A pair whose id is not an expert of this rank (``E``: another expert-parallel rank's, or a
NaN router row's) adds nothing and its id is never used as an address. FP8 (e4m3) weights take
a float32 scale per expert and output row (``moe_torch``), applied as the grouped kernel does.

Both launches have fixed grids for a given T and read nothing on the host, so CUDA graphs
capture them. With programmatic dependent launch (Hopper, ``triton_decode.pdl_enabled``) the
down kernel is launched while the gate/up kernel drains and loads the first K chunk of its
experts' rows before it waits for ``act``. Launch shapes: ``moe_configs.DirectConfig``
(``direct_config``); the path's selection: ``moe_configs.use_direct``. Importing this module
imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tidal.worker.ops import triton_decode
from tidal.worker.ops.moe_configs import DirectConfig, GemvShape, direct_config
from tidal.worker.ops.triton_decode import _w_chunk


@triton.jit
def _gate_up_chunk(acc_g, acc_u, x_row, g_rows, u_rows, kk, row_ok, K: tl.constexpr,
                   EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    km = kk < K
    if EVEN_K:
        xf = tl.load(x_row + kk).to(tl.float32)[None, :]
    else:
        xf = tl.load(x_row + kk, mask=km, other=0.0).to(tl.float32)[None, :]
    even = EVEN_N and EVEN_K
    acc_g += _w_chunk(g_rows, kk, row_ok, km, even, EVICT).to(tl.float32) * xf
    acc_u += _w_chunk(u_rows, kk, row_ok, km, even, EVICT).to(tl.float32) * xf
    return acc_g, acc_u


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows 0..I, up rows I..2I
    ids_ptr,  # [T*k]
    act_ptr,  # [T*k, I] out, the hidden dtype
    scale_ptr,  # [E, 2I] float32 (W_SCALE)
    num_experts,
    num_pairs,
    stride_xm,
    stride_we,
    stride_wn,
    stride_se,
    TOP_K: tl.constexpr,
    H: tl.constexpr,  # K: fixed per model, so the chunk loop unrolls and masks fold away
    I: tl.constexpr,  # N
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVICT: tl.constexpr,
    W_SCALE: tl.constexpr,
    TRIGGER: tl.constexpr,  # let the (PDL-launched) down kernel start as this one drains
    UNROLL: tl.constexpr,  # unroll the loop over K chunks (few of them)
    PDL: tl.constexpr,  # launched as a programmatic dependent of the router's kernel
):
    if PDL:
        # Everything here needs the routing (the expert picks the rows): wait at once. The
        # launch itself is what overlaps the router's tail.
        tl.extra.cuda.gdc_wait()
    if TRIGGER:
        # Only after the wait: the down kernel reads the routing kernel's ids and weights
        # before its own wait, and it launches once every program here has triggered. A
        # trigger before this wait would let it start while the routing kernel, which this
        # one waits for, still runs.
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    # The pairs of one row block run next to each other: two tokens routed to one expert read
    # its rows at about the same time, the second mostly from L2.
    pair = pid % num_pairs
    rows = (pid // num_pairs) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):
        return  # another rank's expert: its act row is never read
    row_ok = rows < I
    g_rows = w_ptr + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + I * stride_wn
    x_row = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm
    cols = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    if UNROLL:
        # A few chunks (H is a constant): every chunk's loads can be in flight before the
        # first FMA.
        for k0 in tl.static_range(0, H, BLOCK_K):
            acc_g, acc_u = _gate_up_chunk(acc_g, acc_u, x_row, g_rows, u_rows, k0 + cols, row_ok,
                                          H, EVEN_N, EVEN_K, EVICT)
    else:
        # Many: hoisting them all would run out of registers (spills, measured 7.9 KB a
        # thread in the down kernel at Mixtral's I = 14336).
        for k0 in range(0, H, BLOCK_K):
            acc_g, acc_u = _gate_up_chunk(acc_g, acc_u, x_row, g_rows, u_rows, k0 + cols, row_ok,
                                          H, EVEN_N, EVEN_K, EVICT)
    g = tl.sum(acc_g, axis=1)
    u = tl.sum(acc_u, axis=1)
    if W_SCALE:
        s_row = scale_ptr + expert.to(tl.int64) * stride_se
        g *= tl.load(s_row + rows, mask=row_ok, other=0.0)
        u *= tl.load(s_row + I + rows, mask=row_ok, other=0.0)
    # Rounded where torch (and the grouped kernel) rounds: the projections, silu, the product.
    dt = act_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    out = act_ptr + pair.to(tl.int64) * I + rows
    if EVEN_N:
        tl.store(out, (s * u).to(dt))
    else:
        tl.store(out, (s * u).to(dt), mask=row_ok)


@triton.jit
def _slot_rows(w_rows, kk, w_ok, K: tl.constexpr, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """One K chunk of every slot's rows, ``[SLOTS, BLOCK_N, BLOCK_K]``; nothing is read for a
    slot of no expert here (``w_ok``)."""
    if EVEN_K:
        w = tl.load(w_rows + kk[None, None, :], mask=w_ok, other=0.0, eviction_policy=EVICT)
    else:
        w = tl.load(w_rows + kk[None, None, :], mask=w_ok & (kk < K)[None, None, :], other=0.0,
                    eviction_policy=EVICT)
    return w


@triton.jit
def _down_chunk(acc, w, a_rows, kk, ok, weight, K: tl.constexpr, EVEN_K: tl.constexpr,
                W_SCALE: tl.constexpr):
    if EVEN_K:
        a = tl.load(a_rows + kk[None, :], mask=ok[:, None], other=0.0)
    else:
        a = tl.load(a_rows + kk[None, :], mask=ok[:, None] & (kk < K)[None, :], other=0.0)
    af = a.to(tl.float32)
    if not W_SCALE:
        af = af * weight[:, None]  # folded into act's row: the scale-free sum is linear
    return acc + w.to(tl.float32) * af[:, None, :]


@triton.jit
def _down_kernel(
    act_ptr,  # [T*k, I]
    w_ptr,  # [E, H, I]
    ids_ptr,  # [T*k]
    weights_ptr,  # [T*k] float32 router weights
    out_ptr,  # [T, H] out, the hidden dtype
    scale_ptr,  # [E, H] float32 (W_SCALE)
    num_experts,
    num_tokens,
    stride_we,
    stride_wn,
    stride_se,
    stride_om,
    TOP_K: tl.constexpr,
    SLOTS: tl.constexpr,  # TOP_K rounded up to a power of two
    H: tl.constexpr,  # N
    I: tl.constexpr,  # K
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVICT: tl.constexpr,
    W_SCALE: tl.constexpr,
    UNROLL: tl.constexpr,  # unroll the loop over K chunks (few of them)
    PDL: tl.constexpr,
):
    # The k slots are a tile dimension: each K chunk is one [SLOTS, BLOCK_N, BLOCK_K] load of
    # all the token's experts' rows, so a program has every slot's bytes in flight at once
    # (a loop over the slots, one after another, was no faster in bf16 and 17% slower in FP8 on
    # an H100 at Qwen3-30B-A3B's shape).
    pid = tl.program_id(0)
    token = pid % num_tokens
    rows = (pid // num_tokens) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < H
    slot = tl.arange(0, SLOTS)
    pair = token * TOP_K + slot
    slot_ok = slot < TOP_K
    expert = tl.load(ids_ptr + pair, mask=slot_ok, other=num_experts)
    ok = slot_ok & (expert >= 0) & (expert < num_experts)
    # (A NaN router weight of another rank's pair never reaches the sum: masked to 0.)
    weight = tl.load(weights_ptr + pair, mask=ok, other=0.0).to(tl.float32)
    e64 = tl.where(ok, expert, 0).to(tl.int64)
    w_rows = w_ptr + e64[:, None, None] * stride_we + \
        rows.to(tl.int64)[None, :, None] * stride_wn
    a_rows = act_ptr + pair.to(tl.int64)[:, None] * I
    cols = tl.arange(0, BLOCK_K)
    if EVEN_N:
        w_ok = ok[:, None, None]
    else:
        w_ok = ok[:, None, None] & row_ok[None, :, None]
    w_pre = _slot_rows(w_rows, cols, w_ok, I, EVEN_K, EVICT)
    if PDL:
        # Ids and router weights come from the routing kernel, complete before any gate/up
        # program triggered this launch: the first chunk of every slot's rows streams in
        # while the gate/up kernel drains.
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # act is written; out may reuse memory it read
    # The first chunk, then the others: unrolled when few, as in _gate_up_kernel.
    acc = tl.zeros((SLOTS, BLOCK_N, BLOCK_K), tl.float32)
    acc = _down_chunk(acc, w_pre, a_rows, cols, ok, weight, I, EVEN_K, W_SCALE)
    if UNROLL:
        for k0 in tl.static_range(BLOCK_K, I, BLOCK_K):
            w = _slot_rows(w_rows, k0 + cols, w_ok, I, EVEN_K, EVICT)
            acc = _down_chunk(acc, w, a_rows, k0 + cols, ok, weight, I, EVEN_K, W_SCALE)
    else:
        for k0 in range(BLOCK_K, I, BLOCK_K):
            w = _slot_rows(w_rows, k0 + cols, w_ok, I, EVEN_K, EVICT)
            acc = _down_chunk(acc, w, a_rows, k0 + cols, ok, weight, I, EVEN_K, W_SCALE)
    per_slot = tl.sum(acc, axis=2)  # [SLOTS, BLOCK_N]
    if W_SCALE:
        scale = tl.load(scale_ptr + e64[:, None] * stride_se + rows[None, :],
                        mask=ok[:, None] & row_ok[None, :], other=0.0)
        per_slot = per_slot * scale * weight[:, None]
    y = tl.sum(per_slot, axis=0)
    out = out_ptr + token.to(tl.int64) * stride_om + rows
    dt = out_ptr.dtype.element_ty
    if EVEN_N:
        tl.store(out, y.to(dt))
    else:
        tl.store(out, y.to(dt), mask=row_ok)


def fused_moe_direct(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     config: DirectConfig | None = None,
                     w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None,
                     pdl: bool | None = None) -> torch.Tensor:
    """``moe_torch.fused_moe`` in two launches (module docstring). The caller
    (``triton_moe.fused_moe``) has checked the arguments and made ``hidden`` and the weights'
    last dimension contiguous, and the scales' too. ``config``: launch shapes instead of
    ``direct_config``'s; ``pdl``: programmatic dependent launch of the down kernel (None:
    where ``triton_decode.pdl_enabled``). Ids of E or more (other ranks' experts) add
    nothing."""
    t, h = hidden.shape
    top_k = topk_ids.shape[1]
    i = w13.shape[1] // 2
    cfg = config or direct_config(t, h, i, top_k, w13.element_size())
    ids, weights = flat_routing(topk_ids, topk_weights)
    act = torch.empty((t * top_k, i), dtype=hidden.dtype, device=hidden.device)
    out = torch.empty((t, h), dtype=hidden.dtype, device=hidden.device)
    if pdl is None:
        pdl = _pdl_default(hidden.device)
    gate_up(hidden, w13, ids, act, cfg.w13, w13_scale, trigger=pdl, pdl=pdl)
    # (A PDL launch that failed just now switched PDL off for the process: not tried again.)
    down(act, w2, ids, weights, out, cfg.w2, w2_scale, pdl=pdl and _pdl_default(hidden.device))
    return out


def flat_routing(topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [T*k], float32 weights [T*k])``, contiguous: views of the router's outputs
    (no launch) unless they come strided or in another dtype."""
    ids = topk_ids.reshape(-1)
    if ids.stride(0) != 1:
        ids = ids.contiguous()
    weights = topk_weights.reshape(-1)
    if weights.dtype != torch.float32 or weights.stride(0) != 1:
        weights = weights.float().contiguous()
    return ids, weights


def gate_up(hidden: torch.Tensor, w13: torch.Tensor, ids: torch.Tensor, act: torch.Tensor,
            shape: GemvShape, w13_scale: torch.Tensor | None = None,
            trigger: bool = False, pdl: bool = False) -> None:
    """``act [T*k, I] = silu(x W_gate^T) * (x W_up^T)`` per pair, of its token's row of
    ``hidden`` and its expert ``ids[pair]`` (pairs of no expert here: left unwritten).
    ``trigger``: let a PDL-launched successor start as this kernel drains; ``pdl``: launched
    as a programmatic dependent of the kernel before (the routing's)."""
    _check_shape(shape)
    h = hidden.shape[1]
    e, i = w13.shape[0], w13.shape[1] // 2
    pairs = ids.numel()
    top_k = pairs // hidden.shape[0]
    fp8 = w13_scale is not None
    args = (hidden, w13, ids, act, w13_scale if fp8 else act, e, pairs, hidden.stride(0),
            w13.stride(0), w13.stride(1), w13_scale.stride(0) if fp8 else 0)
    kwargs = dict(TOP_K=top_k, H=h, I=i, BLOCK_N=shape.block_n, BLOCK_K=shape.block_k,
                  EVEN_N=i % shape.block_n == 0, EVEN_K=h % shape.block_k == 0, EVICT=_evict(),
                  W_SCALE=fp8, TRIGGER=trigger, UNROLL=_unroll(h, shape),
                  num_warps=shape.num_warps)
    triton_decode.launch(_gate_up_kernel, (triton.cdiv(i, shape.block_n) * pairs,), args,
                         kwargs, pdl)


def down(act: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
         out: torch.Tensor, shape: GemvShape, w2_scale: torch.Tensor | None = None,
         pdl: bool = False) -> None:
    """``out [T, H] = sum_j weights[pair] * (act[pair] W2[ids[pair]]^T)`` over each token's
    pairs ``token * k + j``, written in ``out``'s dtype. ``pdl``: launched as a programmatic
    dependent of the kernel before (which wrote ``act``)."""
    _check_shape(shape)
    t, h = out.shape
    e, i = w2.shape[0], w2.shape[2]
    fp8 = w2_scale is not None
    args = (act, w2, ids, weights, out, w2_scale if fp8 else out, e, t, w2.stride(0),
            w2.stride(1), w2_scale.stride(0) if fp8 else 0, out.stride(0))
    top_k = ids.numel() // t
    kwargs = dict(TOP_K=top_k, SLOTS=triton.next_power_of_2(top_k), H=h, I=i,
                  BLOCK_N=shape.block_n, BLOCK_K=shape.block_k, EVEN_N=h % shape.block_n == 0,
                  EVEN_K=i % shape.block_k == 0, EVICT=_evict(), W_SCALE=fp8,
                  UNROLL=_unroll(i, shape), num_warps=shape.num_warps)
    triton_decode.launch(_down_kernel, (triton.cdiv(h, shape.block_n) * t,), args, kwargs, pdl)


# K chunks a kernel unrolls at most (Qwen3-30B-A3B's have 1 and 3; Mixtral's down, 14, spilled
# unrolled).
UNROLL_MAX_CHUNKS = 4


def _unroll(k: int, shape: GemvShape) -> bool:
    return triton.cdiv(k, shape.block_k) <= UNROLL_MAX_CHUNKS


def _evict() -> str:
    # The GEMV's L2 policy (``gemv_stream``): each expert row is read once per step, so
    # evict-first keeps the activations and what the next kernels read in L2.
    return "evict_first" if triton_decode.STREAM_WEIGHTS else ""


def _check_shape(s: GemvShape) -> None:
    for v in (s.block_n, s.block_k):
        if v < 1 or v & (v - 1):
            raise ValueError(f"direct MoE launch shape {s}: block sizes must be powers of two")


def _pdl_default(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return triton_decode.pdl_enabled(device)


def compile_check_cases() -> list[tuple[str, object, dict[str, str], dict[str, object]]]:
    """``(name, kernel, signature, constexprs)`` for ``tools/triton_compile_check.py``: both
    kernels at Qwen3-30B-A3B's shape with the default launch shapes, 16-bit and FP8 weights,
    with and without programmatic dependent launch, a masked (uneven) variant, and Mixtral's
    long rows (K chunks looped, not unrolled)."""
    cases: list[tuple[str, object, dict[str, str], dict[str, object]]] = []
    qwen3, mixtral = (2048, 768, 8), (4096, 14336, 2)
    for fp8, pdl, even, (h, i, k) in ((False, False, True, qwen3), (False, True, True, qwen3),
                                      (True, True, True, qwen3), (False, False, False, qwen3),
                                      (False, True, True, mixtral)):
        w = "*fp8e4nv" if fp8 else "*bf16"
        cfg = direct_config(1, h, i, k, 1 if fp8 else 2)
        # Uneven: H and I one row short of the blocks (every mask on).
        hh, ii = (h, i) if even else (h - 8, i - 2)
        label = (" (FP8 weights)" if fp8 else "") + (" + PDL" if pdl else "") + \
            ("" if even else " (masked)") + (" (Mixtral, K looped)" if k == 2 else "")
        common = dict(TOP_K=k, H=hh, I=ii, EVICT="evict_first", W_SCALE=fp8)
        a, b = cfg.w13, cfg.w2
        consts = dict(common, BLOCK_N=a.block_n, BLOCK_K=a.block_k, EVEN_N=ii % a.block_n == 0,
                      EVEN_K=hh % a.block_k == 0, TRIGGER=pdl, UNROLL=_unroll(hh, a), PDL=pdl)
        types = {"x_ptr": "*bf16", "w_ptr": w, "ids_ptr": "*i32", "act_ptr": "*bf16",
                 "scale_ptr": "*fp32"}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32")
               for n in _gate_up_kernel.arg_names}
        cases.append(("direct MoE gate/up" + label, _gate_up_kernel, sig, consts))
        consts = dict(common, SLOTS=triton.next_power_of_2(k), BLOCK_N=b.block_n, BLOCK_K=b.block_k,
                      EVEN_N=hh % b.block_n == 0, EVEN_K=ii % b.block_k == 0, PDL=pdl,
                      UNROLL=_unroll(ii, b))
        types = {"act_ptr": "*bf16", "w_ptr": w, "ids_ptr": "*i32", "weights_ptr": "*fp32",
                 "out_ptr": "*bf16", "scale_ptr": "*fp32"}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32")
               for n in _down_kernel.arg_names}
        cases.append(("direct MoE down + top-k sum" + label, _down_kernel, sig, consts))
    return cases
