"""Posted pulls of the P2P KV transport: a pull into one run of blocks posts its receives before
it asks (``KVPull.posted``), so the producer's planning and the round trip are off its latency.
The producer sends exactly those receives (straight from its cache, or gathered a few layers at a
time when its blocks are scattered), or zeros of their sizes when it refuses, so the pair stays
in step. Gloo pair on the CPU; the NCCL pair in test_p2p_transport's gpu-marked test."""

from __future__ import annotations

import time

import pytest

from tests.engine_core.kv_transfer.p2p_helpers import (
    DIM,
    LAYERS,
    caches,
    check_landed,
    finished,
    free_port,
)
from tidal.engine_core.kv_transfer.p2p_transport import (
    KVPull,
    KVPullClient,
    KVRefused,
    KVSendServer,
    KVTransferError,
    _posted_sizes,
    layer_block_bytes,
)


@pytest.fixture
def posted_pair():
    src, dst = caches(0), caches(None)
    block = layer_block_bytes(src[0])
    # A send buffer of one layer of 4 blocks: scattered blocks are gathered layer by layer.
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", buffer_bytes=4 * block,
                          send_timeout_s=2.0, min_direct_bytes=block // 2)
    # Posted from 2 blocks up (one K half of a block is half a layer's block bytes).
    client = KVPullClient(dst, timeout_s=5.0, backend="gloo", min_direct_bytes=block)
    yield src, dst, server, client
    client.close()
    server.close()


def test_a_pull_into_one_run_posts_its_receives_before_the_answer(posted_pair) -> None:
    src, dst, server, client = posted_pair
    remote, local = [2, 3, 4, 5], [6, 7, 8, 9]
    server.register("r1", remote, "d", ready=True)
    got = client.pull(server.address, "r1", 0, local, "d")
    check_landed(src, dst, remote, local)
    total = len(remote) * LAYERS * layer_block_bytes(src[0])
    assert got == total and client.bytes_direct == total == server.direct_bytes
    assert server.peak_staged_bytes == 0
    ph = client.last_phases_ms
    assert ph["asked"] <= ph["posted"] <= ph["first_reply"] <= ph["checked"] <= ph["landed"]
    assert finished(server) == {"r1"}


def test_scattered_source_blocks_are_gathered_within_the_send_buffer(posted_pair) -> None:
    src, dst, server, client = posted_pair
    table = [7, 2, 3, 10, 1]  # the first block skipped (start_block 1): 2, 3, 10, 1
    local = [4, 5, 6, 7]
    server.register("r1", table, "d", ready=True)
    got = client.pull(server.address, "r1", 1, local, "d")
    check_landed(src, dst, table[1:], local)
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
    check_landed(src, dst, [1, 2], [3, 4])


def test_a_consumer_of_another_layout_is_refused_not_fed_wrong_bytes() -> None:
    src = caches(0)
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", 1e9, send_timeout_s=2.0,
                          min_direct_bytes=1)
    other = caches(None, dim=2 * DIM)  # the same blocks, another head size
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


def test_a_send_that_fails_mid_pull_drops_the_pair_and_the_server_keeps_serving(
        posted_pair) -> None:
    src, dst, server, client = posted_pair
    client.timeout_s = 0.5
    real = server._stage_flat

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory (simulated)")

    server._stage_flat = out_of_memory  # a scattered source must be staged: it fails
    server.register("r1", [7, 2, 10], "d", ready=True)
    with pytest.raises(KVTransferError) as err:
        client.pull(server.address, "r1", 0, [3, 4, 5], "d")
    assert not isinstance(err.value, KVRefused)
    assert client._pairs == {} and server._pairs == {}
    server._stage_flat = real
    client.timeout_s = 5.0
    client.pull(server.address, "r1", 0, [3, 4, 5], "d")  # a new pair; the thread served it
    check_landed(src, dst, [7, 2, 10], [3, 4, 5])
