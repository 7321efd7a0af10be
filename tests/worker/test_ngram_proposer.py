"""Prompt-lookup drafts (worker/spec_decode/ngram_proposer.py) against a naive reference."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.worker.spec_decode.ngram_proposer import NgramProposer


def naive(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Longest n first; among its earlier occurrences the latest; the k tokens after it."""
    length = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for i in range(length - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_examples():
    p = NgramProposer(3, 1, 3)
    assert p.propose_one(np.array([1, 2, 3, 4, 1, 2], dtype=np.int32)).tolist() == [3, 4, 1]
    # The longest match wins over a later, shorter one.
    assert p.propose_one(np.array([7, 8, 9, 5, 6, 8, 9, 0, 7, 8, 9],
                                  dtype=np.int32)).tolist() == [5, 6, 8]
    assert p.propose_one(np.array([1, 2, 3], dtype=np.int32)).tolist() == []
    assert NgramProposer(3, 2, 3).propose_one(
        np.array([1, 2, 9, 5, 2], dtype=np.int32)).tolist() == []


@pytest.mark.parametrize("n_min,n_max,k", [(1, 1, 4), (1, 3, 2), (2, 5, 5), (3, 3, 8)])
def test_matches_naive_reference(n_min, n_max, k):
    rng = np.random.default_rng(n_min * 100 + n_max * 10 + k)
    p = NgramProposer(k, n_min, n_max)
    for _ in range(300):
        length = int(rng.integers(1, 60))
        vocab = int(rng.integers(2, 8))
        tokens = rng.integers(0, vocab, size=length).astype(np.int32)
        assert p.propose_one(tokens).tolist() == naive(tokens.tolist(), k, n_min, n_max)


def test_batch_rows_lengths_and_limits():
    p = NgramProposer(4, 1, 2)
    batch = np.zeros((3, 16), dtype=np.int32)
    batch[0, :6] = [5, 6, 7, 8, 5, 6]
    batch[2, :5] = [1, 2, 1, 2, 1]
    got = p.propose(batch, np.array([2, 0]), np.array([5, 6]), np.array([4, 1]))
    assert got == [naive([1, 2, 1, 2, 1], 4, 1, 2), [7]]
    assert p.propose(batch, np.array([0]), np.array([6]), np.array([0])) == [[]]


class _Batch:
    """What the device proposer reads of an ``InputBatch``: token rows and generations."""

    def __init__(self, rows: int, width: int) -> None:
        self.token_ids = np.zeros((rows, width), dtype=np.int32)
        self.generation = np.zeros(rows, dtype=np.int64)


@pytest.mark.parametrize("n_min,n_max,k", [(1, 1, 4), (1, 3, 2), (2, 5, 5), (3, 3, 8)])
def test_device_lookup_equals_the_host_one(n_min, n_max, k, monkeypatch):
    """The batched device lookup (worker/spec_decode/ngram_device.py, torch ops: run here on
    the CPU) proposes what the host one does, row by row, while rows grow by a few tokens per
    round (only the new ones are copied over), are reused by other requests, and have limits."""
    import torch

    from tidal.worker.spec_decode import ngram_device
    from tidal.worker.spec_decode.ngram_device import NgramDeviceProposer

    if k == 8:  # (lookups in chunks of rows: two rows of 96 positions at a time)
        monkeypatch.setattr(ngram_device, "LOOKUP_ELEMENTS", 2 * 96)
    rng = np.random.default_rng(7 + n_min + 10 * n_max + 100 * k)
    rows_total, width = 6, 96
    host = NgramProposer(k, n_min, n_max)
    dev = NgramDeviceProposer(k, n_min, n_max, rows_total, width, torch.device("cpu"))
    b = _Batch(rows_total, width)
    vocab = rng.integers(2, 6, size=rows_total)
    lengths = np.zeros(rows_total, dtype=np.int64)
    for _ in range(25):
        for r in range(rows_total):
            if lengths[r] > width - 12 or rng.random() < 0.05:  # another request takes the row
                b.generation[r] += 1
                lengths[r] = 0
            grow = int(rng.integers(1, 6)) if lengths[r] else int(rng.integers(1, 40))
            b.token_ids[r, lengths[r]:lengths[r] + grow] = rng.integers(0, vocab[r], size=grow)
            lengths[r] += grow
            b.token_ids[r, lengths[r]:lengths[r] + k] = -1  # (drafts past the tokens: unread)
        rows = rng.permutation(rows_total)[:int(rng.integers(1, rows_total + 1))]
        limits = rng.integers(0, k + 2, size=len(rows))
        want = host.propose(b.token_ids, rows, lengths[rows], limits)
        assert dev.propose(b, rows, lengths[rows], limits).lists() == want
        # Left on the device (async scheduling), the same drafts reach the host.
        assert dev.propose(b, rows, lengths[rows], limits, defer=True).lists() == want
