"""EAGLE-3 draft head for Llama-shaped targets (one family file; registry family ``eagle3``).

The head drafts from the target's own features: ``fc`` fuses the hidden states entering three
target layers (low, middle, high: ``AuxHiddenSpec`` on the target) into one hidden state; one
decoder layer then attends over ``[input_layernorm(embed(token)), hidden_norm(hidden)]`` side
by side (its q/k/v projection reads 2H), runs its own gated MLP, and a final norm and LM head
over a draft vocabulary give the next token; ``d2t`` maps a draft id to a target id
(``target = draft + d2t[draft]``). The layer's output before the final norm is the hidden
state of the next draft step. Where the checkpoint has no embedding (EAGLE's own
checkpoints) or no LM head, the target's are shared (``share_target_weights``).

Checkpoint names, in the published layouts: ``fc.weight``, ``midlayer.*`` (EAGLE, SGLang) or
``layers.0.*`` (``speculators``), ``norm.weight``, ``lm_head.weight``, ``embed_tokens.weight``
(optional), ``d2t`` and ``t2d`` (the target-to-draft mask, not needed to draft), each perhaps
under ``model.``. Parameter names follow them, except the fused ``qkv_proj``/``gate_up_proj``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl, AttentionMetadata
from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.layers.attention import Attention
from tidal.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.worker.layers.linear import QKVParallelLinear, ReplicatedLinear, as_tensor
from tidal.worker.layers.norm import RMSNorm
from tidal.worker.models.decoder import (
    DecoderAttention,
    DecoderMLP,
    WeightLoadError,
    WeightTally,
)

logger = logging.getLogger(__name__)

NUM_AUX_LAYERS = 3


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default target layers: low, middle and high (as trained by its authors)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def aux_layer_ids(head: ArchSpec, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose entering hidden states feed ``head``: the checkpoint's
    ``eagle_aux_hidden_state_layer_ids`` where it names them, else the defaults."""
    ids = head.aux_hidden_layer_ids or default_aux_layer_ids(num_target_layers)
    if len(ids) != NUM_AUX_LAYERS or not all(0 <= i < num_target_layers for i in ids):
        raise ValueError(f"EAGLE-3 auxiliary layers {list(ids)} must be {NUM_AUX_LAYERS} of "
                         f"the target's layers 0..{num_target_layers - 1}")
    return tuple(ids)


class Eagle3Layer(nn.Module):
    def __init__(self, arch: ArchSpec, dtype: torch.dtype, tp: ParallelGroup,
                 impl: AttentionImpl) -> None:
        super().__init__()
        h = arch.hidden_size
        self.self_attn = DecoderAttention(arch, dtype, tp, impl)
        # Queries, keys and values are read from the embedding and the hidden state side by
        # side: the projection is the decoder's, over 2H inputs.
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, arch.head_dim, arch.num_heads,
                                                    arch.num_kv_heads, False, dtype, tp)
        self.mlp = DecoderMLP(arch, dtype, tp)
        self.input_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(h, arch.rms_norm_eps, dtype)
        # ``speculators`` heads add the normed hidden state back, EAGLE's own the raw one.
        self.norm_before_residual = arch.norm_before_residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual)``; their sum is the layer's output."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn = self.self_attn.attend_qkv(positions, self.self_attn.qkv_proj(x), meta)
        mlp_in, residual = self.post_attention_layernorm(attn, residual)
        return self.mlp(mlp_in), residual


