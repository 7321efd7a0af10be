from __future__ import annotations

import pytest

from tidal.engine_core.block_pool import BlockPool


def test_allocation_order_and_tail_first_free():
    pool = BlockPool(8, enable_caching=True)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.num_free_blocks == 5
    pool.free(reversed(a))  # a request's blocks go back tail first
    order = [b.block_id for b in pool.free_queue]
    assert order[-3:] == [2, 1, 0], "freed tail blocks must be evicted before their prefix"
    pool.check_invariants()


def test_remove_from_the_middle_and_refcounts():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.allocate(6)
    pool.free(blocks)
    middle = pool.blocks[3]
    pool.touch([middle])  # a cache hit on a free block takes it out of the free list
    assert middle.ref_cnt == 1 and 3 not in [b.block_id for b in pool.free_queue]
    pool.touch([middle])
    pool.free([middle])
    assert middle.ref_cnt == 1
    pool.free([middle])
    assert pool.num_free_blocks == 6
    pool.check_invariants()


def test_double_free_and_overdraw_are_refused():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_cached_hash_survives_free_until_reuse():
    pool = BlockPool(2, enable_caching=True)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h1")
    pool.free([b])
    assert pool.lookup(b"h1") is b  # lazy eviction
    pool.allocate(2)  # reusing it drops the stale hash
    assert pool.lookup(b"h1") is None
    pool.check_invariants()
