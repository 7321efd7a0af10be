"""Stored responses across API server processes (frontend/server/response_peers.py): three
peers in one event loop, each with its own store and IPC socket; a lookup a process cannot
answer itself goes to the one that holds the id; deletes too; a malformed message to a peer's
socket is dropped and the peer keeps answering; a background response's stream is followed
from a process that does not keep it."""

from __future__ import annotations

import asyncio
import time

import pytest

from tidal.frontend.server.response_background import EventLog
from tidal.frontend.server.response_peers import (
    ResponsePeers,
    find_response,
    forget_response,
    peer_addresses,
)
from tidal.frontend.server.response_store import ResponseStore

zmq = pytest.importorskip("zmq")


def test_lookups_reach_the_process_that_holds_the_response(tmp_path):
    async def main():
        addresses = peer_addresses(str(tmp_path), 3)
        stores = [ResponseStore() for _ in range(3)]
        peers = [ResponsePeers(i, addresses, s) for i, s in enumerate(stores)]
        for p in peers:
            p.start()
        try:
            conversation = [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "héllo"}]
            assert stores[2].put("resp_a", conversation, b'{"id": "resp_a"}')
            for i in range(3):  # the holder answers from memory, the others over IPC
                got = await find_response(stores[i], peers[i], "resp_a")
                assert got is not None
                assert got.messages == conversation and got.body == b'{"id": "resp_a"}'
            assert await find_response(stores[0], peers[0], "resp_missing") is None
            assert await find_response(stores[0], peers[0], "x" * 10_000) is None
            # A malformed message: dropped, the socket still answers.
            ctx = zmq.Context()
            raw = ctx.socket(zmq.REQ)
            raw.setsockopt(zmq.LINGER, 0)
            raw.connect(addresses[2])
            raw.send(b"\xc1 not msgpack")
            await asyncio.sleep(0.2)
            raw.close(0)
            ctx.term()
            assert (await peers[1].get("resp_a")) is not None
            # Deleted from another process: gone everywhere.
            assert await forget_response(stores[0], peers[0], "resp_a")
            assert len(stores[2]) == 0
            assert not await forget_response(stores[1], peers[1], "resp_a")
            assert await find_response(stores[1], peers[1], "resp_a") is None
        finally:
            for p in peers:
                await p.close()

    asyncio.run(main())


def test_index_must_name_one_of_the_addresses(tmp_path):
    with pytest.raises(ValueError, match="index 2"):
        ResponsePeers(2, peer_addresses(str(tmp_path), 2), ResponseStore())


def test_a_cancel_reaches_the_process_that_runs_the_background_response(tmp_path):
    async def main():
        addresses = peer_addresses(str(tmp_path), 3)
        stores = [ResponseStore() for _ in range(3)]
        asked: list[str] = []

        async def cancel_on_2(rid: str, delete: bool) -> bool:
            asked.append(rid + (" (delete)" if delete else ""))
            if rid != "resp_bg":
                return False
            await asyncio.sleep(0.05)  # the generation winds down meanwhile
            stores[2].put(rid, [], b'{"status": "cancelled"}', [{"id": "msg_1"}], "cancelled")
            return True

        peers = [ResponsePeers(i, addresses, s, cancel_on_2 if i == 2 else None)
                 for i, s in enumerate(stores)]
        for p in peers:
            p.start()
        try:
            stores[2].put("resp_bg", [], b'{"status": "in_progress"}', [{"id": "msg_1"}],
                          "in_progress")
            # Other lookups are answered while a cancel winds down.
            cancel = asyncio.create_task(peers[0].cancel("resp_bg"))
            await asyncio.sleep(0.01)
            during = await peers[1].get("resp_bg")
            got = await cancel
            assert during is not None and during.status == "in_progress"
            assert got is not None and got.status == "cancelled"
            assert got.body == b'{"status": "cancelled"}' and got.input_items == [{"id": "msg_1"}]
            assert await peers[0].cancel("resp_other") is None
            # A delete stops what the holder runs first.
            assert await forget_response(stores[0], peers[0], "resp_bg")
            assert asked == ["resp_bg", "resp_other", "resp_bg (delete)"]
            assert len(stores[2]) == 0
        finally:
            for p in peers:
                await p.close()

    asyncio.run(main())


