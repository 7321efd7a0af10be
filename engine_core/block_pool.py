"""The pool of fixed-size KV cache blocks.

Free blocks sit in one doubly linked list threaded through the blocks themselves, so a free block
can be pulled out of the middle in O(1) (a prefix-cache hit on a block nobody holds) and the list
order is the eviction order: new blocks come from the head, freed blocks go to the tail.
A freed block keeps its hash until it is handed out again (lazy eviction), so a later request
with the same prefix can still find it.

With several KV groups (``kv_groups``) the groups share the pool: a block belongs to the group
that allocated it, the prefix cache is keyed by (group, hash) as one dict per group, and the pool
counts the blocks each group holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set when the block is full and cached
    group: int = 0  # the KV group (kv_groups) that owns it, and whose cache holds its hash
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail."""

    __slots__ = ("_head", "_tail", "num_free")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV cache block")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free list")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free list")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):  # head to tail; for tests and invariant checks
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # Per group: block hash -> the block holding it (one block per hash; duplicates are
        # not cached). ``cached`` is group 0's.
        self.group_cached: list[dict[bytes, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.cached = self.group_cached[0]
        # Blocks each group holds (ref count > 0); only kept with several groups.
        self.group_used = [0] * num_groups
        # Blocks taken out for good (the null block of sliding-window groups): neither free
        # nor counted as used.
        self.num_reserved = 0
        # (block id, hash) of a cached block about to be reused for other tokens: a KV
        # connector that keeps evicted blocks (the host tier) sets it; None costs nothing.
        self.on_evict: Callable[[int, bytes], None] | None = None
        # (block id, hash) of a block just registered in the prefix cache (its K/V are written
        # by this step's forward): the host tier copies it out then (write-through).
        self.on_cache: Callable[[int, bytes], None] | None = None

    def reserve(self) -> KVCacheBlock:
        """Take the next free block out of circulation for good."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        block.group = -1  # no group's
        self.num_reserved += 1
        return block

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        if self.num_reserved:
            usable = self.num_blocks - self.num_reserved
            return 1.0 - self.num_free_blocks / usable if usable else 1.0
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks with {self.num_free_blocks} free")
        out = []
        popleft = self.free_queue.popleft
        for _ in range(n):
            block = popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def allocate_for(self, group: int, n: int) -> list[KVCacheBlock]:
        """``allocate`` for one of several groups: the blocks become ``group``'s."""
        out = self.allocate(n)
        for block in out:
            block.group = group
        self.group_used[group] += n
        return out

    def free_grouped(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``free`` with several groups (keeps the per-group counts)."""
        used = self.group_used
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                used[block.group] -= 1
                self.free_queue.append(block)

    def touch_grouped(self, blocks: Iterable[KVCacheBlock]) -> None:
        """``touch`` with several groups (keeps the per-group counts)."""
        used = self.group_used
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                used[block.group] += 1
            block.ref_cnt += 1

    def lookup_in(self, group: int, block_hash: bytes) -> KVCacheBlock | None:
        return self.group_cached[group].get(block_hash)

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks nobody holds join the free list's tail.

        Callers pass a request's blocks tail first, so its least reusable blocks (the ends of
        prompts) are evicted before the shared prefixes they hang from.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to cached blocks a new request reuses."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Record that ``block`` (full, computed) holds the tokens behind ``block_hash``."""
        if block.block_hash is not None:
            return
        cached = self.group_cached[block.group]
        if block_hash in cached:
            return  # another block already holds these tokens; keep the first
        block.block_hash = block_hash
        cached[block_hash] = block
        if self.on_cache is not None:
            self.on_cache(block.block_id, block_hash)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks + self.num_reserved != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        for cached in self.group_cached:
            cached.clear()
        return True

    def drop_cached(self, block_id: int) -> None:
        """Take block ``block_id`` out of the prefix cache without telling ``on_evict``: its
        content is garbage (a failed KV load), so nothing may keep a copy of it."""
        self._evict(self.blocks[block_id], notify=False)

    def _evict(self, block: KVCacheBlock, notify: bool = True) -> None:
        if block.block_hash is not None:
            cached = self.group_cached[block.group]
            if cached.get(block.block_hash) is block:
                del cached[block.block_hash]
                if notify and self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None

    def check_invariants(self) -> None:
        """Raise if the pool's bookkeeping is inconsistent (tests call this after every step)."""
        free = list(self.free_queue)
        if len(free) != self.free_queue.num_free:
            raise AssertionError("free count does not match the free list")
        if len({b.block_id for b in free}) != len(free):
            raise AssertionError("a block is in the free list twice")
        for block in self.blocks:
            in_free = block.prev_free is not None
            if in_free != (block.ref_cnt == 0):
                raise AssertionError(f"{block}: free-list membership disagrees with ref count")
            if block.ref_cnt < 0:
                raise AssertionError(f"{block}: negative ref count")
        for group, cached in enumerate(self.group_cached):
            for h, block in cached.items():
                if block.block_hash != h or block.group != group:
                    raise AssertionError(f"{block}: cached under a hash or group it does not "
                                         "hold")
        if len(self.group_cached) > 1:
            used = [0] * len(self.group_cached)
            for block in self.blocks:
                if block.ref_cnt > 0 and block.group >= 0:
                    used[block.group] += 1
            if used != self.group_used:
                raise AssertionError(f"blocks held per group {used} but counted "
                                     f"{self.group_used}")
