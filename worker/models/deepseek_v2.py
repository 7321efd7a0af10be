"""DeepSeek-V2 (and V2-Lite): multi-head latent attention (``layers.mla``) and a mixture of
experts with shared experts.

Each layer: RMSNorm -> MLA -> RMSNorm -> feed-forward, the residual added before each norm. The
feed-forward block is a dense SwiGLU MLP on the first ``first_k_dense_replace`` layers (and any
the config's ``moe_layer_freq`` skips), elsewhere a router (replicated, scored in float32 as HF
does), the routed experts (``FusedMoE``: greedy or group-limited top-k, ``routed_scaling_factor``)
and the shared experts (one dense MLP of ``n_shared_experts`` x ``moe_intermediate_size``) added
to the routed output.

Parameter names follow HF's ``DeepseekV2ForCausalLM``, except the fused ``gate_up_proj`` of the
dense MLPs and the stacked ``experts.w13`` / ``experts.w2``, which ``load_weights`` assembles
from the checkpoint's per-expert tensors (``mlp.experts.{e}.{gate,up,down}_proj.weight``).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl, AttentionMetadata
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.layers.activation import SiluAndMul
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig
from tidal.worker.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    as_tensor,
    default_weight_loader,
    set_weight_loader,
)
from tidal.worker.layers.mla import MLAAttention
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.models.decoder import (
    AuxHiddenSpec,
    DecoderForCausalLM,
    WeightLoadError,
    WeightTally,
)

# ``layers.{i}.mlp.experts.`` then ``{e}.{gate,up,down}_proj.weight`` (HF checkpoints) or
# ``{gate_up,down}_proj`` (every expert stacked, as transformers holds them in memory).
_EXPERT_TENSOR = re.compile(
    r"layers\.(\d+)\.mlp\.experts\.(?:(\d+)\.(gate|up|down)_proj\.weight|(gate_up|down)_proj)$")


def load_expert_tensor(experts: FusedMoE, ckpt_name: str, expert: str | None, which: str,
                       tensor: torch.Tensor) -> None:
    """One checkpoint tensor into ``experts``: expert ``expert``'s ``which`` (gate / up /
    down) projection, or with ``expert`` None the stacked ``[E, ...]`` down projections or
    gate/up pair (each expert's gate rows, then its up rows)."""
    try:
        if expert is not None:
            experts.load_expert_weight(which, int(expert), tensor)
        elif which == "down":
            experts.load_stacked_weight("down", tensor)
        else:
            full = as_tensor(tensor)
            inter = full.shape[1] // 2
            experts.load_stacked_weight("gate", full[:, :inter])
            experts.load_stacked_weight("up", full[:, inter:])
    except ValueError as exc:
        raise WeightLoadError(ckpt_name, str(exc)) from exc

class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``; ``reduce_results`` False leaves the tensor-parallel sum
    to the caller (the MoE block sums the shared and routed experts with one all-reduce)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, tp: ParallelGroup,
                 reduce_results: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, dtype, tp)
        self.down_proj = RowParallelLinear(inter, hidden, False, dtype, tp,
                                           reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn.project(self.gate_up_proj, x))


class DeepseekV2MoE(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 prefix: str) -> None:
        super().__init__()
        self.tp = tp
        # The router stays float32 whatever the model dtype (HF keeps ``gate`` in float32).
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(arch.num_experts, arch.hidden_size,
                                                    dtype=torch.float32), requires_grad=False)
        set_weight_loader(self.gate.weight, lambda p, t, shard_id=None: default_weight_loader(p, t))
        v3 = arch.topk_method == "noaux_tc"
        routing = RoutingConfig(top_k=arch.num_experts_per_tok,
                                scoring="sigmoid" if v3 else "softmax",
                                renormalize=arch.norm_topk_prob, num_groups=arch.n_group,
                                topk_groups=arch.topk_group,
                                routed_scaling_factor=arch.routed_scaling_factor,
                                group_score="top2_sum" if v3 else "max")
        # DeepSeek-V3: a bias on the scores for the choice of experts only (float32, as HF).
        self.gate.e_score_correction_bias = None
        if v3:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(arch.num_experts, dtype=torch.float32), requires_grad=False)
            set_weight_loader(self.gate.e_score_correction_bias,
                              lambda p, t, shard_id=None: default_weight_loader(p, t))
        self.experts = FusedMoE(arch.num_experts, arch.hidden_size, arch.moe_intermediate_size,
                                routing, dtype, tp, reduce_results=False, prefix=prefix)
        shared = (arch.shared_expert_intermediate_size
                  or arch.n_shared_experts * arch.moe_intermediate_size)
        self.shared_experts = (GatedMLP(arch.hidden_size, shared, dtype, tp,
                                        reduce_results=False) if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight)
        out = self.experts(x, logits, self.gate.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


class DeepseekV2Layer(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 rotary_emb: RotaryEmbedding, layer: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(arch, dtype, tp, rotary_emb)
        if arch.is_moe_layer(layer):
            self.mlp: nn.Module = DeepseekV2MoE(arch, dtype, tp, f"layers.{layer}.mlp.experts")
        else:
            self.mlp = GatedMLP(arch.hidden_size, arch.intermediate_size, dtype, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            x = self.input_layernorm(hidden)
        else:
            x, residual = self.input_layernorm(hidden, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DeepseekV2ForCausalLM(DecoderForCausalLM):
    """The decoder's stages, forward pass and checkpoint loading over DeepSeek-V2's layers."""

    # No EAGLE-3 head has been trained on an MLA target here.
    supports_aux_hidden_states = False

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None,
                 aux_hidden: AuxHiddenSpec | None = None) -> None:
        if not arch.is_mla:
            raise ValueError(f"{arch.architecture}: DeepSeek-V2 needs kv_lora_rank (MLA)")
        self._rope: RotaryEmbedding | None = None
        super().__init__(arch, dtype, impl, tp, pp, aux_hidden)

    def make_layer(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                   layer: int) -> nn.Module:
        if self._rope is None:
            # One cos/sin table for every layer (V2's is 160k positions long); DeepSeek rotates
            # interleaved pairs (GPT-J style), as HF's complex-number rotary does.
            self._rope = RotaryEmbedding(arch.qk_rope_head_dim, arch.max_position_embeddings,
                                         arch.rope_theta, arch.rope_scaling, is_neox=False)
        return DeepseekV2Layer(arch, dtype, self.tp, self._rope, layer)

    def attention_layers(self) -> list[MLAAttention]:  # type: ignore[override]
        return [layer.self_attn for layer in self.layers.values()]

    # --- weights ------------------------------------------------------------------------------

    def fused_name(self, tally: WeightTally, name: str) -> tuple[str, object | None]:
        # Only the MLPs' gate/up fuse: q_proj, kv_a_proj_with_mqa, ... are MLA's own.
        return tally.fused(name) if ".mlp." in name else (name, None)

    def load_special(self, tally: WeightTally, ckpt_name: str, name: str,
                     tensor: torch.Tensor) -> bool:
        """Expert tensors, one per expert or stacked, into the layer's ``FusedMoE``."""
        m = _EXPERT_TENSOR.fullmatch(name)
        if m is None:
            return False
        layer = self.layers[m.group(1)]
        if not isinstance(layer.mlp, DeepseekV2MoE):
            raise WeightLoadError(ckpt_name, f"layer {m.group(1)} is a dense layer here "
                                  "(first_k_dense_replace / moe_layer_freq), not an MoE one")
        load_expert_tensor(layer.mlp.experts, ckpt_name, m.group(2), m.group(3) or m.group(4),
                           tensor)
        return True
