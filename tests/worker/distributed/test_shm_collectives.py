"""Shared-memory collectives (``worker/distributed/shm_collectives.py``) against gloo, in worlds
of 2 and 3 spawned CPU processes: all-reduce bit-identical to gloo's for every dtype (float32
sums in gloo's ring order, which differs from a left-to-right sum for 3 ranks), all-gather
along each dimension, broadcast from every rank, send/recv around the ring (sends queued past
a full mailbox, no deadlock when everyone sends first), tensors larger than a slot in pieces,
and the segment removed from /dev/shm. A rank killed while its peer waits in a collective is
named (rank and pid) within 5 s; so are a rank that left the group and a receive of the wrong
size.

Slots are tiny (4 KiB, mailboxes 2 x 1 KiB) so that the small tensors used here already go in
pieces. Children report over a Pipe with msgspec bytes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import pytest

SPAWN = mp.get_context("spawn")
SLOT = 4096
MAIL_SLOTS = 2
MAIL_SLOT = 1024


class Report(msgspec.Struct):
    rank: int
    checks: dict[str, bool]
    segment: str = ""
    error: str = ""
    elapsed: float = 0.0


def _inputs(n: int, dtype, rank: int, seed: int):
    """Values spread over many magnitudes, so that the order of a float sum shows."""
    import torch

    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype.is_floating_point:
        mag = 10.0 ** torch.randint(-4, 5, (n,), generator=g).to(torch.float32)
        return (torch.randn(n, generator=g) * mag).to(dtype)
    return torch.randint(-(1 << 20), 1 << 20, (n,), generator=g, dtype=dtype)


def _bits_equal(a, b) -> bool:
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))
    return torch.equal(a, b)


def _join(rank: int, world: int, conn: Connection):
    """Join a gloo world (rendezvous through the parent) and return (gloo group, shm group)."""
    import torch

    from tidal.worker.distributed.parallel_state import (
        ParallelGroup,
        init_distributed,
        serve_store,
    )
    from tidal.worker.distributed.shm_collectives import ShmCollectives

    torch.set_num_threads(1)
    store = None
    if rank == 0:
        store = serve_store("127.0.0.1")
        conn.send_bytes(msgspec.msgpack.encode(int(store.port)))
    port = msgspec.msgpack.decode(conn.recv_bytes(), type=int)
    gloo, _ = init_distributed(rank=rank, tp_size=world, pp_size=1, host="127.0.0.1",
                               port=port, device=torch.device("cpu"), store=store)
    shm = ShmCollectives.create(gloo.cpu_group, gloo.rank, gloo.ranks, slot_bytes=SLOT,
                                mailbox_slots=MAIL_SLOTS, mailbox_slot_bytes=MAIL_SLOT)
    fast = ParallelGroup(rank=gloo.rank, world_size=gloo.world_size,
                         device_group=gloo.device_group, cpu_group=gloo.cpu_group,
                         ranks=gloo.ranks, shm=shm)
    return gloo, fast, shm, store


def _child(rank: int, world: int, conn: Connection) -> None:
    import torch

    from tidal.worker.distributed.parallel_state import ParallelGroup, destroy_distributed
    from tidal.worker.distributed.shm_collectives import ShmCollectives

    checks: dict[str, bool] = {}
    segment = ""
    try:
        gloo, fast, shm, _store = _join(rank, world, conn)
        segment = shm.name
        fast.barrier()  # rank 0 unlinked the name before its first operation
        checks["segment_unlinked"] = not os.path.exists(f"/dev/shm/{segment}")

        # all_reduce: every dtype, sizes below, at and above a slot, a non-contiguous tensor.
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
        sizes = (1, 7, 1000, 3001)
        big = fast
        if world == 3:
            # More than 2 segments per rank in gloo's ring (> 6 x 1 MiB): its layout changes.
            # (A second group with the default 1 MiB slots: a few pieces, not 1,700.)
            sizes += (1_700_001,)
            big = ParallelGroup(rank=gloo.rank, world_size=3, ranks=gloo.ranks,
                                shm=ShmCollectives.create(gloo.cpu_group, gloo.rank, gloo.ranks))
        for dtype in dtypes:
            for n in sizes:
                if n > 10_000 and dtype != torch.float32:
                    continue
                mine = _inputs(n, dtype, rank, seed=n)
                want = gloo.all_reduce(mine.clone())
                got = (big if n > 10_000 else fast).all_reduce(mine.clone())
                checks[f"all_reduce_{dtype}_{n}"] = _bits_equal(got, want)
                if world == 3 and dtype == torch.float32 and n >= 1000:
                    # The order matters here: a plain rank-order sum differs from gloo's.
                    left = _inputs(n, dtype, 0, seed=n)
                    for r in range(1, world):
                        left = left + _inputs(n, dtype, r, seed=n)
                    checks[f"order_matters_{n}"] = not _bits_equal(left, want)
        base = _inputs(2 * 33 * 40, torch.float32, rank, seed=5).view(2, 33, 40)
        strided = base.transpose(0, 2)  # not contiguous: reduced in place all the same
        want = gloo.all_reduce(strided.clone())
        got = fast.all_reduce(strided)
        checks["all_reduce_strided"] = got is strided and _bits_equal(got.contiguous(), want)

        # all_gather along each dimension, odd shapes, one of them larger than a slot.
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for shape in ((3, 5, 7), (41, 37)):
                x = _inputs(int(torch.tensor(shape).prod()), dtype, rank, seed=7).view(shape)
                for dim in range(-1, len(shape)):
                    key = f"all_gather_{dtype}_{shape}_{dim}"
                    checks[key] = _bits_equal(fast.all_gather(x, dim=dim),
                                              gloo.all_gather(x, dim=dim))

        # broadcast from every rank (a tensor larger than a slot too).
        for src in range(world):
            for n, dtype in ((3, torch.float16), (5000, torch.float32), (9, torch.int32)):
                x = _inputs(n, dtype, rank, seed=11)
                got = fast.broadcast(x.clone(), src=src)
                checks[f"broadcast_{src}_{n}"] = _bits_equal(got, _inputs(n, dtype, src, seed=11))

        # send/recv around the ring: everyone sends every message first (more pieces than the
        # mailbox holds: queued, not blocking), then receives, then waits on its handles.
        sizes = (0, 1, 256, 3000, 17)
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        outgoing = [_inputs(n, torch.float32, rank, seed=100 + i) for i, n in enumerate(sizes)]
        handles = [fast.send(t, nxt) for t in outgoing]
        got = [fast.recv(torch.empty(n), prv) for n in sizes]
        for h in handles:
            h.wait()
        checks["send_recv_ring"] = all(
            _bits_equal(g, _inputs(n, torch.float32, prv, seed=100 + i))
            for i, (g, n) in enumerate(zip(got, sizes)))
        if world == 3:
            # Pipeline-style along 0 -> 1 -> 2 with an int header then a strided receive.
            if rank < 2:
                h = fast.send(torch.tensor([rank, 7], dtype=torch.int64), rank + 1)
                h.wait()
            if rank > 0:
                head = fast.recv(torch.empty(2, dtype=torch.int64), rank - 1)
                checks["send_recv_header"] = head.tolist() == [rank - 1, 7]
        fast.barrier()
        checks["ops_after_send_recv"] = float(fast.all_reduce(torch.ones(1)).item()) == world

        conn.send_bytes(msgspec.msgpack.encode(Report(rank, checks, segment)))
    except Exception:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send_bytes(msgspec.msgpack.encode(Report(rank, checks, segment,
                                                      traceback.format_exc())))
        return
    if world != 2:
        # Misuse and departures are named: rank 0 leaves; rank 1 then waits for it in a barrier
        # (after sending rank 2 a message shorter than rank 2 expects).
        if rank == 0:
            destroy_distributed(fast, big)
            conn.send_bytes(msgspec.msgpack.encode(Report(rank, {}, segment)))
            return
        errors = {}
        try:
            if rank == 1:
                fast.send(torch.zeros(2), 2).wait()
                fast.barrier()
            else:
                fast.recv(torch.empty(4), 1)
        except Exception as exc:  # noqa: BLE001 - what the test checks
            errors[rank] = f"{type(exc).__name__}: {exc}"
        conn.send_bytes(msgspec.msgpack.encode(Report(rank, {}, segment, errors.get(rank, ""))))
        return
    # The 2-rank world goes on: rank 0 waits in an all-reduce that rank 1 never joins, and
    # the test kills rank 1.
    if rank != 0:
        time.sleep(600)  # killed here
    conn.recv_bytes()  # the go: rank 1 is about to be killed
    start = time.monotonic()
    try:
        # Larger than a slot: rank 0 is mid-collective (first piece) when its peer dies.
        fast.all_reduce(torch.ones(5000))
        error = ""
    except Exception as exc:  # noqa: BLE001 - what the test checks
        error = f"{type(exc).__name__}: {exc}"
    conn.send_bytes(msgspec.msgpack.encode(Report(rank, {}, segment, error,
                                                  time.monotonic() - start)))


def _start(target, world: int):
    procs, conns = [], []
    for rank in range(world):
        parent, child = SPAWN.Pipe()
        p = SPAWN.Process(target=target, args=(rank, world, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    return procs, conns


def _rendezvous(conns, timeout: float = 120.0) -> None:
    assert conns[0].poll(timeout), "rank 0 did not report the store port"
    port = conns[0].recv_bytes()
    for c in conns:
        c.send_bytes(port)


def _reports(conns, timeout: float = 180.0) -> list[Report]:
    out = []
    for c in conns:
        assert c.poll(timeout), "a rank did not report"
        out.append(msgspec.msgpack.decode(c.recv_bytes(), type=Report))
    return out


@pytest.fixture(scope="module")
def worlds():
    """Worlds of 2 and 3 ranks, started at once (their start-ups overlap), after their
    operation checks: {world: (processes, pipes, reports)}."""
    started = {w: _start(_child, w) for w in (2, 3)}
    try:
        for procs, conns in started.values():
            _rendezvous(conns)
        yield {w: (procs, conns, _reports(conns)) for w, (procs, conns) in started.items()}
    finally:
        for procs, _ in started.values():
            for p in procs:
                p.kill()
                p.join(10)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_every_op_matches_gloo(worlds, world):
    procs, conns, reports = worlds[world]
    for rep in reports:
        assert not rep.error, (world, rep.rank, rep.error)
        failed = [k for k, ok in rep.checks.items() if not ok]
        assert rep.checks and not failed, (world, rep.rank, failed)
    assert len({r.segment for r in reports}) == 1  # one segment per group
    assert not os.path.exists(f"/dev/shm/{reports[0].segment}")
    if world == 3:
        assert "order_matters_1700001" in reports[0].checks
        assert "send_recv_header" in reports[2].checks
        after = _reports(conns)  # what came of the misuse and of rank 0 leaving
        assert not after[0].error
        assert after[1].error.startswith("ShmCollectiveError") and "rank 0" in after[1].error \
            and "closed its end" in after[1].error and "barrier" in after[1].error, after[1].error
        assert after[2].error.startswith("ShmCollectiveError") and "8 bytes" in after[2].error \
            and "16 were expected" in after[2].error, after[2].error
        for p in procs:
            p.join(30)
            assert p.exitcode == 0


@pytest.mark.slow
def test_a_dead_peer_is_named_within_five_seconds(worlds):
    procs, conns, reports = worlds[2]
    assert not any(r.error for r in reports), [r.error for r in reports]
    victim = procs[1].pid
    conns[0].send_bytes(b"go")
    time.sleep(0.3)  # rank 0 is now waiting for rank 1 in the all-reduce
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    assert conns[0].poll(10), "the survivor kept waiting for its dead peer"
    rep = msgspec.msgpack.decode(conns[0].recv_bytes(), type=Report)
    noticed = time.monotonic() - killed
    print(f"dead peer noticed {noticed:.2f} s after kill -9: {rep.error}")
    assert rep.error.startswith("PeerDiedError"), rep.error
    assert "rank 1" in rep.error and f"pid {victim}" in rep.error and "all_reduce" in rep.error
    assert noticed < 5.0
