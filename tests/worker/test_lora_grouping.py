"""Grouping a decode batch's tokens by adapter (``worker/lora/grouping``): every token with an
adapter in exactly one tile, each tile on one adapter and at most a tile long, the adapters'
runs in the batch order, the tile count within ``max_tiles``."""

from __future__ import annotations

import numpy as np
import pytest

from tidal.worker.lora.grouping import group_tokens, max_tiles


@pytest.mark.parametrize("seed", range(20))
def test_tiles_cover_each_adapter_token_once(seed):
    rng = np.random.default_rng(seed)
    n, slots, tile = int(rng.integers(1, 300)), int(rng.integers(1, 9)), 16
    token_slots = rng.integers(-1, slots, n).astype(np.int32)
    perm, starts, lengths, tile_slots = group_tokens(token_slots, tile)
    assert sorted(perm.tolist()) == np.flatnonzero(token_slots >= 0).tolist()
    assert len(starts) <= max_tiles(n, slots, tile)
    covered = []
    for s, length, slot in zip(starts, lengths, tile_slots):
        assert 0 < length <= tile
        members = perm[s:s + length]
        assert (token_slots[members] == slot).all()
        covered += members.tolist()
    assert sorted(covered) == sorted(perm.tolist())
    for slot in np.unique(token_slots[token_slots >= 0]):  # stable: batch order per adapter
        mine = perm[token_slots[perm] == slot]
        assert (np.diff(mine) > 0).all()


def test_no_adapter_tokens_no_tiles():
    perm, starts, lengths, slots = group_tokens(np.full(5, -1, dtype=np.int32), 16)
    assert len(perm) == len(starts) == len(lengths) == len(slots) == 0
    assert max_tiles(5, 4, 16) == 5 and max_tiles(64, 8, 16) == 12
