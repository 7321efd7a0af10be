"""Which KV blocks each request holds: allocation, release and prefix-cache hits on top of the
block pool.

With prefix caching, every full block a request computes is registered under its chained hash
as soon as it is scheduled (the K/V are written in the same forward pass, before any other
request of that step reads them), and a new request starts from the longest run of cached
blocks matching its own block hashes.
"""

from __future__ import annotations

import logging

from tidal.engine_core.block_hash import BlockHasher
from tidal.engine_core.block_pool import BlockPool, KVCacheBlock
from tidal.engine_core.request import Request

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 hash_seed: int | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hasher = BlockHasher(block_size, hash_seed)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are registered in the cache.
        self._num_cached: dict[str, int] = {}
        # request id -> the most tokens (computed + new) its current blocks cover with nothing
        # to allocate and no block to register: ``allocate_slots`` up to there is a no-op, so
        # the scheduler's per-request hot loop can skip the call (most decode steps).
        self.noop_limit: dict[str, int] = {}
        # Prefix-cache lookups since the last report, in tokens.
        self.queries = 0
        self.hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of cached blocks that starts ``request``'s tokens. At least one token
        is always left to compute (its logits are needed to sample)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        hashes = self.hasher.update(request)
        usable = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in hashes[:usable]:
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (failed admissions retry and are not counted)."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[KVCacheBlock] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` beyond its computed ones
        (``computed``: prefix-cache hits taken on admission, already counted in
        ``request.num_computed_tokens``).

        Returns the ids of newly allocated blocks (possibly empty), or None if the pool cannot
        supply them, in which case nothing changes.
        """
        blocks = self.req_blocks.get(request.request_id, [])
        computed = computed or []
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(computed)
        # Hits on blocks nobody holds come out of the free list too.
        reclaimed = sum(1 for b in computed if b.ref_cnt == 0)
        if max(need, 0) + reclaimed > self.pool.num_free_blocks:
            return None
        if computed:
            self.pool.touch(computed)
        new = self.pool.allocate(need) if need > 0 else []
        blocks = self.req_blocks.setdefault(request.request_id, blocks)
        blocks.extend(computed)
        blocks.extend(new)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, total)
        limit = len(blocks) * self.block_size
        if self.enable_caching:
            limit = min(limit, (self._num_cached.get(request.request_id, 0) + 1)
                        * self.block_size - 1)
        self.noop_limit[request.request_id] = limit
        return [b.block_id for b in new]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_tokens: int) -> None:
        start = self._num_cached.get(request.request_id, 0)
        end = num_tokens // self.block_size
        if end <= start:
            return
        # Blocks holding tokens still being sampled (async scheduling) are cached later, once
        # their values are known.
        hashes = self.hasher.update(request, num_tokens)
        end = min(end, len(hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        self._num_cached.pop(request.request_id, None)
        self.noop_limit.pop(request.request_id, None)
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a sequence is the least likely to be shared.
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_stats(self) -> tuple[int, int]:
        """(queried tokens, hit tokens) since the last call."""
        out = (self.queries, self.hits)
        self.queries = self.hits = 0
        return out

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if held.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"{block}: held by {held.get(block.block_id, 0)} requests but ref count "
                    f"is {block.ref_cnt}"
                )
