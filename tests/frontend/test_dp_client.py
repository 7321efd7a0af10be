"""``DPAsyncClient`` over fake per-rank clients (no processes): requests spread, the children
of an ``n > 1`` request stay together, aborts go to the owning rank, finishes free their slot,
a rank's death fails the client naming the rank and aborts this frontend's requests on the
other ranks, control results combined over the ranks (a LoRA adapter some rank refused taken
off the others), and start-up waits on every rank at once."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import zmq

from tidal.engine_core.control import (
    AddLora,
    GetKVStats,
    KVStats,
    ListLoras,
    LoRAIds,
    RemoveLora,
    ResetPrefixCache,
)
from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    OutputBatch,
    SchedulerStats,
)
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.async_llm import EngineDeadError
from tidal.frontend.dp_client import DPAsyncClient, combine_results, wait_all_ready
from tidal.frontend.mp_client import EngineStartupError

BLOCK = 4


class _Conn:
    proc = None
    is_local = False
    engine_pid = 0


class FakeRank:
    """What ``DPAsyncClient`` uses of an ``MPAsyncClient``."""

    def __init__(self, config, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.conn = _Conn()
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.last_progress = 0.0
        self.dead_error = None
        self.on_outputs = None
        self.on_dead = None
        self.closed = False
        self.result = None
        self.calls: list = []

    def attach(self, on_outputs, on_dead) -> None:
        self.on_outputs, self.on_dead = on_outputs, on_dead

    def add_requests(self, reqs) -> None:
        self.added += [r.request_id for r in reqs]

    def abort_requests(self, ids) -> None:
        self.aborted += ids

    async def call(self, call):
        self.calls.append(call)
        if isinstance(self.result, BaseException):
            raise self.result
        return self.result

    def shutdown(self) -> None:
        self.closed = True


class _Cache:
    block_size = BLOCK


class _Config:
    cache = _Cache()


def _req(rid: str, prompt: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=4))


def _client(n: int = 2) -> tuple[DPAsyncClient, list[FakeRank]]:
    ranks = [FakeRank(_Config(), i) for i in range(n)]
    return DPAsyncClient(ranks), ranks  # type: ignore[arg-type]


def test_client_routes_aborts_to_the_owner_and_releases_on_finish():
    async def run():
        client, ranks = _client()
        got: list[OutputBatch] = []
        client.attach(got.append, lambda err: None)
        client.add_requests([_req(f"r{i}", [i, i + 1]) for i in range(4)])
        assert sorted(ranks[0].added + ranks[1].added) == ["r0", "r1", "r2", "r3"]
        assert ranks[0].added and ranks[1].added
        victim = ranks[1].added[0]
        client.abort_requests([victim, "unknown"])
        assert ranks[1].aborted == [victim] and ranks[0].aborted == []
        # A finish in a rank's outputs frees its slot; its stats update that rank's load.
        done = ranks[0].added[0]
        batch = OutputBatch(details=[EngineCoreOutput(done, finish_reason=FinishReason.LENGTH)],
                            scheduler_stats=SchedulerStats(num_running=7), engine_index=0)
        ranks[0].on_outputs(batch)
        assert got == [batch]
        assert client.coordinator.owner(done) is None
        assert client.coordinator.ranks[0].running == 7
        client.abort_requests([done])  # finished already: nothing sent
        assert ranks[0].aborted == []

    asyncio.run(run())


def test_a_rank_death_fails_the_client_naming_the_rank():
    async def run():
        client, ranks = _client(3)
        deaths: list[EngineDeadError] = []
        client.attach(lambda batch: None, deaths.append)
        client.add_requests([_req(f"r{i}", [i]) for i in range(6)])
        ranks[2].on_dead(EngineDeadError("engine dead: the EngineCore process exited"))
        assert len(deaths) == 1 and "data-parallel rank 2" in str(deaths[0])
        assert client.dead_error is deaths[0]
        with pytest.raises(EngineDeadError, match="rank 2"):
            client.add_requests([_req("b", [1])])
        ranks[0].on_dead(EngineDeadError("later"))  # reported once
        assert len(deaths) == 1
        # The live ranks drop what they ran for this frontend; the dead one is told nothing.
        assert ranks[0].aborted == ranks[0].added and ranks[0].added
        assert ranks[1].aborted == ranks[1].added and ranks[1].added
        assert ranks[2].aborted == []

    asyncio.run(run())


def test_last_progress_is_that_of_the_slowest_busy_rank():
    client, ranks = _client()
    ranks[0].last_progress, ranks[1].last_progress = 10.0, 20.0
    assert client.last_progress == 20.0  # nothing in flight: no rank owes progress
    client.coordinator.route("a", [1])
    busy = client.coordinator.owner("a")
    assert client.last_progress == ranks[busy].last_progress


def test_control_results_are_combined():
    assert combine_results(GetKVStats(), [KVStats(10, 4, 1, 0), KVStats(10, 6, 2, 3)]) \
        == KVStats(20, 10, 3, 3)
    assert combine_results(ResetPrefixCache(), [True, False]) is False
    assert combine_results(ResetPrefixCache(), [True, True]) is True
    assert combine_results(ListLoras(), [LoRAIds([1]), LoRAIds([1])]) == LoRAIds([1])

    async def run():
        client, ranks = _client()
        for r in ranks:
            r.result = KVStats(8, 8, 0, 0)
        assert await client.call(GetKVStats()) == KVStats(16, 16, 0, 0)

    asyncio.run(run())


def test_the_children_of_one_request_share_a_rank():
    client, ranks = _client()
    # Two n=3 requests in one batch: each family on one rank, the families spread.
    client.add_requests([_req(f"{p}#{i}", [i]) for p in ("a", "b") for i in range(3)])
    for parent in ("a", "b"):
        holders = [[rid for rid in r.added if rid.startswith(f"{parent}#")] for r in ranks]
        assert sorted(len(h) for h in holders) == [0, 3], holders
    assert ranks[0].added and ranks[1].added  # the families still spread
    assert sum(load.in_flight for load in client.coordinator.ranks) == 6


def test_lora_results_need_every_rank_and_a_refusal_is_undone():
    lora = LoRARequest("x", 3, "/nowhere")
    assert combine_results(AddLora(lora), [True, True]) is True
    assert combine_results(AddLora(lora), [True, False]) is False
    assert combine_results(RemoveLora(3), [False, True]) is False

    async def run():
        client, ranks = _client(3)
        ranks[0].result = True
        ranks[1].result = RuntimeError("LoRAAdapterError: rank 1 cannot load it")
        ranks[2].result = True
        with pytest.raises(RuntimeError, match="rank 1 cannot load it"):
            await client.call(AddLora(lora))
        # The ranks that took it lose it again; the one that refused is not asked.
        assert ranks[0].calls == [AddLora(lora), RemoveLora(3)]
        assert ranks[2].calls == [AddLora(lora), RemoveLora(3)]
        assert ranks[1].calls == [AddLora(lora)]

    asyncio.run(run())


class _Proc:
    def __init__(self) -> None:
        self.sentinel, self._w = os.pipe()  # readable (EOF) once "the process exits"
        self.exitcode = None

    def exit(self, code: int) -> None:
        self.exitcode = code
        os.close(self._w)

    def join(self, timeout=None) -> None:
        pass


class _StartingConn:
    """A rank's connection during start-up: ``wait_ready`` answers as the real one would
    once its socket or its process says something."""

    def __init__(self, ctx, proc: _Proc) -> None:
        self.handshake_socket = ctx.socket(zmq.PAIR)
        self.peer = ctx.socket(zmq.PAIR)
        port = self.handshake_socket.bind_to_random_port("tcp://127.0.0.1")
        self.peer.connect(f"tcp://127.0.0.1:{port}")
        self.proc = proc
        self.ready = False

    def wait_ready(self) -> None:
        if self.proc.exitcode is not None:
            raise EngineStartupError(f"the EngineCore process exited with code "
                                     f"{self.proc.exitcode} during start-up")
        self.handshake_socket.recv()
        self.ready = True


def test_start_up_fails_at_once_when_any_rank_dies():
    ctx = zmq.Context()
    made: list[_StartingConn] = []  # every socket, closed by hand before the context ends

    def connect(procs: list[_Proc]) -> list[_StartingConn]:
        made.extend(_StartingConn(ctx, p) for p in procs)
        return made[-len(procs):]

    procs = [_Proc() for _ in range(3)]
    engines = [SimpleNamespace(rank=i, proc=p) for i, p in enumerate(procs)]
    conns = connect(procs)
    try:
        # Rank 0 would wait for its peers (lockstep): only the death of rank 2 is news.
        conns[1].peer.send(b"ready")
        procs[2].exit(3)
        with pytest.raises(EngineStartupError, match="data-parallel rank 2: .*code 3"):
            wait_all_ready(engines, conns)  # type: ignore[arg-type]
        assert not conns[0].ready
        # Every rank answering: all ready, whatever the order.
        procs = [_Proc() for _ in range(2)]
        engines = [SimpleNamespace(rank=i, proc=p) for i, p in enumerate(procs)]
        conns = connect(procs)
        for conn in reversed(conns):
            conn.peer.send(b"ready")
        wait_all_ready(engines, conns)  # type: ignore[arg-type]
        assert all(c.ready for c in conns)
    finally:
        # (Not ctx.destroy: in a full run it once hung in term(), 600 s, with sockets the
        # first half's conns had dropped; closing each one we hold leaves term() nothing.)
        for conn in made:
            conn.handshake_socket.close(linger=0)
            conn.peer.close(linger=0)
        ctx.term()
