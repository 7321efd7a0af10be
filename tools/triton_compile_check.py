"""Compile the tensor-parallel Triton kernels for Hopper (sm_90) on a machine without a GPU.

    pip install --no-deps --target /tmp/tri triton==3.6.0
    PYTHONPATH=/tmp/tri python tools/triton_compile_check.py     (tidal installed, e.g. -e .)

Triton's compiler passes run on the CPU, so a kernel that crashes the compiler (Triton 3.6 did
on a spin loop whose loaded tensor was carried and then left unused) shows up here in seconds,
not after a device call. Covers the batch-1 GEMV in each of its roles (plain, producer that
pushes its rows, consumer that polls and sums them, with and without the SiLU epilogue, with
the GeGLU one, with the LoRA term: plain, SiLU and the norm prologue, q/k/v slices, GeGLU),
LoRA's one-row shrink of partial sums (norming its row or not) and its grouped decode kernels,
the few-row GEMV (tensor-core, also split over K, and elementwise, with the PDL prefetch), the INT4 (W4A16) GEMVs (whole rows, tiled by groups), the partial-sum kernel, the signal-free all-reduce (also with the
residual add and sums of squares, and as an all-gather), the add + norm of one or a few rows, and the
attention chain of a decode step (rotary + K/V write, also with Gemma's q/k norms; split
attention, merge; with and without time stamps; unsplit attention over an FP8 cache, widened
to the query's dtype or to float16, V also transposed in registers), the FP8 quantizers and the
block-wise FP8 group quantizer and GEMM. Exits non-zero if any fails.
"""

from __future__ import annotations

import sys
from typing import Any


def _compile(fn: Any, signature: dict[str, str], constants: dict[str, Any]) -> str | None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except Exception as exc:  # noqa: BLE001 - reported per kernel
        return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def _decode_chain_cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """The rotary + K/V write, split-decode attention and merge kernels, with the time stamps of
    ``tools/bench_decode_chain.py`` on and off."""
    from tidal.worker.ops import attention_plan as ap
    from tidal.worker.ops import triton_attention_kernels as tak
    from tidal.worker.ops import triton_decode as td

    cases = []
    ints = {"num_slots", "stride_qkv", "stride_qo", "stride_cs", "stride_c_blk", "stride_c_tok"}
    # (times, FP8 KV cache): the stamped variants, and the FP8 cache without stamps.
    # (times, FP8 KV cache, Gemma 3's (1 + w) q/k norms): the stamped variants, the FP8 cache
    # without stamps, and the Gemma norms.
    for times, fp8, gemma in ((False, False, False), (True, False, False),
                              (False, True, False), (False, False, True)):
        cache = "*fp8e4nv" if fp8 else "*bf16"
        name = (" + stamps" if times else " (FP8 cache)" if fp8
                else " + Gemma q/k norms" if gemma else "")
        consts = dict(NUM_HEADS=16, NUM_KV_HEADS=4, HEADS_P=16, KV_HEADS_P=4, HEAD_DIM=128,
                      HALF=64, PAGE_SIZE=16, NORM=gemma, PDL=True, TIMES=times, KV_FP8=fp8,
                      GEMMA=gemma)
        sig = {a: "constexpr" if a in consts else "i32" if a in ints else "fp32" if a == "eps"
               else "*i64" if a in ("pos_ptr", "slot_ptr", "times_ptr") else "*fp32"
               if a in ("cs_ptr", "k_scale_ptr", "v_scale_ptr") else cache
               if a in ("k_cache_ptr", "v_cache_ptr") else "*bf16"
               for a in td._qk_norm_rope_kv_kernel.arg_names}
        cases.append((f"rotary + K/V write{name}", td._qk_norm_rope_kv_kernel, sig, consts))
        if gemma:  # the attention kernels do not change with the norm
            continue
        consts = dict(NUM_HEADS=16, QPK=4, HEAD_DIM=128, HEAD_DIM_P=128, PAGE_SIZE=16,
                      BLOCK_Q=1, BLOCK_M=16, TILE_N=64, DECODE_ONLY=True, SPLIT_KV=True,
                      IEEE_DOT=False, FUSED_MERGE=False, SPLITS_P=ap.MAX_SPLITS, EARLY_V=True,
                      PDL=True, QPK_P=4, PRELOAD=True, TIMES=times, WINDOW=False,
                      SOFT_CAP=False, KV_FP8=fp8)
        ptrs = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": cache,
                "v_cache_ptr": cache, "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                "part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
                "part_sum_ptr": "*fp32", "counter_ptr": "*i32", "block_table_ptr": "*i32",
                "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "times_ptr": "*i64",
                "scale_log2": "fp32", "softcap_log2": "fp32"}
        sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32")
               for a in tak._paged_attention_kernel.arg_names}
        cases.append((f"split-decode attention{name}",
                      tak._paged_attention_kernel, sig, consts))
        consts = dict(NUM_HEADS=16, HEAD_DIM=128, HEAD_DIM_P=128, SPLITS_P=ap.MAX_SPLITS,
                      PDL=True, TIMES=times)
        sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32")
               for a in tak._merge_splits_kernel.arg_names}
        cases.append((f"split merge{name}", tak._merge_splits_kernel,
                      sig, consts))
    # Unsplit decode over an FP8 cache, its tiles widened to the query's dtype and to float16.
    for mode in (tak.FP8_AS_QUERY.value, tak.FP8_F16.value, tak.FP8_F16_VT.value):
        consts = dict(NUM_HEADS=32, QPK=4, HEAD_DIM=128, HEAD_DIM_P=128, PAGE_SIZE=16,
                      BLOCK_Q=1, BLOCK_M=16, TILE_N=128, DECODE_ONLY=True, SPLIT_KV=False,
                      IEEE_DOT=False, FUSED_MERGE=False, SPLITS_P=ap.MAX_SPLITS, EARLY_V=False,
                      PDL=True, QPK_P=4, PRELOAD=False, TIMES=False, WINDOW=False,
                      SOFT_CAP=False, KV_FP8=mode)
        ptrs.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
        sig = {a: "constexpr" if a in consts else ptrs.get(a, "i32")
               for a in tak._paged_attention_kernel.arg_names}
        cases.append((f"decode attention (FP8 cache, widen mode {mode})",
                      tak._paged_attention_kernel, sig, consts))
    return cases


