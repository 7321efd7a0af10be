"""Which KV blocks each request holds; allocation and release on top of the block pool."""

from __future__ import annotations

import logging

from tidal.engine_core.block_pool import BlockPool, KVCacheBlock
from tidal.engine_core.request import Request

logger = logging.getLogger(__name__)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for ``num_new_tokens`` more computed tokens of ``request``.

        Returns the ids of newly allocated blocks (possibly empty), or None if the pool cannot
        supply them, in which case nothing changes.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(blocks)
        if need <= 0:
            return []
        if need > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        new = self.pool.allocate(need)
        blocks.extend(new)
        return [b.block_id for b in new]

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a sequence is the least likely to be shared.
            self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

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
