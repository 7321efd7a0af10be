"""Which KV blocks each request holds: allocation, release and prefix-cache hits on top of the
block pool.

This is the manager of models with one KV group of full-attention layers (``kv_groups``);
``HybridKVCacheManager`` takes models with sliding-window layers.

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
        # request id -> the most tokens (computed + new) its current blocks cover: up to there
        # the scheduler's per-request hot loop skips ``allocate_slots`` (most decode steps).
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

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (failed admissions retry and are not counted).
        As vLLM counts them (its ``prefix_cache_queries``/``hits``): nothing when the request
        did not read the cache (caching off, prompt logprobs), nor a preempted request's lookup
        on resuming, so the hit rate is that of new prompts."""
        if (not self.enable_caching or request.num_preemptions
                or request.sampling_params.prompt_logprobs is not None):
            return
        self.queries += request.num_tokens
        self.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: list[KVCacheBlock] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` beyond its computed ones
        (``computed``: prefix-cache hits taken on admission, already counted in
        ``request.num_computed_tokens``).

        Returns the ids of newly allocated blocks (possibly empty), or None if the pool cannot
        supply them, in which case nothing changes.
        """
        # Called for every request that outgrows its blocks (every block_size tokens, twice
        # with prefix caching): kept to plain local arithmetic.
        rid = request.request_id
        bs = self.block_size
        blocks = self.req_blocks.get(rid)
        total = request.num_computed_tokens + num_new_tokens
        need = -(-total // bs) - (len(blocks) if blocks is not None else 0)
        if computed:
            need -= len(computed)
            # Hits on blocks nobody holds come out of the free list too.
            reclaimed = sum(1 for b in computed if b.ref_cnt == 0)
            if max(need, 0) + reclaimed > self.pool.free_queue.num_free:
                return None
            self.pool.touch(computed)
        elif need > self.pool.free_queue.num_free:
            return None
        if blocks is None:
            blocks = self.req_blocks[rid] = []
        if computed:
            blocks.extend(computed)
        new_ids: list[int] = []
        if need > 0:
            new = self.pool.allocate(need)
            blocks.extend(new)
            new_ids = [b.block_id for b in new]
        if self.enable_caching:
            # Register the full blocks whose tokens are all known (with async scheduling the
            # last token may still be being sampled). A decode block that fills is registered
            # by the call that allocates the next one: one call per block, not two, at the
            # price of a block registered a step later (and the last block of a request that
            # ends exactly on a block boundary staying unregistered).
            num_cached = self._num_cached.get(rid, 0)
            full = min(total, len(request.all_token_ids)) // bs
            if full > num_cached:
                self._cache_blocks(request, blocks, num_cached, full)
        self.noop_limit[rid] = len(blocks) * bs
        return new_ids

    def _cache_blocks(self, request: Request, blocks: list[KVCacheBlock], start: int,
                      end: int) -> None:
        """Register ``request``'s blocks [start, end) (full, their tokens known) under their
        hashes; the first ``start`` are registered already."""
        hashes = request.block_hashes
        if len(hashes) < end:
            self.hasher.update(request, end * self.block_size)
        cache_block = self.pool.cache_block
        for i in range(start, end):
            cache_block(blocks[i], hashes[i])
        self._num_cached[request.request_id] = end

    def free(self, request: Request) -> None:
        self._num_cached.pop(request.request_id, None)
        self.noop_limit.pop(request.request_id, None)
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a sequence is the least likely to be shared.
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """Tables of KV groups beyond the first: none here (one group of full attention; models
        with several use ``HybridKVCacheManager``)."""
        return []

    def group_usage(self) -> list[float]:
        return []

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
