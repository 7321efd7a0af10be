"""worker/sample/grammar_mask.py: the in-place bitmask fill against a bit-by-bit reference (and
the Triton kernel against it on a GPU), the placement of the EngineCore's rows on the sampling
rows, the pinned staging, and the sampler with a mask."""

from __future__ import annotations

import numpy as np
import torch

import pytest

from tidal.worker.sample.grammar_mask import MaskStaging, apply_token_bitmask_, grammar_rows
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


def _random_masks(rows: int, words: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-(1 << 31), 1 << 31, size=(rows, words), dtype=np.int64).astype(np.int32)


def test_apply_token_bitmask_matches_bit_by_bit():
    gen = torch.Generator().manual_seed(0)
    vocab = 77  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = _random_masks(5, 3)
    bitmask[0] = -1  # everything allowed
    bitmask[1] = 0
    bitmask[1, 2] = 1 << 12  # only token 76
    got = logits.clone()
    apply_token_bitmask_(got, torch.from_numpy(bitmask))
    assert torch.equal(got, reference_mask(logits, bitmask))
    assert torch.equal(got[0], logits[0])
    assert torch.isfinite(got[1]).nonzero().flatten().tolist() == [76]


def test_apply_token_bitmask_on_chosen_rows_leaves_the_others():
    logits = torch.randn(6, 70, generator=torch.Generator().manual_seed(1))
    bitmask = _random_masks(2, 3, seed=1)
    got = logits.clone()
    apply_token_bitmask_(got, torch.from_numpy(bitmask), torch.tensor([4, 1]))
    want = logits.clone()
    want[[4, 1]] = reference_mask(logits[[4, 1]], bitmask)
    assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton mask kernel needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_bitmask_kernel_matches_torch(dtype):
    from tidal.worker.ops import triton_sampling

    vocab = 151_936 + 5
    words = (vocab + 31) // 32
    logits = torch.randn(9, vocab, device="cuda").to(dtype)
    bitmask = torch.from_numpy(_random_masks(4, words, seed=2)).cuda()
    for rows in (None, torch.tensor([8, 0, 3, 5], device="cuda")):
        want, got = logits.clone(), logits.clone()
        apply_token_bitmask_(want, bitmask, rows)
        triton_sampling.apply_token_bitmask_(got, bitmask, rows)
        assert torch.equal(got, want)


def test_grammar_rows_places_each_grammar_on_its_sampling_row():
    placed = grammar_rows(["c", "a", "gone"], ["a", "b", "c"])
    assert placed is not None
    src, dst = placed
    assert src.tolist() == [0, 1] and dst is not None and dst.tolist() == [2, 0]
    assert grammar_rows(["gone"], ["a"]) is None
    same = grammar_rows(["a", "b"], ["a", "b"])
    assert same is not None and same[0].tolist() == [0, 1] and same[1] is None


def test_mask_staging_hands_out_slots_in_turn():
    staging = MaskStaging(words=3, device=torch.device("cpu"), slots=2)
    a = staging.buffer(2)
    a[:] = 7
    assert torch.equal(staging.to_device(a), torch.full((2, 3), 7, dtype=torch.int32))
    b = staging.buffer(4)  # the other slot, grown
    assert b.shape == (4, 3) and not np.shares_memory(a, b)
    c = staging.buffer(1)  # the first slot again
    assert np.shares_memory(a, c)


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs a GPU")
def test_mask_staging_copies_from_pinned_slots():
    staging = MaskStaging(words=5, device=torch.device("cuda"), slots=2)
    # Slots reused (each waits for its previous copy); the device buffer reused, grown, and
    # only its first rows handed out.
    for step, rows in enumerate((3, 3, 6, 2, 4)):
        buf = staging.buffer(rows)
        buf[:] = step
        dev = staging.to_device(buf)
        assert torch.equal(dev.cpu(), torch.full((rows, 5), step, dtype=torch.int32))
    other = np.arange(10, dtype=np.int32).reshape(2, 5)  # not a staging buffer: pinned copy
    assert torch.equal(staging.to_device(other).cpu(), torch.from_numpy(other))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side-stream upload needs a GPU")
def test_mask_staging_uploads_on_a_side_stream_and_waits_for_the_last_reader():
    """The fill thread's upload: the sampling stream waits for it, and an upload into a slot
    waits for the sampling that read that slot's device buffer last (the main stream kept
    busy, so a missing wait would read the next step's masks)."""
    import threading

    staging = MaskStaging(words=4096, device=torch.device("cuda"), slots=2)
    read = []
    for step in range(6):
        buf = staging.buffer(64)
        buf[:] = step
        upload = staging.uploader()
        assert upload is not None
        worker = threading.Thread(target=upload)  # (as the fill thread calls it)
        worker.start()
        worker.join()
        dev = staging.to_device(buf)
        torch.cuda._sleep(2_000_000)  # the forward pass and sampling ahead on the stream
        read.append(dev.sum(dtype=torch.int64))  # the sampling's read
        staging.consumed()
    torch.cuda.synchronize()
    assert [int(r) for r in read] == [step * 64 * 4096 for step in range(6)]
