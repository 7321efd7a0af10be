"""The consumer's background puller with a fake client (no sockets): cancellation touches
only pulls still pending and forgets them once done, and nothing a job raises stops the
thread or leaves its request unreported."""

from __future__ import annotations

import threading
import time

from tidal.engine_core.kv_transfer.p2p_async_pull import AsyncPuller, PullJob


class FakeClient:
    def __init__(self) -> None:
        self.kv_caches: list = []
        self.timeout_s = 1.0
        self.gate = threading.Event()  # pulls wait here
        self.pulled: list[str] = []
        self.released: list[str] = []
        self.release_error = False

    def pull(self, address, request_id, start_block, block_ids, digest) -> int:
        self.gate.wait(5)
        self.pulled.append(request_id)
        return 0

    def release(self, address, request_id, digest) -> None:
        if self.release_error:
            raise RuntimeError("socket gone")
        self.released.append(request_id)


def _job(rid: str) -> PullJob:
    return PullJob(rid, "tcp://127.0.0.1:1", rid, 0, [1, 2], "d")


def _wait_done(puller: AsyncPuller, n: int) -> tuple[set[str], set[int]]:
    done: set[str] = set()
    invalid: set[int] = set()
    deadline = time.monotonic() + 5
    while len(done) < n and time.monotonic() < deadline:
        d, i = puller.take_finished()
        done |= d
        invalid |= i
        time.sleep(0.005)
    return done, invalid


def test_cancel_keeps_only_pending_pulls_and_forgets_them_when_done():
    client = FakeClient()
    puller = AsyncPuller(client)
    try:
        puller.submit(_job("busy"))  # holds the thread
        puller.submit(_job("a"))
        # Every finished request of every step is passed in: only pending ones are kept.
        puller.cancel(["a", "x", "y"])
        assert puller._cancelled == {"a"}
        client.gate.set()
        done, invalid = _wait_done(puller, 2)
        assert done == {"busy", "a"} and invalid == {1, 2} and client.released == ["a"]
        assert not puller._cancelled and not puller._pending
        # The id comes back later (the old pull over): its pull runs, not skipped.
        puller.cancel(["a"])
        puller.submit(_job("a"))
        done, invalid = _wait_done(puller, 1)
        assert done == {"a"} and not invalid and client.pulled == ["busy", "a"]
    finally:
        client.gate.set()
        assert puller.close()


def test_a_job_that_raises_is_reported_and_the_thread_lives_on():
    client = FakeClient()
    client.gate.set()
    puller = AsyncPuller(client)
    try:
        client.gate.clear()
        puller.submit(_job("busy"))
        puller.submit(_job("c"))
        puller.cancel(["c"])
        client.release_error = True  # a cancelled job's release raises in the thread
        puller.submit(PullJob("rel", "tcp://127.0.0.1:1", "rel", 0, [], "d"))  # so does this
        client.gate.set()
        done, invalid = _wait_done(puller, 2)
        assert done == {"busy", "c"} and invalid == {1, 2}
        client.release_error = False
        puller.submit(_job("d"))
        done, invalid = _wait_done(puller, 1)
        assert done == {"d"} and not invalid
    finally:
        client.gate.set()
        assert puller.close()
