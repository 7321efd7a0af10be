"""The fused ops of one ``KernelPolicy``: what the layers call.

A ``Kernels`` is built once per worker from its policy (``kernel_policy.kernels_for``) and
handed to the layers as the model is built; it holds the implementation module for GPU tensors
(the CUDA extension's ``cuda_ops``, ``triton_ops`` or ``torch_ops``) and which Triton decode
fusions exist, so nothing here reads a global setting. CPU tensors always take ``torch_ops``.
What is left to decide per call is the shape: the one-row (batch-1 decode) kernels apply to one
row on the GPU only; a CUDA graph fixes that choice when it is captured.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tidal.worker.distributed.pending_sum import PendingSum
from tidal.worker.ops import (fp8_block_torch, fp8_scaled_mm, fp8_torch, int4_torch, lora_torch,
                             torch_ops)
from tidal.worker.sample import grammar_mask, gumbel_sample, seeded_random

if TYPE_CHECKING:
    from tidal.worker.kernel_policy import KernelPolicy
    from tidal.worker.layers.expert_load import CountInto
    from tidal.worker.layers.fused_moe import RoutingConfig

GEMV_MAX_ROWS = 1  # decode batches with more rows stay on cuBLAS (its tiles suit them)
GATED_ACTS = ("silu", "gelu_tanh")  # the activations of Kernels.gated_linear
ARGMAX_MAX_ROWS = 16  # larger batches already fill the GPU with torch's one-block-per-row argmax
# The RMSNorm before a GEMV of at least this many weights runs once, in its own one-program
# kernel, rather than as the GEMV's prologue (which every one of the GEMV's programs runs over
# the whole row), and the GEMV's weights stream in under dependent launch while it runs:
# measured on H200 for Llama-3.1-8B's q/k/v (25M weights) in bf16 12.2 + 1.2 us against 15.5,
# and 3.32 against 3.58 ms for a whole TP=1 step's GEMVs; in FP8 (per-row, 25 MB) the batch-1
# step 2.663 against 2.690 ms (two runs each). Counted in weights, not bytes, for that reason:
# FP8's 16-row programs pay the prologue as bf16's 2-row ones do. Qwen3-0.6B's weights (4-6M)
# keep the prologue, and so do Qwen3-30B-A3B's q/k/v (10.5M, a 2048-wide row): on an H100 its
# batch-1 step took 3.035 ms with the prologue against 3.059 with the norm apart (same call,
# both with a MoE routing variant since reverted, measured level). Weights of 8-16M with wider
# rows (3072-3584: Llama-3.2-3B's, Qwen2.5-7B's q/k/v) are not measured either way.
# Under tensor parallelism the signal-free all-reduce before the norm computes its
# statistics instead, for weights of any size. KernelConfig.norm_apart off: always the prologue.
NORM_APART_MIN_WEIGHTS = 16 << 20

_OP_MODULES = {"cuda": "tidal.worker.ops.cuda_ops", "triton": "tidal.worker.ops.triton_ops",
               "torch": "tidal.worker.ops.torch_ops"}


def op_module(name: str) -> ModuleType:
    """The implementation module of the fused ops called ``name`` (imported on first use)."""
    return importlib.import_module(_OP_MODULES[name])


def _triton_module(name: str) -> ModuleType | None:
    """``tidal.worker.ops.<name>`` (a module of Triton kernels), or None without triton."""
    try:
        return importlib.import_module(f"tidal.worker.ops.{name}")
    except ImportError:
        # Only a policy written by hand for a machine without triton gets here (a resolved
        # one has the Triton kernels only where triton imports): its CPU tensors never reach
        # them, and a CUDA tensor would fail loudly on the missing module.
        return None


def _check_gated_act(act: str) -> None:
    if act not in GATED_ACTS:
        raise ValueError(f"unknown gated activation {act!r}; known: {', '.join(GATED_ACTS)}")


class Kernels:
    """Fused ops bound to one policy. Immutable after construction."""

    __slots__ = ("policy", "gpu", "_decode", "_gemv", "_gemv_max_bytes", "_norm_apart",
                 "_vocab", "_td", "_sampling", "_moe", "_fp8", "_fp8q", "_fp8b", "_w4", "_lora",
                 "_custom", "_custom_impl", "_rows", "_skinny")

    def __init__(self, policy: KernelPolicy) -> None:
        self.policy = policy
        self.gpu: ModuleType = op_module(policy.ops)
        self._decode = policy.decode_kernels
        self._gemv = policy.gemv
        self._gemv_max_bytes = policy.gemv_max_bytes
        self._norm_apart = policy.norm_apart
        self._vocab = policy.vocab_embedding
        # The decode kernels' module imports triton: only where the policy runs them.
        self._td: ModuleType | None = _triton_module("triton_decode") if self._decode else None
        # The few-row GEMV (2-8 rows), where the policy runs it.
        self._rows: ModuleType | None = (_triton_module("triton_gemv_rows")
                                         if policy.gemv_rows else None)
        # The sampling kernels (seeded noise, grammar masks) wherever Triton runs on the GPU.
        self._sampling = (_triton_module("triton_sampling")
                          if policy.triton and policy.device == "cuda" else None)
        # The MoE routing and grouped GEMM kernels wherever the fused ops run on Triton-capable
        # GPUs (ops forced to torch: the torch reference, graph-safe while capturing).
        self._moe = (_triton_module("triton_moe")
                     if policy.triton and policy.device == "cuda" and policy.ops != "torch"
                     else None)
        self._fp8: ModuleType | None = fp8_scaled_mm if policy.fp8_scaled_mm else None
        # The norm that also quantizes its output for the FP8 GEMMs (imports triton).
        self._fp8q: ModuleType | None = (_triton_module("triton_fp8_quant")
                                         if policy.fp8_norm_quant else None)
        # The block-wise FP8 quantizer and GEMM (imports triton).
        self._fp8b: ModuleType | None = (_triton_module("triton_fp8_block")
                                         if policy.triton_fp8_block else None)
        # The W4A16 (AWQ/GPTQ) GEMM and split-K GEMV (imports triton).
        self._w4: ModuleType | None = (_triton_module("triton_w4a16")
                                       if policy.triton_w4a16 else None)
        # INT4 linears of 2 to 8 rows on the CUDA extension's tensor-core product.
        self._skinny: ModuleType | None = (importlib.import_module(
            "tidal.worker.ops.skinny_gemm")
            if policy.skinny_w4a16 or policy.skinny_fp8_block else None)
        # LoRA's shrink / expand kernels (imports triton; --enable-lora models only call them).
        self._lora: ModuleType | None = (_triton_module("triton_lora")
                                         if policy.triton_lora else None)
        # Compiled models: the fused ops kept as custom ops (``compilation/custom_ops``).
        self._custom = frozenset(policy.custom_ops)
        self._custom_impl = policy.custom_op_impl
        if self._custom:
            importlib.import_module("tidal.worker.compilation.custom_ops")  # registers them

    def __copy__(self) -> Kernels:
        return self  # immutable, and holds modules (which do not copy)

    def __deepcopy__(self, memo: dict) -> Kernels:
        return self

    @property
    def name(self) -> str:
        """'cuda', 'triton' or 'torch': what the fused ops on this policy's device run on."""
        return self.policy.ops

    def impl_for(self, x: torch.Tensor) -> ModuleType:
        return self.gpu if x.is_cuda else torch_ops

    # --- elementwise fused ops ------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if "rms_norm" in self._custom:
            return torch.ops.tidal.rms_norm(x, weight, eps, self._custom_impl)
        return self.impl_for(x).rms_norm(x, weight, eps)

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(rms_norm(x + residual), x + residual)``."""
        if "fused_add_rms_norm" in self._custom:
            return torch.ops.tidal.fused_add_rms_norm(x, residual, weight, eps,
                                                      self._custom_impl)
        return self.impl_for(x).fused_add_rms_norm(x, residual, weight, eps)

    def add_rms_norm_row(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``fused_add_rms_norm``; one 16-bit row on the GPU (the GEMV policy) in the
        one-program Triton kernel, launched as a programmatic dependent, so a GEMV after it
        (a MoE router's) overlaps its launch, as it cannot after the CUDA kernel."""
        if (self._gemv and x.is_cuda and x.numel() == x.shape[-1]
                and x.dtype in (torch.bfloat16, torch.float16) and residual.dtype == x.dtype
                and residual.shape == x.shape and weight.dtype == x.dtype
                and x.shape[-1] <= self._td.ADD_NORM_MAX and not torch.compiler.is_compiling()):
            return self._td.add_rms_norm_row(x, residual, weight, eps)
        return self.fused_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if "silu_and_mul" in self._custom:
            return torch.ops.tidal.silu_and_mul(x, self._custom_impl)
        return self.impl_for(x).silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if "gelu_tanh_and_mul" in self._custom:
            return torch.ops.tidal.gelu_tanh_and_mul(x, self._custom_impl)
        return self.impl_for(x).gelu_tanh_and_mul(x)

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if "gemma_rms_norm" in self._custom:
            return torch.ops.tidal.gemma_rms_norm(x, weight, eps, self._custom_impl)
        return self.impl_for(x).gemma_rms_norm(x, weight, eps)

    def gemma_add_norm_norm(self, x: torch.Tensor, residual: torch.Tensor,
                            post_weight: torch.Tensor, next_weight: torch.Tensor,
                            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gemma_rms_norm(r, next_weight), r)`` with ``r = residual +
        gemma_rms_norm(x, post_weight)``: one kernel between two Gemma sub-blocks."""
        if "gemma_add_norm_norm" in self._custom:
            return torch.ops.tidal.gemma_add_norm_norm(x, residual, post_weight, next_weight,
                                                       eps, self._custom_impl)
        return self.impl_for(x).gemma_add_norm_norm(x, residual, post_weight, next_weight, eps)

    def rotary_embedding(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                         cos_sin_cache: torch.Tensor,
                         is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if "rotary_embedding" in self._custom:
            return torch.ops.tidal.rotary_embedding(positions, query, key, cos_sin_cache,
                                                    is_neox, self._custom_impl)
        return self.impl_for(query).rotary_embedding(positions, query, key, cos_sin_cache,
                                                     is_neox)

    def select_experts(self, router_logits: torch.Tensor, routing: RoutingConfig,
                       correction_bias: torch.Tensor | None = None,
                       count: CountInto | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE routing, ``[T, E]`` logits -> ``(weights float32 [T, k], ids int32 [T, k])`` by
        a ``fused_moe.RoutingConfig``. Semantics: ``moe_torch.select_experts``; on the GPU
        one Triton kernel. ``count``: add the real tokens' picks to a routing counter
        (``layers.expert_load``), inside the Triton kernel where it runs."""
        # (The Triton kernel scores a group by its best expert only: V3's top-2 sums take
        # the torch ops, which are graph-safe.)
        if (self._moe is not None and router_logits.is_cuda
                and (routing.group_score == "max" or routing.num_groups == 1)):
            return self._moe.select_experts(
                router_logits, routing, correction_bias,
                None if count is None else (count.counts, count.valid))
        from tidal.worker.ops import moe_torch

        weights, ids = moe_torch.select_experts(router_logits, routing, correction_bias)
        if count is not None:
            count.add(ids)
        return weights, ids

    def fused_moe(self, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
        """The routed experts' SwiGLU MLPs summed over top-k: ``hidden [T, H]``, ``w13 [E, 2I,
        H]``, ``w2 [E, H, I]`` -> ``[T, H]``. Semantics: ``moe_torch.fused_moe``; on the GPU
        the Triton grouped GEMM (CUDA-graph safe). FP8 experts take their per-row scales
        (weight-only; Triton converts e4m3 from compute capability 8.9, where the policy has
        ``fp8_scaled_mm``). ``partial``: ids of E name experts of another expert-parallel
        rank, which add nothing (``layers/moe_ep``)."""
        if self._moe is not None and hidden.is_cuda and (
                w13_scale is None or self.policy.fp8_scaled_mm):
            return self._moe.fused_moe(hidden, w13, w2, topk_weights, topk_ids,
                                       w13_scale=w13_scale, w2_scale=w2_scale, partial=partial)
        from tidal.worker.ops import moe_torch

        return moe_torch.fused_moe(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)

    # --- multi-head latent attention (DeepSeek-V2) over the paged latent cache -----------------

    def _mla_triton(self, x: torch.Tensor) -> ModuleType | None:
        # Wherever Triton runs on the GPU (imported on first use: only MLA models need it).
        if x.is_cuda and self.policy.triton and self.policy.device == "cuda":
            return _triton_module("triton_mla")
        return None

    def mla_write_latent(self, latent: torch.Tensor, k_rope: torch.Tensor,
                         cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Each new token's latent ``[T, r]`` and rotated rope key ``[T, dr]`` into its slot of
        ``cache [blocks, block_size, r + dr]`` (slot < 0: padding). Semantics:
        ``mla_torch.write_latent``; on the GPU a Triton kernel (CUDA-graph safe)."""
        mod = self._mla_triton(latent)
        if mod is None:
            from tidal.worker.ops import mla_torch as mod
        mod.write_latent(latent, k_rope, cache, slot_mapping)

    def mla_decode(self, q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, scale: float, kv_lora_rank: int) -> torch.Tensor:
        """Absorbed-MLA decode attention, ``q [B, H, r + dr]`` -> latent outputs ``[B, H, r]``.
        Semantics: ``mla_torch.mla_decode``; on the GPU the split-K Triton kernel."""
        mod = self._mla_triton(q)
        if mod is None:
            from tidal.worker.ops import mla_torch as mod
        return mod.mla_decode(q, cache, block_table, seq_lens, scale, kv_lora_rank)

    # --- one-row (batch-1 decode) GEMV and its fusions ------------------------------------------

    def one_row_fusion_applies(self, x: torch.Tensor | PendingSum) -> bool:
        """Whether a layer fed ``x`` (one row on the GPU, the GEMV on) should go through
        ``rms_norm_linear``: it fuses where the GEMV applies and composes the plain ops
        elsewhere. A ``PendingSum`` (only ever made for such rows) always does."""
        if isinstance(x, PendingSum):
            return True
        return self._gemv and x.is_cuda and x.dim() >= 1 and x.numel() == x.shape[-1]

    def gemv_applies(self, x: torch.Tensor, *weights: torch.Tensor) -> bool:
        """Whether ``linear`` / ``rms_norm_linear`` on ``x`` run the one-row GEMV kernel."""
        if not (self._gemv and x.is_cuda and x.dim() >= 1 and x.numel() == x.shape[-1]):
            return False
        # FP8 weights too (``gemv_supported`` knows where Triton converts e4m3): the caller
        # then hands the GEMV their ``weight_scale``.
        td = self._td
        return all(td.gemv_supported(x, w)
                   and w.numel() * w.element_size() <= self._gemv_max_bytes for w in weights)

    def gemv_tuned(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """``gemv_applies`` and the weight's shape has a measured launch shape (for weights
        where cuBLAS is already close to the copy rate, such as LM heads, only a tuned GEMV
        beats it)."""
        if not self.gemv_applies(x, weight):
            return False
        return (weight.shape[0], weight.shape[1], False, weight.element_size()) in \
            self._td.GEMV_CONFIGS

    def rows_gemv_applies(self, x: torch.Tensor, weight: torch.Tensor, gated: bool = False
                          ) -> bool:
        """Whether ``linear`` / ``gated_linear`` (``gated``) on ``x`` run the few-row GEMV: 2
        to 8 rows on a GPU whose policy has it, a weight within the GEMV's size limit whose
        shape has a measured launch shape (``ROWS_CONFIGS``: only there was it measured
        faster than cuBLAS)."""
        rows = self._rows
        if rows is None or not rows.gemv_rows_supported(x, weight):
            return False
        n = weight.shape[0] // 2 if gated else weight.shape[0]
        return (rows.tuned_for(n, weight.shape[1], gated, x.numel() // x.shape[-1])
                and weight.numel() * weight.element_size() <= self._gemv_max_bytes
                and not torch.compiler.is_compiling())

    def fp8_rows_applies(self, x: torch.Tensor, w_q: torch.Tensor, gated: bool = False,
                         bias: torch.Tensor | None = None) -> bool:
        """Whether an FP8 ``w_q`` times ``x`` (with ``bias``, or the activation of a fused
        ``[gate; up]`` weight when ``gated``) runs on the few-row tensor-core GEMV: the policy
        has it and the rows are 2 to 8 (where it measured faster than rows quantized to FP8
        and cuBLASLt on every weight tried: ``FP8_ROWS_CONFIGS``)."""
        rows = self._rows
        if (rows is None or w_q.dtype != torch.float8_e4m3fn
                or not rows.gemv_rows_supported(x, w_q)
                or (gated and (w_q.shape[0] % 2 or bias is not None))
                or (bias is not None and bias.dtype != x.dtype)):
            return False
        n = w_q.shape[0] // 2 if gated else w_q.shape[0]
        return (rows.tuned_for(n, w_q.shape[1], gated, x.numel() // x.shape[-1], fp8=True)
                and w_q.numel() <= self._gemv_max_bytes
                and not torch.compiler.is_compiling())

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear``; a single row on the GPU runs the GEMV kernel, 2 to 8 rows the
        few-row one."""
        if self.gemv_applies(x, weight) and (bias is None or bias.dtype == x.dtype):
            y, _ = self._td.gemv(x, weight, bias)
            return y.view(*x.shape[:-1], weight.shape[0])
        if self.rows_gemv_applies(x, weight) and (bias is None or bias.dtype == x.dtype):
            return self._rows.gemv_rows(x, weight, bias)
        return F.linear(x, weight, bias)

    def lora_shrink(self, x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                    segments: object | None = None, out: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """LoRA's first product over a batch mixing adapters (``ops/lora_torch.py`` for the
        layout): x [T, in] -> [T, S*R]. ``segments`` (the step's runs of tokens sharing an
        adapter; eager steps only) picks the segmented Triton kernel, else per-token. ``out``:
        a zeroed float32 [T, S*R] the Triton kernels may sum into (``LoRAContext.zeroed``)."""
        if torch.compiler.is_compiling():
            # (One opaque op in a compiled graph: ``compilation/custom_ops``, per token.)
            return torch.ops.tidal.lora_shrink(x, a, slots, self._lora_impl(x))
        if self._lora is not None and x.is_cuda:
            return self._lora.lora_shrink(x, a, slots, segments, out=out)
        return lora_torch.lora_shrink(x, a, slots)

    def lora_expand(self, y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                    slots: torch.Tensor, offsets: tuple[int, ...], rank: int,
                    segments: object | None = None) -> None:
        """LoRA's second product, added into ``y`` [T, out] in place, slice by slice."""
        if torch.compiler.is_compiling():
            torch.ops.tidal.lora_expand(y, xa, b, slots, list(offsets), rank,
                                        self._lora_impl(y))
            return
        if self._lora is not None and y.is_cuda:
            self._lora.lora_expand(y, xa, b, slots, offsets, rank, segments)
            return
        lora_torch.lora_expand(y, xa, b, slots, offsets, rank)

    def lora_gemv_applies(self, x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None,
                          norm_weight: torch.Tensor | None = None,
                          residual: torch.Tensor | None = None, act: str | None = None) -> bool:
        """Whether ``lora_gemv`` takes these arguments: one row on the GPU where the GEMV
        applies (weights of ``x``'s dtype: no FP8), the LoRA kernels on Triton, and no
        torch.compile trace (whose LoRA products are the custom ops)."""
        if self._lora is None or torch.compiler.is_compiling():
            return False
        return (self.gemv_applies(x, weight) and weight.dtype == x.dtype
                and (bias is None or (bias.dtype == x.dtype and act is None))
                and (norm_weight is None or norm_weight.dtype == x.dtype)
                and (residual is None or (norm_weight is not None and residual.dtype == x.dtype
                                          and residual.shape == x.shape))
                and (act is None or (act in GATED_ACTS and weight.shape[0] % 2 == 0)))

    def lora_gemv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                  offsets: tuple[int, ...], rank: int, *,
                  norm_weight: torch.Tensor | None = None,
                  residual: torch.Tensor | None = None, eps: float = 0.0,
                  act: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(act(linear(h) + h @ A^T @ B^T), new_residual)`` for one row, ``h`` being ``x``
        or with ``norm_weight`` ``rms_norm(x + residual)`` (``new_residual``: ``x + residual``,
        or ``x``; None without a norm), the adapter of the token's slot (``slots[0]``, read on
        the device; -1: the base product alone) from the slot buffers ``a`` / ``b``
        (``lora_torch``), ``act`` a gated activation of ``GATED_ACTS`` or None. Two kernels
        where ``lora_gemv_applies``: the shrink, which norms the row itself and stores its
        per-slice partial sums, and the GEMV, which adds the expand to its rows' sums before
        its epilogue. (``LoRALayer.add`` after a linear runs a norm, the GEMV, a zeroing, the
        shrink, the expand and, gated, the activation: up to six.)"""
        parts, h, new_residual = self._lora.lora_shrink_partials(
            x, a, slots, norm_weight=norm_weight, residual=residual, eps=eps)
        y, _ = self._td.gemv(h, weight, bias, silu=act == "silu", gelu=act == "gelu_tanh",
                             lora=self._td.LoRAArgs(parts, b, slots, offsets, rank))
        n = weight.shape[0] // 2 if act is not None else weight.shape[0]
        return y.view(*x.shape[:-1], n), new_residual

    def _lora_impl(self, x: torch.Tensor) -> str:
        return "triton" if self._lora is not None and x.is_cuda else "torch"

    def fp8_linear(self, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None = None,
                   input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` times an FP8 e4m3 weight ``w_q`` [N, K] with float32 scales ``w_scale``
        [N, 1], activations quantized per token (or by the static ``input_scale``; in one
        Triton pass where the policy has it), then cuBLASLt where the policy has it (compute
        capability >= 8.9); else the torch reference (``fp8_torch``). One row on the GPU where
        the GEMV applies: the FP8 GEMV, weight-only (``fp8_torch.fp8_weight_only_linear``;
        ``input_scale`` unused: nothing quantizes x); 2 to 8 rows where ``fp8_rows_applies``:
        the few-row tensor-core GEMV, weight-only too."""
        if self.fp8_rows_applies(x, w_q, bias=bias):
            return self._rows.gemv_rows(x, w_q, bias, weight_scale=w_scale)
        if self.gemv_applies(x, w_q) and (bias is None or bias.dtype == x.dtype):
            y, _ = self._td.gemv(x, w_q, bias, weight_scale=w_scale)
            return y.view(*x.shape[:-1], w_q.shape[0])
        if self._fp8 is not None and x.is_cuda:
            q = self._fp8q
            x2 = x.reshape(-1, x.shape[-1])
            if q is not None and q.supported(x2) and fp8_scaled_mm.supported(x2, w_q):
                # One Triton pass quantizes the rows, cuBLASLt multiplies.
                x_q, x_scale = q.quantize(x2, input_scale)
                y = fp8_scaled_mm.mm_quantized(x_q, x_scale, w_q, w_scale, bias, x.dtype)
                return y.reshape(*x.shape[:-1], w_q.shape[0])
            return self._fp8.fp8_linear(x, w_q, w_scale, bias, input_scale)
        return fp8_torch.fp8_linear(x, w_q, w_scale, bias, input_scale)

    def fp8_block_linear(self, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                         block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., K] times a block-wise FP8 weight ``w_q`` [N, K] with its per-row block
        scale ``w_scale`` [N, ceil(K / block_k)], activations quantized per token and group of
        ``block_k`` (``fp8_block_torch``): the Triton kernels on the GPU where the policy has
        them, else the torch reference. With ``skinny_fp8_block``, 1 to 8 rows run the CUDA
        few-row product instead, weight-only (the activations are not quantized)."""
        if self._skinny_fp8_block_applies(x, w_q, block_k, bias):
            return self._skinny.skinny_gemm(x, w_q, bias, scales=w_scale, group_size=block_k)
        fb = self._fp8b
        if fb is not None and x.is_cuda:
            x2 = x.reshape(-1, x.shape[-1])
            if fb.supported(x2, w_q, block_k):
                y = fb.fp8_block_linear(x2, w_q, w_scale, block_k, bias)
                return y.reshape(*x.shape[:-1], w_q.shape[0])
        return fp8_block_torch.fp8_block_linear(x, w_q, w_scale, block_k, bias)

    def _skinny_fp8_block_applies(self, x: torch.Tensor, w_q: torch.Tensor, block_k: int,
                                  bias: torch.Tensor | None, gated: bool = False) -> bool:
        """1-8 rows of a block-wise FP8 linear on the CUDA few-row product
        (``skinny_fp8_block``): it takes the shapes, a bias of x's dtype (none when gated),
        not inside a torch.compile trace."""
        sk = self._skinny
        return (sk is not None and self.policy.skinny_fp8_block and x.is_cuda
                and (bias is None or (bias.dtype == x.dtype and not gated))
                and sk.supported(x, w_q, block_k, gated=gated, fp8_groups=True)
                and not torch.compiler.is_compiling())

    def fp8_block_gated_linear(self, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                               block_k: int, bias: torch.Tensor | None, act: str) -> torch.Tensor:
        """``act(gate) * up`` of ``fp8_block_linear`` over a fused ``[gate; up]`` block-wise FP8
        weight (``act``: "silu" or "gelu_tanh"): 1 to 8 rows on the CUDA few-row product with
        the activation as its epilogue (no bias; no separate activation kernel), else the
        linear, then the activation."""
        _check_gated_act(act)
        if self._skinny_fp8_block_applies(x, w_q, block_k, bias, gated=True):
            return self._skinny.skinny_gemm(x, w_q, scales=w_scale, group_size=block_k,
                                            act=act)
        return self._gated_act(self.fp8_block_linear(x, w_q, w_scale, block_k, bias), act)

    def skinny_w4a16_applies(self, x: torch.Tensor, qweight: torch.Tensor,
                             scales: torch.Tensor, group_size: int,
                             g_idx: torch.Tensor | None, bias: torch.Tensor | None,
                             gated: bool = False) -> bool:
        """Whether an INT4 linear on ``x`` runs the CUDA few-row product: the policy has it,
        2 to 8 rows, or one row where the kernel stages the activations in shared memory
        (groups of 128 or more; else one row stays on the group-tiled Triton GEMV, which the
        direct form only ties), no act-order, a group it takes (a power of two from 32, or
        the whole row), no bias when gated, and not inside a torch.compile trace."""
        sk = self._skinny
        if (sk is None or not self.policy.skinny_w4a16 or g_idx is not None or not x.is_cuda
                or not x.shape[-1]):
            return False
        k = x.shape[-1]
        rows = x.numel() // k
        if rows == 1 and not sk.stages_activations(1, k, group_size):
            return False
        return (1 <= rows <= sk.MAX_ROWS and scales.dtype == x.dtype
                and (bias is None or (not gated and bias.dtype == x.dtype))
                and sk.supported(x, qweight, group_size, gated)
                and not torch.compiler.is_compiling())

    def w4a16_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     qzeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` times an INT4 weight in tidal's layout (``int4_torch``: ``qweight`` int32
        [N, K / 8], per-group ``scales`` and uint8 ``qzeros`` [N, G], act-order ``g_idx``):
        the Triton kernels on the GPU where the policy has them (a GEMM, a split-K GEMV for
        decode rows), dequantizing in registers; 1 to 8 rows without act-order on the CUDA
        few-row product where ``skinny_w4a16_applies``; else the torch reference."""
        if self.skinny_w4a16_applies(x, qweight, scales, group_size, g_idx, bias):
            return self._skinny.skinny_gemm(x, qweight, bias, scales=scales, zeros=qzeros,
                                            group_size=group_size)
        if self._w4 is not None and x.is_cuda:
            return self._w4.w4a16_linear(x, qweight, scales, qzeros, group_size, g_idx, bias)
        return int4_torch.w4a16_linear(x, qweight, scales, qzeros, group_size, g_idx, bias)

    def w4a16_gated_linear(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           qzeros: torch.Tensor, group_size: int, g_idx: torch.Tensor | None,
                           bias: torch.Tensor | None, act: str) -> torch.Tensor:
        """``act(gate) * up`` of ``w4a16_linear`` over a fused ``[gate; up]`` INT4 weight
        (``act``: "silu" or "gelu_tanh"): one row on the GPU runs the group-tiled GEMV with
        the activation as its epilogue (no separate activation kernel); else the linear, then
        the activation."""
        _check_gated_act(act)
        if self.skinny_w4a16_applies(x, qweight, scales, group_size, g_idx, bias, gated=True):
            return self._skinny.skinny_gemm(x, qweight, scales=scales, zeros=qzeros,
                                            group_size=group_size, act=act)
        if (self._w4 is not None and x.is_cuda
                and self._w4.gated_gemv_applies(x, qweight, group_size, g_idx)):
            return self._w4.w4a16_gated_gemv(x, qweight, scales, qzeros, group_size, act, bias)
        y = self.w4a16_linear(x, qweight, scales, qzeros, group_size, g_idx, bias)
        return self._gated_act(y, act)

    def _gated_act(self, y: torch.Tensor, act: str) -> torch.Tensor:
        """``act(gate) * up`` over a fused ``[gate | up]`` input (``act`` checked)."""
        return self.silu_and_mul(y) if act == "silu" else self.gelu_tanh_and_mul(y)

    def rms_norm_fp8_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        w_q: torch.Tensor,
        w_scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
        silu: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(fp8_linear(rms_norm(x + residual)), x + residual)`` for rows where the one-row
        GEMV does not apply. 2 to 8 rows (``fp8_rows_applies``): the Triton norm over the
        rows, then the few-row tensor-core GEMV, weight-only as at one row. Else on the GPU,
        where the policy has it, one Triton pass adds, norms and quantizes each row
        (``triton_fp8_quant``) and cuBLASLt multiplies; elsewhere the plain norm, then
        ``fp8_linear`` (which quantizes again: the same numbers)."""
        if (self._td is not None and x.dim() == 2 and norm_weight.dtype == x.dtype
                and (residual is None
                     or (residual.shape == x.shape and residual.dtype == x.dtype))
                and x.shape[-1] <= self._td.ADD_NORM_MAX
                and self.fp8_rows_applies(x, w_q, silu, bias)):
            h, residual = self._td.add_rms_norm_rows(x, residual, norm_weight, eps)
            y = self._rows.gemv_rows(h, w_q, bias, act="silu" if silu else None,
                                     weight_scale=w_scale)
            return y, residual
        q = self._fp8q
        if (q is not None and x.is_cuda and x.dim() == 2 and q.supported(x)
                and norm_weight.dtype == x.dtype
                and (residual is None or residual.dtype == x.dtype)
                and fp8_scaled_mm.supported(x, w_q)):
            x_q, x_scale, residual = q.add_rms_norm_quant(x, residual, norm_weight, eps,
                                                          input_scale)
            y = fp8_scaled_mm.mm_quantized(x_q, x_scale, w_q, w_scale, bias, x.dtype)
        else:
            if residual is None:
                h, residual = self.rms_norm(x, norm_weight, eps), x
            else:
                h, residual = self.fused_add_rms_norm(x, residual, norm_weight, eps)
            y = self.fp8_linear(h, w_q, w_scale, bias, input_scale)
        return (self.silu_and_mul(y) if silu else y), residual

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, act: str) -> torch.Tensor:
        """``act(gate) * up`` of ``F.linear(x, weight)``, ``weight`` a fused ``[gate; up]`` one
        and ``act`` ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU); a single row on the GPU runs
        the GEMV kernel with the activation as its epilogue."""
        _check_gated_act(act)
        n = weight.shape[0] // 2
        if (self.gemv_applies(x, weight) and weight.dtype == x.dtype
                and weight.shape[0] % 2 == 0):
            y, _ = self._td.gemv(x, weight, silu=act == "silu", gelu=act == "gelu_tanh")
            return y.view(*x.shape[:-1], n)
        if self.rows_gemv_applies(x, weight, gated=True) and weight.shape[0] % 2 == 0:
            return self._rows.gemv_rows(x, weight, act=act)
        y = F.linear(x, weight)
        return self._gated_act(y, act)

    def rms_norm_linear(
        self,
        x: torch.Tensor | PendingSum,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        silu: bool = False,
        weight_scale: torch.Tensor | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(linear(rms_norm(x + residual)), x + residual)``; see ``torch_ops.rms_norm_linear``.
        An FP8 ``weight`` comes with its ``weight_scale`` (and static ``input_scale``, if any):
        the GEMV reads it as it is (weight-only); the unfused ops run ``fp8_linear``.
        One row on the GPU: the GEMV kernel with the norm as its prologue (or, before a large
        weight, a one-row norm kernel first) and SiLU-and-mul as its epilogue. ``x`` may be a
        tensor-parallel ``PendingSum``: its all-reduce then completes inside the GEMV (pushed
        rows, summed as they are read) or inside the all-reduce kernel that hands the GEMV the
        norm's statistics."""
        pending = x if isinstance(x, PendingSum) else None
        if pending is not None:
            x = pending.like
        fused = (self.gemv_applies(x, weight) and norm_weight.dtype == x.dtype
                 and (residual is None
                      or (residual.dtype == x.dtype and residual.shape == x.shape))
                 and (bias is None or (bias.dtype == x.dtype and not silu))
                 and not (silu and weight.shape[0] % 2))
        td = self._td
        parts = stats = None
        if pending is not None:
            if fused and residual is not None:
                # The sum, residual add and norm statistics in one small kernel, so the GEMV
                # reads a finished row; else pushed rows summed by the GEMV as it reads them.
                if self._norm_apart:
                    stats = pending.reduce_add_stats(residual)
                if stats is None:
                    parts = pending.parts()
            if parts is None and stats is None:
                # No kernel can take the pending sum (or, with no residual, the sum itself
                # would be returned as one): complete the all-reduce first.
                x = pending.wait()
        n = weight.shape[0] // 2 if silu else weight.shape[0]
        if stats is not None:
            h, ss = stats
            y, _ = td.gemv(h, weight, bias, norm_weight=norm_weight, eps=eps, silu=silu,
                           norm_ss=ss, weight_scale=weight_scale)
            return y.view(*h.shape[:-1], n), h
        if (fused and parts is None and self._norm_apart
                and x.dtype in (torch.bfloat16, torch.float16)
                and weight.numel() >= NORM_APART_MIN_WEIGHTS
                and x.shape[-1] <= td.ADD_NORM_MAX):
            h, residual = td.add_rms_norm_row(x, residual, norm_weight, eps)
            y, _ = td.gemv(h, weight, bias, silu=silu, weight_scale=weight_scale)
            return y.view(*h.shape[:-1], n), residual
        if fused:
            y, res = td.gemv(x, weight, bias, norm_weight=norm_weight, residual=residual,
                             eps=eps, silu=silu, parts=parts, weight_scale=weight_scale)
            return y.view(*x.shape[:-1], n), res
        rows_gemv = (weight_scale is None and self.rows_gemv_applies(x, weight, gated=silu)
                     and (bias is None or (bias.dtype == x.dtype and not silu))
                     and not (silu and weight.shape[0] % 2))
        if (rows_gemv and self._rows.PDL_DOT and norm_weight.dtype == x.dtype
                and x.shape[-1] <= td.ADD_NORM_MAX
                and (residual is None
                     or (residual.dtype == x.dtype and residual.shape == x.shape))):
            # The few-row GEMV under dependent launch: its weights stream in while the norm
            # (the Triton one, a dependent launch too) runs.
            h, residual = td.add_rms_norm_rows(x, residual, norm_weight, eps)
        elif residual is None:
            h, residual = self.rms_norm(x, norm_weight, eps), x
        else:
            h, residual = self.fused_add_rms_norm(x, residual, norm_weight, eps)
        if rows_gemv:  # (h: x's shape and dtype)
            return self._rows.gemv_rows(h, weight, bias, act="silu" if silu else None), residual
        if weight_scale is None:
            y = F.linear(h, weight, bias)
        else:
            y = self.fp8_linear(h, weight, weight_scale, bias, input_scale)
        return (self.silu_and_mul(y) if silu else y), residual

    # --- other decode fusions -------------------------------------------------------------------

    def qk_norm_rope_applies(self, qkv: torch.Tensor, head_dim: int,
                             cos_sin_cache: torch.Tensor, is_neox: bool,
                             kv_cache: torch.Tensor) -> bool:
        """Whether ``qk_norm_rope_write_kv`` has a kernel for these tensors (else: the unfused
        ops)."""
        if not (self._decode and qkv.is_cuda):
            return False
        return self._td.qk_norm_rope_supported(qkv, head_dim, cos_sin_cache, is_neox, kv_cache)

    def qk_norm_rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_norm_weight: torch.Tensor | None,
        k_norm_weight: torch.Tensor | None,
        eps: float,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        gemma_norm: bool = False,
    ) -> torch.Tensor:
        """q/k RMSNorm (Qwen3's, or Gemma 3's with ``gemma_norm``), neox rotary and the K/V
        cache write in one pass; returns q ``[T, H, D]``. Semantics:
        ``torch_ops.qk_norm_rope_write_kv`` (an FP8 cache stores K/V quantized with the layer's
        scales)."""
        args = (qkv, positions, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                eps, cos_sin_cache, kv_cache, slot_mapping)
        kw = dict(k_scale=k_scale, v_scale=v_scale, gemma_norm=gemma_norm)
        if self.qk_norm_rope_applies(qkv, head_dim, cos_sin_cache, True, kv_cache):
            return self._td.qk_norm_rope_write_kv(*args, **kw)
        return torch_ops.qk_norm_rope_write_kv(*args, **kw)

    def vocab_shard_embedding(self, ids: torch.Tensor, weight: torch.Tensor,
                              start: int) -> torch.Tensor:
        """Embedding rows of ``ids`` from the vocabulary shard ``weight`` that starts at token
        ``start``; zeros for tokens outside it. Semantics: ``torch_ops.vocab_shard_embedding``."""
        if self._vocab and ids.is_cuda:
            from tidal.worker.ops import triton_ops

            return triton_ops.vocab_shard_embedding(ids, weight, start)
        return torch_ops.vocab_shard_embedding(ids, weight, start)

    def seeded_exponential_(self, q: torch.Tensor, rows: torch.Tensor,
                            keys: torch.Tensor) -> None:
        """Rows ``rows`` of ``q`` get the Exp(1) noise of their position keys (one launch on
        the GPU). Semantics: ``sample/seeded_random.seeded_exponential_``."""
        if self._sampling is not None and q.is_cuda:
            self._sampling.seeded_exponential_(q, rows, keys)
        else:
            seeded_random.seeded_exponential_(q, rows, keys)

    def apply_token_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor,
                             rows: torch.Tensor | None) -> None:
        """Ban, in place, the tokens whose bits are clear. Semantics:
        ``sample/grammar_mask.apply_token_bitmask_``."""
        if self._sampling is not None and logits.is_cuda:
            self._sampling.apply_token_bitmask_(logits, bitmask, rows)
        else:
            grammar_mask.apply_token_bitmask_(logits, bitmask, rows)

    def gumbel_sample(self, logits: torch.Tensor, temperature: torch.Tensor,
                      keys: torch.Tensor, bitmask: torch.Tensor | None = None,
                      grammar_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row: temperature, the keys' noise and the grammar masks in one pass
        over the logits (one launch on the GPU). Semantics:
        ``sample/gumbel_sample.gumbel_sample``."""
        if self._sampling is not None and logits.is_cuda:
            return self._sampling.gumbel_sample(logits, temperature, keys, bitmask,
                                                grammar_rows)
        return gumbel_sample.gumbel_sample(logits, temperature, keys, bitmask, grammar_rows)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(dim=-1)`` of ``[rows, n]``; few rows on the GPU: a two-stage kernel that
        spreads each row over many programs (torch reduces a row in one block)."""
        if (self._decode and x.is_cuda and x.dim() == 2 and x.shape[0] <= ARGMAX_MAX_ROWS
                and self._td.argmax_supported(x)):
            return self._td.argmax(x)
        return x.argmax(dim=-1)
