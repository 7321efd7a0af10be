"""Process groups on CPU (gloo): rendezvous on a free port served by rank 0, the tensor-/pipeline-
parallel layout of a TP=2 x PP=2 world, and every collective of ``ParallelGroup``. Every rank
listens on loopback only (the store, and gloo's connections).

Two worlds run at the same time on this host (4 ranks and 2 ranks), each on a port the kernel
picked, to show that engines can share a host. Children report over a Pipe with msgspec bytes.
"""

from __future__ import annotations

import ipaddress
import multiprocessing as mp
from multiprocessing.connection import Connection

import msgspec

from tidal.worker.distributed.parallel_state import ParallelGroup, rank_layout, single_group

SPAWN = mp.get_context("spawn")


class Report(msgspec.Struct):
    rank: int
    tp: tuple[int, int, list[int]]  # group rank, world size, members
    pp: tuple[int, int, list[int]]
    checks: dict[str, bool]
    error: str = ""


def _child(rank: int, tp_size: int, pp_size: int, conn: Connection) -> None:
    import torch

    from tidal.worker.distributed.parallel_state import (
        destroy_distributed,
        init_distributed,
        serve_store,
    )

    torch.set_num_threads(1)
    checks: dict[str, bool] = {}
    tp = pp = ParallelGroup()
    try:
        store = None
        if rank == 0:
            store = serve_store("127.0.0.1")
            conn.send_bytes(msgspec.msgpack.encode(int(store.port)))
        port = msgspec.msgpack.decode(conn.recv_bytes(), type=int)
        tp, pp = init_distributed(rank=rank, tp_size=tp_size, pp_size=pp_size,
                                  host="127.0.0.1", port=port, device=torch.device("cpu"),
                                  store=store)
        t_rank, p_rank = rank_layout(rank, tp_size)
        checks["layout"] = tp.rank == t_rank and pp.rank == p_rank
        # The store (rank 0) and gloo's own listeners: nothing reachable from the network.
        checks["listens_on_loopback_only"] = _listens_on_loopback_only()

        x = torch.full((3,), float(rank + 1))
        tp.all_reduce(x)
        checks["all_reduce"] = torch.equal(x, torch.full((3,), float(sum(r + 1 for r in tp.ranks))))

        y = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * tp.rank
        want_last = torch.cat([torch.arange(6.0).reshape(2, 3) + 100 * r
                               for r in range(tp.world_size)], dim=-1)
        want_first = torch.cat([torch.arange(6.0).reshape(2, 3) + 100 * r
                                for r in range(tp.world_size)], dim=0)
        checks["all_gather_last"] = torch.equal(tp.all_gather(y, dim=-1), want_last)
        checks["all_gather_first"] = torch.equal(tp.all_gather(y, dim=0), want_first)

        b = torch.full((4,), float(rank))
        tp.broadcast(b, src=tp.world_size - 1)
        checks["broadcast"] = torch.equal(b, torch.full((4,), float(tp.ranks[-1])))
        c = torch.full((2,), float(rank), dtype=torch.float64)
        tp.broadcast(c, src=0, cpu=True)
        checks["broadcast_cpu"] = torch.equal(c, torch.full((2,), float(tp.ranks[0]),
                                                             dtype=torch.float64))

        # Send/recv along the pipeline, like stage-to-stage transfers: each stage receives
        # from the previous and sends to the next (async sends, waited afterwards).
        if pp.world_size > 1:
            works = []
            if not pp.is_last:
                payload = torch.arange(5, dtype=torch.float32) + 10 * pp.rank
                works.append(pp.send(payload, pp.rank + 1))
                header = torch.tensor([pp.rank, 7], dtype=torch.int64)
                works.append(pp.send(header, pp.rank + 1, cpu=True))
            if not pp.is_first:
                got = pp.recv(torch.empty(5), pp.rank - 1)
                head = pp.recv(torch.empty(2, dtype=torch.int64), pp.rank - 1, cpu=True)
                checks["send_recv"] = torch.equal(got, torch.arange(5.0) + 10 * (pp.rank - 1))
                checks["send_recv_cpu"] = head.tolist() == [pp.rank - 1, 7]
            for w in works:
                w.wait()
            checks["pp_all_reduce"] = float(pp.all_reduce(torch.ones(1)).item()) == pp.world_size
        tp.barrier()
        pp.barrier()
        destroy_distributed()
        conn.send_bytes(msgspec.msgpack.encode(Report(
            rank, (tp.rank, tp.world_size, list(tp.ranks)),
            (pp.rank, pp.world_size, list(pp.ranks)), checks)))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send_bytes(msgspec.msgpack.encode(Report(rank, (0, 0, []), (0, 0, []), checks,
                                                      f"{type(exc).__name__}: {exc}")))


