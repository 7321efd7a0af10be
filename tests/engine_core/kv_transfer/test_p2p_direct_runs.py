"""Direct runs of the P2P KV transport: where both sides' blocks are consecutive the pull goes
cache to cache (no staging tensor), the scattered rest is staged; the blocks land exactly as a
staged pull puts them (gloo pair on the CPU; NCCL in test_p2p_transport's gpu-marked test), and
a cut that does not fit the pull is refused on either side."""

from __future__ import annotations


import pytest
import torch

from tests.engine_core.kv_transfer.p2p_helpers import (
    LAYERS,
    caches,
    check_landed,
    finished,
    free_port,
)
from tidal.engine_core.kv_transfer.p2p_direct_runs import (
    CacheBytes,
    check_direct,
    min_direct_blocks,
    plan_direct,
    run_lengths,
    run_slices,
    staged_positions,
)
from tidal.engine_core.kv_transfer.p2p_transport import (
    KVPull,
    KVPullClient,
    KVSendServer,
    layer_block_bytes,
)


def _runs_by_hand(src: list[int], dst: list[int], min_blocks: int) -> list[int]:
    """The cut from its definition: a stretch ends where src or dst stops counting up."""
    out, start = [], 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            if i - start >= min_blocks:
                out += [start, i - start]
            start = i
    return out


def test_the_cut_follows_both_sides_runs() -> None:
    assert run_lengths([4, 5, 6, 0, 9, 10]) == [3, 1, 2]
    assert run_lengths([]) == []
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        # Mostly consecutive ids with random breaks, on each side.
        src = torch.cumsum(1 + (torch.rand(n, generator=g) < 0.3).long() * 5, 0).tolist()
        dst = torch.cumsum(1 + (torch.rand(n, generator=g) < 0.3).long() * 3, 0).tolist()
        for min_blocks in (1, 2, 3):
            cut = plan_direct(src, run_lengths(dst), min_blocks)
            assert cut == _runs_by_hand(src, dst, min_blocks)
            runs = check_direct(cut, dst)
            staged = staged_positions(n, runs)
            covered = sorted(staged + [o + k for o, ln in runs for k in range(ln)])
            assert covered == list(range(n))  # every block exactly once


@pytest.mark.parametrize("runs", [[2], [1, 1, 2], [0, 3], [3, -1, 1]])
def test_runs_not_covering_the_pull_are_refused(runs: list[int]) -> None:
    with pytest.raises(ValueError, match="do not cover"):
        plan_direct([1, 2, 3], runs, 1)


@pytest.mark.parametrize("direct", [[0], [0, 4], [1, 2, 0, 1], [0, 0], [1, 2]])
def test_a_cut_that_does_not_fit_the_consumer_is_refused(direct: list[int]) -> None:
    # dst [5, 6, 0]: only (0, 2) / (0, 1) / (1, 1) / (2, 1) are consecutive runs here.
    with pytest.raises(ValueError):
        check_direct(direct, [5, 6, 0])


def test_slices_are_the_run_of_each_half_in_place() -> None:
    kv = torch.arange(2 * 6 * 4, dtype=torch.float32).view(2, 6, 4)
    kv = kv.view(2, 6, 2, 2)  # [K/V, blocks, block_size, dim]
    parts = run_slices(CacheBytes.of(kv), 2, 3)
    assert len(parts) == 2 and all(p.is_contiguous() for p in parts)
    assert parts[1].data_ptr() == kv[1, 2].data_ptr()  # a view, not a copy
    assert torch.equal(parts[0].view(torch.float32), kv[0, 2:5].reshape(-1))  # its bytes
    assert torch.equal(parts[1].view(torch.float32), kv[1, 2:5].reshape(-1))
    mla = torch.arange(6 * 2 * 8, dtype=torch.bfloat16).view(6, 2, 8)
    (part,) = run_slices(CacheBytes.of(mla), 1, 2)
    assert part.numel() == 2 * 2 * 8 * 2 and torch.equal(part.view(torch.bfloat16),
                                                         mla[1:3].reshape(-1))
    # One K half of one block of these caches is 2*2*4 bytes = 16: 40 bytes need 3 blocks.
    assert min_direct_blocks([kv], 40) == 3 and min_direct_blocks([kv], 0) == 1


