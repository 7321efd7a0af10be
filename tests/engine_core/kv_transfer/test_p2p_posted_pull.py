"""Posted pulls of the P2P KV transport: a pull into one run of blocks posts its receives before
it asks (``KVPull.posted``), so the producer's planning and the round trip are off its latency.
The producer sends exactly those receives (straight from its cache, or gathered a few layers at a
time when its blocks are scattered), or zeros of their sizes when it refuses, so the pair stays
in step. Gloo pair on the CPU; the NCCL pair in test_p2p_transport's gpu-marked test."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from tidal.engine_core.kv_transfer.p2p_transport import (
    KVPull,
    KVPullClient,
    KVRefused,
    KVSendServer,
    KVTransferError,
    _posted_sizes,
    layer_block_bytes,
)

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 12, 4, 2, 8, 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _caches(seed: int | None, dim: int = DIM) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, dim)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


def _finished(server: KVSendServer) -> set[str]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done = server.take_finished()
        if done:
            return done
        time.sleep(0.005)
    return set()


@pytest.fixture
def posted_pair():
    src, dst = _caches(0), _caches(None)
    block = layer_block_bytes(src[0])
    # A send buffer of one layer of 4 blocks: scattered blocks are gathered layer by layer.
    server = KVSendServer(src, f"tcp://127.0.0.1:{_free_port()}", buffer_bytes=4 * block,
                          send_timeout_s=2.0, min_direct_bytes=block // 2)
    # Posted from 2 blocks up (one K half of a block is half a layer's block bytes).
    client = KVPullClient(dst, timeout_s=5.0, backend="gloo", min_direct_bytes=block)
    yield src, dst, server, client
    client.close()
    server.close()


def _check_landed(src, dst, remote: list[int], local: list[int]) -> None:
    for s, d in zip(src, dst):
        for r, loc in zip(remote, local):
            assert torch.equal(d[:, loc], s[:, r])
        assert not d[:, [b for b in range(NUM_BLOCKS) if b not in local]].any()


def test_a_pull_into_one_run_posts_its_receives_before_the_answer(posted_pair) -> None:
    src, dst, server, client = posted_pair
    remote, local = [2, 3, 4, 5], [6, 7, 8, 9]
    server.register("r1", remote, "d", ready=True)
    got = client.pull(server.address, "r1", 0, local, "d")
    _check_landed(src, dst, remote, local)
    total = len(remote) * LAYERS * layer_block_bytes(src[0])
    assert got == total and client.bytes_direct == total == server.direct_bytes
    assert server.peak_staged_bytes == 0
    ph = client.last_phases_ms
    assert ph["asked"] <= ph["posted"] <= ph["first_reply"] <= ph["checked"] <= ph["landed"]
    assert _finished(server) == {"r1"}


def test_scattered_source_blocks_are_gathered_within_the_send_buffer(posted_pair) -> None:
    src, dst, server, client = posted_pair
    table = [7, 2, 3, 10, 1]  # the first block skipped (start_block 1): 2, 3, 10, 1
    local = [4, 5, 6, 7]
    server.register("r1", table, "d", ready=True)
    got = client.pull(server.address, "r1", 1, local, "d")
    _check_landed(src, dst, table[1:], local)
    block = layer_block_bytes(src[0])
    assert got == len(local) * LAYERS * block
    assert server.peak_staged_bytes == 4 * block  # one layer at a time, as the buffer says
    assert server.direct_bytes == 0


@pytest.mark.parametrize("case", ["unknown", "digest", "range", "not computed"])
def test_a_refused_posted_pull_keeps_the_pair(posted_pair, case: str) -> None:
    src, dst, server, client = posted_pair
    server.register("r1", [1, 2], "d", ready=case != "not computed")
    rid, digest, local = "r1", "d", [3, 4]
    if case == "unknown":
        rid = "other"
    elif case == "digest":
        digest = "another prompt"
    elif case == "range":
        local = [3, 4, 5]
    with pytest.raises(KVRefused):
        client.pull(server.address, rid, 0, local, digest)
    (key, pair), = client._pairs.values()
    # The producer filled the posted receives: the same pair carries the next pull.
    server.mark_ready(["r1"])
    client.pull(server.address, "r1", 0, [3, 4], "d")
    assert client._pairs[server.address] == (key, pair)
    _check_landed(src, dst, [1, 2], [3, 4])


def test_a_consumer_of_another_layout_is_refused_not_fed_wrong_bytes() -> None:
    src = _caches(0)
    server = KVSendServer(src, f"tcp://127.0.0.1:{_free_port()}", 1e9, send_timeout_s=2.0,
                          min_direct_bytes=1)
    other = _caches(None, dim=2 * DIM)  # the same blocks, another head size
    client = KVPullClient(other, timeout_s=5.0, backend="gloo", min_direct_bytes=1)
    try:
        server.register("r1", [1, 2], "d", ready=True)
        with pytest.raises(KVRefused, match="layout"):
            client.pull(server.address, "r1", 0, [3, 4], "d")
        assert not any(c.any() for c in other)  # zeros landed, in blocks the caller drops
        assert len(client._pairs) == 1
    finally:
        client.close()
        server.close()


def test_a_producer_that_never_answers_ends_the_pull_and_the_pair(posted_pair) -> None:
    src, dst, server, client = posted_pair
    client.timeout_s = 0.5
    server.register("r1", [1, 2], "d", ready=True)
    client.pull(server.address, "r1", 0, [3, 4], "d")  # (builds the pair)
    server._serve_posted = lambda *args: None  # a stuck producer: no answer, nothing sent
    server.register("r2", [5, 6], "d", ready=True)
    start = time.monotonic()
    with pytest.raises(KVTransferError) as err:
        client.pull(server.address, "r2", 0, [7, 8], "d")
    assert not isinstance(err.value, KVRefused)
    assert time.monotonic() - start < 5.0
    assert client._pairs == {}  # receives may still be posted on it: never used again


@pytest.mark.parametrize("posted", [[2], [3, 8], [2, 0], [2, -8], [2, 1 << 40]])
def test_malformed_posted_receives_are_refused(posted: list[int]) -> None:
    with pytest.raises(ValueError, match="malformed"):
        _posted_sizes(KVPull("r", 0, 4, "d", posted=posted))
    assert _posted_sizes(KVPull("r", 0, 4, "d", posted=[2, 8, 1, 16])) == [32, 32, 64]
