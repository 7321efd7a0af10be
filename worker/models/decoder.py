"""One decoder-only transformer for every supported family (Llama 2/3, Mistral, SmolLM2, Qwen2,
Qwen3). The families differ in a few flags of ``ArchSpec``: q/k/v bias (Qwen2), per-head q/k
RMSNorm (Qwen3), rope scaling, tied embeddings.

Parameter names follow HF transformers, except the fused ``qkv_proj`` and ``gate_up_proj``,
which ``load_weights`` assembles from the separate checkpoint tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl, AttentionMetadata
from tidal.worker.attention.fp8_kv import load_kv_scale
from tidal.worker.cpu_offload import layer_built
from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.distributed.pending_sum import PendingSum
from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers import fp8_block, int4
from tidal.worker.layers.activation import GatedActivation, SiluAndMul
from tidal.worker.layers.attention import Attention
from tidal.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.worker.layers.fused_moe import FusedMoE
from tidal.worker.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding


class WeightLoadError(ValueError):
    def __init__(self, tensor: str, message: str) -> None:
        super().__init__(f"tensor {tensor!r}: {message}")
        self.tensor = tensor


# Checkpoint names of the parts of the fused q/k/v and gate/up parameters.
STACKED_PARTS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


class WeightTally:
    """Loads checkpoint tensors into parameters by name and keeps count of what is complete: a
    plain parameter once loaded, a fused one (q/k/v, gate/up) once every part has been."""

    __slots__ = ("params", "_loaded", "_shards")

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self._loaded: set[str] = set()
        self._shards: dict[str, set[object]] = {}

    @staticmethod
    def fused(name: str) -> tuple[str, object | None]:
        """(the parameter's name, the part it is of a fused parameter, or None)."""
        for fused, part, sid in STACKED_PARTS:
            if part in name:
                return name.replace(part, fused), sid
        return name, None

    def load(self, ckpt_name: str, name: str, shard_id: object | None,
             tensor: torch.Tensor) -> None:
        param = self.params[name]
        try:
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
        except ValueError as exc:
            raise WeightLoadError(ckpt_name, str(exc)) from exc
        if shard_id is None:
            self._loaded.add(name)
        else:
            self._shards.setdefault(name, set()).add(shard_id)

    def mark(self, name: str) -> None:
        self._loaded.add(name)

    def loaded(self) -> set[str]:
        for name, got in self._shards.items():
            if got == ({"q", "k", "v"} if ".qkv_proj." in name else {0, 1}):
                self._loaded.add(name)
        return self._loaded

    @staticmethod
    def check_missing(missing: set[str]) -> None:
        if missing:
            names = sorted(missing)
            shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
            raise WeightLoadError(names[0], f"missing from the checkpoint ({len(names)} "
                                  f"parameters not loaded: {shown})")


class DecoderAttention(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 impl: AttentionImpl, layer: int = 0) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, arch.qkv_bias, dtype, tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size, False,
                                        dtype, tp)
        self.rotary_emb = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings,
                                          arch.rope_theta, arch.rope_scaling)
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5, impl,
                              sliding_window=arch.layer_sliding_window(layer))
        self.kernels = current_kernels()

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.attend_qkv(positions, self.qkv_proj(hidden), meta)

    def attend_qkv(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata,
                   defer_reduce: bool = False) -> torch.Tensor | PendingSum:
        """Everything after the q/k/v projection: norms, rotary, K/V write, attention, o_proj.
        Where the policy has the decode kernels (a GPU) the first four are one kernel
        (``Kernels.qk_norm_rope_write_kv``) for the tensors it supports.
        ``defer_reduce``: see ``RowParallelLinear.forward``."""
        n = qkv.shape[0]
        rope = self.rotary_emb
        kv_cache = self.attn.kv_cache
        kernels = self.kernels
        if kernels.qk_norm_rope_applies(qkv, self.head_dim, rope.cos_sin_cache, rope.is_neox,
                                        kv_cache):
            qn = self.q_norm
            q = kernels.qk_norm_rope_write_kv(
                qkv, positions, self.num_heads, self.num_kv_heads, self.head_dim,
                None if qn is None else qn.weight,
                None if qn is None else self.k_norm.weight,
                0.0 if qn is None else qn.eps, rope.cos_sin_cache, kv_cache,
                self.attn.group_meta(meta).slot_mapping, self.attn.k_scale, self.attn.v_scale)
            return self.o_proj(self.attn.attend(q.view(n, -1), meta), defer_reduce)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_dim)
        k = k.reshape(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, meta)
        return self.o_proj(out, defer_reduce)


