"""The order in which gloo's ring all-reduce adds the ranks' values, so that another all-reduce
(``shm_collectives``) can add in the same order and give bit-identical floating-point sums.

gloo's ``ring`` (``gloo/allreduce.cc``; torch's ProcessGroupGloo uses it for dense CPU tensors
unless ``LOCAL_WORLD_SIZE`` selects its shared-memory variant) cuts the buffer into
``n_segments`` segments: at least two per rank, at most ``kMaxSegmentSize`` (1 MiB) each,
rounded up to a multiple of the world size. Rank ``c`` owns the ``n_segments / world``
consecutive segments of chunk ``c``. In the reduce-scatter a chunk's partial sum travels down
the ring (each rank sends to rank - 1): it starts as rank ``c - 1``'s own values, and every
rank on the way computes ``own + received``, so chunk ``c`` ends as::

    a[c] + (a[c+1] + (a[c+2] + ... + (a[c-2] + a[c-1])))     (indices mod world)

Float addition is commutative but not associative, so only that nesting matters (with two
ranks there is a single addition and any order agrees). The all-gather then copies each chunk
unchanged. tests/worker/distributed/test_shm_collectives.py checks this against gloo itself.
"""

from __future__ import annotations

# gloo's AllreduceOptionsImpl::kMaxSegmentSize: the largest segment one send carries.
MAX_SEGMENT_BYTES = 1 << 20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, multiple: int) -> int:
    return _cdiv(a, multiple) * multiple


def ring_chunks(numel: int, elem_size: int, world: int) -> list[tuple[int, int]]:
    """Element range ``[lo, hi)`` of each rank's chunk, by rank (empty ranges where the buffer
    runs out before the last ranks)."""
    if numel <= 0:
        return [(0, 0)] * world
    total = numel * elem_size
    max_segment = elem_size * max(1, MAX_SEGMENT_BYTES // elem_size)
    n_segments = _round_up(max(_cdiv(total, max_segment), 2 * world), world)
    segment = _round_up(_cdiv(total, n_segments), elem_size)
    chunk_elems = (n_segments // world) * segment // elem_size
    return [(min(c * chunk_elems, numel), min((c + 1) * chunk_elems, numel))
            for c in range(world)]


def ring_order(chunk: int, world: int) -> list[int]:
    """The ranks whose values make up chunk ``chunk``'s sum, innermost first: the sum is
    ``acc = a[order[0]]`` then ``acc = a[r] + acc`` for each later ``r``."""
    return [(chunk + k) % world for k in range(world - 1, -1, -1)]
