"""Which kernel runs where, decided once per worker.

``resolve(kernel_config, device, arch, parallel)`` turns the engine config's kernel section
(``tidal.engine_core.kernel_config``) and a description of the device (``DeviceInfo``, from
``probe_device``) into a frozen ``KernelPolicy``: the implementation of the fused ops, the
attention backend of every layer (a layer with a sliding window or a logit soft-cap never gets
the CUDA extension's attention, which has no kernel for either), which fusions exist (the
one-row GEMV with the norm as its prologue and SiLU-and-mul as its epilogue, q/k-norm + rotary
+ K/V write, the few-row argmax, the sharded-vocabulary embedding), the kernel variants, and
the tensor-parallel all-reduce. ``resolve`` is a pure function of its inputs, so what a GPU
with or without triton would run can be checked on any machine.

The model is then built inside ``building(kernels)``: each layer takes its implementations
from the ``Kernels`` of the policy in its constructor (``current_kernels``), so a ``forward``
never consults a global setting, and the decode fast path is fixed when the model (and its CUDA
graphs) are built. ``describe`` gives the start-up log one line per choice, with the reason
wherever something was turned off.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from tidal.engine_core.config import ConfigError, ParallelConfig
from tidal.engine_core.kernel_config import GemvShapes, KernelConfig, parse_gemv_configs
from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.ops.kernels import Kernels

logger = logging.getLogger(__name__)

# Backends whose attention kernels take a per-layer sliding window and logit soft-cap.
LAYER_FEATURE_BACKENDS = ("triton", "torch")


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """What the kernel choice needs to know about a device."""

    type: str  # "cpu" | "cuda"
    triton: bool = False  # triton imports and a CUDA device exists
    cuda_ext: bool = False  # the CUDA extension built (probed only where it could be used)
    name: str = ""
    capability: tuple[int, int] = (0, 0)  # CUDA compute capability; (0, 0) off a GPU


def probe_device(device: torch.device, kc: KernelConfig) -> DeviceInfo:
    """Describe ``device``. Builds the CUDA extension (cached on disk) only where the config
    could choose it: ops auto/cuda or the cuda attention backend, on a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceInfo("cpu", name="cpu")
    from tidal.worker.ops.gpu_info import triton_available

    cuda_ext = False
    if kc.ops in ("auto", "cuda") or kc.attention_backend == "cuda":
        from tidal.worker.ops.cuda_ext import load_extension

        cuda_ext = load_extension() is not None  # the loader warns once when it can't build
    return DeviceInfo("cuda", triton=triton_available(), cuda_ext=cuda_ext,
                      name=torch.cuda.get_device_name(device),
                      capability=tuple(torch.cuda.get_device_capability(device)))


