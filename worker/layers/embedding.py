"""Token embedding and LM head, with the vocabulary split across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers.linear import WeightShapeError, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r*V/tp, (r+1)*V/tp) of the (padded) vocabulary; tokens of other ranks
    look up zeros, and one all-reduce assembles the full embedding."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 tp: ParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or single_group()
        self.kernels = current_kernels()
        world = self.tp.world_size
        self.vocab_size = vocab_size
        self.padded_vocab = -(-vocab_size // world) * world
        self.shard_size = self.padded_vocab // world
        self.start = self.tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise WeightShapeError(
                f"shape mismatch: the model expects ({self.vocab_size}, {param.shape[1]}), the "
                f"checkpoint has {tuple(loaded.shape)}"
            )
        end = min(self.start + self.shard_size, self.vocab_size)
        n = max(0, end - self.start)
        if n:
            # narrow, not indexing: a lazy checkpoint tensor then reads only this rank's rows.
            param.data[:n].copy_(loaded.narrow(0, self.start, n))
        param.data[n:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)
        return self.tp.all_reduce(self.kernels.vocab_shard_embedding(input_ids, self.weight,
                                                                     self.start))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; each rank computes its vocabulary slice and the slices
    are gathered. Shares its weight with the embedding when the model ties them."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # One row on the GPU: the GEMV kernel where its launch shape for this weight was
        # measured (Llama-3.1-8B at TP 1 and 2 on H200: 8-9 us under cuBLAS per step, and it
        # launches early behind the norm); other shapes keep cuBLAS, which reads the LM head
        # at ~95 % of the copy rate.
        # 2 to 8 rows: the few-row GEMV, likewise where measured (Llama-3.1-8B's on an H100:
        # 339 against 380 us at four rows).
        if (self.kernels.gemv_tuned(hidden, self.weight)
                or self.kernels.rows_gemv_applies(hidden, self.weight)):
            logits = self.kernels.linear(hidden, self.weight)
        else:
            logits = F.linear(hidden, self.weight)
        if self.tp.world_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.vocab_size]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover - use compute_logits
        return self.compute_logits(hidden)
