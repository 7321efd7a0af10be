"""Per-step sampling inputs, one row per request that samples this step, already on the device."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # int64 [B]; vocab size = disabled
    top_p: torch.Tensor | None = None  # float32 [B]; 1 = disabled
    min_p: torch.Tensor | None = None  # float32 [B]; 0 = disabled
    # row -> generator seeded for this very position (seeded requests only)
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    # Penalties: None when no row uses them.
    presence_penalty: torch.Tensor | None = None  # float32 [B]
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # float32 [B, V]: times each token was generated
    prompt_mask: torch.Tensor | None = None  # bool [B, V]: token occurs in the prompt
    # Sparse additions / masks as (row, token) index pairs.
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None  # min_tokens: stop tokens banned until reached
    ban_cols: torch.Tensor | None = None