@dataclass(frozen=True, slots=True)
class KernelPolicy:
    device: str  # "cpu" | "cuda"
    triton: bool  # Triton kernels can run here
    ops: str  # the fused ops on this device's tensors: "cuda" | "triton" | "torch"
    attention: str  # the attention backend: "cuda" | "triton" | "torch"
    attention_layers: tuple[str, ...]  # the backend of each layer (one batch layout: all equal)
    decode_kernels: bool  # fused Triton decode ops (q/k-norm + rotary + K/V write, argmax)
    gemv: bool  # the one-row GEMV and the norm + linear / SiLU fusions built on it
    gemv_max_bytes: float  # weights larger than this stay on cuBLAS (one row or few)
    norm_apart: bool  # the norm before a large GEMV as its own one-row kernel
    vocab_embedding: bool  # the Triton sharded-vocabulary embedding (tensor parallelism)
    # Kernel variants (kernel_config.py).
    pdl: bool
    gemv_stream: bool
    gemv_configs: GemvShapes
    attn_fused_merge: bool
    attn_preload: bool
    attn_split_stages: int
    # Tensor-parallel all-reduce: what start-up tries (each path kept only where it wins).
    all_reduce: str  # "none" (one rank) | "gloo" | "nccl" | "symmetric"
    symm_allreduce_max_bytes: int
    lamport_allreduce: str  # "on" | "off" | "force"
    push_allreduce: bool
    # (choice, why) for everything turned off or moved by the device or the model.
    reasons: tuple[tuple[str, str], ...] = field(default=())
    # FP8 linears on cuBLASLt (torch._scaled_mm, compute capability >= 8.9); else the torch
    # reference (dequantize and matmul).
    fp8_scaled_mm: bool = False
    # The RMSNorm before an FP8 linear of several rows also quantizes its output (one Triton
    # pass, ``triton_fp8_quant``) for cuBLASLt; where the one-row GEMV applies it reads the
    # FP8 weights itself (weight-only).
    fp8_norm_quant: bool = False
    # Block-wise FP8 linears (``fp8`` checkpoints with ``weight_block_size``) on the Triton
    # kernels (``triton_fp8_block``: a group quantizer and a block-scaled e4m3 GEMM, compute
    # capability >= 8.9); else the torch reference.
    triton_fp8_block: bool = False
    # INT4 (AWQ/GPTQ) linears on the Triton W4A16 kernels (``triton_w4a16``: a GEMM, GEMVs
    # for decode rows); else the torch reference (dequantize and matmul).
    triton_w4a16: bool = False
    # 2 to 8 rows of an INT4 linear (no act-order) on the CUDA extension's few-row tensor-core
    # product (``csrc/skinny_gemm.cu``), and one row with groups of 128 or more (its staged
    # form, 3-8 % faster than the Triton GEMV per Llama-3.1-8B weight on an H200); the Triton
    # split-K GEMV it replaced took 14-21x as long per weight at four rows.
    skinny_w4a16: bool = False
    # 1 to 8 rows of a block-wise FP8 linear on the same product, weight-only (e4m3 needs
    # compute capability 8.9).
    skinny_fp8_block: bool = False
    # LoRA's shrink / expand products (--enable-lora) on the Triton kernels (``triton_lora``:
    # per-token for graph-captured steps, segmented for eager ones); else the torch reference.
    triton_lora: bool = False
    # With triton_lora: decode steps of at least this many tokens grouped by adapter (tiles
    # through a permutation, graph-captured too; lora/grouping.py); 0: per-token always.
    lora_grouped_min_tokens: int = 0
    # 2 to 8 rows of a linear on the few-row tensor-core GEMV (``triton_gemv_rows``).
    gemv_rows: bool = False
    gemv_rows_pdl: bool = False  # its tensor-core kernel under programmatic dependent launch
    # MoE calls of at most this many (token, expert) pairs may take the direct GEMV path
    # (moe_configs.use_direct); 0: never.
    moe_direct_max_pairs: int = 0
    # Compiled (mode 3) only: the fused ops kept in the graph as ``tidal::`` custom ops
    # (compilation_config.custom_ops), running ``custom_op_impl``: the implementation the
    # fused ops would have without compilation ("cuda" | "triton" | "torch").
    custom_ops: tuple[str, ...] = ()
    custom_op_impl: str = "torch"

    @property
    def fused_add_norm(self) -> str:
        """Which implementation adds the residual and normalises in one op."""
        return self.ops

    def why(self, choice: str) -> str:
        return "; ".join(r for c, r in self.reasons if c == choice)


def reference_policy() -> KernelPolicy:
    """Torch ops everywhere: what a CPU resolves to, and what layers built outside a model
    build (tests, tools) use."""
    return resolve(KernelConfig(), DeviceInfo("cpu"))


def _layer_needs(arch: ArchSpec | None) -> list[str]:
    needs: list[str] = []
    if arch is None:
        return needs
    for i in range(arch.num_layers):
        window = arch.layer_sliding_window(i)
        if window is not None:
            needs.append(f"sliding window {window} (attention layer {i})")
        if arch.attn_logit_softcap is not None:
            needs.append(f"logit soft-cap {arch.attn_logit_softcap} (attention layer {i})")
    return needs


def _attention(kc: KernelConfig, dev: DeviceInfo, triton_ok: bool, arch: ArchSpec | None,
               why: list[tuple[str, str]]) -> str:
    wanted = kc.attention_backend
    best = "triton" if triton_ok else "torch"
    if wanted is None:
        chosen = best
        if not triton_ok:
            why.append(("attention", "no Triton on this device" if dev.type == "cuda"
                        else "CPU"))
    elif wanted == "torch":
        chosen = "torch"
    elif wanted == "cuda" and dev.type == "cuda" and dev.cuda_ext:
        chosen = "cuda"
    else:
        chosen = best
        if wanted == "cuda" and dev.type == "cuda":
            why.append(("attention", "the CUDA extension did not build"))
        elif wanted != chosen:
            why.append(("attention", f"{wanted} attention unavailable on {dev.type} "
                        f"(triton {'importable' if dev.triton else 'missing'})"))
    if chosen in LAYER_FEATURE_BACKENDS:
        return chosen
    needs = _layer_needs(arch)
    if not needs:
        return chosen
    first = needs[0] + (f" and {len(needs) - 1} more" if len(needs) > 1 else "")
    if wanted == chosen:
        raise ConfigError(
            f"attention backend {chosen!r} has no kernel for this model's {first}; "
            f"use one of {', '.join(LAYER_FEATURE_BACKENDS)} (or leave the backend unset)"
        )
    why.append(("attention", f"{chosen} attention has no kernel for {first}"))
    return best


