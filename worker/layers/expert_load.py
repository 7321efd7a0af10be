"""How many tokens each expert of a mixture-of-experts model is routed, for ``/metrics``.

Every MoE layer adds its step's routing to one device counter per (layer, expert), only for
rows that are real tokens, so the padding rows of a replayed CUDA graph (whose router picks
experts from garbage) count nothing: on a GPU inside the Triton routing kernel (atomic adds,
no launch of its own), elsewhere one ``index_add_`` of the top-k ids weighted by a row mask.
The real-token count is a device scalar the runner writes with each step's metadata
(``StepBuffers.num_tokens``): it sits at a fixed address, which is what a captured graph reads.
With expert parallelism across engines every engine routes every engine's gathered tokens and
counts only its own rows among them (so the sum over engines stays the number of routings, and
each engine's count leaves with its own steps).

Each step that samples, the runner folds the counter over the layers and hands the sums to
the host with the step's sampled tokens (``snapshot``: a sum and a zero on the device, the
copy on the side stream the tokens take, read once the step's existing wait returns them), so
counting costs no host synchronisation. The engine adds them to ``SchedulerStats`` and the
frontend to ``tidal:moe_expert_load_tokens`` (per expert) and, with expert parallelism,
``tidal:moe_ep_rank_load_tokens`` (per EP rank's contiguous range of experts).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tidal.worker.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CountInto:
    """Where one MoE layer's routing is counted: its row of the counter, and the real token
    count (None: every row is a token). ``select_experts`` takes it: the Triton routing
    kernel counts in the same launch; other paths call ``add``."""

    counts: torch.Tensor  # int32 [E]
    valid: torch.Tensor | None
    rows: torch.Tensor  # int32 0..max_rows-1, to tell rows past ``valid``

    def add(self, ids: torch.Tensor, start: int = 0) -> None:
        """Count the routing ``ids [T, k]`` (global expert ids) of the step's rows ``start``
        to ``start + T``."""
        t, k = ids.shape
        if t == 0:
            return
        if self.valid is None:
            weight = torch.ones(t * k, dtype=torch.int32, device=ids.device)
        else:
            real = self.rows[start:start + t] < self.valid
            weight = real.to(torch.int32).unsqueeze(1).expand(t, k).reshape(-1)
            # A padding row's router read garbage (a NaN row's ids are out of range): count
            # it, with weight 0, at expert 0.
            ids = torch.where(real.unsqueeze(1), ids, 0)
        self.counts.index_add_(0, ids.reshape(-1), weight)


class ExpertLoad:
    """The routing counter of one model's ``layers`` (its MoE layers in forward order).
    ``valid``: a one-element int32 device tensor holding the step's real token count (rows
    beyond it are padding), None to count every row."""

    def __init__(self, layers: Sequence[FusedMoE], valid: torch.Tensor | None,
                 max_rows: int, device: torch.device) -> None:
        num_experts = layers[0].num_experts
        if any(moe.num_experts != num_experts for moe in layers):
            raise ValueError("expert load: the MoE layers differ in their expert counts")
        self.num_experts = num_experts
        # (int32: the Triton kernel's atomics; a snapshot sums into int64 every step.)
        self.counts = torch.zeros(len(layers), num_experts, dtype=torch.int32, device=device)
        rows = torch.arange(max_rows, dtype=torch.int32, device=device)
        self._into = [CountInto(self.counts[i], valid, rows) for i in range(len(layers))]
        for index, moe in enumerate(layers):
            moe.expert_load, moe.expert_load_index = self, index

    def into(self, layer: int) -> CountInto:
        """Layer ``layer``'s ``CountInto``."""
        return self._into[layer]

    def snapshot(self) -> torch.Tensor:
        """Each expert's routings since the last snapshot, summed over the layers, as a device
        int64 tensor ``[E]``; the counter starts again from zero (both in stream order, so a
        step launched after this counts into the next snapshot)."""
        total = self.counts.sum(0, dtype=torch.int64)
        self.counts.zero_()
        return total

    def reset(self) -> None:
        """Forget what start-up's profile, capture and warm-up forwards routed."""
        self.counts.zero_()


def attach(model: torch.nn.Module, valid: torch.Tensor | None, max_rows: int,
           device: torch.device) -> ExpertLoad | None:
    """An ``ExpertLoad`` over ``model``'s MoE layers (None: it has none, or they differ in
    their expert counts: a metric never stops a model from serving)."""
    from tidal.worker.layers.fused_moe import FusedMoE

    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return None
    try:
        load = ExpertLoad(layers, valid, max_rows, device)
    except ValueError as exc:
        logger.warning("expert load: not counted for /metrics: %s", exc)
        return None
    logger.info("expert load: counting the routing of %d MoE layers x %d experts for /metrics",
                len(layers), load.num_experts)
    return load
