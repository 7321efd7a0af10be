"""The ``mtp`` method's proposer: DeepSeek's multi-token-prediction layer
(``models.deepseek_mtp``) drafting from the target's final hidden states.

The rows are an EAGLE-3 head's (``draft_proposer``): the target step's rows, row t holding
token t + 1 and, in ``hidden``, the target's final hidden state of row t (``AuxHiddenSpec``
with layer ``num_layers``). Draft 1 comes from each request's last row; each later draft feeds
the previous one with the layer's own pre-norm output, the one MTP layer reused at every step.
The layer attends with MLA, so its cache is one latent row per token (``cache_shape``), not the
K/V pairs of ``_ChainProposer``'s default.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.models.deepseek_mtp import DeepseekMTP
from tidal.worker.spec_decode.draft_proposer import DraftBatch, _ChainProposer

logger = logging.getLogger(__name__)


class MTPProposer(_ChainProposer):
    model: DeepseekMTP
    # No CUDA graphs of the uniform step: its first pass has k + 1 rows per request, which
    # MLA attends request by request from host lengths (graphs replay no host work).
    capturable = False

    def __init__(self, model: DeepseekMTP, num_speculative_tokens: int,
                 target_model: nn.Module, max_model_len: int) -> None:
        target = target_model.arch
        if model.arch.hidden_size != target.hidden_size or \
                model.arch.vocab_size != target.vocab_size:
            raise ValueError("the MTP layer's hidden size / vocabulary is not the target's")
        model.share_target_weights(target_model)
        super().__init__(model, num_speculative_tokens, target.vocab_size, max_model_len)
        if num_speculative_tokens > 1:
            logger.info("mtp: %d speculative tokens from one MTP layer: the layer is reused "
                        "for each draft after the first, chained on its own hidden state",
                        num_speculative_tokens)

    # --- the latent cache ---------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.tensor([], dtype=self._cache_dtype()).element_size()
        return sum(math.prod(a.cache_shape(1, block_size)) * elem
                   for a in self.attention_layers())

    def bind_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        dev = next(self.model.parameters()).device
        self.kv_caches = []
        for layer in self.attention_layers():
            layer.kv_cache = torch.zeros(layer.cache_shape(num_blocks, block_size),
                                         dtype=self._cache_dtype(), device=dev)
            layer.kv_group = 0
            self.kv_caches.append(layer.kv_cache)
        return self.kv_caches

    def _block_size(self) -> int:
        caches = self.attention_layers()
        if not caches or caches[0].kv_cache.dim() != 3:
            raise RuntimeError("the MTP layer's latent cache is not bound (bind_kv_cache)")
        return caches[0].kv_cache.shape[1]

    # --- drafting -------------------------------------------------------------------------------

    def _first(self, batch: DraftBatch, last: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if batch.hidden is None:
            raise ValueError("an MTP batch needs the target's final hidden states")
        normed, pre = self.model(batch.input_ids, batch.positions, batch.meta, batch.hidden)
        return self.model.compute_logits(normed[last]), pre[last]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert state is not None
        normed, pre = self.model(ids, positions, meta, state)
        return self.model.compute_logits(normed), pre