class DecoderMLP(nn.Module):
    """Gated MLP: ``down(act(gate) * up)``; SwiGLU unless a family passes its own ``act_fn``
    (Gemma: GeGLU)."""

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 act_fn: GatedActivation | None = None) -> None:
        super().__init__()
        inter = arch.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(arch.hidden_size, [inter, inter], False,
                                                       dtype, tp)
        self.down_proj = RowParallelLinear(inter, arch.hidden_size, False, dtype, tp)
        self.act_fn = SiluAndMul() if act_fn is None else act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn.project(self.gate_up_proj, x))


class NormLinear:
    """``(linear(norm(x + residual)), x + residual)`` as one op (``Kernels.rms_norm_linear``):
    for one row on the GPU, where the policy has the GEMV, the norm runs inside (or just
    before) the GEMV and SiLU-and-mul (``silu``) inside it; everywhere else the plain ops, in
    the order the math reads. A plain object, not a module: it borrows the parameters of
    ``norm`` and ``linear``, which stay where the checkpoint names them."""

    __slots__ = ("_op", "_norm", "_linear", "_silu", "_fp8", "_int4", "_block", "_apart")

    def __init__(self, norm: RMSNorm, linear: nn.Module, silu: bool = False) -> None:
        self._op = norm.kernels.rms_norm_linear
        self._norm, self._linear, self._silu = norm, linear, silu
        # FP8 weights: one row on the GPU goes through the same fused GEMV paths (reading the
        # FP8 weights, weight-only); other rows take the norm that quantizes for the FP8 GEMM.
        self._fp8 = getattr(linear, "weight_scale", None) is not None
        # INT4 weights (AWQ/GPTQ) never reach the fused 16-bit GEMV paths: the plain norm,
        # then the layer's own W4A16 matmul (with SiLU-and-mul as its epilogue for one row on
        # the GPU). Block-wise FP8 weights likewise (the layer's own block-scaled matmul, its
        # gate/up with SiLU-and-mul as the few-row product's epilogue).
        self._int4 = getattr(linear, "w4a16", None) is not None
        self._block = getattr(linear, "fp8_block", None)
        self._apart = self._int4 or self._block is not None

    def __call__(self, x: torch.Tensor | PendingSum,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, linear = self._norm, self._linear
        # LoRA, hung on the linear after the model is built: one row on the GPU takes the
        # shrink (which norms the row) and the GEMV that adds the adapters' products; other
        # rows the plain norm, then the linear with its adapters (the other fused GEMV paths
        # would skip their products).
        if linear.lora is not None:
            act = "silu" if self._silu else None
            if linear.lora_gemv_applies(x, linear.bias, norm.weight, residual, act):
                return linear.lora.gemv(x, linear.weight, linear.bias, norm_weight=norm.weight,
                                        residual=residual, eps=norm.eps, act=act)
            return self._norm_then_linear(x, residual)
        if self._apart:
            return self._norm_then_linear(x, residual)
        if not self._fp8:
            return self._op(x, residual, norm.weight, norm.eps, linear.weight, linear.bias,
                            silu=self._silu)
        kernels = norm.kernels
        if kernels.one_row_fusion_applies(x):
            return self._op(x, residual, norm.weight, norm.eps, linear.weight, linear.bias,
                            silu=self._silu, weight_scale=linear.weight_scale,
                            input_scale=linear.input_scale)
        if isinstance(x, PendingSum):
            x = x.wait()
        return kernels.rms_norm_fp8_linear(x, residual, norm.weight, norm.eps, linear.weight,
                                           linear.weight_scale, linear.bias, linear.input_scale,
                                           silu=self._silu)

    def _norm_then_linear(self, x: torch.Tensor | PendingSum,
                          residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, kernels = self._norm, self._norm.kernels
        if isinstance(x, PendingSum):
            x = x.wait()
        if residual is None:
            h, residual = kernels.rms_norm(x, norm.weight, norm.eps), x
        else:
            # (One row on the GPU: the norm kernel launched as a programmatic dependent, which
            # lets the INT4 / block-FP8 product after it fetch its weights while it runs.)
            h, residual = kernels.add_rms_norm_row(x, residual, norm.weight, norm.eps)
        linear = self._linear
        if self._silu and self._int4 and linear.lora is None:
            return int4.gated_matmul(linear, h, linear.bias, "silu"), residual
        if self._silu and self._block is not None and linear.lora is None:
            return fp8_block.gated_matmul(linear, h, linear.bias, "silu"), residual
        y = linear(h)
        return (kernels.silu_and_mul(y) if self._silu else y), residual


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 impl: AttentionImpl, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(arch, dtype, tp, impl, layer)
        self.mlp = DecoderMLP(arch, dtype, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.norm_qkv = NormLinear(self.input_layernorm, self.self_attn.qkv_proj)
        self.norm_gate_up = NormLinear(self.post_attention_layernorm, self.mlp.gate_up_proj,
                                       silu=True)
        # With the one-row GEMV (a GPU policy) the row-parallel outputs of a batch-1 decode
        # step may come back as a PendingSum, whose all-reduce the next norm completes; the
        # choice is the policy's, fixed here (and so in every captured graph).
        self.defer_reduce = self.input_layernorm.kernels.policy.gemv

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor | PendingSum,
                residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor | PendingSum, torch.Tensor]:
        # norm -> attention -> norm -> MLP, each norm with the residual add before it.
        qkv, residual = self.norm_qkv(hidden, residual)
        hidden = self.self_attn.attend_qkv(positions, qkv, meta, self.defer_reduce)
        act, residual = self.norm_gate_up(hidden, residual)  # SiLU(gate) * up
        return self.mlp.down_proj(act, self.defer_reduce), residual


def build_stage_ends(model: nn.Module, arch: ArchSpec, dtype: torch.dtype,
                     norm_cls: type[nn.Module]) -> None:
    """Give ``model`` (with ``tp``/``pp`` set) the modules its pipeline stage owns at either
    end: ``embed_tokens`` (first stage, or the last with tied embeddings), the final ``norm``
    and ``lm_head`` (last stage); None where the stage has none."""
    tied = arch.tie_word_embeddings
    model.embed_tokens = None
    if model.pp.is_first or (tied and model.pp.is_last):
        model.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size, dtype,
                                                    model.tp)
    model.norm = model.lm_head = None
    if model.pp.is_last:
        model.norm = norm_cls(arch.hidden_size, arch.rms_norm_eps, dtype)
        model.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, model.tp)
        if tied:
            model.lm_head.weight = model.embed_tokens.weight


