"""The sampler against plain reference formulas."""

from __future__ import annotations

import torch

from tidal.worker.sample.metadata import SamplingMetadata
from tidal.worker.sample.seeded_random import position_seed
from tidal.worker.sample.sampler import (
    Sampler,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

V = 50


def meta(b: int, **kw) -> SamplingMetadata:
    temp = kw.pop("temperature", torch.ones(b))
    return SamplingMetadata(temperature=temp, all_greedy=bool((temp == 0).all()),
                            all_random=bool((temp > 0).all()), **kw)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    k = torch.tensor([1, 5, V, 17])
    out = apply_top_k_top_p(logits, k, None)
    for row in range(4):
        kept = torch.isfinite(out[row]).nonzero().flatten()
        expected = logits[row].topk(int(k[row])).indices
        assert set(kept.tolist()) == set(expected.tolist())
        assert torch.equal(out[row][kept], logits[row][kept])


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    p = torch.tensor([0.1, 0.5, 0.95])
    out = apply_top_k_top_p(logits, None, p)
    for row in range(3):
        probs = logits[row].softmax(-1)
        order = probs.argsort(descending=True)
        cum = probs[order].cumsum(0)
        # the nucleus: tokens until the mass first reaches p (inclusive)
        n = int((cum < p[row]).sum()) + 1
        assert set(torch.isfinite(out[row]).nonzero().flatten().tolist()) == set(
            order[:n].tolist())


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    min_p = torch.tensor([0.0, 0.3])
    out = apply_min_p(logits, min_p)
    assert torch.isfinite(out[0]).all()
    probs = logits[1].softmax(-1)
    keep = probs >= 0.3 * probs.max()
    assert torch.equal(torch.isfinite(out[1]), keep)


def test_penalties_match_the_reference_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, V, generator=g)
    counts = torch.zeros(2, V)
    counts[0, [3, 3, 7]] = torch.tensor([2.0, 2.0, 1.0])
    counts[1, 9] = 4.0
    prompt = torch.zeros(2, V, dtype=torch.bool)
    prompt[0, 11] = True
    m = meta(2, presence_penalty=torch.tensor([0.5, 0.0]),
             frequency_penalty=torch.tensor([0.25, 1.0]),
             repetition_penalty=torch.tensor([1.3, 1.0]), output_counts=counts,
             prompt_mask=prompt)
    out = apply_penalties(logits.clone(), m)
    ref = logits.clone()
    for row in range(2):
        rep = float(m.repetition_penalty[row])
        for tok in range(V):
            x = float(ref[row, tok])
            if counts[row, tok] > 0 or prompt[row, tok]:
                x = x / rep if x > 0 else x * rep
            x -= float(m.frequency_penalty[row]) * float(counts[row, tok])
            x -= float(m.presence_penalty[row]) * float(counts[row, tok] > 0)
            ref[row, tok] = x
    assert torch.allclose(out, ref, atol=1e-6)


def test_seeded_rows_reproduce_whatever_the_batch():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(6, V, generator=g)
    sampler = Sampler()

    def draw(rows, seed):
        # Every row seeded with ``seed`` at position 0 (keys as the metadata builder makes them).
        key = position_seed(seed, 0)
        return sampler(logits[rows], meta(len(rows), seeded_rows=torch.arange(len(rows)),
                                          seeded_keys=torch.full((len(rows),), key))).token_ids

    alone = draw([2], 99)
    batched = draw([0, 1, 2, 3], 99)
    assert int(alone[0]) == int(batched[2])
    # Rows without a key draw from the global generator; the keyed row keeps its draw.
    mixed = sampler(logits[[0, 2]], meta(2, seeded_rows=torch.tensor([1]),
                                          seeded_keys=torch.tensor([position_seed(99, 0)])))
    assert int(mixed.token_ids[1]) == int(alone[0])
    many = {int(draw([2], s)[0]) for s in range(40)}
    assert len(many) > 3, "different seeds should draw different tokens"


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler()
    hits = torch.zeros(3)
    torch.manual_seed(5)
    for _ in range(3000):
        hits[int(sampler(logits, meta(1)).token_ids[0])] += 1
    assert torch.allclose(hits / 3000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_logprobs_are_log_softmax_of_processed_logits():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, V, generator=g)
    temp = torch.tensor([0.0, 0.5, 2.0])
    bias_rows, bias_cols = torch.tensor([1, 1]), torch.tensor([4, 8])
    bias_vals = torch.tensor([3.0, -2.0])
    m = meta(3, temperature=temp, max_num_logprobs=5, bias_rows=bias_rows, bias_cols=bias_cols,
             bias_vals=bias_vals, top_k=torch.tensor([V, 3, V]))
    out = Sampler()(logits, m)
    processed = logits.clone()
    processed[1, 4] += 3.0
    processed[1, 8] -= 2.0
    processed = processed / torch.tensor([1.0, 0.5, 2.0]).unsqueeze(1)
    ref = processed.log_softmax(-1)
    lp = out.logprobs
    assert int(out.token_ids[0]) == int(logits[0].argmax())  # greedy row
    for row in range(3):
        tok = int(out.token_ids[row])
        assert int(lp.token_ids[row, 0]) == tok
        assert abs(float(lp.logprobs[row, 0]) - float(ref[row, tok])) < 1e-5
        assert int(lp.ranks[row]) == int((ref[row] > ref[row, tok]).sum()) + 1
        top = ref[row].topk(5)
        assert lp.token_ids[row, 1:].tolist() == top.indices.tolist()
        assert torch.allclose(lp.logprobs[row, 1:], top.values, atol=1e-5)
    assert int(out.token_ids[1]) in ref[1].topk(3).indices.tolist()  # top-k applied


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(2, V)
    logits[:, 5] = 10.0
    m = meta(2, temperature=torch.tensor([0.0, 1.0]), ban_rows=torch.tensor([0, 1]),
             ban_cols=torch.tensor([5, 5]))
    out = Sampler()(logits, m)
    assert 5 not in out.token_ids.tolist()