def resolve(kc: KernelConfig, device: DeviceInfo, arch: ArchSpec | None = None,
            parallel: ParallelConfig | None = None, compiled: bool = False,
            custom_ops: tuple[str, ...] = ()) -> KernelPolicy:
    """The kernels a worker on ``device`` runs for the model ``arch`` (None: no attention
    layers to fit) under ``parallel`` (None: one rank). Pure: the same inputs, the same
    policy. Raises ``ConfigError`` when an explicitly requested backend cannot run the model.
    ``compiled`` (--compilation-config mode 3): the fused ops are torch's, which Dynamo traces
    and Inductor fuses, except those named in ``custom_ops``, which stay the hand-written
    kernels as opaque custom ops inside the graph (``worker/compilation/custom_ops``); attention
    keeps its backend, an opaque op between the compiled pieces."""
    why: list[tuple[str, str]] = []
    gpu = device.type == "cuda"
    triton_ok = gpu and device.triton
    native = _native_ops(kc, device, triton_ok, why)
    ops = native
    custom = tuple(custom_ops) if compiled else ()
    if compiled:
        ops = "torch"
        why.append(("ops", "compiled: Inductor generates the fused elementwise kernels"
                    + (f" (kept as custom ops on {native}: {', '.join(custom)}"
                       + (", which Inductor cannot fuse: no faster than leaving them out"
                          if native == "torch" else "") + ")"
                       if custom else "")))

    decode = triton_ok and ops != "torch" and kc.decode_kernels
    if gpu and not decode:
        why.append(("decode_kernels", "off in the config" if not kc.decode_kernels
                    else "no Triton" if not triton_ok else "ops forced to torch"))
    elif not gpu:
        why.append(("decode_kernels", "CPU"))
    gemv = decode and kc.gemv
    if decode and not kc.gemv:
        why.append(("gemv", "off in the config"))
    # (Its launch shapes fill a Hopper SM's shared memory; measured there only.)
    hopper = gpu and (9, 0) <= device.capability < (10, 0)
    gemv_rows = gemv and kc.gemv_rows and hopper
    if gemv and not gemv_rows:
        why.append(("gemv_rows", "off in the config" if not kc.gemv_rows
                    else f"measured on Hopper only (compute capability "
                         f"{device.capability[0]}.{device.capability[1]}): cuBLAS"))

    skinny = gpu and kc.skinny_w4a16 and device.cuda_ext and device.capability >= (8, 0)
    if gpu and not skinny:
        why.append(("w4a16_linear", "off in the config" if not kc.skinny_w4a16
                    else "the CUDA extension is not loaded (ops not auto / cuda, or it did "
                         "not build)" if not device.cuda_ext
                    else "no tensor-core mma below compute capability 8.0"))

    attention = _attention(kc, device, triton_ok, arch, why)
    layers = (attention,) * (arch.num_layers if arch is not None else 0)

    tp = parallel.tensor_parallel_size if parallel is not None else 1
    if tp == 1:
        all_reduce = "none"
    elif not gpu:
        all_reduce = "gloo"
    elif not kc.symm_allreduce:
        all_reduce = "nccl"
        why.append(("all_reduce", "symm_allreduce off in the config"))
    else:
        all_reduce = "symmetric"
    push = kc.push_allreduce and all_reduce == "symmetric" and gemv
    # (No entry in ``reasons``: this matters only to FP8 models, and ``describe`` says it.)
    fp8_scaled_mm = gpu and device.capability >= (8, 9)
    fp8_norm_quant = fp8_scaled_mm and triton_ok and ops != "torch"

    return KernelPolicy(
        device=device.type,
        triton=triton_ok,
        ops=ops,
        attention=attention,
        attention_layers=layers,
        decode_kernels=decode,
        gemv=gemv,
        gemv_max_bytes=float("inf") if kc.gemv_max_mb is None else kc.gemv_max_mb * 2**20,
        norm_apart=kc.norm_apart,
        vocab_embedding=triton_ok and ops != "torch",
        pdl=kc.pdl,
        gemv_stream=kc.gemv_stream,
        gemv_configs=parse_gemv_configs(kc.gemv_configs),
        attn_fused_merge=kc.attn_fused_merge,
        attn_preload=kc.attn_preload,
        attn_split_stages=kc.attn_split_stages,
        all_reduce=all_reduce,
        symm_allreduce_max_bytes=kc.symm_allreduce_max_bytes,
        lamport_allreduce=kc.lamport_allreduce,
        push_allreduce=push,
        reasons=tuple(why),
        fp8_scaled_mm=fp8_scaled_mm,
        fp8_norm_quant=fp8_norm_quant,
        triton_fp8_block=fp8_norm_quant,
        triton_w4a16=gpu and triton_ok,
        skinny_w4a16=skinny,
        skinny_fp8_block=(gpu and kc.skinny_fp8_block and device.cuda_ext
                          and device.capability >= (8, 9)),
        triton_lora=gpu and triton_ok,
        lora_grouped_min_tokens=kc.lora_grouped_min_tokens if gpu and triton_ok else 0,
        moe_direct_max_pairs=kc.moe_direct_max_pairs if gpu and triton_ok else 0,
        gemv_rows=gemv_rows,
        gemv_rows_pdl=gemv_rows and kc.gemv_rows_pdl and kc.pdl,
        custom_ops=custom,
        # (Only where used: the policy is part of the compile cache's key.)
        custom_op_impl=native if custom else "torch",
    )


