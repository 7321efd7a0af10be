"""Gemma 2 and Gemma 3 (text): one implementation for both registry families, which differ
only in their config.

Both interleave sliding-window ("local") and full ("global") attention layers, wrap each
sub-block in a pre- and a post-norm (``(1 + w)`` RMSNorm computed in float32), use a GeGLU MLP
with tanh-GELU, scale queries by ``query_pre_attn_scalar ** -0.5`` and the embedding by
``sqrt(hidden_size)`` (rounded to the model dtype, as HF does), and (in the released models)
tie the LM head to the embedding. Gemma 2 alternates local/global layers and soft-caps the
attention scores and the final logits; Gemma 3 has five local layers per global one, q/k
RMSNorm, and a rope base of its own for local layers (``rope_local_theta``; rope scaling
applies to the global layers only).

Parameter names follow HF transformers, except the fused ``qkv_proj`` and ``gate_up_proj``; the
checkpoint layout is the decoder's, so the decoder's loader is used as is.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl, AttentionMetadata
from tidal.worker.cpu_offload import layer_built
from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers.activation import GeluTanhAndMul
from tidal.worker.layers.attention import Attention
from tidal.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from tidal.worker.layers.norm import GemmaRMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.models.decoder import (
    DecoderForCausalLM,
    DecoderMLP,
    build_stage_ends,
    layer_range,
)


def soft_cap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap


class GemmaAttention(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 impl: AttentionImpl, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, arch.qkv_bias, dtype, tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        arch.qkv_bias, dtype, tp)
        # One table per rope variant, shared by the layers that use it.
        self.rotary_emb = rotary_emb
        if arch.qk_norm:
            self.q_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        scalar = arch.query_pre_attn_scalar or arch.head_dim
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, scalar**-0.5,
                              impl, sliding_window=sliding_window,
                              logits_soft_cap=arch.attn_logit_softcap)
        self.kernels = current_kernels()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        n = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        rope, kv_cache, kernels = self.rotary_emb, self.attn.kv_cache, self.kernels
        # The q/k norms (Gemma 3's, (1 + w)), rotary and the K/V write are one kernel on the
        # GPU, as in the decoder.
        if kernels.qk_norm_rope_applies(qkv, self.head_dim, rope.cos_sin_cache, rope.is_neox,
                                        kv_cache):
            qn, kn = self.q_norm, self.k_norm
            q = kernels.qk_norm_rope_write_kv(
                qkv, positions, self.num_heads, self.num_kv_heads, self.head_dim,
                None if qn is None else qn.weight, None if kn is None else kn.weight,
                0.0 if qn is None else qn.eps, rope.cos_sin_cache, kv_cache,
                self.attn.group_meta(meta).slot_mapping, self.attn.k_scale, self.attn.v_scale,
                gemma_norm=True)
            return self.o_proj(self.attn.attend(q.view(n, -1), meta))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v, meta))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 impl: AttentionImpl, rotary_emb: RotaryEmbedding,
                 sliding_window: int | None) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.self_attn = GemmaAttention(arch, dtype, tp, impl, rotary_emb, sliding_window)
        self.mlp = DecoderMLP(arch, dtype, tp, GeluTanhAndMul())  # GeGLU
        self.input_layernorm = GemmaRMSNorm(arch.hidden_size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(arch.hidden_size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(arch.hidden_size, eps, dtype)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, x: torch.Tensor,
                meta: AttentionMetadata, next_norm: GemmaRMSNorm | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` is ``input_layernorm(hidden)``, computed by the layer before in the kernel that
        ends it. Returns the new ``hidden`` and ``next_norm`` of it (None without one): each
        post-norm, its residual add and the following pre-norm are one kernel on the GPU."""
        attn = self.self_attn(positions, x, meta)
        mlp_in, hidden = self.post_attention_layernorm.add_then(
            attn, hidden, self.pre_feedforward_layernorm)
        mlp = self.mlp(mlp_in)
        if next_norm is None:
            return hidden + self.post_feedforward_layernorm(mlp), None
        x, hidden = self.post_feedforward_layernorm.add_then(mlp, hidden, next_norm)
        return hidden, x


class Gemma2ForCausalLM(nn.Module):
    supports_lazy_weights = True

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp or single_group()
        self.pp = pp or single_group()
        self.start_layer, self.end_layer = layer_range(arch.num_layers, self.pp)
        # HF multiplies by the normaliser cast to the model dtype (sqrt(3072) is 55.5 in bf16).
        self.embed_scale = float(torch.tensor(math.sqrt(arch.hidden_size), dtype=dtype,
                                              device="cpu"))
        full_rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                    arch.rope_theta, arch.rope_scaling)
        local_rope = full_rope
        if arch.rope_local_theta is not None:
            local_rope = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                         arch.rope_local_theta, None)
        layers: dict[str, nn.Module] = {}
        for i in range(self.start_layer, self.end_layer):
            window = arch.layer_sliding_window(i)
            layers[str(i)] = layer_built(i, GemmaDecoderLayer(  # (--cpu-offload-gb)
                arch, dtype, self.tp, impl, full_rope if window is None else local_rope, window))
        self.layers = nn.ModuleDict(layers)
        build_stage_ends(self, arch, dtype, GemmaRMSNorm)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers.values()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        """Runs this stage's layers (see ``DecoderForCausalLM.forward``). Each Gemma layer adds
        its own residual, so no separate residual stream passes between stages."""
        self.tp.begin_step()
        if self.pp.is_first:
            hidden = self.embed_tokens(input_ids) * self.embed_scale
        elif hidden is None:
            # The memory-profiling pass of a later stage: activations of the right size only.
            dtype = self.layers[str(self.start_layer)].input_layernorm.weight.dtype
            hidden = torch.zeros(input_ids.shape[0], self.arch.hidden_size, dtype=dtype,
                                 device=input_ids.device)
        layers = list(self.layers.values())
        if not layers:
            return (self.norm(hidden) if self.pp.is_last else hidden), None
        x = layers[0].input_layernorm(hidden)
        final = self.norm if self.pp.is_last else None
        for i, layer in enumerate(layers):
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final
            hidden, x = layer(positions, hidden, x, meta, nxt)
        # The last stage ends with the final norm, which the last layer applied.
        return (x if final is not None else hidden), None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.arch.final_logit_softcap is not None:
            logits = soft_cap(logits, self.arch.final_logit_softcap)
        return logits

    # Same checkpoint names and fused q/k/v, gate/up as the decoder: its loader applies as is.
    load_weights = DecoderForCausalLM.load_weights
    load_special = DecoderForCausalLM.load_special
    fused_name = DecoderForCausalLM.fused_name
    still_missing = DecoderForCausalLM.still_missing
    _param_name = DecoderForCausalLM._param_name
    _belongs_elsewhere = DecoderForCausalLM._belongs_elsewhere
