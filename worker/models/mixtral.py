"""Mixtral: the Llama decoder with a mixture of experts in place of each layer's MLP.

Each MoE layer routes every token through a replicated router (``gate``, hidden -> experts) to
its top-k SwiGLU experts, run together by ``FusedMoE`` (the kernel is the worker policy's). The
attention, norms, pipeline stages and checkpoint loading are the decoder's; this module adds the
MoE feed-forward block (shared with Qwen3-MoE, ``models.qwen3_moe``) and the loading of expert
tensors: one per expert in HF checkpoints, one stacked ``[E, ...]`` tensor per layer in GGUF.

Parameter names are the decoder's, with the feed-forward block always at ``mlp`` (Mixtral's
checkpoints say ``block_sparse_moe``) and each layer's experts as ``mlp.experts.w13`` /
``mlp.experts.w2``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl, AttentionMetadata
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.distributed.pending_sum import PendingSum
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig
from tidal.worker.layers.fp8 import quantizing
from tidal.worker.layers.linear import ReplicatedLinear
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.models.decoder import (
    DecoderAttention,
    DecoderForCausalLM,
    DecoderMLP,
    NormLinear,
    WeightLoadError,
    WeightTally,
)

# ``layers.{i}.mlp.experts.`` then ``{e}.{part}.weight`` (HF: one tensor per expert) or
# ``{gate,up,down}_exps.weight`` (GGUF: every expert stacked, named by the registry's map).
_EXPERT_TENSOR = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(\w+)|(gate|up|down)_exps)\.weight")


def routing_config(arch: ArchSpec) -> RoutingConfig:
    return RoutingConfig(
        top_k=arch.num_experts_per_tok,
        scoring="sigmoid" if arch.scoring_func == "sigmoid" else "softmax",
        renormalize=arch.norm_topk_prob,
        num_groups=arch.n_group,
        topk_groups=arch.topk_group,
        routed_scaling_factor=arch.routed_scaling_factor,
    )


class SparseMoeBlock(nn.Module):
    """Router + experts: ``experts(x, gate(x))``. The router is replicated on every
    tensor-parallel rank (small, and every rank needs all the logits); the experts shard their
    intermediate dimension, and their output comes back summed over the ranks."""

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 prefix: str) -> None:
        super().__init__()
        # The router stays in the model dtype under --quantization fp8 (as in vLLM): its few
        # bytes decide every token's experts.
        with quantizing(None):
            self.gate = ReplicatedLinear(arch.hidden_size, arch.num_experts, False, dtype)
        self.experts = FusedMoE(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size,
                                routing_config(arch), dtype, tp, prefix=prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))


class MoEDecoderLayer(nn.Module):
    """The decoder layer with ``mlp`` a :class:`SparseMoeBlock` on the layers ``arch`` makes
    MoE, the dense gated MLP on the others (Qwen3-MoE's ``mlp_only_layers``)."""

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 impl: AttentionImpl, layer: int) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(arch, dtype, tp, impl, layer)
        self.mlp: nn.Module = (SparseMoeBlock(arch, dtype, tp, f"layers.{layer}.mlp")
                               if arch.is_moe_layer(layer) else DecoderMLP(arch, dtype, tp))
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.norm_qkv = NormLinear(self.input_layernorm, self.self_attn.qkv_proj)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | PendingSum,
                residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # The attention output is reduced at once (no deferred sum): the router and the
        # experts both read the normed hidden state, so no one kernel can finish the sum.
        qkv, residual = self.norm_qkv(hidden, residual)
        hidden = self.self_attn.attend_qkv(positions, qkv, meta)
        norm = self.post_attention_layernorm
        hidden, residual = norm.kernels.add_rms_norm_row(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual


class MixtralForCausalLM(DecoderForCausalLM):
    # The auxiliary hidden state loop would run these layers as they are, but no EAGLE-3 head
    # for a MoE target has been checked against its training setup: refuse rather than guess.
    supports_aux_hidden_states = False
    # Checkpoint module name of each layer's feed-forward block, and each expert's tensors.
    FFN_NAME = "block_sparse_moe"
    EXPERT_PARTS: Mapping[str, str] = MappingProxyType({"w1": "gate", "w3": "up",
                                                         "w2": "down"})

    def make_layer(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                   layer: int) -> nn.Module:
        return MoEDecoderLayer(arch, dtype, self.tp, impl, layer)

    def _param_name(self, ckpt_name: str) -> str | None:
        name = super()._param_name(ckpt_name)
        if name is not None and self.FFN_NAME != "mlp":
            name = name.replace(f".{self.FFN_NAME}.", ".mlp.", 1)
        return name

    def load_special(self, tally: WeightTally, ckpt_name: str, name: str,
                     tensor: torch.Tensor) -> bool:
        match = _EXPERT_TENSOR.fullmatch(name)
        if match is None:
            return False
        layer, expert, part, stacked = match.groups()
        block = self.layers[layer].mlp if layer in self.layers else None
        if not isinstance(block, SparseMoeBlock):
            raise WeightLoadError(ckpt_name, f"layer {layer} of {self.arch.architecture} has "
                                  "no experts (a dense layer, by the config)")
        try:
            if stacked is not None:
                block.experts.load_stacked_weight(stacked, tensor)
            else:
                which = self.EXPERT_PARTS.get(part)
                if which is None:
                    raise ValueError(f"unknown expert tensor {part!r} (expected "
                                     f"{', '.join(self.EXPERT_PARTS)})")
                block.experts.load_expert_weight(which, int(expert), tensor)
        except ValueError as exc:
            raise WeightLoadError(ckpt_name, str(exc)) from exc
        return True