class Eagle3ForCausalLM(nn.Module):
    supports_lazy_weights = True

    def __init__(self, arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.tp = tp or single_group()
        if pp is not None and pp.world_size > 1:
            raise ValueError("an EAGLE-3 head runs whole on every rank: pipeline parallelism "
                             "does not apply to it")
        h = arch.hidden_size
        self.draft_vocab_size = arch.draft_vocab_size or arch.vocab_size
        target_hidden = arch.target_hidden_size or h
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, h, dtype, self.tp)
        self.fc = ReplicatedLinear(NUM_AUX_LAYERS * target_hidden, h, False, dtype, self.tp)
        self.midlayer = Eagle3Layer(arch, dtype, self.tp, impl)
        self.norm = RMSNorm(h, arch.rms_norm_eps, dtype)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, dtype, self.tp)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        # Whether the checkpoint brought its own; else ``share_target_weights`` must be
        # called with the target before the head drafts. Dummy weights bring both.
        self.has_embeddings = True
        self.has_lm_head = True

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def combine_hidden_states(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's auxiliary hidden states ``[n, 3 * target_hidden]`` -> ``[n, H]``."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` ``[n, H]``: the fused target states (``combine_hidden_states``) or the
        previous draft step's output. Returns ``(normed, pre-norm)``: the first for the LM
        head, the second the next draft step's ``hidden``."""
        out, residual = self.midlayer(positions, self.embed_tokens(input_ids), hidden, meta)
        normed, prenorm = self.norm(out, residual)
        return normed, prenorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary ``[n, draft_vocab_size]``."""
        return self.lm_head.compute_logits(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def share_target_weights(self, target: nn.Module) -> None:
        """Use the target's embedding and/or LM head where the checkpoint had none."""
        if not self.has_embeddings:
            embed = getattr(target, "embed_tokens", None)
            if embed is None or embed.weight.shape != self.embed_tokens.weight.shape:
                raise ValueError("the EAGLE-3 checkpoint has no embed_tokens and the target's "
                                 "embedding does not fit the head (vocabulary / hidden size)")
            self.embed_tokens = embed
            self.has_embeddings = True
        if not self.has_lm_head:
            head = getattr(target, "lm_head", None)
            if head is None or head.weight.shape != self.lm_head.weight.shape:
                raise ValueError("the EAGLE-3 checkpoint has no lm_head and the target's LM "
                                 "head does not fit its draft vocabulary")
            self.lm_head = head
            self.has_lm_head = True

    # --- weights ------------------------------------------------------------------------------

    _OPTIONAL = ("embed_tokens.weight", "lm_head.weight")

    @classmethod
    def _param_name(cls, ckpt_name: str) -> str | None:
        name = ckpt_name.removeprefix("model.")
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        if name == "t2d" or "rotary_emb.inv_freq" in name:
            return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy an EAGLE-3 checkpoint's tensors into the head; raises ``WeightLoadError``
        naming the tensor on a mismatch, an unknown tensor, or what the checkpoint lacked."""
        tally = WeightTally(dict(self.named_parameters(remove_duplicate=False)))
        for ckpt_name, tensor in weights:
            name = self._param_name(ckpt_name)
            if name is None:
                continue
            if name == "d2t":
                d2t = as_tensor(tensor)
                if tuple(d2t.shape) != tuple(self.d2t.shape):
                    raise WeightLoadError(ckpt_name, f"shape {tuple(d2t.shape)}, the draft "
                                          f"vocabulary needs ({self.draft_vocab_size},)")
                self.d2t.copy_(d2t.to(torch.int64))
                tally.mark(name)
                continue
            name, shard_id = tally.fused(name)
            if name not in tally.params:
                raise WeightLoadError(ckpt_name, "not a tensor of an EAGLE-3 head (one decoder "
                                      "layer as midlayer.* or layers.0.*, fc, norm, lm_head, "
                                      "embed_tokens, d2t, t2d)")
            tally.load(ckpt_name, name, shard_id, tensor)
        loaded = tally.loaded()
        self.has_embeddings = "embed_tokens.weight" in loaded
        self.has_lm_head = "lm_head.weight" in loaded
        if self.draft_vocab_size != self.arch.vocab_size and "d2t" not in loaded:
            raise WeightLoadError("d2t", f"missing: a draft vocabulary of "
                                  f"{self.draft_vocab_size} tokens needs its map to the "
                                  f"target's {self.arch.vocab_size}")
        tally.check_missing(set(tally.params) - loaded - set(self._OPTIONAL))
        if not (self.has_embeddings and self.has_lm_head):
            logger.info("EAGLE-3 head without its own %s: the target's will be shared",
                        " and ".join(n for n, own in (("embedding", self.has_embeddings),
                                                      ("LM head", self.has_lm_head)) if not own))
