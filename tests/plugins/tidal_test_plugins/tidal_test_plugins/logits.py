"""A logits processor: the token ``$TIDAL_TEST_BANNED_ID`` (default 7) is never sampled in the
rows of the requests that name it."""

from __future__ import annotations

import os

import torch

from tidal.worker.sample.logits_processors import BatchState


class BanToken:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.token = int(os.environ.get("TIDAL_TEST_BANNED_ID", "7"))
        assert 0 <= self.token < vocab_size

    def apply(self, logits: torch.Tensor, state: BatchState) -> torch.Tensor:
        logits[state.rows, self.token] = float("-inf")
        return logits
