"""The P2P KV transport between two caches (producer server, consumer client) in one process:
blocks land where asked, chunked within the send buffer, and every refusal is an error the
consumer sees (never a silent partial copy); over ZMQ frames and over a two-rank gloo pair
(NCCL between two GPUs in the gpu-marked test)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch

from tests.engine_core.kv_transfer.p2p_helpers import (
    BLOCK,
    DIM,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    caches,
    finished,
    free_port,
)
from tidal.engine_core.kv_transfer.p2p_transport import (
    KVPullClient,
    KVSendServer,
    KVTransferError,
    layer_block_bytes,
)


@pytest.fixture(params=["zmq", "gloo"])
def pair(request):
    src, dst = caches(0), caches(None)
    # A buffer of one layer of two blocks: a 3-block pull goes one layer per chunk.
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}",
                          buffer_bytes=2 * layer_block_bytes(src[0]), send_timeout_s=0.5)
    client = KVPullClient(dst, timeout_s=2.0, backend=request.param)
    yield src, dst, server, client
    client.close()
    server.close()


def test_pull_copies_the_asked_blocks_in_chunks(pair) -> None:
    src, dst, server, client = pair
    server.register("r1", [7, 2, 9, 4], "d1", ready=True)
    # The producer's blocks 1..3 of the request (pool blocks 2, 9, 4) into local 5, 0, 11.
    got = client.pull(server.address, "r1", 1, [5, 0, 11], "d1")
    assert got == 3 * LAYERS * layer_block_bytes(src[0])
    for s, d in zip(src, dst):
        for remote, local in zip([2, 9, 4], [5, 0, 11]):
            assert torch.equal(d[:, local], s[:, remote])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 0, 11)]
        assert not d[:, untouched].any()
    # Back-pressure: one layer per chunk, never more than the buffer staged at once.
    assert server.chunks_sent == LAYERS
    assert server.peak_staged_bytes <= 3 * layer_block_bytes(src[0])
    assert finished(server) == {"r1"}  # the consumer's done releases it
    assert server.pending() == 0
    # Over gloo every chunk went through one pair, built once and used again.
    assert len(server._pairs) == (client.backend == "gloo")
    server.register("r2", [1], "d2", ready=True)
    client.pull(server.address, "r2", 0, [6], "d2")
    assert torch.equal(dst[1][:, 6], src[1][:, 1])
    assert len(server._pairs) == (client.backend == "gloo")


def test_release_needs_the_prompt_digest(pair) -> None:
    _, _, server, client = pair
    server.register("r1", [1], "d1", ready=True)
    client.release(server.address, "r1", "another prompt")
    client.release(server.address, "r1", "d1")
    assert finished(server) == {"r1"} and server.pending() == 0


@pytest.mark.parametrize("case", ["unknown", "not_ready", "digest", "range"])
def test_refusals_fail_the_pull(pair, case: str) -> None:
    src, dst, server, client = pair
    server.register("r1", [1, 2], "d1", ready=case != "not_ready")
    rid, digest, start, local = "r1", "d1", 0, [3, 4]
    if case == "unknown":
        rid = "other"
    elif case == "digest":
        digest = "another prompt"
    elif case == "range":
        local = [3, 4, 5]
    with pytest.raises(KVTransferError):
        client.pull(server.address, rid, start, local, digest)
    assert not any(d.any() for d in dst)
    # The request stays servable: a correct pull afterwards still works.
    server.mark_ready(["r1"])
    client.pull(server.address, "r1", 0, [3, 4], "d1")
    assert torch.equal(dst[0][:, 3], src[0][:, 1])


def test_pairs_are_rebuilt_after_the_producer_drops_one() -> None:
    src, dst = caches(0), caches(None)
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", 1e9, send_timeout_s=2)
    client = KVPullClient(dst, timeout_s=2.0, backend="gloo")
    try:
        server.register("r1", [1], "d", ready=True)
        client.pull(server.address, "r1", 0, [2], "d")
        server._pairs.clear()  # as when a pair's send timed out, or the oldest of too many
        server.register("r2", [3], "d", ready=True)
        with pytest.raises(KVTransferError, match="dropped our pair"):
            client.pull(server.address, "r2", 0, [4], "d")
        client.pull(server.address, "r2", 0, [4], "d")  # a new pair
        assert torch.equal(dst[0][:, 4], src[0][:, 3])
        # A CPU producer cannot pair over NCCL: refused in the handshake, no hang.
        nccl = KVPullClient(caches(None), timeout_s=2.0, backend="nccl")
        with pytest.raises(KVTransferError, match="not on a CUDA device"):
            nccl.pull(server.address, "r2", 0, [4], "d")
        nccl.close()
    finally:
        client.close()
        server.close()


def test_layout_mismatch_and_dead_producer() -> None:
    src = caches(0)
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", 1e9, send_timeout_s=0.2)
    server.register("r1", [1], "d", ready=True)
    other = KVPullClient(caches(None, torch.float32), timeout_s=2.0)  # another dtype
    with pytest.raises(KVTransferError, match="bfloat16"):
        other.pull(server.address, "r1", 0, [0], "d")
    other.close()
    address = server.address
    server.close()
    client = KVPullClient(caches(None), timeout_s=0.3)
    with pytest.raises(KVTransferError, match="no answer"):
        client.pull(address, "r1", 0, [0], "d")
    client.close()


def test_unpulled_requests_expire() -> None:
    server = KVSendServer(caches(0), f"tcp://127.0.0.1:{free_port()}", 1e9,
                          send_timeout_s=0.05)
    try:
        server.register("r1", [1], "d", ready=True)
        server.register("r2", [2], "d", ready=True)
        server.register("r3", [3], "d", ready=False)  # its step still runs: no clock yet
        server.forget("r2")  # aborted: not reported as sent
        time.sleep(0.1)
        server.mark_ready(["r3"])  # the clock starts when its blocks are servable
        assert server.take_finished() == {"r1"}
        time.sleep(0.1)
        assert server.take_finished() == {"r3"}
        assert server.take_finished() == set()
    finally:
        server.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (the transport's device-cache path)")
@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_pull_between_gpu_caches(backend: str) -> None:
    """The producer's cache on the first GPU, the consumer's on the last (the same GPU with
    one): staged through host memory both ways (gloo: gathered on the server's own stream)."""
    src_dev, dst_dev = "cuda:0", f"cuda:{torch.cuda.device_count() - 1}"
    src = [c.to(src_dev) for c in caches(0)]
    dst = [c.to(dst_dev) for c in caches(None)]
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", 1e9, send_timeout_s=5)
    client = KVPullClient(dst, timeout_s=5.0, backend=backend)
    try:
        server.register("r1", [3, 1], "d", ready=True)
        client.pull(server.address, "r1", 0, [0, 7], "d")
        torch.cuda.synchronize()
        for s, d in zip(src, dst):
            assert torch.equal(d[:, [0, 7]].cpu(), s[:, [3, 1]].cpu())
    finally:
        client.close()
        server.close()


_NCCL_PRODUCER = textwrap.dedent("""
    import sys, torch
    from tidal.engine_core.kv_transfer.p2p_transport import KVSendServer
    torch.cuda.set_device(0)
    g = torch.Generator().manual_seed(0)
    src = [torch.randn({shape}, generator=g).to(torch.bfloat16).cuda(0) for _ in range({layers})]
    # Runs of 2+ blocks go cache to cache (one block's K half is {half} bytes).
    server = KVSendServer(src, "tcp://127.0.0.1:{port}", {buffer}, send_timeout_s=60,
                          min_direct_bytes=2 * {half})
    # (A pull's done releases its request, as in the real protocol: each pull its own.)
    server.register("r1", [3, 1, 8], "d", ready=True)
    server.register("r2", [3, 1, 8], "d", ready=True)
    server.register("r3", [4, 5, 6, 9], "d", ready=True)
    server.register("r4", [7, 2, 10], "d", ready=True)
    server.register("r5", [4, 5, 6], "d", ready=True)
    print("ready", flush=True)
    sys.stdin.readline()  # until the test is done
    server.close()
""")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs (NCCL pairs need a distinct GPU per rank)")
@pytest.mark.parametrize("streams", [1, 2, 4])
def test_nccl_pull_between_two_processes(streams: int) -> None:
    """The producer in its own process on GPU 0, the consumer here on GPU 1: the blocks go
    GPU to GPU over a two-rank NCCL pair (of ``streams`` communicators, the sends spread over
    them), chunked (a buffer of one layer) when scattered, cache to cache where both sides'
    blocks are consecutive; a pull into one run of 2+ blocks posts its receives first."""
    port = free_port()
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, DIM)
    one_layer = 3 * layer_block_bytes(caches(0)[0])
    code = _NCCL_PRODUCER.format(shape=shape, layers=LAYERS, port=port,
                                 buffer=one_layer, half=BLOCK * HEADS * DIM * 2)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        dst = [c.cuda(1) for c in caches(None)]
        client = KVPullClient(dst, timeout_s=60.0, backend="nccl", streams=streams,
                              min_direct_bytes=2 * BLOCK * HEADS * DIM * 2)
        got = client.pull(f"tcp://127.0.0.1:{port}", "r1", 0, [0, 7, 5], "d")
        torch.cuda.synchronize(1)
        src = caches(0)
        assert got == 3 * LAYERS * layer_block_bytes(src[0])
        for s_, d in zip(src, dst):
            assert torch.equal(d[:, [0, 7, 5]].cpu(), s_[:, [3, 1, 8]])
        assert client.bytes_direct == 0  # scattered: all staged
        assert len(next(iter(client._pairs.values()))[1].groups) == streams
        # Again on the same pair (no second handshake needed); r1 was released by its pull's
        # done message (asking for it again is refused, as over gloo).
        client.pull(f"tcp://127.0.0.1:{port}", "r2", 1, [2], "d")
        torch.cuda.synchronize(1)
        assert torch.equal(dst[2][:, 2].cpu(), src[2][:, 1])
        # Blocks 4, 5, 6 into 9, 10, 11 straight between the caches, 9 into 3 staged: one
        # chunk (one staged block a layer fits the buffer).
        got = client.pull(f"tcp://127.0.0.1:{port}", "r3", 0, [9, 10, 11, 3], "d")
        torch.cuda.synchronize(1)
        assert got == 4 * LAYERS * layer_block_bytes(src[0])
        assert client.bytes_direct == 3 * LAYERS * layer_block_bytes(src[0])
        for s_, d in zip(src, dst):
            assert torch.equal(d[:, [9, 10, 11, 3]].cpu(), s_[:, [4, 5, 6, 9]])
        # Posted pulls (one run here): scattered there, gathered a layer at a time (the
        # sends of each layer continue the receives' round-robin over the communicators),
        # then one run there too, cache to cache.
        for rid, local, remote in (("r4", [4, 5, 6], [7, 2, 10]), ("r5", [0, 1, 2], [4, 5, 6])):
            got = client.pull(f"tcp://127.0.0.1:{port}", rid, 0, local, "d")
            torch.cuda.synchronize(1)
            assert got == 3 * LAYERS * layer_block_bytes(src[0])
            assert client.last_phases_ms["posted"] <= client.last_phases_ms["first_reply"]
            for s_, d in zip(src, dst):
                assert torch.equal(d[:, local].cpu(), s_[:, remote])
        client.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_gloo_pair_has_one_group_whatever_streams_were_asked() -> None:
    """Streams are NCCL communicators: a gloo consumer asking for four gets one group, and
    the pull still lands."""
    src, dst = caches(0), caches(None)
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", 1e9, send_timeout_s=5)
    client = KVPullClient(dst, timeout_s=5.0, backend="gloo", streams=4)
    try:
        server.register("r1", [1, 2], "d", ready=True)
        client.pull(server.address, "r1", 0, [5, 6], "d")
        assert torch.equal(dst[0][:, [5, 6]], src[0][:, [1, 2]])
        assert len(next(iter(client._pairs.values()))[1].groups) == 1
        assert [len(p.groups) for p in server._pairs.values()] == [1]
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("backend", ["zmq", "gloo"])
def test_a_producer_with_a_shared_secret_serves_only_consumers_that_send_it(backend) -> None:
    """``$TIDAL_KV_AUTH_KEY``: pulls, pair hellos and releases without it (or with another)
    are refused (a pull fails with the reason, a release is ignored); with it the pull works."""
    src = caches(0)
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", 1e9, send_timeout_s=30,
                          auth_key="s3cret")
    server.register("r1", [7, 2], "d1", ready=True)
    try:
        for key in (None, "guess"):
            stranger = KVPullClient(caches(None), timeout_s=2.0, backend=backend, auth_key=key)
            try:
                with pytest.raises(KVTransferError, match="TIDAL_KV_AUTH_KEY"):
                    stranger.pull(server.address, "r1", 0, [0, 1], "d1")
                stranger.release(server.address, "r1", "d1")  # ignored: still served below
            finally:
                stranger.close()
        assert server.refused_unauthorized >= 2
        dst = caches(None)
        client = KVPullClient(dst, timeout_s=2.0, backend=backend, auth_key="s3cret")
        try:
            client.pull(server.address, "r1", 0, [3, 4], "d1")
        finally:
            client.close()
        for s, d in zip(src, dst):
            assert torch.equal(d[:, [3, 4]], s[:, [7, 2]])
        assert finished(server) == {"r1"}
    finally:
        server.close()