def test_a_background_stream_is_followed_from_another_process(tmp_path, monkeypatch):
    """Process 0 replays the stream process 2 keeps: the events after the reader's, then new
    ones as they come (long polls), a bounded slice per answer, until the last; a peer without
    the log, or an unknown id, is no stream."""
    from tidal.frontend.server import response_peers

    monkeypatch.setattr(response_peers, "EVENTS_BYTES", 10)  # 2 events of 5 bytes an answer

    async def main():
        addresses = peer_addresses(str(tmp_path), 3)
        log = EventLog()
        logs = {"resp_bg": log}
        peers = [ResponsePeers(i, addresses, ResponseStore(),
                               logs=logs.get if i == 2 else None) for i in range(3)]
        for p in peers:
            p.start()
        try:
            await log.send([b"ev-00", b"ev-01", b"ev-02"], False)
            assert await peers[0].find_events("resp_none", -1) is None
            found = await peers[0].find_events("resp_bg", 0)
            assert found is not None
            address, first = found
            assert address == addresses[2]
            assert first.events == [b"ev-01", b"ev-02"] and first.total == 3
            assert not first.done
            got: list[bytes] = []
            ends: list[bool] = []

            sizes: list[int] = []

            async def read():
                async for events, last in peers[0].follow_events(address, "resp_bg", 0,
                                                                 first):
                    got.extend(events)
                    ends.append(last)
                    sizes.append(len(events))

            reader = asyncio.create_task(read())
            await asyncio.sleep(0.05)  # the reader waits in a long poll
            await log.send([b"ev-03", b"ev-04", b"ev-05"], False)
            await asyncio.sleep(0.05)
            await log.send([b"ev-06"], True)
            await asyncio.wait_for(reader, 5)
            assert got == [b"ev-01", b"ev-02", b"ev-03", b"ev-04", b"ev-05", b"ev-06"]
            assert ends[-1] and not any(ends[:-1])
            assert max(sizes) == 2  # EVENTS_BYTES: two 5-byte events an answer at most
            # A reader past the end of a finished stream learns how long it is.
            done = await peers[1].find_events("resp_bg", 9)
            assert done is not None and done[1].done and done[1].total == 7
            assert done[1].events == []
        finally:
            for p in peers:
                await p.close()

    asyncio.run(main())


