"""worker/sample/grammar_mask.py: the bitmask unpack-and-fill against a plain torch reference,
the placement of the EngineCore's rows on the sampling rows, and the sampler with a mask."""

from __future__ import annotations

import numpy as np
import torch

from tidal.worker.sample.grammar_mask import apply_token_bitmask, bitmask_rows
from tidal.worker.sample.metadata import SamplingMetadata
from tidal.worker.sample.sampler import Sampler


def reference_mask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            word = int(bitmask[r, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def test_apply_token_bitmask_matches_bit_by_bit():
    gen = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(1 << 31), 1 << 31, size=(5, 3), dtype=np.int64).astype(np.int32)
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 12  # only token 76
    got = apply_token_bitmask(logits, torch.from_numpy(bitmask))
    assert torch.equal(got, reference_mask(logits, bitmask))
    assert torch.equal(got[0], logits[0])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [76]


def test_bitmask_rows_places_each_grammar_on_its_sampling_row():
    words = 2
    bm = np.arange(3 * words, dtype=np.int32).reshape(3, words)
    rows = bitmask_rows(["c", "a", "gone"], bm, ["a", "b", "c"])
    assert rows is not None
    assert rows.tolist() == [bm[1].tolist(), [-1, -1], bm[0].tolist()]
    assert bitmask_rows(["gone"], bm[:1], ["a"]) is None
    same = bitmask_rows(["a", "b"], bm[:2], ["a", "b"])
    assert same is not None and same.tolist() == bm[:2].tolist()


def test_sampler_respects_the_mask_greedy_and_random():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 64, generator=gen)
    bitmask = np.full((4, 2), -1, dtype=np.int32)
    bitmask[1] = [0, 1 << 5]  # only token 37
    bitmask[3] = [0b1010, 0]  # tokens 1 and 3
    sampler = Sampler()
    for temp in (0.0, 1.0):
        meta = SamplingMetadata(temperature=torch.full((4,), temp), all_greedy=temp == 0.0,
                                all_random=temp > 0, grammar_bitmask=torch.from_numpy(bitmask))
        for _ in range(5):
            out = sampler(logits, meta).token_ids.tolist()
            assert out[1] == 37 and out[3] in (1, 3)
            if temp == 0.0:  # unmasked rows: the plain argmax
                assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
