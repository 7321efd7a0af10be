"""worker/sample/seeded_random.py: the position keys against the scalar function, the noise's
distribution and independence from the batch, and the Triton kernel against the torch twin on a
GPU (the sampler's use of them: tests/worker/test_sampler.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.worker.sample import seeded_random as sr


def test_position_keys_match_the_scalar_function():
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 1 << 62, size=200, dtype=np.int64)
    seeds[:3] = [0, 1, (1 << 63) - 1]
    positions = rng.integers(0, 1 << 20, size=200, dtype=np.int64)
    keys = sr.position_keys(seeds, positions)
    assert keys.tolist() == [sr.position_seed(int(s), int(p)) for s, p in zip(seeds, positions)]
    assert (keys > 0).all()


def test_noise_is_exponential_and_keyed():
    keys = torch.tensor([3, 4, 3], dtype=torch.int64)
    q = sr.seeded_exponential(keys, 50_000)
    assert torch.equal(q[0], q[2]) and not torch.equal(q[0], q[1])
    assert (q > 0).all() and torch.isfinite(q).all()
    # The extreme hashes stay strictly inside (0, 1): no zero noise (0 / 0 would draw a banned
    # token), no infinite one.
    edge = sr.uniform_from_hash(torch.tensor([0, 0xFFFFFFFF]))
    assert 0 < edge[0] and edge[1] < 1 and (-torch.log(edge) > 0).all()
    # Exp(1): mean 1, variance 1, P(q > 1) = 1/e (loose bounds over 100k draws).
    flat = q[:2].flatten().double()
    assert abs(flat.mean().item() - 1) < 0.02 and abs(flat.var().item() - 1) < 0.05
    assert abs((flat > 1).double().mean().item() - np.exp(-1)) < 0.01
    # Neighbouring columns and keys are uncorrelated.
    a, b = q[0, :-1].double(), q[0, 1:].double()
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02
    assert abs(torch.corrcoef(q[:2].double())[0, 1].item()) < 0.02


def test_seeded_exponential_writes_only_its_rows():
    q = torch.zeros(4, 40)
    sr.seeded_exponential_(q, torch.tensor([2, 0]), torch.tensor([11, 12]))
    want = sr.seeded_exponential(torch.tensor([11, 12]), 40)
    assert torch.equal(q[2], want[0]) and torch.equal(q[0], want[1])
    assert not q[1].any() and not q[3].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton noise kernel needs a GPU")
def test_triton_noise_matches_torch():
    from tidal.worker.ops import triton_sampling

    keys = torch.tensor([1, 2, (1 << 62) + 12345, 987654321], dtype=torch.int64)
    n = 151_936
    want = sr.seeded_exponential(keys, n)
    q = torch.zeros(6, n, device="cuda")
    rows = torch.tensor([5, 0, 3, 2], device="cuda")
    triton_sampling.seeded_exponential_(q, rows, keys.cuda())
    got = q[rows].cpu()
    # The same 23-bit uniforms; only the log may differ in its last bit.
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    assert not q[1].any() and not q[4].any()


def test_host_hash_matches_the_torch_twin():
    """The CPU path hashes in numpy uint32: the same bits as the int64 torch emulation (which
    the Triton kernel is checked against), so the same noise on every device."""
    rng = np.random.default_rng(1)
    keys = torch.from_numpy(rng.integers(1, (1 << 63) - 1, size=40, dtype=np.int64))
    keys[:2] = torch.tensor([1, (1 << 63) - 1])
    a, b = sr.row_states(keys)
    cols = torch.arange(5000)
    want = sr.column_hash(a, b, cols)
    got = sr.column_hash_np(a.numpy(), b.numpy(), cols.numpy())
    assert np.array_equal(got.astype(np.int64), want.numpy())
    u_want = sr.uniform_from_hash(want)
    q = sr.seeded_exponential(keys, 5000)
    assert torch.equal(q, -torch.log(u_want))
