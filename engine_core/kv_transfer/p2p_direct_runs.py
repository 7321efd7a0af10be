"""Which blocks of a P2P KV pull go straight from cache to cache (no staging copy).

A run of consecutive block ids in one layer's cache is one contiguous slice per K / V half
(``[2, blocks, ...]``: ``cache[h, a:b]``; MLA's ``[blocks, ...]``: ``cache[a:b]``), so where the
producer's source blocks and the consumer's destination blocks are both consecutive, a
two-rank group can send from one cache's slice into the other's without gathering the blocks
into a staging tensor and scattering them out again (two device passes saved per side). A fresh
long prompt's blocks usually come out of the pool in one run on both sides.

The consumer tells the producer the run lengths of its destination ids (``KVPull.runs``); the
producer cuts the asked blocks where either side's run breaks and sends the stretches at least
``min_blocks`` long directly (``KVChunk.direct``: flat ``[offset, length, ...]`` in the asked
blocks' positions). Everything else is staged as before, in one tensor sent first. The wire
order of a chunk, both sides: the staged tensor (if any), then per layer, per direct run, per
half, one slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A direct send shorter than this (one layer's K or V over the run) is staged instead: each
# send costs a fixed overhead on the wire, staging two extra passes over its bytes.
DIRECT_MIN_BYTES = 512 * 1024


def _one_run(ids: list[int]) -> bool:
    """All of ``ids`` consecutive (a fresh long prompt's usual case: checked at C speed, not
    id by id, since a pull's control path is on its latency)."""
    return bool(ids) and ids[-1] - ids[0] == len(ids) - 1 and \
        ids == list(range(ids[0], ids[0] + len(ids)))


def run_lengths(ids: list[int]) -> list[int]:
    """The lengths of the maximal runs of consecutive ids, in order."""
    if _one_run(ids):
        return [len(ids)]
    runs: list[int] = []
    for i, block in enumerate(ids):
        if i and block == ids[i - 1] + 1:
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def plan_direct(src_ids: list[int], peer_runs: list[int], min_blocks: int) -> list[int]:
    """The producer's cut: flat ``[offset, length, ...]`` of the stretches of ``src_ids``
    consecutive on both sides (the consumer's runs ``peer_runs``), each at least
    ``min_blocks`` long. Raises ``ValueError`` when the runs do not cover the asked blocks."""
    n = len(src_ids)
    if any(type(r) is not int or r < 1 for r in peer_runs) or sum(peer_runs) != n:
        raise ValueError(f"the pull's destination runs do not cover its {n} blocks")
    if len(peer_runs) == 1 and _one_run(src_ids):
        return [0, n] if n >= min_blocks else []
    breaks = set()
    at = 0
    for r in peer_runs:
        at += r
        breaks.add(at)
    out: list[int] = []
    start = 0
    for i in range(1, n + 1):
        if i == n or i in breaks or src_ids[i] != src_ids[i - 1] + 1:
            if i - start >= min_blocks:
                out += [start, i - start]
            start = i
    return out


def check_direct(direct: list[int], dst_ids: list[int]) -> list[tuple[int, int]]:
    """The consumer's check of the producer's cut: sorted, disjoint, inside the pull, and each
    run consecutive in ``dst_ids`` (so a slice never writes a block outside the pull's).
    Raises ``ValueError``."""
    if len(direct) % 2:
        raise ValueError("the direct runs are not (offset, length) pairs")
    runs = [(direct[k], direct[k + 1]) for k in range(0, len(direct), 2)]
    end = 0
    for offset, length in runs:
        if offset < end or length < 1 or offset + length > len(dst_ids):
            raise ValueError(f"direct run ({offset}, {length}) is out of order or outside "
                             f"the pull's {len(dst_ids)} blocks")
        if run_lengths(dst_ids[offset:offset + length]) != [length]:
            raise ValueError(f"direct run ({offset}, {length}) is not consecutive here")
        end = offset + length
    return runs


def staged_positions(n: int, runs: list[tuple[int, int]]) -> list[int]:
    """The asked blocks' positions that no direct run covers (they travel staged)."""
    if runs == [(0, n)]:
        return []
    covered = [False] * n
    for offset, length in runs:
        covered[offset:offset + length] = [True] * length
    return [i for i in range(n) if not covered[i]]


@dataclass(frozen=True, slots=True)
class CacheBytes:
    """One contiguous layer cache as flat bytes, with where its blocks lie: a run's slice is
    one ``narrow`` of ``flat`` (a pull cuts 64 of them for an 8k prompt of a 32-layer model,
    on its latency path: one cheap op each, not three indexing ops)."""

    flat: torch.Tensor  # uint8, 1-D, the cache's storage in place
    halves: int  # K and V (``[2, blocks, ...]``), or 1 (MLA's ``[blocks, ...]``)
    half_bytes: int
    block_bytes: int

    @classmethod
    def of(cls, cache: torch.Tensor) -> CacheBytes:
        halves = 1 if cache.dim() == 3 else cache.shape[0]
        blocks = cache.shape[0] if cache.dim() == 3 else cache.shape[1]
        flat = cache.view(torch.uint8).reshape(-1)  # (a view: the cache is contiguous)
        half = flat.numel() // halves
        return cls(flat, halves, half, half // max(1, blocks))


def run_slices(cache: CacheBytes, first_block: int, length: int) -> list[torch.Tensor]:
    """The contiguous slices of ``length`` blocks from ``first_block`` of one layer's cache:
    one per K / V half (``[2, blocks, ...]``), or one (MLA's ``[blocks, ...]``); as flat bytes,
    as the staging tensor is (a group may know no float8 type)."""
    start, size = first_block * cache.block_bytes, length * cache.block_bytes
    return [cache.flat.narrow(0, h * cache.half_bytes + start, size)
            for h in range(cache.halves)]


def min_direct_blocks(caches: list[torch.Tensor], min_bytes: int) -> int:
    """Blocks a run needs for each of its sends to be at least ``min_bytes``."""
    per_block = min(c[0].numel() * c.element_size() // c.shape[1] if c.dim() != 3
                    else c[0].numel() * c.element_size() for c in caches)
    return max(1, -(-min_bytes // max(1, per_block)))


def all_contiguous(caches: list[torch.Tensor]) -> bool:
    """Only a contiguous cache's block runs are contiguous slices."""
    return all(c.is_contiguous() for c in caches)