def _lora_grouped_cases() -> list[tuple[str, Any, dict[str, str], dict[str, Any]]]:
    """LoRA's segmented shrink (split, through the permutation) and expand (Llama-8B's
    q/k/v and gate/up slices, float32 sums into bf16 by three TF32 products) of a grouped
    decode batch."""
    from tidal.worker.ops import triton_lora as tl_

    seg = {"seg_start_ptr": "*i32", "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32",
           "perm_ptr": "*i32"}
    consts = dict(IN=4096, SR=48, BLOCK_M=16, BLOCK_R=64, BLOCK_K=64, IEEE=False, PERM=True,
                  K_PER_SPLIT=256, SPLITS=16)
    sig = {"x_ptr": "*bf16", "a_ptr": "*bf16", **seg, "out_ptr": "*fp32", "stride_xt": "i32",
           "stride_al": "i32", "stride_ar": "i32", "stride_ot": "i32",
           **{k: "constexpr" for k in consts}}
    cases = [("LoRA grouped shrink (split, atomics)", tl_._shrink_segmented, sig, consts)]
    for label, out, slices, off1, off2, r in (("q/k/v", 6144, 3, 4096, 5120, 16),
                                              ("gate/up", 28672, 2, 14336, 28672, 16),
                                              ("gate/up, rank 64", 28672, 2, 14336, 28672, 64),
                                              ("q/k/v, rank 256", 6144, 3, 4096, 5120, 256)):
        consts = dict(OUT=out, R=r, BLOCK_R=r, NUM_SLICES=slices, OFF1=off1, OFF2=off2,
                      BLOCK_M=16, BLOCK_N=tl_._expand_block_n(out, r), PRECISION="tf32x3",
                      PERM=True)
        sig = {"xa_ptr": "*fp32", "b_ptr": "*bf16", **seg, "y_ptr": "*bf16",
               "stride_xat": "i32", "stride_bl": "i32", "stride_bn": "i32", "stride_yt": "i32",
               **{k: "constexpr" for k in consts}}
        cases.append((f"LoRA grouped expand ({label}, tf32x3)", tl_._expand_segmented, sig,
                      consts))
    return cases


