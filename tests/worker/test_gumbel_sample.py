"""worker/sample/gumbel_sample.py: the one-pass draw against the sampler's exponential race
(argmax of softmax(x / T) / q on the same noise), its distribution, the grammar masks and the
greedy rows; on a GPU the Triton kernel against the torch reference, and the sampler taking it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.worker.sample import grammar_mask, seeded_random
from tidal.worker.sample.gumbel_sample import gumbel_sample, mask_rows, row_keys
from tidal.worker.sample.metadata import SamplingMetadata
from tidal.worker.sample.sampler import Sampler

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="the Triton sampling kernel needs a GPU")


def _bitmask(rows: int, vocab: int, seed: int, keep: float = 0.3) -> torch.Tensor:
    """int32 [rows, words]: random allowed sets (each row keeps at least one token)."""
    gen = np.random.default_rng(seed)
    allowed = gen.random((rows, vocab)) < keep
    allowed[np.arange(rows), gen.integers(0, vocab, rows)] = True
    words = (vocab + 31) // 32
    bits = np.zeros((rows, words * 32), dtype=bool)
    bits[:, :vocab] = allowed
    packed = np.packbits(bits.reshape(rows, words, 32)[:, :, ::-1], axis=2)
    return torch.from_numpy(packed.view(">u4").astype(np.uint32).view(np.int32)
                            .reshape(rows, words).copy())


def test_bitmask_helper_packs_bit_t_of_word_w_as_token_32w_plus_t():
    mask = _bitmask(3, 70, seed=0)
    allowed = grammar_mask.unpack_allowed(mask, 70)
    x = torch.zeros(3, 70)
    grammar_mask.apply_token_bitmask_(x, mask, None)
    assert torch.equal(allowed, x == 0)


def test_equals_the_exponential_race_on_the_same_noise():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 3000, generator=gen) * 3
    temp = torch.rand(64, generator=gen) * 1.5 + 0.1
    keys = torch.randint(1, 1 << 62, (64,), generator=gen)
    before = logits.clone()
    got = gumbel_sample(logits, temp, keys)
    q = seeded_random.seeded_exponential(keys, 3000)
    want = ((logits / temp.unsqueeze(1)).softmax(dim=-1) / q).argmax(dim=-1)
    assert torch.equal(got, want)
    assert torch.equal(logits, before)  # the caller's logits are left alone


def test_greedy_rows_masks_and_mask_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 500, generator=gen).to(torch.bfloat16)
    temp = torch.tensor([0.0, 1.0, 0.7, 0.0, 1.3, 1.0])
    keys = torch.arange(1, 7)
    mask = _bitmask(3, 500, seed=1, keep=0.05)
    rows = torch.tensor([4, 0, 3])  # mask row g applies to logits row rows[g]
    assert mask_rows(6, 3, rows, torch.device("cpu")).tolist() == [1, -1, -1, 2, 0, -1]
    assert mask_rows(6, 2, None, torch.device("cpu")).tolist() == [0, 1, -1, -1, -1, -1]
    for _ in range(3):
        got = gumbel_sample(logits, temp, keys, mask, rows)
        allowed = grammar_mask.unpack_allowed(mask, 500)
        for g, r in enumerate(rows.tolist()):
            assert allowed[g, got[r]]
        masked = logits.float().clone()
        grammar_mask.apply_token_bitmask_(masked, mask, rows)
        # Temperature 0: the plain argmax, of the masked row where it has a mask.
        assert got[0] == masked[0].argmax() and got[3] == masked[3].argmax()
        keys = keys + 100


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    temp = torch.tensor([0.8])
    probs = (logits / 0.8).softmax(dim=-1)[0]
    draws = 20_000
    batch = logits.expand(draws, 5).contiguous()
    keys = torch.randint(1, 1 << 62, (draws,), generator=torch.Generator().manual_seed(3))
    tokens = gumbel_sample(batch, temp.expand(draws).contiguous(), keys)
    counts = torch.bincount(tokens, minlength=5)
    freq = counts / draws
    assert counts[4] == 0
    assert torch.allclose(freq, probs, atol=0.015), (freq, probs)


def test_row_keys_keep_the_seeded_rows_keys():
    rows = torch.tensor([3, 1])
    keys = row_keys(5, rows, torch.tensor([111, 222]), torch.device("cpu"))
    assert keys[3] == 111 and keys[1] == 222 and (keys > 0).all()
    assert not torch.equal(row_keys(5, None, None, torch.device("cpu")),
                           row_keys(5, None, None, torch.device("cpu")))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_matches_the_reference(dtype):
    from tidal.worker.ops import triton_sampling

    gen = torch.Generator().manual_seed(4)
    b, v = 37, 151_936
    logits = (torch.randn(b, v, generator=gen) * 4).to(dtype)
    temp = torch.rand(b, generator=gen) + 0.2
    temp[[0, 9]] = 0.0
    keys = torch.randint(1, 1 << 62, (b,), generator=gen)
    mask = _bitmask(5, v, seed=4, keep=0.01)
    cases = [(None, None), (mask, None), (mask, torch.tensor([36, 2, 9, 11, 0]))]
    for bm, rows in cases:
        want = gumbel_sample(logits, temp, keys, bm, rows)
        cuda = [None if t is None else t.cuda() for t in (bm, rows)]
        got = triton_sampling.gumbel_sample(logits.cuda(), temp.cuda(), keys.cuda(), *cuda)
        # The same hash and formula; a log's last bit may differ, which could only flip a
        # row whose two best scores are a rounding apart.
        assert (got.cpu() == want).float().mean() >= 35 / 37, (got.cpu(), want)


@needs_gpu
def test_sampler_draws_seeded_rows_by_their_keys_on_the_gpu():
    gen = torch.Generator().manual_seed(5)
    b, v = 8, 4096
    logits = torch.randn(b, v, generator=gen).cuda()
    temp = torch.full((b,), 0.9).cuda()
    seeded = torch.tensor([1, 6]).cuda()
    keys = torch.tensor([seeded_random.position_seed(7, 3), seeded_random.position_seed(8, 0)])
    mask = _bitmask(b, v, seed=5, keep=0.02).cuda()
    meta = SamplingMetadata(temperature=temp, all_greedy=False, all_random=True,
                            seeded_rows=seeded, seeded_keys=keys.cuda(), grammar_bitmask=mask)
    from tidal.worker.kernel_policy import kernels_for

    out = Sampler(kernels_for(torch.device("cuda")))(logits.clone(), meta).token_ids.cpu()
    allowed = grammar_mask.unpack_allowed(mask.cpu(), v)
    assert all(allowed[r, out[r]] for r in range(b))
    want = gumbel_sample(logits.cpu(), temp.cpu(), torch.tensor([0, keys[0], 0, 0, 0, 0,
                                                                  keys[1], 0]), mask.cpu())
    assert out[1] == want[1] and out[6] == want[6]