def test_a_stream_whose_keeper_drops_it_or_goes_quiet_is_lost(tmp_path, monkeypatch):
    """The keeper dropping the log (evicted, deleted) ends the stream with PeerStreamLost; so
    does a keeper that stops answering for ``POLL_RETRIES`` asks in a row, while one that
    misses a single ask (a stalled loop) goes on serving it."""
    from tidal.frontend.server import response_peers

    monkeypatch.setattr(response_peers, "POLL_WAIT_S", 0.05)
    monkeypatch.setattr(response_peers, "_TIMEOUT_S", 0.1)

    async def main():
        addresses = peer_addresses(str(tmp_path), 2)
        log = EventLog()
        logs = {"resp_bg": log}
        peers = [ResponsePeers(i, addresses, ResponseStore(),
                               logs=logs.get if i == 1 else None) for i in range(2)]
        for p in peers:
            p.start()

        async def quiet(keeper: ResponsePeers) -> None:  # its answer loop stops
            assert keeper._task is not None
            keeper._task.cancel()
            await asyncio.gather(keeper._task, return_exceptions=True)

        try:
            await log.send([b"a"], False)
            found = await peers[0].find_events("resp_bg", -1)
            assert found is not None
            address, first = found
            stream = peers[0].follow_events(address, "resp_bg", -1, first)
            assert await stream.__anext__() == ([b"a"], False)
            # One ask unanswered, then the keeper is back: the stream goes on.
            await quiet(peers[1])
            nxt = asyncio.create_task(stream.__anext__())
            await asyncio.sleep(0.2)  # (the first ask times out after 0.15 s)
            peers[1].start()
            await log.send([b"b"], True)
            assert await asyncio.wait_for(nxt, 5) == ([b"b"], True)
            # Gone quiet for good: lost after POLL_RETRIES asks.
            log2 = logs["resp_2"] = EventLog()
            await log2.send([b"x"], False)
            found = await peers[0].find_events("resp_2", -1)
            assert found is not None
            stream = peers[0].follow_events(found[0], "resp_2", -1, found[1])
            assert await stream.__anext__() == ([b"x"], False)
            await quiet(peers[1])
            with pytest.raises(response_peers.PeerStreamLost, match="3 times in a row"):
                await asyncio.wait_for(stream.__anext__(), 5)
            # Dropped: lost at once.
            peers[1].start()
            log3 = logs["resp_3"] = EventLog()
            await log3.send([b"y"], False)
            found = await peers[0].find_events("resp_3", -1)
            assert found is not None
            stream = peers[0].follow_events(found[0], "resp_3", -1, found[1])
            assert await stream.__anext__() == ([b"y"], False)
            del logs["resp_3"]
            with pytest.raises(response_peers.PeerStreamLost, match="no longer keeps"):
                await asyncio.wait_for(stream.__anext__(), 5)
        finally:
            for p in peers:
                await p.close()

    asyncio.run(main())


def test_a_lost_stream_ends_with_an_error_event():
    """The replay of a stream whose keeper is lost ends with an ``error`` event (code
    ``stream_unavailable``, the next sequence number) rather than just stopping."""
    import json

    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    from tidal.frontend.server import serving_responses
    from tidal.frontend.server.response_peers import PeerStreamLost

    async def events():
        yield [b'{"type":"response.output_text.delta","sequence_number":5}'], False
        raise PeerStreamLost("gone")

    async def handler(request: web.Request) -> web.StreamResponse:
        return await serving_responses._replay(request, events(), 4, "resp_x")

    async def main():
        app = web.Application()
        app.router.add_get("/s", handler)
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/s")
            return resp.status, await resp.text()

    status, body = asyncio.run(main())
    assert status == 200
    data = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: ")]
    kinds = [line[7:] for line in body.splitlines() if line.startswith("event: ")]
    assert kinds == ["response.output_text.delta", "error"]
    assert data[1]["code"] == "stream_unavailable" and data[1]["sequence_number"] == 6


def test_a_caught_up_reader_finds_the_stream_at_once(tmp_path):
    """The first ask, which finds the keeper, is answered at once even when the reader has
    every event so far (its response headers do not wait for a long poll); following it then
    waits for the next event."""
    from tidal.frontend.server import response_peers

    async def main():
        addresses = peer_addresses(str(tmp_path), 2)
        log = EventLog()
        peers = [ResponsePeers(i, addresses, ResponseStore(),
                               logs={"resp_bg": log}.get if i == 1 else None)
                 for i in range(2)]
        for p in peers:
            p.start()
        try:
            await log.send([b"a", b"b"], False)
            start = time.perf_counter()
            found = await peers[0].find_events("resp_bg", 1)
            assert time.perf_counter() - start < response_peers.POLL_WAIT_S / 2
            assert found is not None
            address, first = found
            assert first.events == [] and first.total == 2 and not first.done
            stream = peers[0].follow_events(address, "resp_bg", 1, first)
            assert await stream.__anext__() == ([], False)
            nxt = asyncio.create_task(stream.__anext__())
            await asyncio.sleep(0.05)
            assert not nxt.done()  # a long poll
            await log.send([b"c"], True)
            assert await asyncio.wait_for(nxt, 5) == ([b"c"], True)
        finally:
            for p in peers:
                await p.close()

    asyncio.run(main())
