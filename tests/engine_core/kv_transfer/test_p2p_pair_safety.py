"""The producer's pairs under hostile or many peers, and shutdown: a hello nobody follows up
holds the serving thread only briefly, a pair serves only the peer that built it, the least
recently used pair is the one evicted, the store fails closed rather than listen on every
interface, and close drops pairs and store."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import torch
import zmq

from tidal.engine_core.kv_transfer import p2p_pair_group, p2p_transport
from tidal.engine_core.kv_transfer.p2p_transport import (
    KVPairHello,
    KVPullClient,
    KVSendServer,
    KVTransferError,
)

SHAPE = (2, 8, 4, 2, 8)


def _caches(seed: int | None) -> list[torch.Tensor]:
    if seed is None:
        return [torch.zeros(SHAPE) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=g) for _ in range(2)]


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setattr(p2p_transport, "PAIR_BUILD_TIMEOUT_S", 0.5, raising=False)
    srv = KVSendServer(_caches(0), _address(), 1e9, send_timeout_s=20)
    yield srv
    srv.close()


def test_a_hello_nobody_joins_stalls_the_server_briefly(server):
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(server.address)
    client = KVPullClient(_caches(None), timeout_s=3.0)
    try:
        rogue.send(msgspec.msgpack.encode(KVPairHello("gloo")))
        assert rogue.poll(2000)  # answered; it never joins the pair
        server.register("r", [1], "d", ready=True)
        start = time.monotonic()
        client.pull(server.address, "r", 0, [2], "d")  # served once the build gave up
        assert time.monotonic() - start < 2.5
    finally:
        client.close()
        rogue.close()
        ctx.term()


def test_a_pair_serves_only_the_peer_that_built_it(server):
    owner = KVPullClient(_caches(None), timeout_s=3.0, backend="gloo")
    other = KVPullClient(_caches(None), timeout_s=3.0, backend="gloo")
    try:
        server.register("r1", [1], "d", ready=True)
        owner.pull(server.address, "r1", 0, [2], "d")
        # Another peer presenting the owner's pair key (and group) is refused.
        other._pairs[server.address] = owner._pairs[server.address]
        server.register("r2", [3], "d", ready=True)
        with pytest.raises(KVTransferError, match="dropped our pair"):
            other.pull(server.address, "r2", 0, [4], "d")
        other._pairs.clear()  # (the group is the owner's to close)
        owner.pull(server.address, "r2", 0, [4], "d")
        assert torch.equal(owner.kv_caches[0][:, 4], server.kv_caches[0][:, 3])
    finally:
        other.close()
        owner.close()


def test_the_least_recently_used_pair_is_evicted(server, monkeypatch):
    monkeypatch.setattr(p2p_transport, "MAX_PAIRS", 2)
    clients = [KVPullClient(_caches(None), timeout_s=3.0, backend="gloo") for _ in range(3)]
    try:
        for i, c in enumerate(clients[:2]):
            server.register(f"a{i}", [1], "d", ready=True)
            c.pull(server.address, f"a{i}", 0, [2], "d")
        server.register("b", [1], "d", ready=True)
        clients[0].pull(server.address, "b", 0, [2], "d")  # the first pair, used again
        server.register("c", [1], "d", ready=True)
        clients[2].pull(server.address, "c", 0, [2], "d")  # a third: one must go
        keys = {c._pairs[server.address][0] for c in (clients[0], clients[2])}
        assert set(server._pairs) == keys
    finally:
        for c in clients:
            c.close()


def test_the_store_fails_closed(monkeypatch):
    real = p2p_pair_group.dist.TCPStore

    def no_fd(*args):
        if len(args) > 6:
            raise TypeError("TCPStore() takes no master_listen_fd")
        return real(*args)

    monkeypatch.setattr(p2p_pair_group.dist, "TCPStore", no_fd)
    with pytest.raises(p2p_pair_group.PairError, match="every interface"):
        p2p_pair_group.PairStoreHost("127.0.0.1", 1.0)


def test_close_drops_pairs_and_store(monkeypatch):
    closed = []
    monkeypatch.setattr(p2p_pair_group.PairGroup, "close", lambda self: closed.append(self.backend))
    srv = KVSendServer(_caches(0), _address(), 1e9, send_timeout_s=20)
    client = KVPullClient(_caches(None), timeout_s=3.0, backend="gloo")
    try:
        srv.register("r", [1], "d", ready=True)
        client.pull(srv.address, "r", 0, [2], "d")
        port = srv._store.port
    finally:
        client.close()
        srv.close()
    assert closed and not srv._pairs and srv._store is None
    assert not srv._thread.is_alive() and srv._sock.closed
    with pytest.raises(OSError):  # the store's server (and its socket) went with it
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
