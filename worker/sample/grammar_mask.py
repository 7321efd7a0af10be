"""Structured outputs on the device: the step's grammar bitmasks (packed by the EngineCore, one
bit per vocabulary id) placed on the sampling rows, copied once, and applied to the logits."""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF = float("-inf")


def bitmask_rows(grammar_req_ids: list[str], bitmask: np.ndarray,
                 sampled_ids: list[str]) -> np.ndarray | None:
    """int32 [len(sampled_ids), words]: each sampling row's mask, all ones (everything
    allowed) for rows without a grammar. None when no sampling row has one."""
    where = {rid: i for i, rid in enumerate(sampled_ids)}
    src, dst = [], []
    for i, rid in enumerate(grammar_req_ids):
        j = where.get(rid)
        if j is not None:
            src.append(i)
            dst.append(j)
    if not src:
        return None
    if len(src) == len(sampled_ids) and src == dst and bitmask.flags.writeable:
        return np.ascontiguousarray(bitmask)
    out = np.full((len(sampled_ids), bitmask.shape[1]), -1, dtype=np.int32)
    out[dst] = bitmask[src]
    return out


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token whose bit is clear: one unpack and one fill for the batch.
    ``bitmask``: int32 [B, words] on the logits' device, words * 32 >= vocabulary."""
    rows, vocab = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, -1)[:, :vocab]
    return logits.masked_fill(allowed == 0, _NEG_INF)