@pytest.fixture
def gloo_pair():
    src, dst = caches(0), caches(None)
    block_bytes = layer_block_bytes(src[0])
    # Runs of 2+ blocks direct (one K half of a block is half a layer's block bytes); a buffer
    # of one staged block per layer: one layer a chunk while anything is staged.
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", buffer_bytes=block_bytes,
                          send_timeout_s=2.0, min_direct_bytes=block_bytes)
    client = KVPullClient(dst, timeout_s=5.0, backend="gloo")
    yield src, dst, server, client
    client.close()
    server.close()


def test_a_consecutive_pull_is_never_staged(gloo_pair) -> None:
    src, dst, server, client = gloo_pair
    remote, local = [2, 3, 4, 5], [6, 7, 8, 9]
    server.register("r1", remote, "d", ready=True)
    got = client.pull(server.address, "r1", 0, local, "d")
    check_landed(src, dst, remote, local)
    total = len(remote) * LAYERS * layer_block_bytes(src[0])
    assert got == total and client.bytes_direct == total == server.direct_bytes
    assert server.peak_staged_bytes == 0
    assert server.chunks_sent == 1  # nothing staged: every layer in one chunk
    assert finished(server) == {"r1"}


def test_scattered_blocks_are_staged_beside_direct_runs(gloo_pair) -> None:
    src, dst, server, client = gloo_pair
    # Cut: [0, 3) direct (2,3,4 -> 6,7,8), [3, 5) direct (9,10 -> 0,1), the last block
    # staged (1 -> 11), and the first block of the pull is skipped (start_block 1).
    table = [7, 2, 3, 4, 9, 10, 1]
    local = [6, 7, 8, 0, 1, 11]
    server.register("r1", table, "d", ready=True)
    got = client.pull(server.address, "r1", 1, local, "d")
    check_landed(src, dst, table[1:], local)
    block = layer_block_bytes(src[0])
    assert got == len(local) * LAYERS * block
    assert client.bytes_direct == 5 * LAYERS * block
    assert server.peak_staged_bytes == block  # one staged block, one layer a chunk
    assert server.chunks_sent == LAYERS


def test_the_producer_refuses_runs_that_do_not_cover_the_pull(gloo_pair) -> None:
    src, _, server, _ = gloo_pair
    server.register("r1", [1, 2, 3], "d", ready=True)
    reply, tensors = server._chunk(KVPull("r1", 0, 3, "d", 0, "k", [5]), "gloo")
    assert "do not cover" in reply.error and tensors() == []
    # Over ZMQ frames the runs mean nothing (every block is staged through host memory).
    reply, tensors = server._chunk(KVPull("r1", 0, 3, "d", 0, "", [5]), "zmq")
    assert reply.error is None and reply.direct == []
    assert len(tensors()) == reply.num_layers  # one frame a layer


def test_the_one_run_shortcut_agrees_with_the_walk():
    """A single consecutive run skips the id-by-id walk; the answers must not change."""
    import random

    rng = random.Random(3)
    for _ in range(300):
        n = rng.randrange(1, 40)
        start = rng.randrange(0, 100)
        ids = list(range(start, start + n))
        if rng.random() < 0.5:  # break it somewhere (or swap two ids)
            i = rng.randrange(n)
            ids[i] += rng.choice([1, 7, -3])
        walked = []
        for i, b in enumerate(ids):  # the plain definition
            if i and b == ids[i - 1] + 1:
                walked[-1] += 1
            else:
                walked.append(1)
        assert run_lengths(ids) == walked
        min_blocks = rng.randrange(1, 8)
        plan = plan_direct(ids, [n], min_blocks)
        consecutive = walked == [n]
        if consecutive:
            assert plan == ([0, n] if n >= min_blocks else [])
        runs = [(plan[k], plan[k + 1]) for k in range(0, len(plan), 2)]
        covered = {p for o, ln in runs for p in range(o, o + ln)}
        assert staged_positions(n, runs) == [p for p in range(n) if p not in covered]