@dataclass(frozen=True, slots=True)
class AuxHiddenSpec:
    """Build-time option of a decoder: record the residual stream entering each of ``layers``
    (after embedding for layer 0; HF's ``hidden_states[i]`` of ``output_hidden_states``), the
    inputs of an EAGLE-3 draft head, into one fixed buffer of ``max_tokens`` rows. Layer
    ``num_layers`` is the final hidden state after the norm (HF's ``hidden_states[-1]``), what
    multi-token-prediction layers read."""

    layers: tuple[int, ...]
    max_tokens: int


def layer_range(num_layers: int, pp: ParallelGroup) -> tuple[int, int]:
    """Layers [start, end) owned by pipeline stage ``pp.rank``: an even split, the remainder
    going to the first stages."""
    base, extra = divmod(num_layers, pp.world_size)
    start = pp.rank * base + min(pp.rank, extra)
    return start, start + base + (1 if pp.rank < extra else 0)


class DecoderForCausalLM(nn.Module):
    # Every weight loader below only narrows or materialises what it is given, so the checkpoint
    # reader may hand over lazy tensors (a tensor-parallel rank then reads just its shard).
    supports_lazy_weights = True
    supports_aux_hidden_states = True

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None,
                 aux_hidden: AuxHiddenSpec | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp or single_group()
        self.pp = pp or single_group()
        self.start_layer, self.end_layer = layer_range(arch.num_layers, self.pp)
        self.layers = nn.ModuleDict({
            # (--cpu-offload-gb may move a layer's weights to host memory as it is built)
            str(i): layer_built(i, self.make_layer(arch, dtype, impl, i))
            for i in range(self.start_layer, self.end_layer)
        })
        build_stage_ends(self, arch, dtype, RMSNorm)
        # The layer loop is chosen here, once: a model built without auxiliary hidden states
        # runs the plain loop, with no per-layer check in its forward (or its CUDA graphs).
        self.aux_hidden_states: torch.Tensor | None = None
        self._run_layers = self._run_layers_plain
        self._aux_final_cols: tuple[int, ...] = ()  # where the final state goes in the buffer
        if aux_hidden is not None:
            self._init_aux_hidden(aux_hidden, dtype)

    def _init_aux_hidden(self, spec: AuxHiddenSpec, dtype: torch.dtype) -> None:
        n = self.arch.num_layers
        bad = [i for i in spec.layers if not 0 <= i <= n]
        if not spec.layers or bad:
            raise ValueError(f"auxiliary hidden state layer ids must be 1 or more of 0..{n} "
                             f"(the model has {n} layers; {n}: the final hidden state), got "
                             f"{list(spec.layers)}")
        if not self.pp.is_last or any(not self.start_layer <= i < self.end_layer
                                      for i in spec.layers if i < n):
            raise ValueError("auxiliary hidden states need every chosen layer on the last "
                             "pipeline stage (EAGLE-3 with pipeline parallelism is not "
                             "supported)")
        if spec.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {spec.max_tokens}")
        width = self.arch.hidden_size
        # [max_tokens, len(layers) * hidden]: a step's first rows are the draft head's input
        # as they are (its fc takes the states side by side, in the order of ``layers``).
        self.aux_hidden_states = torch.empty(spec.max_tokens, len(spec.layers) * width,
                                             dtype=dtype)
        self._aux_plan = tuple(
            (layer, tuple(k * width for k, j in enumerate(spec.layers) if j == int(i)))
            for i, layer in self.layers.items())
        self._aux_final_cols = tuple(k * width for k, j in enumerate(spec.layers) if j == n)
        if any(j < n for j in spec.layers):
            self._run_layers = self._run_layers_aux

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers.values()]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Runs this stage's layers. The first stage embeds ``input_ids``; later stages take
        ``hidden``/``residual`` from the previous one. The last stage returns the final normed
        hidden states (and None); others return (hidden, residual) to send on."""
        self.tp.begin_step()
        if self.pp.is_first:
            hidden = self.embed_tokens(input_ids)
            residual = None
        elif hidden is None:
            # A later stage run without the previous stage's tensors: the memory-profiling
            # pass, which only needs activations of the right size.
            hidden = torch.zeros(input_ids.shape[0], self.arch.hidden_size,
                                 dtype=self.layers[str(self.start_layer)].input_layernorm
                                 .weight.dtype, device=input_ids.device)
            residual = torch.zeros_like(hidden)
        hidden, residual = self._run_layers(positions, hidden, residual, meta)
        if isinstance(hidden, PendingSum):
            hidden = hidden.wait()
        if not self.pp.is_last:
            return hidden, residual
        if residual is None:
            hidden = self.norm(hidden)
        else:
            hidden, _ = self.norm(hidden, residual)
        if self._aux_final_cols:
            self._record_final(hidden)
        return hidden, None

    def _record_final(self, hidden: torch.Tensor) -> None:
        buf = self.aux_hidden_states
        assert buf is not None
        _check_aux_rows(hidden.shape[0], buf)
        for c in self._aux_final_cols:
            _store_aux(buf, hidden, c)

    def _run_layers_plain(self, positions: torch.Tensor, hidden: torch.Tensor | PendingSum,
                          residual: torch.Tensor | None, meta: AttentionMetadata
                          ) -> tuple[torch.Tensor | PendingSum, torch.Tensor | None]:
        for layer in self.layers.values():
            hidden, residual = layer(positions, hidden, residual, meta)
        return hidden, residual

    def _run_layers_aux(self, positions: torch.Tensor, hidden: torch.Tensor | PendingSum,
                        residual: torch.Tensor | None, meta: AttentionMetadata
                        ) -> tuple[torch.Tensor | PendingSum, torch.Tensor | None]:
        """The layer loop, copying the residual stream entering the chosen layers into the
        first rows of ``aux_hidden_states`` (a fixed buffer: CUDA graphs replay into it)."""
        buf = self.aux_hidden_states
        for layer, cols in self._aux_plan:
            if cols:
                if isinstance(hidden, PendingSum):
                    hidden = hidden.wait()
                # tidal's layers hand on the residual add unfinished; the stream is the sum.
                state = hidden if residual is None else hidden + residual
                # (Rows counted on the copied state, not on ``positions``: compiled, the two
                # are separate unbacked sizes, and torch 2.11 cannot guard their equality.)
                _check_aux_rows(state.shape[0], buf)
                for c in cols:
                    _store_aux(buf, state, c)
            hidden, residual = layer(positions, hidden, residual, meta)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters; raises ``WeightLoadError``
        naming the tensor on a mismatch, and listing every parameter the checkpoint lacked."""
        tally = WeightTally(dict(self.named_parameters(remove_duplicate=False)))
        expected = set(tally.params)
        if self.arch.tie_word_embeddings and "lm_head.weight" in expected:
            expected.discard("lm_head.weight")  # shared with the embedding
        # FP8 scales computed as their weights quantize on load (layers/fp8.py).
        expected -= {n for n, p in tally.params.items() if getattr(p, "derived_on_load", False)}
        for ckpt_name, tensor in weights:
            name = self._param_name(ckpt_name)
            if name is None or self.load_special(tally, ckpt_name, name, tensor):
                continue
            try:  # FP8 KV cache scales (attention/fp8_kv.py), not parameters
                if load_kv_scale(self, name, tensor):
                    continue
            except ValueError as exc:
                raise WeightLoadError(ckpt_name, str(exc)) from None
            name, shard_id = self.fused_name(tally, name)
            if name not in tally.params:
                if self._belongs_elsewhere(name):
                    continue
                raise WeightLoadError(ckpt_name, "the checkpoint has it but the model does not "
                                      f"({self.arch.architecture}); wrong architecture?")
            tally.load(ckpt_name, name, shard_id, tensor)
        tally.check_missing(self.still_missing(expected - tally.loaded()))

    def fused_name(self, tally: WeightTally, name: str) -> tuple[str, object | None]:
        """The parameter a checkpoint tensor fills and its shard id: q/k/v into ``qkv_proj``,
        gate/up into ``gate_up_proj``; a family with other projections under those names
        narrows it."""
        return tally.fused(name)

    def still_missing(self, missing: set[str]) -> set[str]:
        """The parameters the checkpoint lacked. A ``FusedMoE`` layer's stacked parameters
        are filled piecewise (a tensor per expert, by ``load_special``), so they count by
        expert: the first one lacking is named."""
        for name, module in self.named_modules():
            if isinstance(module, FusedMoE):
                missing.discard(f"{name}.w13")
                missing.discard(f"{name}.w2")
                lacking = module.missing_weights()
                if lacking:
                    missing.add(f"{name} ({lacking[0]}, ...)")
        return missing

    def make_layer(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                   layer: int) -> nn.Module:
        """Layer ``layer`` of this stage (called with ``self.tp`` set); families whose layers
        differ only in their feed-forward part (MoE) return their own."""
        return DecoderLayer(arch, dtype, self.tp, impl, layer)

    def load_special(self, tally: WeightTally, ckpt_name: str, name: str,
                     tensor: torch.Tensor) -> bool:
        """A family's hook for checkpoint tensors that fill no one parameter by name (MoE
        experts, stacked into one parameter): True when it has loaded ``tensor``."""
        return False

    def _param_name(self, ckpt_name: str) -> str | None:
        if "rotary_emb.inv_freq" in ckpt_name:
            return None
        if ckpt_name.startswith("model."):
            name = ckpt_name[len("model."):]
        else:
            name = ckpt_name
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return None
        if name.startswith("layers."):
            idx = int(name.split(".")[1])
            if not self.start_layer <= idx < self.end_layer:
                return None  # another pipeline stage's layer
        return name

    def _belongs_elsewhere(self, name: str) -> bool:
        # Embedding / head / final norm held by another pipeline stage.
        head = name.split(".")[0]
        return head in ("embed_tokens", "lm_head", "norm") and getattr(self, head) is None


