"""Chained hashes of full KV blocks, the keys of the prefix cache.

hash(block i) = sha256(seed ‖ hash(block i-1) ‖ the block's token ids ‖ extra keys), over a
canonical byte encoding (little-endian int32 token ids, length-prefixed extra keys), so equal
prefixes give equal hashes and a block's hash commits to everything before it. The seed is random
per process unless the user fixes one: hashes are never predictable from outside, so one client
cannot probe whether another's prompt is cached by crafting collisions. A request's ``cache_salt``
is an extra key of its first block; requests with different salts never share a block, nor do
requests with different LoRA adapters (the adapter is a key of the first block too).
"""

from __future__ import annotations

import hashlib
import os
import struct

import numpy as np

from tidal.engine_core.request import Request

_EMPTY = b"\x00" * 32
_LEN = struct.Struct("<I")


class BlockHasher:
    def __init__(self, block_size: int, seed: int | None = None) -> None:
        self.block_size = block_size
        self.seed = os.urandom(32) if seed is None else hashlib.sha256(
            b"tidal-prefix-seed" + str(seed).encode()).digest()
        # Every hash starts with the seed: hash it once and copy that state per block. A full
        # block's ids pack with one precompiled struct (the same bytes as int32 little-endian).
        self._seeded = hashlib.sha256(self.seed)
        self._pack_block = struct.Struct(f"<{block_size}i").pack

    def block_hash(self, parent: bytes | None, tokens: list[int], extra: bytes = b"") -> bytes:
        h = self._seeded.copy()
        if len(tokens) == self.block_size:
            packed = self._pack_block(*tokens)
        else:
            packed = np.asarray(tokens, dtype="<i4").tobytes()
        h.update(b"".join((parent or _EMPTY, packed, _LEN.pack(len(extra)), extra)))
        return h.digest()

    def update(self, req: Request, num_tokens: int | None = None) -> list[bytes]:
        """Extend ``req.block_hashes`` to cover every full block among its first ``num_tokens``
        known tokens (all of them by default); only new blocks are hashed."""
        hashes = req.block_hashes
        tokens = req.all_token_ids
        limit = len(tokens) if num_tokens is None else min(num_tokens, len(tokens))
        bs = self.block_size
        for i in range(len(hashes), limit // bs):
            extra = b""
            if i == 0:
                if req.cache_salt:
                    extra = req.cache_salt.encode()
                lora = req.lora_request
                if lora is not None:
                    # Another adapter computes other K/V for the same tokens: its blocks are
                    # its own (the path too: an id re-registered for other weights).
                    extra += _LEN.pack(lora.lora_int_id) + lora.lora_path.encode()
            hashes.append(self.block_hash(hashes[-1] if hashes else None,
                                          tokens[i * bs:(i + 1) * bs], extra))
        return hashes
