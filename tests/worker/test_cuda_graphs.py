"""Which CUDA graphs are captured and which one a step replays (host logic; the replays
themselves are compared with eager runs in test_gpu_runner.py)."""

from __future__ import annotations

import pytest

from tidal.worker.cuda_graphs import CudaGraphRunner, capture_sizes, mixed_capture_sizes


@pytest.mark.parametrize("limit", [1, 7, 64, 100, 512, 2048, 3000, 8192])
def test_mixed_sizes_cover_every_step_with_bounded_padding(limit):
    sizes = mixed_capture_sizes(limit)
    assert sizes == sorted(set(sizes)) and sizes[-1] == limit
    for tokens in range(1, limit + 1):
        padded = next(s for s in sizes if s >= tokens)
        step = 64 if tokens <= 256 else 128 if tokens <= 1024 else 256
        assert padded - tokens < step, (tokens, padded)


def test_no_mixed_graphs_when_turned_off():
    assert mixed_capture_sizes(0) == []
    runner = CudaGraphRunner(capture_sizes(8), [])
    assert runner.mixed_size_for(10) is None


def test_a_step_replays_the_next_captured_size_only_if_captured():
    runner = CudaGraphRunner(capture_sizes(16), mixed_capture_sizes(512))
    assert runner.mixed_size_for(100) is None  # nothing captured yet
    runner._mixed = {s: (None, None) for s in runner.mixed_sizes}  # as if captured
    assert runner.mixed_size_for(2) == 8
    assert runner.mixed_size_for(40) == 64
    assert runner.mixed_size_for(100) == 128
    assert runner.mixed_size_for(512) == 512
    assert runner.mixed_size_for(513) is None  # larger steps run eagerly
    assert len(runner) == len(runner.mixed_sizes)


def test_dummy_mixed_batch_fits_the_block_table_rows():
    """The mixed-graph capture's dummy batch: every chunk at most max_model_len tokens (a
    longer one read past its block-table row on an H100: an illegal address), all tokens
    placed, every request at least one token; a size no real step can have is refused."""
    from tidal.worker.model_runner import dummy_chunk_lens

    for tokens, reqs, limit in [(512, 4, 128), (16, 4, 128), (8, 8, 100), (300, 4, 128),
                                (2048, 512, 4096), (2048, 3, 4096)]:
        lens = dummy_chunk_lens(tokens, reqs, limit)
        assert len(lens) == reqs and sum(lens) == tokens
        assert all(1 <= x <= limit for x in lens)
    with pytest.raises(ValueError):
        dummy_chunk_lens(2048, 4, 128)