def _native_ops(kc: KernelConfig, device: DeviceInfo, triton_ok: bool,
                why: list[tuple[str, str]]) -> str:
    """The fused ops' implementation without compilation."""
    if device.type != "cuda":
        why.append(("ops", "CPU"))
        return "torch"
    if kc.ops == "torch":
        return "torch"
    if kc.ops in ("auto", "cuda") and device.cuda_ext:
        return "cuda"
    if triton_ok:
        if kc.ops == "cuda":
            why.append(("ops", "the CUDA extension did not build"))
        return "triton"
    why.append(("ops", "neither the CUDA extension nor triton is available"))
    return "torch"


def describe(policy: KernelPolicy) -> list[str]:
    """The start-up log's lines: one per choice, with why where something was turned off."""

    def line(name: str, value: str) -> str:
        why = policy.why(name)
        return f"{name}: {value}" + (f" ({why})" if why else "")

    def on(flag: bool) -> str:
        return "on" if flag else "off"

    decode, gemv = on(policy.decode_kernels), on(policy.gemv)
    if policy.decode_kernels:
        decode += " (q/k-norm + rotary + KV write, few-row argmax)"
    if policy.gemv:
        limit = ("no size limit" if policy.gemv_max_bytes == float("inf")
                 else f"weights <= {policy.gemv_max_bytes / 2**20:g} MiB")
        gemv += (f" (norm + linear prologue, SiLU epilogue; {limit}; norm apart before large "
                 f"weights: {on(policy.norm_apart)})")
    layers = len(policy.attention_layers)
    lines = [
        line("ops", f"{policy.ops} (rms_norm, fused add + rms_norm, rotary, silu_and_mul)"),
        line("attention", f"{policy.attention} on all {layers} layers" if layers
             else policy.attention),
        line("decode_kernels", decode),
        line("gemv", gemv),
        line("gemv_rows", "on (2-8 rows: triton tensor-core GEMV)" if policy.gemv_rows
             else "off (cuBLAS)"),
        line("vocab_embedding", "triton" if policy.vocab_embedding else "torch"),
        # Kernels.fp8_linear (models loaded with --quantization fp8 only).
        line("fp8_linear", ("torch._scaled_mm (row-wise scales)"
                            + ("; norm + activation quantization fused (triton)"
                               if policy.fp8_norm_quant else "")
                            + ("; one row: the GEMV on FP8 weights, weight-only"
                               if policy.gemv and policy.fp8_scaled_mm else ""))
             if policy.fp8_scaled_mm
             else "torch reference" + (" (compute capability < 8.9)"
                                       if policy.device == "cuda" else "")),
        # Kernels.fp8_block_linear (block-wise FP8 checkpoints only).
        line("fp8_block_linear", ("triton (group quantizer, block-scaled e4m3 GEMM)"
                                  if policy.triton_fp8_block else "torch reference")
             + ("; CUDA tensor-core product for 1-8 rows, weight-only"
                if policy.skinny_fp8_block else "")),
        # Kernels.w4a16_linear (AWQ / GPTQ checkpoints only).
        line("w4a16_linear", "triton (GEMM; group-tiled GEMV with the gate/up activation for "
             "one row; " + ("CUDA tensor-core product for 2-8 rows, and for one row with "
                            "groups of 128 or more (activations staged in shared memory)"
                            if policy.skinny_w4a16 else "split-K GEMV for 2-8 rows") + ")"
             if policy.triton_w4a16 else "torch reference"),
        # Kernels.lora_shrink / lora_expand (--enable-lora only).
        line("lora", "triton (per-token shrink / expand; segmented for eager steps"
             + (f"; decode of {policy.lora_grouped_min_tokens}+ tokens grouped by adapter"
                if policy.lora_grouped_min_tokens else "") + ")"
             if policy.triton_lora else "torch reference"),
        # Kernels.fused_moe / select_experts follow this rule (MoE models only).
        line("fused_moe", "triton (routing, expert alignment, grouped GEMMs"
             + (f"; direct GEMVs up to {policy.moe_direct_max_pairs} (token, expert) pairs"
                if policy.moe_direct_max_pairs else "") + ")"
             if policy.triton and policy.device == "cuda" and policy.ops != "torch"
             else "torch"),
    ]
    if policy.triton:
        lines.append(f"variants: pdl {on(policy.pdl)}, gemv_stream {on(policy.gemv_stream)}, "
                     f"gemv_configs {len(policy.gemv_configs)} override(s), attn_fused_merge "
                     f"{on(policy.attn_fused_merge)}, attn_preload {on(policy.attn_preload)}, "
                     f"attn_split_stages {policy.attn_split_stages}, gemv_rows_pdl "
                     f"{on(policy.gemv_rows_pdl)}")
    if policy.all_reduce == "symmetric":
        ar = (f"symmetric memory (one-shot up to {policy.symm_allreduce_max_bytes >> 10} KiB, "
              f"signal-free {policy.lamport_allreduce}, fused into GEMVs "
              f"{on(policy.push_allreduce)}; each kept only where it beats NCCL), NCCL above")
    else:
        ar = {"none": "none (one rank)", "gloo": "gloo", "nccl": "NCCL"}[policy.all_reduce]
    lines.append(line("all_reduce", ar))
    return lines


