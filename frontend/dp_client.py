"""``DPAsyncClient``: one ``AsyncEngineClient`` over every data-parallel EngineCore.

``AsyncLLM`` (and so every API server) sees one engine; underneath, one ``MPAsyncClient`` per
rank. New requests go where ``DPCoordinator`` says (least load, prefix affinity on a tie);
aborts go to the rank that owns the request; each rank's outputs reach the output processor as
they come (they carry the rank: metrics label them), and their stats update the coordinator's
view of that rank. The ``n`` children of one request go to one rank together (they share the
prompt's cached blocks). Control calls run on every rank and their answers are combined (KV
figures summed, a yes/no is yes only if every rank said yes); a LoRA adapter that some rank
refused is removed again from the ranks that took it, so the ranks never disagree on it.

A rank's death is the engine's death, as with one EngineCore: every in-flight request fails
with ``EngineDeadError`` naming the rank, the other ranks are told to drop this frontend's
requests, and the server ends (``api_servers`` sees the process exit). An API server did not
spawn the ranks, so it watches their processes through pidfds: the failure is immediate, not
a heartbeat deadline later.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import (
    AddLora,
    ControlCall,
    ControlResult,
    KVStats,
    Pong,
    RemoveLora,
)
from tidal.engine_core.protocol import EngineCoreRequest, OutputBatch
from tidal.frontend.async_llm import EngineDeadError
from tidal.frontend.dp_coordinator import DPCoordinator

if TYPE_CHECKING:
    from tidal.frontend.dp_engines import DPEngine
    from tidal.frontend.mp_client import EngineConnection, MPAsyncClient

logger = logging.getLogger(__name__)

# After a rank's process exits, how long its last message (EngineDead, with the reason) may take.
_LAST_WORDS_S = 0.2


class DPAsyncClient:
    def __init__(self, clients: list[MPAsyncClient], *, owned: Any = None) -> None:
        """``owned``: kept until ``shutdown`` (the ranks this client spawned, with the lockstep
        ranks' rendezvous store, which must outlive them)."""
        if not clients:
            raise ValueError("DPAsyncClient needs at least one rank's client")
        self.clients = clients
        self._owned = owned
        self.config = clients[0].config
        self.coordinator = DPCoordinator(len(clients), self.config.cache.block_size)
        self._dead: EngineDeadError | None = None
        self._on_outputs: Callable[[OutputBatch], None] | None = None
        self._on_dead: Callable[[EngineDeadError], None] | None = None
        self._watch_loop: asyncio.AbstractEventLoop | None = None
        self._pidfds: dict[int, int] = {}  # rank -> pidfd of its process

    # --- AsyncEngineClient ---------------------------------------------------------------------

    @property
    def last_progress(self) -> float:
        """The least recent progress of the ranks this frontend waits on (a rank with nothing
        of ours to do owes no progress); the latest of all when it waits on none."""
        ranks = self.coordinator.ranks
        busy = [c.last_progress for c, r in zip(self.clients, ranks) if r.in_flight]
        if busy:
            return min(busy)
        return max(c.last_progress for c in self.clients)

    @property
    def dead_error(self) -> EngineDeadError | None:
        if self._dead is None:
            for rank, client in enumerate(self.clients):
                if (err := client.dead_error) is not None:
                    return _rank_error(rank, err)
        return self._dead

    def attach(self, on_outputs: Callable[[OutputBatch], None],
               on_dead: Callable[[EngineDeadError], None]) -> None:
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        for rank, client in enumerate(self.clients):
            client.attach(_bind_outputs(self, rank), _bind_dead(self, rank))
        loop = asyncio.get_running_loop()
        if self._dead is None and loop is not self._watch_loop:
            self._watch_exits(loop)

    def _watch_exits(self, loop: asyncio.AbstractEventLoop) -> None:
        """Watch each rank's process on this host through a pidfd: an API server did not spawn
        the ranks (no sentinel), and the heartbeat deadline would leave the other ranks' streams
        running for seconds after one rank died. Elsewhere (no pidfd) the heartbeat serves."""
        self._unwatch_exits()
        self._watch_loop = loop
        for rank, client in enumerate(self.clients):
            conn = client.conn
            if conn.proc is not None or not conn.is_local or not conn.engine_pid:
                continue  # a spawned rank's sentinel is watched by its client already
            try:
                fd = os.pidfd_open(conn.engine_pid)
            except (AttributeError, OSError) as exc:
                logger.debug("no pidfd for DP rank %d (pid %d): %s", rank, conn.engine_pid, exc)
                continue
            self._pidfds[rank] = fd
            loop.add_reader(fd, _bind_exit(self, rank))

    def _unwatch_exits(self) -> None:
        loop, self._watch_loop = self._watch_loop, None
        for fd in self._pidfds.values():
            if loop is not None and not loop.is_closed():
                loop.remove_reader(fd)
            os.close(fd)
        self._pidfds.clear()

    def _rank_exited(self, rank: int) -> None:
        fd = self._pidfds.pop(rank, None)
        if fd is not None and self._watch_loop is not None:
            self._watch_loop.remove_reader(fd)
            os.close(fd)
            # What the rank sent before it died (its EngineDead and reason) comes first.
            self._watch_loop.call_later(_LAST_WORDS_S, self._rank_dead, rank, EngineDeadError(
                f"engine dead: the EngineCore process (pid {self.clients[rank].conn.engine_pid})"
                " exited"))

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        if self._dead is not None:
            raise self._dead
        groups: dict[int, list[EngineCoreRequest]] = {}
        coordinator = self.coordinator
        parents: dict[str, int] = {}  # parent request id -> rank of its first child
        for req in reqs:
            parent = _parent_id(req.request_id)
            rank = parents.get(parent)
            if rank is None:
                rank = coordinator.route(req.request_id, req.prompt_token_ids, req.cache_salt)
                parents[parent] = rank
            else:
                coordinator.assign(req.request_id, rank)
            groups.setdefault(rank, []).append(req)
        for rank, group in groups.items():
            logger.debug("DP rank %d gets %d request(s)", rank, len(group))
            self.clients[rank].add_requests(group)

    def engine_of(self, request_id: str) -> int:
        """The rank running ``request_id`` (0 if none does: it finished there already)."""
        rank = self.coordinator.owner(request_id)
        return 0 if rank is None else rank

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._dead is not None:
            raise self._dead
        groups: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.coordinator.release(rid)
            if rank is not None:  # (unknown: finished already, nothing to stop)
                groups.setdefault(rank, []).append(rid)
        for rank, ids in groups.items():
            self.clients[rank].abort_requests(ids)

    async def call(self, call: ControlCall) -> ControlResult:
        """Run a control call on every rank; their results combined. If a rank raises, so does
        this (its error; the first rank's that failed) once every rank answered, after taking
        an adapter that ``AddLora`` added on some ranks off those again."""
        results = await asyncio.gather(*(c.call(call) for c in self.clients),
                                       return_exceptions=True)
        failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, BaseException)]
        if not failed:
            return combine_results(call, list(results))  # type: ignore[arg-type]
        rank, error = failed[0]
        logger.warning("control call %s failed on data-parallel rank(s) %s: %s",
                       type(call).__name__, [r for r, _ in failed], error)
        if isinstance(call, AddLora):
            added = [r for r, result in enumerate(results) if result is True]
            await self._remove_lora(call.lora.lora_int_id, added)
        raise error

    async def _remove_lora(self, lora_int_id: int, ranks: list[int]) -> None:
        """Undo an adapter's partial registration (a best effort: a rank that fails this too
        is dying or broken, and its error was logged)."""
        if not ranks:
            return
        undo = await asyncio.gather(*(self.clients[r].call(RemoveLora(lora_int_id))
                                      for r in ranks), return_exceptions=True)
        for rank, result in zip(ranks, undo):
            if isinstance(result, BaseException):
                logger.error("data-parallel rank %d keeps LoRA adapter %d that the other ranks "
                             "refused: removing it failed: %s", rank, lora_int_id, result)

    def shutdown(self) -> None:
        self._unwatch_exits()
        for client in self.clients:
            client.shutdown()
        self._owned = None  # the ranks are gone: the lockstep store may go too
        if self._dead is None:
            self._dead = EngineDeadError("engine dead: the client was shut down")

    # --- per-rank callbacks --------------------------------------------------------------------

    def _outputs(self, rank: int, batch: OutputBatch) -> None:
        coordinator = self.coordinator
        # Finishes first: the stats no longer count these requests (the report's excess over
        # this frontend's count is the other frontends' load).
        for detail in batch.details:
            if detail.finish_reason is not None:
                coordinator.release(detail.request_id)
        if batch.scheduler_stats is not None:
            coordinator.report(rank, batch.scheduler_stats)
        if self._on_outputs is not None and self._dead is None:
            self._on_outputs(batch)

    def _rank_dead(self, rank: int, err: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = _rank_error(rank, err)
        logger.error("data-parallel rank %d of %d is gone: %s", rank, len(self.clients), err)
        # The other ranks still run this frontend's requests, which fail here now: stop them
        # there too (the connections stay until shutdown; closing one this frontend spawned
        # would wait for its process here, in the event loop).
        others: dict[int, list[str]] = {}
        for rid, owner in self.coordinator.owners.items():
            if owner != rank:
                others.setdefault(owner, []).append(rid)
        self.coordinator.owners.clear()
        for owner, ids in others.items():
            try:
                self.clients[owner].abort_requests(ids)
            except EngineDeadError:
                pass  # that one is going too
        if self._on_dead is not None:
            self._on_dead(self._dead)


def _bind_outputs(client: DPAsyncClient, rank: int) -> Callable[[OutputBatch], None]:
    return lambda batch: client._outputs(rank, batch)


def _bind_dead(client: DPAsyncClient, rank: int) -> Callable[[EngineDeadError], None]:
    return lambda err: client._rank_dead(rank, err)


def _bind_exit(client: DPAsyncClient, rank: int) -> Callable[[], None]:
    return lambda: client._rank_exited(rank)


def _rank_error(rank: int, err: BaseException) -> EngineDeadError:
    return EngineDeadError(f"data-parallel rank {rank}: {err}")


def _parent_id(request_id: str) -> str:
    """The frontend request an engine request belongs to (``{parent}#{i}`` for the children of
    an ``n > 1`` request: output_processor.py). Only groups requests of one ``add_requests``
    call, so a user id that happens to contain ``#`` costs at most a routing choice."""
    return request_id.rpartition("#")[0] or request_id


def combine_results(call: ControlCall, results: list[ControlResult]) -> ControlResult:
    """One answer from every rank's: KV figures and unfinished counts summed; a yes/no is yes
    only if every rank said yes (a prefix-cache reset done everywhere; a LoRA adapter new to,
    or removed from, every rank: afterwards every rank has it, or none, either way); anything
    else is rank 0's (the same on every rank)."""
    first = results[0]
    if isinstance(first, KVStats):
        stats = [r for r in results if isinstance(r, KVStats)]
        return KVStats(num_blocks=sum(s.num_blocks for s in stats),
                       num_free_blocks=sum(s.num_free_blocks for s in stats),
                       num_running=sum(s.num_running for s in stats),
                       num_waiting=sum(s.num_waiting for s in stats))
    if isinstance(first, Pong):
        return Pong(engine_pid=first.engine_pid,
                    num_unfinished=sum(r.num_unfinished for r in results
                                       if isinstance(r, Pong)))
    if isinstance(first, bool):
        return all(r is True for r in results)
    return first


def spawn_dp_client(config: EngineConfig) -> DPAsyncClient:
    """Start every rank of ``config`` (``data_parallel_size`` EngineCore processes) and connect
    to them: the client of an ``AsyncLLM`` that owns its ranks (closing it stops them)."""
    from tidal.frontend.dp_engines import start_dp_engines, stop_dp_engines
    from tidal.frontend.mp_client import EngineConnection, MPAsyncClient

    engines = start_dp_engines(config)
    conns: list[EngineConnection] = []
    try:
        for engine in engines:
            conn = EngineConnection(engine.address, proc=engine.proc, tmpdir=engine.tmpdir)
            conns.append(conn)
            # Non-daemon processes: stopped before multiprocessing's exit handler would join
            # them. ``close`` unregisters this (a closed client leaves nothing behind).
            atexit.register(conn.close)
        wait_all_ready(engines, conns)
    except BaseException:
        for conn in conns:
            conn.close()
        stop_dp_engines(engines, 0.0)
        raise
    return DPAsyncClient([MPAsyncClient(conn) for conn in conns], owned=engines)


def wait_all_ready(engines: list[DPEngine], conns: list[EngineConnection]) -> None:
    """Finish every rank's handshake, waiting on all of them at once: a rank whose process
    exits (or that refuses) fails the start-up now, naming the rank, instead of after the
    ranks before it, which may wait for it (the lockstep ranks meet at start-up)."""
    from tidal.frontend.mp_client import EngineStartupError

    poller = zmq.Poller()
    by_socket: dict[Any, int] = {}
    by_sentinel: dict[int, int] = {}
    for i, (engine, conn) in enumerate(zip(engines, conns)):
        by_socket[conn.handshake_socket] = i
        by_sentinel[engine.proc.sentinel] = i
        poller.register(conn.handshake_socket, zmq.POLLIN)
        poller.register(engine.proc.sentinel, zmq.POLLIN)
    pending = set(range(len(conns)))
    while pending:
        for key, _ in poller.poll():
            i = by_socket.get(key) if not isinstance(key, int) else by_sentinel.get(key)
            if i is None:
                continue
            engine = engines[i]
            if i not in pending:  # ready, then gone while the others start
                engine.proc.join(1)
                raise EngineStartupError(
                    f"data-parallel rank {engine.rank}: the EngineCore process exited with "
                    f"code {engine.proc.exitcode} during start-up (its log above says why)")
            pending.discard(i)
            poller.unregister(conns[i].handshake_socket)  # (wait_ready closes it)
            try:
                # The answer waits (or the process is gone: then its last words, or its
                # exit code): this returns or raises at once.
                conns[i].wait_ready()
            except EngineStartupError as exc:
                raise EngineStartupError(f"data-parallel rank {engine.rank}: {exc}") from None
