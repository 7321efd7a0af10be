"""A decode batch's tokens grouped by adapter, for the LoRA kernels' tiles.

A decode step mixing adapters runs each token on its own adapter. The per-token kernels read
an adapter's A and B once per token: at batch 64 with eight adapters, every weight eight times
over. Grouped, the tokens are sorted by slot (stably: the batch order within an adapter) and
each adapter's run is cut in tiles of at most ``tile`` tokens; one program per (tile, block of
outputs) loads the weights once for the tile (``triton_lora``'s segmented kernels through the
permutation). The tables have a fixed size per batch size (``max_tiles``), so a CUDA graph
captures the grid and replays whatever this step wrote into them.
"""

from __future__ import annotations

import numpy as np

TILE = 16  # tokens per tile: the segmented kernels' tl.dot rows (triton_lora._BLOCK_M)


def max_tiles(tokens: int, max_slots: int, tile: int) -> int:
    """Tiles a batch of ``tokens`` can need: each adapter's run adds at most one partial
    tile to the whole tiles."""
    return -(-tokens // tile) + min(max_slots, tokens)


def group_tokens(token_slots: np.ndarray, tile: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(perm, starts, lengths, slots): ``perm`` the tokens with an adapter (slot >= 0) sorted
    by slot, stably; tile k covers ``perm[starts[k]:starts[k] + lengths[k]]``, all on adapter
    slot ``slots[k]``, at most ``tile`` long. Base-model tokens (-1) are in no tile."""
    live = np.flatnonzero(token_slots >= 0)
    perm = live[np.argsort(token_slots[live], kind="stable")]
    sorted_slots = token_slots[perm]
    n = len(perm)
    if not n:
        empty = np.zeros(0, dtype=np.int64)
        return perm, empty, empty, empty
    change = np.ones(n, dtype=bool)
    change[1:] = sorted_slots[1:] != sorted_slots[:-1]
    run_start = np.flatnonzero(change)
    run_len = np.diff(np.append(run_start, n))
    per_run = -(-run_len // tile)
    first = np.repeat(run_start, per_run)
    # The tile's index within its run, times the tile length.
    within = np.arange(per_run.sum()) - np.repeat(np.cumsum(per_run) - per_run, per_run)
    starts = first + within * tile
    ends = np.repeat(run_start + run_len, per_run)
    lengths = np.minimum(ends - starts, tile)
    return perm, starts, lengths, sorted_slots[starts]
