"""DeepSeek-V3's multi-token-prediction (MTP) layer as a draft model (the ``mtp`` speculative
method; registry family ``deepseek_mtp``, built from the target's ``ArchSpec``).

For a position ``t`` with the target's final hidden state ``h_t`` (after its norm) and the next
token ``x_{t+1}``, the layer predicts token ``t + 2``:
``eh_proj([enorm(embed(x_{t+1})), hnorm(h_t)])`` (2H -> H) goes through one decoder block of the
target's kind (MLA with its own latent cache, then the dense MLP or the routed + shared experts,
as the checkpoint has them), and ``shared_head.norm`` then ``shared_head.head`` give the logits.
The block's output before that norm is the hidden state of the next draft step: with more draft
tokens than MTP layers the one layer is chained on its own output (as vLLM does).

Its weights are in the target's checkpoint as ``model.layers.{num_hidden_layers}.*``: the
block's tensors under their decoder names, plus ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.{norm,head}`` and ``embed_tokens``; where a checkpoint has no embedding or head
of its own the target's are shared (``share_target_weights``). Only the first of several MTP
layers is used (DeepSeek-V3 and R1 have one).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl, AttentionMetadata
from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.worker.layers.linear import ReplicatedLinear
from tidal.worker.layers.mla import MLAAttention
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.models.decoder import WeightLoadError, WeightTally
from tidal.worker.models.deepseek_v2 import (
    DeepseekV2Layer,
    DeepseekV2MoE,
    load_expert_tensor,
)

logger = logging.getLogger(__name__)

# The block's expert tensors, per expert or stacked (as ``deepseek_v2``'s, under ``block.``).
_EXPERT_TENSOR = re.compile(
    r"block\.mlp\.experts\.(?:(\d+)\.(gate|up|down)_proj\.weight|(gate_up|down)_proj)$")
# The MTP layer's own tensors (everything else of it belongs to the decoder block).
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")


class SharedHead(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup) -> None:
        super().__init__()
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.head = ParallelLMHead(arch.vocab_size, arch.hidden_size, dtype, tp)


class DeepseekMTP(nn.Module):
    supports_lazy_weights = True

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        super().__init__()
        if arch.num_nextn_predict_layers < 1:
            raise ValueError(f"{arch.architecture} has no multi-token-prediction layers "
                             "(num_nextn_predict_layers)")
        if pp is not None and pp.world_size > 1:
            raise ValueError("the MTP drafter runs whole on every rank: pipeline parallelism "
                             "does not apply to it")
        self.arch = arch
        self.tp = tp or single_group()
        # Its index in the checkpoint: the first layer after the decoder's.
        self.layer_index = arch.num_layers
        h = arch.hidden_size
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, h, dtype, self.tp)
        self.enorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.eh_proj = ReplicatedLinear(2 * h, h, False, dtype, self.tp)
        rope = RotaryEmbedding(arch.qk_rope_head_dim, arch.max_position_embeddings,
                               arch.rope_theta, arch.rope_scaling, is_neox=False)
        self.block = DeepseekV2Layer(arch, dtype, self.tp, rope, self.layer_index)
        self.shared_head = SharedHead(arch, dtype, self.tp)
        # Whether the checkpoint brought its own; else ``share_target_weights``. Dummy
        # weights bring both.
        self.has_embeddings = True
        self.has_lm_head = True

    def attention_layers(self) -> list[MLAAttention]:
        return [self.block.self_attn]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [n, H]``: the target's final hidden states, or the previous draft step's
        output. Returns ``(normed, pre-norm)``: the first for the head, the second the next
        draft step's ``hidden``."""
        x = torch.cat([self.enorm(self.embed_tokens(input_ids)), self.hnorm(hidden)], dim=-1)
        out, residual = self.block(positions, self.eh_proj(x), None, meta)
        pre = out + residual
        return self.shared_head.norm(pre), pre

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head.compute_logits(hidden)

    def share_target_weights(self, target: nn.Module) -> None:
        """Use the target's embedding and/or LM head where the checkpoint had none."""
        if not self.has_embeddings:
            embed = getattr(target, "embed_tokens", None)
            if embed is None or embed.weight.shape != self.embed_tokens.weight.shape:
                raise ValueError("the MTP layer has no embed_tokens and the target's embedding "
                                 "is not on this rank / does not fit")
            self.embed_tokens = embed
            self.has_embeddings = True
        if not self.has_lm_head:
            head = getattr(target, "lm_head", None)
            if head is None or head.weight.shape != self.shared_head.head.weight.shape:
                raise ValueError("the MTP layer has no shared_head.head and the target's LM "
                                 "head is not on this rank / does not fit")
            self.shared_head.head = head
            self.has_lm_head = True

    # --- weights ------------------------------------------------------------------------------

    def _param_name(self, ckpt_name: str) -> str | None:
        """``model.layers.{N}.X`` -> this module's name of X; None for the target's tensors
        (and later MTP layers, unused)."""
        prefix = f"layers.{self.layer_index}."
        name = ckpt_name.removeprefix("model.")
        if not name.startswith(prefix) or "rotary_emb.inv_freq" in name:
            return None
        rest = name[len(prefix):]
        return rest if rest.startswith(_OWN) else "block." + rest

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the MTP layer's tensors out of the target's checkpoint; raises
        ``WeightLoadError`` naming the tensor on a mismatch or what the checkpoint lacked."""
        tally = WeightTally(dict(self.named_parameters(remove_duplicate=False)))
        mlp = self.block.mlp
        for ckpt_name, tensor in weights:
            name = self._param_name(ckpt_name)
            if name is None:
                continue
            m = _EXPERT_TENSOR.fullmatch(name)
            if m is not None:
                self._load_experts(ckpt_name, m, tensor)
                continue
            shard_id = None
            if ".mlp." in name:  # only the MLPs' gate/up fuse (MLA's projections are its own)
                name, shard_id = tally.fused(name)
            if name not in tally.params:
                raise WeightLoadError(ckpt_name, "not a tensor of a DeepSeek MTP layer")
            tally.load(ckpt_name, name, shard_id, tensor)
        loaded = tally.loaded()
        self.has_embeddings = "embed_tokens.weight" in loaded
        self.has_lm_head = "shared_head.head.weight" in loaded
        missing = set(tally.params) - loaded - {"embed_tokens.weight",
                                                "shared_head.head.weight"}
        if isinstance(mlp, DeepseekV2MoE):
            missing -= {"block.mlp.experts.w13", "block.mlp.experts.w2"}
            lacking = mlp.experts.missing_weights()
            if lacking:
                missing.add(f"block.mlp.experts ({lacking[0]}, ...)")
        if missing and missing >= {"eh_proj.weight", "enorm.weight", "hnorm.weight"}:
            raise WeightLoadError(f"model.layers.{self.layer_index}.eh_proj.weight",
                                  "missing: the checkpoint has no multi-token-prediction layer "
                                  f"(layers.{self.layer_index}.*), though its config sets "
                                  f"num_nextn_predict_layers={self.arch.num_nextn_predict_layers}")
        tally.check_missing({f"model.layers.{self.layer_index}." + n.removeprefix("block.")
                             for n in missing})
        if not (self.has_embeddings and self.has_lm_head):
            logger.info("MTP layer without its own %s: the target's will be shared",
                        " and ".join(n for n, own in (("embedding", self.has_embeddings),
                                                      ("LM head", self.has_lm_head)) if not own))

    def _load_experts(self, ckpt_name: str, m: re.Match[str], tensor: torch.Tensor) -> None:
        mlp = self.block.mlp
        if not isinstance(mlp, DeepseekV2MoE):
            raise WeightLoadError(ckpt_name, "the MTP layer is a dense layer here "
                                  "(first_k_dense_replace), not an MoE one")
        load_expert_tensor(mlp.experts, ckpt_name, m.group(1), m.group(2) or m.group(3), tensor)
