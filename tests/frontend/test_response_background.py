"""The background responses of one API server (frontend/server/response_background.py): a
bound on how many run at once (429 beyond), a cancel that aborts and waits for the wind-down
(and marks the response cancelled when that takes too long), and a close that leaves no task
behind."""

from __future__ import annotations

import asyncio

import pytest

from tidal.frontend.server import response_background
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.response_background import BackgroundResponses


def test_bound_cancel_and_close(monkeypatch):
    monkeypatch.setattr(response_background, "CANCEL_WAIT_S", 0.05)
    events: list[str] = []

    async def work(name: str, stubborn: bool, stop: asyncio.Event) -> None:
        try:
            await stop.wait()
            if stubborn:  # winds down slowly after its abort
                await asyncio.sleep(0.5)
            events.append(f"{name} ended")
        finally:
            events.append(f"{name} released")

    async def main():
        bg = BackgroundResponses(limit=2)
        stops = {n: asyncio.Event() for n in ("a", "b", "c")}
        for name, stubborn in (("a", False), ("b", True)):
            bg.start(name, work(name, stubborn, stops[name]), stops[name].set,
                     lambda n=name: events.append(f"{n} marked cancelled"))
        with pytest.raises(APIError) as full:
            bg.check_room()
        assert full.value.status == 429 and len(bg) == 2 and "a" in bg
        assert not await bg.cancel("nope")
        assert await bg.cancel("a")  # winds down in time: its own end stores it
        assert "a" not in bg and events[:2] == ["a ended", "a released"]
        assert await bg.cancel("b")  # too slow: stored as cancelled now, still running
        assert events[-1] == "b marked cancelled" and "b" in bg
        bg.check_room()  # room again
        bg.start("c", work("c", False, stops["c"]), lambda: None, lambda: None)
        await bg.close()  # every task over (its resources released) when close returns
        assert len(bg) == 0
        assert {"b released", "c released"} <= set(events)

    asyncio.run(main())


def test_event_log_followers():
    async def main():
        log = response_background.EventLog()
        got: dict[str, list[bytes]] = {"a": [], "b": []}

        async def follow(name: str, after: int) -> bool:
            last = False
            async for chunk, last in log.follow(after):
                got[name].extend(chunk)
            return last

        await log.send([b"0", b"1"], False)
        readers = [asyncio.create_task(follow("a", -1)), asyncio.create_task(follow("b", 0))]
        await asyncio.sleep(0)
        await log.send([b"2"], False)
        await asyncio.sleep(0)
        await log.send([b"3"], True)
        assert await asyncio.gather(*readers) == [True, True]
        assert got == {"a": [b"0", b"1", b"2", b"3"], "b": [b"1", b"2", b"3"]}
        # Ended without its final events (its generation cancelled): readers end too.
        cut = response_background.EventLog()
        reader = asyncio.create_task(follow_into(cut, []))
        await asyncio.sleep(0)
        cut.close()
        assert await asyncio.wait_for(reader, 1) == []
        # Past the end of a finished log: nothing, at once.
        assert [c async for c in log.follow(10)] == [([], True)]
        assert log.num_bytes == 4

    async def follow_into(log, out):
        async for chunk, _ in log.follow(-1):
            out.extend(chunk)
        return out

    asyncio.run(main())


def test_kept_logs_are_bounded_and_a_deleted_one_is_not_kept(monkeypatch):
    monkeypatch.setattr(response_background, "CANCEL_WAIT_S", 0.01)

    async def main():
        bg = BackgroundResponses(limit=10, kept_bytes=10)

        async def work(log, stop):
            await log.send([b"abc", b"def"], False)  # 6 bytes
            await stop.wait()
            await log.send([], True)

        stops = {}
        for name in ("a", "b", "c"):
            log = response_background.EventLog()
            stops[name] = asyncio.Event()
            bg.start(name, work(log, stops[name]), stops[name].set, lambda: None, log)
        await asyncio.sleep(0)
        assert all(bg.log_of(n) is not None for n in "abc")  # running: all kept
        for name in ("a", "b"):
            stops[name].set()
            await asyncio.sleep(0.01)
        assert bg.log_of("a") is None and bg.log_of("b") is not None  # 10 bytes at most
        # Deleted while it runs: its log goes when it ends.
        assert await bg.cancel("c", delete=True)
        await asyncio.sleep(0.01)
        assert bg.log_of("c") is None and bg.log_of("b") is not None
        # One that outlasts the cancel's wait: marked deleted (what it stores as it winds
        # down is dropped) until it ends.
        slow = response_background.EventLog()
        stops["d"] = asyncio.Event()
        bg.start("d", work(slow, stops["d"]), lambda: None, lambda: None, slow)
        assert await bg.cancel("d", delete=True)
        assert bg.is_deleted("d") and not bg.is_deleted("b")
        stops["d"].set()
        await asyncio.sleep(0.01)
        assert not bg.is_deleted("d") and bg.log_of("d") is None
        assert not await bg.cancel("b", delete=True) and bg.log_of("b") is None

    asyncio.run(main())
