"""Rejection sampling of draft tokens (worker/sample/rejection_sampler.py) against plain torch
references: greedy exactness, the emitted tokens' distribution equal to the target's (a
statistical test over many independent rows on a tiny vocabulary), seeds, synthetic rates."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.worker.sample.metadata import SamplingMetadata, position_seed
from tidal.worker.sample.rejection_sampler import RejectionSampler, verify_layout


def _run(sampler, logits, meta, drafts):
    lay = verify_layout(drafts)
    out = sampler(logits, meta, torch.from_numpy(lay.index), torch.from_numpy(lay.draft_ids),
                  torch.from_numpy(lay.num_drafts))
    tokens, counts = out.token_ids.numpy(), out.num_emitted.numpy()
    return [tokens[i, :counts[i]].tolist() for i in range(len(drafts))], tokens, counts


def test_verify_layout_mixed_draft_counts():
    lay = verify_layout([[], [5, 6], [7]])
    assert lay.num_rows == 1 + 3 + 2
    assert lay.num_drafts.tolist() == [0, 2, 1]
    # Request 0 is row 0; request 1 rows 1..3; request 2 rows 4..5 (clamped past its drafts).
    assert lay.index.tolist() == [[0, 0, 0], [1, 2, 3], [4, 5, 5]]
    assert lay.draft_ids.tolist() == [[0, 0, 0], [5, 6, 0], [7, 0, 0]]


def test_greedy_matches_a_naive_loop():
    gen = torch.Generator().manual_seed(0)
    vocab = 11
    drafts = [[], [3, 4, 5], [1], [2, 2], [0, 1, 2, 3]]
    lay = verify_layout(drafts)
    logits = torch.randn(lay.num_rows, vocab, generator=gen)
    # Make some drafts the argmax so runs of acceptances happen.
    row = 0
    for d in drafts:
        for j, t in enumerate(d[:2]):
            logits[row + j, t] += 10.0
        row += len(d) + 1
    meta = SamplingMetadata(temperature=torch.zeros(lay.num_rows), all_greedy=True,
                            all_random=False)
    got, _, _ = _run(RejectionSampler(), logits, meta, drafts)
    row = 0
    for d, emitted in zip(drafts, got):
        want = []
        for j in range(len(d) + 1):
            top = int(logits[row + j].argmax())
            want.append(top)
            if j == len(d) or top != d[j]:
                break
        assert emitted == want
        row += len(d) + 1


def test_argmax_is_the_one_given() -> None:
    """The sampler takes the worker's row argmax (``Kernels.argmax``: a Triton kernel for few
    rows on a GPU) for every greedy decision: acceptances and the token after them."""
    gen = torch.Generator().manual_seed(1)
    drafts = [[2, 3], [4]]
    lay = verify_layout(drafts)
    logits = torch.randn(lay.num_rows, 7, generator=gen)
    meta = SamplingMetadata(temperature=torch.zeros(lay.num_rows), all_greedy=True,
                            all_random=False)
    calls = []

    def last_index(x):  # an "argmax" that always answers 5: drafts rejected, 5 emitted
        calls.append(tuple(x.shape))
        return torch.full((x.shape[0],), 5, dtype=torch.int64)

    got, _, _ = _run(RejectionSampler(argmax=last_index), logits, meta, drafts)
    assert calls == [(lay.num_rows, 7)]
    assert got == [[5], [5]]
    assert RejectionSampler().argmax(logits).tolist() == logits.argmax(dim=-1).tolist()


def _reference_probs(logits, temp, top_k=None, top_p=None):
    """Plain torch: temperature, then top-k and top-p truncation, then softmax."""
    z = logits / temp
    if top_k is not None:
        kth = z.topk(top_k).values[-1]
        z = torch.where(z < kth, torch.tensor(float("-inf")), z)
    p = z.softmax(-1)
    if top_p is not None:
        order = p.argsort(descending=True)
        cum = p[order].cumsum(0)
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order[(cum - p[order]) < top_p]] = True
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    return p


def _tv(counts: np.ndarray, probs: torch.Tensor) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - probs.numpy()).sum())


@pytest.mark.parametrize("case", ["accept", "reject", "truncated"])
def test_sampled_tokens_follow_the_target_distribution(case):
    """Many independent requests with the same logits and drafts: the first emitted token is
    distributed as the target's p at position 0 (whatever the draft), and the token after an
    accepted first draft as p at position 1."""
    torch.manual_seed(1234)
    vocab, n = 6, 40000
    pos_logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(7)) * 1.5
    temp = 0.8
    top_k = top_p = None
    if case == "truncated":
        top_k, top_p = 4, 0.85
    ref = [_reference_probs(pos_logits[j], temp, top_k, top_p) for j in range(3)]
    # accept: the drafts are the most likely tokens; reject: the first draft a less likely
    # one (rejected most of the time), the second the least likely one still possible.
    order0, order1 = ref[0].argsort(descending=True), ref[1].argsort(descending=True)
    if case == "reject":
        d0 = int(order0[1])
        d1 = int(order1[(ref[1][order1] > 0).sum() - 1])
    else:
        d0, d1 = int(order0[0]), int(order1[0])
    drafts = [[d0, d1]] * n
    logits = pos_logits.repeat(n, 1)
    rows = logits.shape[0]
    meta = SamplingMetadata(
        temperature=torch.full((rows,), temp), all_greedy=False, all_random=True,
        top_k=None if top_k is None else torch.full((rows,), top_k, dtype=torch.int64),
        top_p=None if top_p is None else torch.full((rows,), top_p))
    got, tokens, counts = _run(RejectionSampler(), logits, meta, drafts)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    assert _tv(first, ref[0]) < 0.015, (first, ref[0])
    second = tokens[(tokens[:, 0] == d0) & (counts >= 2), 1]
    assert len(second) > 2000
    assert _tv(np.bincount(second, minlength=vocab), ref[1]) < 0.03
    # The acceptance rate of the first draft is its target probability.
    assert abs(float((tokens[:, 0] == d0).mean()) - float(ref[0][d0])) < 0.015
    # Nothing outside the truncated support is ever emitted.
    for j in range(2):
        col = tokens[counts > j, j]
        assert (ref[j][torch.from_numpy(col)] > 0).all()


def test_greedy_and_sampled_rows_mix():
    vocab = 9
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(3))
    drafts = [[int(logits[0].argmax()), int(logits[1].argmax())], [4, 4]]
    temp = torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0])
    meta = SamplingMetadata(temperature=temp, all_greedy=False, all_random=False)
    got, _, _ = _run(RejectionSampler(), logits, meta, drafts)
    assert got[0] == [drafts[0][0], drafts[0][1], int(logits[2].argmax())]
    assert 1 <= len(got[1]) <= 3


def _seeded_meta(rows, seeds, offsets):
    gens = {}
    for i, (s, o) in enumerate(zip(seeds, offsets)):
        gens[i] = torch.Generator().manual_seed(position_seed(s, o))
    return SamplingMetadata(temperature=torch.full((rows,), 1.0), all_greedy=False,
                            all_random=True, generators=gens)


def test_seeded_rows_are_deterministic():
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 0.3
    drafts = [[1, 2, 3]]
    outs = []
    for _ in range(3):
        torch.manual_seed(torch.seed() % 1000)  # the global generator is irrelevant
        meta = _seeded_meta(4, [42] * 4, [10, 11, 12, 13])
        outs.append(_run(RejectionSampler(), logits, meta, drafts)[0])
    assert outs[0] == outs[1] == outs[2]
    others = {tuple(_run(RejectionSampler(), logits, _seeded_meta(4, [s] * 4, [10, 11, 12, 13]),
                         drafts)[0][0]) for s in range(20)}
    assert len(others) > 1


def test_synthetic_acceptance_rate():
    torch.manual_seed(0)
    vocab, n, k, alpha = 7, 20000, 4, 0.6
    logits = torch.randn(n * (k + 1), vocab)
    drafts = [[1, 2, 3, 4]] * n
    meta = SamplingMetadata(temperature=torch.zeros(n * (k + 1)), all_greedy=True,
                            all_random=False)
    got, tokens, counts = _run(RejectionSampler((alpha,) * k), logits, meta, drafts)
    accepted = counts - 1
    for j in range(k):
        reached = accepted >= j
        rate = float((accepted[reached] >= j + 1).mean())
        assert abs(rate - alpha) < 0.02, (j, rate)
    # Synthetic mode emits the drafts themselves.
    for row, c in zip(tokens[:200], counts[:200]):
        assert row[:c - 1].tolist() == [1, 2, 3, 4][:c - 1]


def test_sampled_drafter_keeps_the_target_distribution():
    """A drafter that samples its drafts from q (a draft model): the emitted token follows p."""
    torch.manual_seed(99)
    vocab, n, temp = 5, 40000, 1.0
    target = torch.randn(2, vocab, generator=torch.Generator().manual_seed(11))
    q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(12)), -1)
    p0 = _reference_probs(target[0], temp)
    d0 = torch.multinomial(q, n, replacement=True, generator=torch.Generator().manual_seed(13))
    drafts = [[int(t)] for t in d0]
    logits = target.repeat(n, 1)
    meta = SamplingMetadata(temperature=torch.full((2 * n,), temp), all_greedy=False,
                            all_random=True)
    lay = verify_layout(drafts)
    out = RejectionSampler()(logits, meta, torch.from_numpy(lay.index),
                             torch.from_numpy(lay.draft_ids), torch.from_numpy(lay.num_drafts),
                             draft_probs=q.expand(n, 1, vocab).contiguous())
    first = np.bincount(out.token_ids[:, 0].numpy(), minlength=vocab)
    assert _tv(first, p0) < 0.015, (first / n, p0)
    # Accepted with probability min(1, p/q) overall: sum over d of q(d) min(1, p(d)/q(d)).
    accepted = float((out.num_emitted == 2).float().mean())
    assert abs(accepted - float(torch.minimum(p0, q).sum())) < 0.015


def _bitmask(rows: list[set[int]], vocab: int) -> torch.Tensor:
    words = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.uint32)
    for i, allowed in enumerate(rows):
        for t in allowed:
            words[i, t >> 5] |= np.uint32(1 << (t & 31))
    return torch.from_numpy(words.view(np.int32))


@pytest.mark.parametrize("method", ["greedy", "sampled", "synthetic"])
def test_grammar_masks_hold_at_every_verify_position(method):
    """One mask per verify position: whatever the logits (the top token always banned) and
    whichever drafts are taken, every emitted token is one its position's mask allows, also
    when synthetic acceptance rejects a draft that is the only token allowed."""
    vocab, k = 40, 3
    g = torch.Generator().manual_seed(0)
    drafts = [[5, 6, 7], [9], []]
    lay = verify_layout(drafts)
    logits = torch.randn(lay.num_rows, vocab, generator=g)
    # Request 0: position 0 allows {5, 1, 2}, 1 only {6}, 2 {7, 3}, 3 {8, 4}; request 1:
    # {9, 10} then {11}; request 2: {12, 13}. Each row's own argmax is banned.
    allowed = [{5, 1, 2}, {6}, {7, 3}, {8, 4}, {9, 10}, {11}, {12, 13}]
    drafted = {0: 5, 1: 6, 2: 7, 4: 9}  # (the engine only verifies drafts the mask allows)
    for row, a in enumerate(allowed):
        top = int(logits[row].argmax())
        if top != drafted.get(row) and len(a) > 1:
            allowed[row] = a - {top}
    greedy = method == "greedy"
    sampler = RejectionSampler((0.5,) * k if method == "synthetic" else None)
    for trial in range(40):
        meta = SamplingMetadata(
            temperature=torch.full((lay.num_rows,), 0.0 if greedy else 1.0),
            all_greedy=greedy, all_random=not greedy,
            grammar_bitmask=_bitmask(allowed, vocab))
        got, _, _ = _run(sampler, logits.clone(), meta, drafts)
        row = 0
        for d, emitted in zip(drafts, got):
            for j, t in enumerate(emitted):
                assert t in allowed[row + j], (method, trial, d, emitted)
                if j < len(emitted) - 1:
                    assert t == d[j]
            row += len(d) + 1
