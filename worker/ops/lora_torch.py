"""LoRA's two products over a batch that mixes adapters, in plain torch (the reference, and
what a CPU or a GPU without Triton runs).

The adapters sit in stacked slot buffers: ``a`` [L, S*R, in] (the S output slices' A matrices
one under the other, each zero-padded to rank R) and ``b`` [L, out, R] (slice s's rows of B,
scaling folded in). ``slots`` [T] gives each token's slot, -1 for the base model.

    shrink:  xa[t] = x[t] @ a[slots[t]]^T                      [T, S*R]
    expand:  y[t, slice s] += xa[t, s*R:(s+1)*R] @ b[slots[t], slice s]^T

Both loop over the L slots with masks instead of gathering a matrix per token: no shape depends
on the data (CUDA graphs capture it) and no [T, R, in] gather is ever materialised.
"""

from __future__ import annotations

import torch


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    num_slots = a.shape[0]
    out = torch.zeros(x.shape[0], a.shape[1], dtype=x.dtype, device=x.device)
    for slot in range(num_slots):
        mask = (slots == slot).unsqueeze(1).to(x.dtype)
        out.addcmul_(x @ a[slot].t(), mask)
    return out


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                offsets: tuple[int, ...], rank: int) -> None:
    """Adds in place into ``y`` [T, out]; ``offsets`` are the slices' first output columns
    (slice s spans ``offsets[s]`` up to the next offset, or the end)."""
    num_slots, out_features = b.shape[0], b.shape[1]
    ends = offsets[1:] + (out_features,)
    for slot in range(num_slots):
        mask = (slots == slot).unsqueeze(1).to(xa.dtype)
        xm = xa * mask
        for s, (start, end) in enumerate(zip(offsets, ends)):
            y[:, start:end] += (xm[:, s * rank:(s + 1) * rank] @ b[slot, start:end].t()).to(
                y.dtype)
