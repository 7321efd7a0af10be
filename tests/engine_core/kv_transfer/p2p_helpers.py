"""Helpers shared by the P2P KV transport's tests: tiny CPU caches, a free port, and waits on
what a producer reports."""

from __future__ import annotations

import socket
import time

import torch

from tidal.engine_core.kv_transfer.p2p_transport import KVSendServer

NUM_BLOCKS, BLOCK, HEADS, DIM, LAYERS = 12, 4, 2, 8, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def caches(seed: int | None, dtype: torch.dtype = torch.bfloat16,
           dim: int = DIM) -> list[torch.Tensor]:
    """``LAYERS`` caches ``[2, NUM_BLOCKS, BLOCK, HEADS, dim]``: zeros, or seeded noise."""
    shape = (2, NUM_BLOCKS, BLOCK, HEADS, dim)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(LAYERS)]


def finished(server: KVSendServer) -> set[str]:
    """The first non-empty ``take_finished`` (the consumer's last message is asynchronous)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        done = server.take_finished()
        if done:
            return done
        time.sleep(0.005)
    return set()


def check_landed(src: list[torch.Tensor], dst: list[torch.Tensor], remote: list[int],
                 local: list[int]) -> None:
    """Blocks ``remote`` of the producer's caches are blocks ``local`` of the consumer's, and
    the consumer's other blocks are untouched (zero)."""
    for s, d in zip(src, dst):
        for r, loc in zip(remote, local):
            assert torch.equal(d[:, loc], s[:, r])
        assert not d[:, [b for b in range(NUM_BLOCKS) if b not in local]].any()
