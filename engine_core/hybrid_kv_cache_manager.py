"""The KV cache manager of models with several KV groups (``kv_groups``): sliding-window layers,
or a mix of window sizes and full attention.

Each group keeps its own block table per request over the one shared pool. All tables of a
request have the same length (one entry per block of positions), so a token's entry is at the
same index in every group; a sliding-window group puts the pool's *null block* where it holds
nothing: blocks that fell out of the window of every token still to be computed are given back
(their hashes stay cached until the blocks are handed out again), and blocks that would lie
wholly outside that window are never allocated. The attention kernels never read those entries:
the window masks them and they skip the tiles before it.

Prefix caching: blocks are hashed per token block as before (one hash for all groups) and cached
per (group, hash). A hit of n blocks needs every full-attention group to hold all n blocks and
every sliding group the blocks of the window at position n * block_size.

Models whose layers are all full attention never get here: ``KVCacheManager`` serves them, as
before this existed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tidal.engine_core.block_hash import BlockHasher
from tidal.engine_core.block_pool import BlockPool, KVCacheBlock
from tidal.engine_core.kv_groups import KVLayout
from tidal.engine_core.request import Request

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GroupHit:
    """A prefix-cache hit of ``num_blocks`` blocks: each group's table for them (null blocks
    where a sliding group needs nothing)."""

    num_blocks: int = 0
    tables: list[list[KVCacheBlock]] = field(default_factory=list)

    def __len__(self) -> int:  # as a hit list's: the scheduler counts hit tokens by it
        return self.num_blocks


_NO_HIT = GroupHit()


@dataclass(slots=True)
class _RequestBlocks:
    tables: list[list[KVCacheBlock]]
    # Per group, leading entries that are null already (sliding groups; 0 for full ones).
    dropped: list[int]
    num_cached: int = 0  # leading blocks registered in the cache


class HybridKVCacheManager:
    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int,
                 enable_caching: bool = False, hash_seed: int | None = None) -> None:
        self.layout = layout
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = layout.windows()
        self.num_groups = len(self.windows)
        self.pool = BlockPool(num_blocks, enable_caching, self.num_groups)
        # Stands in for the blocks a sliding group does not hold; never written (no token's
        # slot is in it) nor read (outside every window).
        self.null_block = self.pool.reserve() if layout.has_sliding else None
        self.null_id = self.null_block.block_id if self.null_block is not None else -1
        self.hasher = BlockHasher(block_size, hash_seed)
        self.full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self.sliding_groups = [(g, w) for g, w in enumerate(self.windows) if w is not None]
        self.reqs: dict[str, _RequestBlocks] = {}
        # As KVCacheManager's: up to there the scheduler skips ``allocate_slots``.
        self.noop_limit: dict[str, int] = {}
        self.queries = 0
        self.hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def group_usage(self) -> list[float]:
        """Share of the usable pool each group holds."""
        usable = max(1, self.pool.num_blocks - self.pool.num_reserved)
        return [n / usable for n in self.pool.group_used]

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    # --- prefix cache ---------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> GroupHit:
        """The longest cached prefix every group can resume from (at least one token is left
        to compute)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return _NO_HIT
        bs = self.block_size
        hashes = self.hasher.update(request)
        n = min(len(hashes), (request.num_tokens - 1) // bs)
        group_cached = self.pool.group_cached
        for g in self.full_groups:
            cached = group_cached[g]
            k = 0
            while k < n and hashes[k] in cached:
                k += 1
            n = k
        if n and self.sliding_groups:
            # runs[s][i]: cached blocks in a row ending at block i, in sliding group s.
            runs = []
            for g, _ in self.sliding_groups:
                cached = group_cached[g]
                run, r = [], 0
                for h in hashes[:n]:
                    r = r + 1 if h in cached else 0
                    run.append(r)
                runs.append(run)
            while n:
                if all(run[n - 1] >= n - max(0, n * bs - w + 1) // bs
                       for run, (_, w) in zip(runs, self.sliding_groups)):
                    break
                n -= 1
        if not n:
            return _NO_HIT
        tables: list[list[KVCacheBlock]] = []
        null = self.null_block
        for g, w in enumerate(self.windows):
            cached = group_cached[g]
            first = 0 if w is None else max(0, n * bs - w + 1) // bs
            table = [null] * first if first else []
            table.extend(cached[h] for h in hashes[first:n])
            tables.append(table)  # type: ignore[arg-type]
        return GroupHit(n, tables)

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        if (not self.enable_caching or request.num_preemptions
                or request.sampling_params.prompt_logprobs is not None):
            return
        self.queries += request.num_tokens
        self.hits += num_hit_tokens

    # --- allocation -----------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: GroupHit | None = None) -> list[list[int]] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (``computed``: its
        prefix-cache hit on admission, already counted in ``num_computed_tokens``).

        Sliding groups first give back the blocks no token still to be computed can see.
        Returns each group's new table entries (null ids included, so the worker's tables stay
        aligned), ``[]`` when no table grew, or None when the pool cannot supply the blocks
        (the allocation then changed nothing but those give-backs)."""
        rid = request.request_id
        bs = self.block_size
        pool = self.pool
        null = self.null_block
        c = request.num_computed_tokens
        total = c + num_new_tokens
        n_total = -(-total // bs)
        state = self.reqs.get(rid)
        if state is None:
            hit = computed if computed else None
            tables = [list(t) for t in hit.tables] if hit is not None else [
                [] for _ in self.windows]
            dropped = [0] * self.num_groups
            if hit is not None:
                for g, w in self.sliding_groups:
                    dropped[g] = max(0, hit.num_blocks * bs - w + 1) // bs
            cur = len(tables[0])
        else:
            tables, dropped = state.tables, state.dropped
            cur = len(tables[0])
            # Give back what slid out of every window still to come.
            free_grouped = pool.free_grouped
            for g, w in self.sliding_groups:
                first = min(max(0, c - w + 1) // bs, cur)
                start = dropped[g]
                if first > start:
                    table = tables[g]
                    gone = [b for b in table[start:first] if b is not null]
                    table[start:first] = [null] * (first - start)  # type: ignore[list-item]
                    dropped[g] = first
                    if gone:
                        free_grouped(gone)
        grow = n_total - cur
        # Blocks to allocate: every group grows by ``grow`` entries, sliding groups with nulls
        # for the entries before the window of the first token to compute.
        need = 0
        skips = [0] * self.num_groups
        if grow > 0:
            need = grow * len(self.full_groups)
            for g, w in self.sliding_groups:
                first = max(0, c - w + 1) // bs
                skip = min(max(0, first - cur), grow)
                skips[g] = skip
                need += grow - skip
        reclaim = 0
        if state is None and computed:
            reclaim = sum(1 for t in computed.tables for b in t
                          if b is not null and b.ref_cnt == 0)
        if need + reclaim > pool.free_queue.num_free:
            return None
        if state is None:
            if computed:
                pool.touch_grouped(b for t in computed.tables for b in t if b is not null)
            state = self.reqs[rid] = _RequestBlocks(tables, dropped)
        new_ids: list[list[int]] = []
        if grow > 0:
            allocate_for = pool.allocate_for
            null_id = self.null_id
            for g in range(self.num_groups):
                skip = skips[g]
                ids = [null_id] * skip if skip else []
                if skip:
                    tables[g].extend([null] * skip)  # type: ignore[list-item]
                    if dropped[g] == cur:  # all nulls so far: they are dropped entries too
                        dropped[g] = cur + skip
                n = grow - skip
                if n:
                    blocks = allocate_for(g, n)
                    tables[g].extend(blocks)
                    ids.extend(b.block_id for b in blocks)
                new_ids.append(ids)
        if self.enable_caching:
            full = min(total, len(request.all_token_ids)) // bs
            if full > state.num_cached:
                self._cache_blocks(request, state, full)
        self.noop_limit[rid] = len(tables[0]) * bs
        return new_ids

    def _cache_blocks(self, request: Request, state: _RequestBlocks, end: int) -> None:
        hashes = request.block_hashes
        if len(hashes) < end:
            self.hasher.update(request, end * self.block_size)
        cache_block = self.pool.cache_block
        null = self.null_block
        for table in state.tables:
            for i in range(state.num_cached, end):
                block = table[i]
                if block is not null:
                    cache_block(block, hashes[i])
        state.num_cached = end

    def free(self, request: Request) -> None:
        self.noop_limit.pop(request.request_id, None)
        state = self.reqs.pop(request.request_id, None)
        if state is None:
            return
        null = self.null_block
        # Tail first: the end of a sequence is the least likely to be shared.
        for table in state.tables:
            self.pool.free_grouped(b for b in reversed(table) if b is not null)

    def block_ids(self, request_id: str) -> list[int]:
        state = self.reqs.get(request_id)
        return [b.block_id for b in state.tables[0]] if state is not None else []

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The tables of groups 1.. (group 0's is ``block_ids``)."""
        state = self.reqs.get(request_id)
        if state is None:
            return []
        return [[b.block_id for b in t] for t in state.tables[1:]]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_stats(self) -> tuple[int, int]:
        out = (self.queries, self.hits)
        self.queries = self.hits = 0
        return out

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held: dict[int, int] = {}
        null = self.null_block
        for state in self.reqs.values():
            lengths = {len(t) for t in state.tables}
            if len(lengths) != 1:
                raise AssertionError(f"a request's group tables differ in length: {lengths}")
            for g, table in enumerate(state.tables):
                for i, b in enumerate(table):
                    if b is null:
                        if self.windows[g] is None:
                            raise AssertionError(f"full-attention group {g} holds a null block")
                        continue
                    if i < state.dropped[g]:
                        raise AssertionError(f"group {g} holds a block it dropped")
                    if b.group != g:
                        raise AssertionError(f"{b} of group {b.group} in group {g}'s table")
                    held[b.block_id] = held.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            if block is null:
                continue
            if held.get(block.block_id, 0) != block.ref_cnt:
                raise AssertionError(
                    f"{block}: held by {held.get(block.block_id, 0)} tables but ref count "
                    f"is {block.ref_cnt}")