def main() -> int:
    from tidal.worker.ops import triton_allreduce as ta
    from tidal.worker.ops import triton_decode as td

    cases: list[tuple[str, Any, dict[str, str], dict[str, Any]]] = []
    gemv_types = {"out_ptr": "*bf16", "x_ptr": "*bf16", "res_ptr": "*bf16",
                  "res_out_ptr": "*bf16", "nw_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
                  "N": "i32", "K": "i32", "stride_w": "i32", "eps": "fp32",
                  "parts_bits_ptr": "*i16", "rearm_ptr": "*i16", "rearm_n": "i32",
                  "push_ptrs": "*i64", "push_off": "i32", "ss_ptr": "*fp32", "ws_ptr": "*fp32",
                  "lora_xa_ptr": "*fp32", "lora_b_ptr": "*bf16", "lora_slot_ptr": "*i32",
                  "stride_bl": "i32", "stride_bn": "i32"}
    no_lora = dict(LORA=False, LORA_R=1, LORA_SR=1, LORA_SR_P=1, LORA_SPLITS=1, LORA_SPLITS_P=1,
                   LORA_OFF1=0, LORA_OFF2=0)
    # The LoRA term at Llama-3.1-8B's rank-16 shapes: (S*R, slices of the shrink's inputs,
    # slice bounds): one slice (o / down), q/k/v, gate/up.
    lora_o = dict(no_lora, LORA=True, LORA_R=16, LORA_SR=16, LORA_SR_P=16, LORA_SPLITS=56,
                  LORA_SPLITS_P=64, LORA_OFF1=4096, LORA_OFF2=4096)
    lora_qkv = dict(lora_o, LORA_SR=48, LORA_SR_P=64, LORA_SPLITS=16, LORA_SPLITS_P=16,
                    LORA_OFF1=4096, LORA_OFF2=5120)
    lora_gu = dict(lora_o, LORA_SR=32, LORA_SR_P=32, LORA_SPLITS=16, LORA_SPLITS_P=16,
                   LORA_OFF1=14336, LORA_OFF2=28672)
    for name, parts, push, silu, prefetch, ss, gelu, norm, lora in (
            ("gemv", 0, 0, False, 1, 0, False, False, no_lora),
            ("gemv producer", 0, 2, False, 1, 0, False, False, no_lora),
            ("gemv consumer", 2, 0, False, 1, 0, False, False, no_lora),
            ("gemv consumer + SiLU", 2, 0, True, 1, 0, False, False, no_lora),
            ("gemv two chunks prefetched", 0, 0, False, 2, 0, False, False, no_lora),
            ("gemv + SiLU, norm from sums of squares, two chunks prefetched", 0, 0, True, 2, 8,
             False, False, no_lora),
            ("gemv + GeGLU", 0, 0, True, 1, 0, True, False, no_lora),
            ("gemv + LoRA", 0, 0, False, 2, 0, False, False, lora_o),
            ("gemv + LoRA q/k/v slices", 0, 0, False, 2, 0, False, False, lora_qkv),
            ("gemv + LoRA + SiLU", 0, 0, True, 2, 0, False, False, lora_gu),
            ("gemv + norm prologue + LoRA + SiLU", 0, 0, True, 1, 0, False, True, lora_gu),
            ("gemv + LoRA + GeGLU", 0, 0, True, 1, 0, True, False, lora_gu)):
        consts = dict(BLOCK_N=4, BLOCK_K=1024, NORM=parts > 0 or ss > 0 or norm, ADD=parts > 0
                      or norm, SILU=silu, GELU=gelu, HAS_BIAS=False, EVEN_N=True, EVEN_K=True,
                      PDL=True, ROW_CHUNK=4096, PREFETCH=prefetch, SS_PARTS=ss, PARTS=parts,
                      PUSH_WORLD=push, SENT=td.SENTINEL, EVICT="evict_first" if push else "",
                      W_SCALE=False, **lora)
        sig = {a: "constexpr" if a in consts else gemv_types[a]
               for a in td._gemv_kernel.arg_names}
        cases.append((name, td._gemv_kernel, sig, consts))
    from tidal.worker.ops import triton_lora as tlo

    for label, in_f, sr, norm in (("LoRA one-row shrink, partial sums (down)", 14336, 16, False),
                                  ("LoRA one-row shrink + add + norm (q/k/v)", 4096, 48, True)):
        consts = dict(IN=in_f, SR=sr, BLOCK_R=16, BLOCK_K=256, K_PER_SPLIT=256, NORM=norm,
                      ADD=norm,
                      ROW_CHUNK=4096 if norm else 16, PDL=True)
        ptrs = {"a_ptr": "*bf16", "slots_ptr": "*i32", "out_ptr": "*fp32", "eps": "fp32"}
        sig = {a: "constexpr" if a in consts else ptrs.get(a, "*bf16" if a.endswith("_ptr")
                                                            else "i32")
               for a in tlo._shrink_partials.arg_names}
        cases.append((label, tlo._shrink_partials, sig, consts))
    for add_ss in (False, True):
        consts = dict(PARTS=2, BLOCK=512, SENT=td.SENTINEL, PDL=True, ADD_SS=add_ss)
        sig = {"out_ptr": "*bf16", "parts_ptr": "*bf16", "bits_ptr": "*i16", "rearm_ptr": "*i16",
               "rearm_n": "i32", "K": "i32", "res_ptr": "*bf16", "ss_ptr": "*fp32",
               **{k: "constexpr" for k in consts}}
        cases.append(("sum_parts" + (" + residual, sums of squares" if add_ss else ""),
                      td._sum_parts_kernel, sig, consts))
    for add_ss, gather, label in ((False, False, "signal-free all-reduce"),
                                  (True, False, "signal-free all-reduce + residual, sums of "
                                                "squares"),
                                  (False, True, "signal-free all-gather")):
        consts = dict(WORLD=2, CHUNK=ta.CHUNK, BF16=True, SENT=ta.SENTINEL, PDL=True,
                      ADD_SS=add_ss, GATHER=gather)
        sig = {"x_ptr": "*i16", "out_ptr": "*i16", "buf_ptrs": "*i64", "count_ptr": "*i32",
               "n": "i32", "rank": "i32", "row_stride": "i32", "parity_stride": "i32",
               "res_ptr": "*i16", "ss_ptr": "*fp32", **{k: "constexpr" for k in consts}}
        cases.append((label, ta._lamport_all_reduce_kernel, sig, consts))
    consts = dict(BLOCK=4096, HAS_RES=True, PDL=True)
    sig = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "out_ptr": "*bf16",
           "res_out_ptr": "*bf16", "n": "i32", "eps": "fp32", "stride_x": "i32",
           "stride_r": "i32", "stride_o": "i32", "stride_ro": "i32",
           **{k: "constexpr" for k in consts}}
    cases.append(("add + norm rows", td._add_rms_norm_row_kernel, sig, consts))
    from tidal.worker.ops import triton_w4a16 as w4

    for bias in (False, True):
        consts = dict(GROUP=128, HAS_BIAS=bias, BLOCK_N=4, BLOCK_K=1024)
        sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8",
               "b_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32", "K8": "i32",
               "NG": "i32", **{k: "constexpr" for k in consts}}
        cases.append(("INT4 GEMV over whole rows" + (" + bias" if bias else ""),
                      w4._w4a16_gemv_rows, sig, consts))
    for prefetch, split, gated in ((False, 1, False), (True, 1, False), (True, 4, False),
                                   (False, 4, True)):
        consts = dict(GROUP=128, HAS_BIAS=split > 1, BLOCK_N=16, GPC=4, PREFETCH=prefetch,
                      SPLIT=split, GATED=gated, GELU=False)
        sig = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8",
               "b_ptr": "*bf16", "out_ptr": "*bf16", "ws_ptr": "*fp32", "count_ptr": "*i32",
               "N": "i32", "K8": "i32", "NG": "i32", "one_bits": "i32",
               **{k: "constexpr" for k in consts}}
        cases.append(("INT4 GEMV tiled by groups" + (", next chunk ahead" if prefetch else "")
                      + (", K split + bias" if split > 1 else "")
                      + (", SiLU epilogue" if gated else ""),
                      w4._w4a16_gemv_groups, sig, consts))
    cases += _decode_chain_cases()
    cases += _lora_grouped_cases()
    from tidal.worker.ops import triton_gemv_rows as tr

    rows_types = {"out_ptr": "*bf16", "x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16",
                  "ws_ptr": "*fp32", "count_ptr": "*i32", "scale_ptr": "*fp32"}
    for gated, pdl, split, fp8 in ((False, False, 1, False), (False, True, 1, False),
                                   (True, True, 1, False), (False, False, 4, False),
                                   (True, True, 2, False), (True, False, 1, True),
                                   (False, True, 4, True)):
        consts = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, HAS_BIAS=not gated, GATED=gated,
                      GELU=False, EVICT="evict_first", PDL=pdl, SPLIT=split, W_FP8=fp8)
        types = dict(rows_types, w_ptr="*fp8e4nv") if fp8 else rows_types
        sig = {n: "constexpr" if n in consts else types.get(n, "i32")
               for n in tr._gemv_rows_kernel.arg_names}
        cases.append((f"few-row GEMV, tensor cores{', FP8 weights' if fp8 else ''}"
                      f"{' + SiLU' if gated else ' + bias'}"
                      f"{' + PDL prefetch' if pdl else ''}"
                      f"{f', K split {split} ways' if split > 1 else ''}",
                      tr._gemv_rows_kernel, sig, consts))
    for gated, even, prefetch in ((False, True, 2), (True, False, 1), (True, True, 2)):
        consts = dict(BLOCK_M=4, BLOCK_N=4, BLOCK_K=512, HAS_BIAS=not gated, GATED=gated,
                      GELU=False, EVEN=even, EVICT="evict_first", PREFETCH=prefetch, PDL=True)
        sig = {n: "constexpr" if n in consts else rows_types.get(n, "i32")
               for n in tr._gemv_rows_fma_kernel.arg_names}
        cases.append((f"few-row GEMV, elementwise{' + SiLU' if gated else ' + bias'}"
                      f"{'' if even else ', masked'}, {prefetch} chunk(s) before the PDL wait",
                      tr._gemv_rows_fma_kernel, sig, consts))
    from tidal.worker.ops import triton_moe

    for label, consts in (
            ("MoE routing + PDL (Qwen3: softmax top-8 of 128, renormalised, counted)",
             dict(TOP_K=8, TOPK_P2=8, SIGMOID=False, HAS_BIAS=False, RENORM=True, GROUPS=1,
                  TOPK_GROUPS=1, EXPERTS=128, ROWS=8, COUNT=True, HAS_VALID=True, PDL=True)),
            ("MoE routing + PDL (sigmoid + bias, 8 groups ranked by their best expert)",
             dict(TOP_K=8, TOPK_P2=8, SIGMOID=True, HAS_BIAS=True, RENORM=True, GROUPS=8,
                  TOPK_GROUPS=4, EXPERTS=256, ROWS=4, COUNT=False, HAS_VALID=False,
                  PDL=True))):
        types = {"logits_ptr": "*bf16", "bias_ptr": "*fp32", "weights_ptr": "*fp32",
                 "ids_ptr": "*i32", "counts_ptr": "*i32", "valid_ptr": "*i32",
                 "scale": "fp32"}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32")
               for n in triton_moe._route_kernel.arg_names}
        cases.append((label, triton_moe._route_kernel, sig, consts))
    from tidal.worker.ops import triton_moe_gemv

    cases += triton_moe_gemv.compile_check_cases()  # the direct small-batch MoE kernels
    from tidal.worker.ops import triton_fp8_quant as fq

    for static in (False, True):
        consts = dict(STATIC=static, BLOCK=16384, QMAX=fq.FP8_MAX, SMIN=fq.MIN_SCALE)
        types = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                 "res_out_ptr": "*bf16", "stride_x": "i64", "stride_r": "i64", "eps": "fp32"}
        for label, fn, extra in (("FP8 row quantization", fq._quant_kernel, {}),
                                 ("add + norm + FP8 quantization", fq._norm_quant_kernel,
                                  {"ADD": True})):
            c = {**consts, **extra}
            sig = {n: "constexpr" if n in c else types.get(n, "*fp32" if n.endswith("_ptr")
                                                           else "i32")
                   for n in fn.arg_names}
            cases.append((label + (" (static scale)" if static else ""), fn, sig, c))
    from tidal.worker.ops import triton_fp8_block as fb

    for group in (128, 512):
        c = dict(GROUP=group, ROWS=1 if group >= 512 else 4, QMAX=fb.FP8_MAX, SMIN=fb.MIN_SCALE)
        types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        sig = {n: "constexpr" if n in c else types.get(n, "i32")
               for n in fb._quant_groups.arg_names}
        cases.append((f"block-wise FP8 group quantization ({group})", fb._quant_groups, sig, c))
    for m in (1, 64, 4096):
        block_m, block_n, _, _ = fb._config(m)
        c = dict(SCALE_K=128, HAS_BIAS=m == 64, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=128,
                 GROUP_M=8)
        types = {"xq_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "ws_ptr": "*fp32",
                 "b_ptr": "*bf16", "out_ptr": "*bf16"}
        sig = {n: "constexpr" if n in c else types.get(n, "i32") for n in fb._block_mm.arg_names}
        cases.append((f"block-wise FP8 GEMM ({m} rows{' + bias' if m == 64 else ''})",
                      fb._block_mm, sig, c))
    failed = 0
    for name, fn, sig, consts in cases:
        error = _compile(fn, sig, consts)
        print(f"{'FAIL' if error else 'ok  '} {name}" + (f": {error}" if error else ""))
        failed += error is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