def _copy_aux(buf: torch.Tensor, state: torch.Tensor, col: int) -> None:
    buf.narrow(0, 0, state.shape[0]).narrow(1, col, state.shape[1]).copy_(state)


@torch.library.custom_op("tidal::store_aux_hidden", mutates_args=("buf",))
def _store_aux_op(buf: torch.Tensor, state: torch.Tensor, col: int) -> None:
    _copy_aux(buf, state, col)


@_store_aux_op.register_fake
def _(buf: torch.Tensor, state: torch.Tensor, col: int) -> None:
    return None


def _store_aux(buf: torch.Tensor, state: torch.Tensor, col: int) -> None:
    """``state`` into rows [0, n), columns [col, col + width) of the auxiliary hidden-state
    buffer. Compiled, as one opaque op: written as a view copy, torch 2.11's piece compiler
    guarded whether the step's (unbacked) token count is 1, for broadcasting, and gave up the
    whole graph (measured on an H200; torch 2.13 on the CPU compiled it either way)."""
    if torch.compiler.is_compiling():
        _store_aux_op(buf, state, col)
    else:
        _copy_aux(buf, state, col)


def _check_aux_rows(n: int, buf: torch.Tensor) -> None:
    """The step's tokens fit the auxiliary hidden-state buffer (``ValueError``; while Dynamo
    traces, a ``torch._check``: the token count is symbolic there, so a Python ``if`` on it
    cannot be traced; the eager path's check names the limit)."""
    rows = buf.shape[0]
    if not torch.compiler.is_compiling():
        if n > rows:
            raise ValueError(f"{n} tokens exceed the {rows} rows of the auxiliary hidden "
                             "state buffer")
        return
    # (No message: torch 2.11's Dynamo cannot trace one built from a local ("Can't extract
    # message from torch._check()") and then gives up the whole graph.)
    torch._check(n <= rows)