def _listening_ips(port: int | None = None) -> list[str]:
    """The addresses this process listens on (TCP), on ``port`` or on any."""
    import psutil

    return [c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and port in (None, c.laddr.port)]


def _listens_on_loopback_only() -> bool:
    ips = _listening_ips()
    return bool(ips) and all(ipaddress.ip_address(ip).is_loopback for ip in ips)


def _start_world(tp_size: int, pp_size: int):
    procs, conns = [], []
    for rank in range(tp_size * pp_size):
        parent, child = SPAWN.Pipe()
        p = SPAWN.Process(target=_child, args=(rank, tp_size, pp_size, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    return procs, conns


def _finish_world(procs, conns, timeout: float = 120.0) -> tuple[int, list[Report]]:
    assert conns[0].poll(timeout), "rank 0 did not report the store port"
    port = msgspec.msgpack.decode(conns[0].recv_bytes(), type=int)
    for c in conns:
        c.send_bytes(msgspec.msgpack.encode(port))
    reports = []
    for c in conns:
        assert c.poll(timeout), "a rank did not report"
        reports.append(msgspec.msgpack.decode(c.recv_bytes(), type=Report))
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return port, reports


def test_groups_and_collectives_two_worlds_on_one_host():
    big = _start_world(2, 2)
    small = _start_world(2, 1)
    port_big, reports = _finish_world(*big)
    port_small, small_reports = _finish_world(*small)
    assert port_big != port_small and 0 not in (port_big, port_small)

    for rep in reports + small_reports:
        assert not rep.error, rep.error
        assert rep.checks and all(rep.checks.values()), (rep.rank, rep.checks)
    by_rank = {r.rank: r for r in reports}
    # global rank = pp_rank * tp + tp_rank: TP groups are consecutive ranks, PP groups strided.
    assert by_rank[0].tp == (0, 2, [0, 1]) and by_rank[3].tp == (1, 2, [2, 3])
    assert by_rank[1].pp == (0, 2, [1, 3]) and by_rank[2].pp == (1, 2, [0, 2])
    assert {"send_recv", "send_recv_cpu"} <= set(by_rank[2].checks)
    small_by_rank = {r.rank: r for r in small_reports}
    assert small_by_rank[1].tp == (1, 2, [0, 1]) and small_by_rank[1].pp == (0, 1, [1])


def test_store_listens_on_its_host_only():
    """torch's TCPStore binds every interface (the wildcard) whatever host it is given; the
    store rank 0 serves listens on its host alone, and still serves clients there."""
    import datetime

    import torch

    from tidal.worker.distributed.parallel_state import serve_store

    store = serve_store("127.0.0.1")
    try:
        assert _listening_ips(store.port) == ["127.0.0.1"]
        client = torch.distributed.TCPStore("127.0.0.1", store.port, None, False,
                                            timeout=datetime.timedelta(seconds=10))
        client.set("rank1", b"ready")
        assert store.get("rank1") == b"ready"
        del client
    finally:
        del store


def test_single_process_group_is_a_no_op():
    import torch

    g = single_group()
    x = torch.arange(4.0)
    assert g.all_reduce(x) is x and g.all_gather(x) is x and g.broadcast(x) is x
    assert g.is_first and g.is_last and g.world_size == 1
    g.barrier()


def test_small_tensors_take_the_fast_all_reduce_when_one_is_set():
    """``all_reduce`` hands tensors the fast path accepts to it and uses its result; others go
    to torch.distributed (not initialised here: reaching it would raise). On a CPU device no
    fast path is ever built."""
    import torch

    from tidal.worker.distributed.symm_allreduce import make_symm_allreduce

    class Doubling:
        calls = 0

        def applies(self, x):
            return x.numel() <= 4

        def __call__(self, x):
            Doubling.calls += 1
            return x * 2

    group = ParallelGroup(rank=0, world_size=2, fast_all_reduce=Doubling())
    x = torch.ones(4)
    out = group.all_reduce(x)
    assert Doubling.calls == 1 and torch.equal(out, torch.full((4,), 2.0))
    assert torch.equal(x, torch.ones(4))  # the fast path returns a new tensor
    try:
        group.all_reduce(torch.ones(8))
        raise AssertionError("a large tensor must not take the fast path")
    except (RuntimeError, ValueError):
        pass  # torch.distributed is not initialised: the NCCL/gloo path was taken
    assert Doubling.calls == 1
    assert make_symm_allreduce(None, None, 2, torch.device("cpu")) is None