def apply_tuning(policy: KernelPolicy) -> None:
    """Hand the kernel variants to the Triton kernel modules, once per worker at start-up,
    before anything compiles or a CUDA graph is captured (the modules keep them as launch
    constants), and the dependent-launch switch to the CUDA few-row product. Nothing else to
    do, and nothing else imported, where Triton cannot run."""
    if policy.skinny_w4a16 or policy.skinny_fp8_block:
        from tidal.worker.ops import skinny_gemm

        skinny_gemm.configure(pdl=policy.pdl)
    if not policy.triton:
        return
    from tidal.worker.ops import (attention_plan, moe_configs, triton_attention_kernels,
                                  triton_decode)

    moe_configs.configure_direct(max_pairs=policy.moe_direct_max_pairs)

    triton_decode.configure(pdl=policy.pdl, stream_weights=policy.gemv_stream,
                            gemv_configs=policy.gemv_configs)
    triton_attention_kernels.configure(fused_merge=policy.attn_fused_merge,
                                       preload=policy.attn_preload)
    attention_plan.SPLIT_STAGES = policy.attn_split_stages
    if policy.gemv_rows:
        from tidal.worker.ops import triton_gemv_rows

        triton_gemv_rows.PDL_DOT = policy.gemv_rows_pdl


def log_policy(policy: KernelPolicy, rank: int = 0) -> None:
    for text in describe(policy):
        logger.info("rank %d kernels: %s", rank, text)


# --- the model being built ----------------------------------------------------------------

_BUILDING: ContextVar[Kernels | None] = ContextVar("tidal_kernels_building", default=None)


@functools.cache
def reference_kernels() -> Kernels:
    """The torch ops (immutable, so one instance serves everyone)."""
    return Kernels(reference_policy())


@contextlib.contextmanager
def building(kernels: Kernels) -> Iterator[Kernels]:
    """Layers constructed inside take their implementations from ``kernels``."""
    token = _BUILDING.set(kernels)
    try:
        yield kernels
    finally:
        _BUILDING.reset(token)


def current_kernels() -> Kernels:
    """For a layer's constructor: the kernels of the model being built, else the torch ones."""
    kernels = _BUILDING.get()
    return reference_kernels() if kernels is None else kernels


def kernels_for(device: torch.device, kc: KernelConfig | None = None,
                arch: ArchSpec | None = None,
                parallel: ParallelConfig | None = None, compiled: bool = False,
                custom_ops: tuple[str, ...] = ()) -> Kernels:
    """Probe ``device``, resolve ``kc`` (default: the defaults) and apply the variants: the
    kernels a worker (or a test, a tool) on that device runs."""
    kc = kc or KernelConfig()
    policy = resolve(kc, probe_device(device, kc), arch, parallel, compiled, custom_ops)
    apply_tuning(policy)
    return Kernels(policy)
