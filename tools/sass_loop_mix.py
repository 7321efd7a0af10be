"""The instruction mix of a Triton kernel's inner loop in Hopper (sm_90) SASS, on a machine without
a GPU: Triton compiles for the target on the CPU and ships ``nvdisasm``, so a GEMV variant's
instructions per weight can be compared before any device time is spent. Issue 23's INT4 GEMVs
ran at the same microseconds on an H100 and an H200 (compute-bound, not memory-bound); this is
how their two forms were compared (about 7.5 SASS instructions a weight for the whole-row
kernel against 3.6-4.8 for the group-tiled one at one warp of 16-64 rows), and how decode
attention over an FP8 cache was found to read V from shared memory a byte at a time
(``attn-decode``: "a weight" is then a K or V entry).

    pip install --no-deps --target /tmp/tri triton==3.6.0
    PYTHONPATH=/tmp/tri python tools/sass_loop_mix.py int4-groups 32,4,1,0,4 int4-rows 8,1024,2
    PYTHONPATH=/tmp/tri python tools/sass_loop_mix.py attn-decode 0,64,4,2 2,128,4,3 3,128,4,3

Each kernel takes launch shapes as comma lists (see ``KERNELS``). The pointer and size
arguments are compiled as divisible by 16, as Triton specializes them at a launch on aligned
tensors, so the loads vectorize as they would there.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

Counter = collections.Counter


def loop_mix(sass: str) -> Counter[str] | None:
    """Opcode counts of the longest loop body (a label up to a branch back to it)."""
    labels: dict[str, int] = {}
    instrs: list[str] = []
    for line in sass.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(1).strip())
    best: list[str] | None = None
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            body = instrs[labels[m.group(1)]:i + 1]
            if best is None or len(body) > len(best):
                best = body
    if best is None:
        return None
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in best)


def disassemble(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def compile_sm90(fn: Any, signature: dict[str, str], constants: dict[str, Any],
                 warps: int, stages: int | None = None) -> Any:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
               if t.startswith("*") or a in ("N", "K", "K8", "NG", "stride_w")
               or a.startswith("stride_kv")}
    options: dict[str, int] = {"num_warps": warps}
    if stages is not None:
        options["num_stages"] = stages
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants,
                                    attrs=aligned),
                          target=GPUTarget("cuda", 90, 32), options=options)


_INT4 = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*bf16", "z_ptr": "*u8", "b_ptr": "*bf16",
         "out_ptr": "*bf16"}


def _int4_rows(bn: int, bk: int, warps: int) -> tuple[Any, dict, dict, int, float]:
    from tidal.worker.ops import triton_w4a16 as w4

    consts = dict(GROUP=128, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk)
    sig = {**_INT4, "N": "i32", "K": "i32", "K8": "i32", "NG": "i32"}
    return w4._w4a16_gemv_rows, sig, consts, warps, bn * bk / (32 * warps)


def _int4_groups(bn: int, gpc: int, warps: int, prefetch: int,
                 split: int) -> tuple[Any, dict, dict, int, float]:
    from tidal.worker.ops import triton_w4a16 as w4

    consts = dict(GROUP=128, HAS_BIAS=False, BLOCK_N=bn, GPC=gpc, PREFETCH=bool(prefetch),
                  SPLIT=split, GATED=False, GELU=False)
    sig = {**_INT4, "ws_ptr": "*fp32", "count_ptr": "*i32", "N": "i32", "K8": "i32",
           "NG": "i32", "one_bits": "i32"}
    return w4._w4a16_gemv_groups, sig, consts, warps, bn * gpc * 128 / (32 * warps)


def _gemv(dtype: str, bn: int, bk: int, warps: int) -> tuple[Any, dict, dict, int, float]:
    """The one-row GEMV (``triton_decode._gemv_kernel``), plain: no norm, residual or LoRA."""
    from tidal.worker.ops import triton_decode as td

    consts = dict(BLOCK_N=bn, BLOCK_K=bk, NORM=False, ADD=False, SILU=False, GELU=False,
                  HAS_BIAS=False, EVEN_N=True, EVEN_K=True, PDL=True, ROW_CHUNK=4096,
                  PREFETCH=1, SS_PARTS=0, PARTS=0, PUSH_WORLD=0, SENT=td.SENTINEL, EVICT="",
                  W_SCALE=dtype == "fp8", LORA=False, LORA_R=1, LORA_SR=1, LORA_SR_P=1,
                  LORA_SPLITS=1, LORA_SPLITS_P=1, LORA_OFF1=0, LORA_OFF2=0)
    types = {"w_ptr": "*fp8e4nv" if dtype == "fp8" else "*bf16", "N": "i32", "K": "i32",
             "stride_w": "i32", "eps": "fp32", "parts_bits_ptr": "*i16", "rearm_ptr": "*i16",
             "rearm_n": "i32", "push_ptrs": "*i64", "push_off": "i32", "ss_ptr": "*fp32",
             "ws_ptr": "*fp32", "lora_xa_ptr": "*fp32", "lora_slot_ptr": "*i32",
             "stride_bl": "i32", "stride_bn": "i32"}
    sig = {a: types.get(a, "*bf16") for a in td._gemv_kernel.arg_names if a not in consts}
    return td._gemv_kernel, sig, consts, warps, bn * bk / (32 * warps)


def _attn_decode(widen: int, tile: int, warps: int,
                 stages: int) -> tuple[Any, dict, dict, int, float, int]:
    """Unsplit decode attention (``_paged_attention_kernel``), Llama-3.1-8B's heads (32 / 8,
    128 wide), pages of 16: over a bfloat16 cache (``widen`` 0) or an FP8 one (``widen`` the
    kernel's KV_FP8: 1 to the query's dtype, 2 to float16, 3 to float16 with V transposed in
    registers). Counted per K and V element."""
    from tidal.worker.ops import attention_plan as ap
    from tidal.worker.ops import triton_attention_kernels as tak

    consts = dict(NUM_HEADS=32, QPK=4, HEAD_DIM=128, HEAD_DIM_P=128, PAGE_SIZE=16, BLOCK_Q=1,
                  BLOCK_M=16, TILE_N=tile, DECODE_ONLY=True, SPLIT_KV=False, IEEE_DOT=False,
                  FUSED_MERGE=False, SPLITS_P=ap.MAX_SPLITS, EARLY_V=False, PDL=True, QPK_P=4,
                  PRELOAD=False, TIMES=False, WINDOW=False, SOFT_CAP=False, KV_FP8=widen)
    cache = "*fp8e4nv" if widen else "*bf16"
    types = {"k_cache_ptr": cache, "v_cache_ptr": cache, "k_scale_ptr": "*fp32",
             "v_scale_ptr": "*fp32", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
             "part_sum_ptr": "*fp32", "counter_ptr": "*i32", "block_table_ptr": "*i32",
             "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "times_ptr": "*i64",
             "scale_log2": "fp32", "softcap_log2": "fp32", "window": "i32",
             "num_reqs": "i32", "num_splits": "i32"}
    sig = {a: types.get(a, "i32" if a.startswith("stride") else "*bf16")
           for a in tak._paged_attention_kernel.arg_names if a not in consts}
    return (tak._paged_attention_kernel, sig, consts, warps, 2 * tile * 128 / (32 * warps),
            stages)


# name -> (what the comma list is, a builder of (kernel, signature, constants, warps, weights a
# thread an iteration of its loop[, pipeline stages]))
KERNELS: dict[str, tuple[str, Callable[..., tuple[Any, ...]]]] = {
    "int4-rows": ("BLOCK_N,BLOCK_K,warps", _int4_rows),
    "int4-groups": ("BLOCK_N,GPC,warps,prefetch,split", _int4_groups),
    "gemv-bf16": ("BLOCK_N,BLOCK_K,warps", lambda *a: _gemv("bf16", *a)),
    "gemv-fp8": ("BLOCK_N,BLOCK_K,warps", lambda *a: _gemv("fp8", *a)),
    "attn-decode": ("KV_FP8,TILE_N,warps,stages", _attn_decode),
}


def report(name: str, shape: list[int], top: int = 12) -> dict[str, Any]:
    fn, sig, consts, warps, per_thread, *stages = KERNELS[name][1](*shape)
    kernel = compile_sm90(fn, {**sig, **{k: "constexpr" for k in consts}}, consts, warps,
                          *stages)
    sass = disassemble(kernel.asm["cubin"])
    mix = loop_mix(sass)
    out: dict[str, Any] = {"kernel": name, "shape": shape, "spill_stores": sass.count("STL")}
    if mix is None:
        out["error"] = "no loop in the SASS"
        return out
    total = sum(mix.values())
    out.update(loop_instructions=total, per_weight=round(total / per_thread, 2),
               top={op: round(n / per_thread, 2) for op, n in mix.most_common(top)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("specs", nargs="+", help="KERNEL SHAPE [SHAPE ...] [KERNEL SHAPE ...]; "
                   + "; ".join(f"{k}: {v[0]}" for k, v in KERNELS.items()))
    args = p.parse_args(argv)
    if importlib.util.find_spec("triton") is None:
        print("needs triton (a CPU install is enough: pip install --no-deps triton==3.6.0)",
              file=sys.stderr)
        return 2
    kernel = None
    for spec in args.specs:
        if spec in KERNELS:
            kernel = spec
            continue
        if kernel is None:
            p.error(f"{spec!r}: name a kernel first ({', '.join(KERNELS)})")
        r = report(kernel, [int(v) for v in spec.split(",")])
        if "error" in r:
            print(f"{kernel} {spec}: {r['error']}")
            continue
        top = " ".join(f"{op}={v}" for op, v in r["top"].items())
        print(f"{kernel:12s} {spec:14s} {r['per_weight']:5.2f} a weight "
              f"({r['loop_instructions']} in the loop, {r['spill_stores']} spill stores): {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
