"""Tests for the shared-memory broadcast ring (tidal.worker.shm_broadcast).

Multi-process tests use the spawn context like the engine does; children report back over a
Pipe with msgspec-encoded results (send_bytes, so nothing here depends on pickling results).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tidal.worker.shm_broadcast import (
    RingClosed,
    RingHandle,
    RingReaderDied,
    RingWriterDied,
    ShmRingReader,
    ShmRingWriter,
    unlink_ring,
)

SPAWN = mp.get_context("spawn")
RESULT_TIMEOUT_S = 30.0


# ---------------------------------------------------------------- message generators

def _small_msg(i: int) -> list[bytes]:
    return [struct.pack("<Q", i), bytes([i % 251]) * (i * 37 % 300)]


def _mixed_msg(i: int) -> list[bytes]:
    """Deterministic mix: every third message has a frame far bigger than a 1 KiB slot."""
    rng = random.Random(i)
    frames = [struct.pack("<Q", i)]
    for k in range(rng.randint(1 if i % 3 == 0 else 0, 3)):
        big = i % 3 == 0 and k == 0
        frames.append(rng.randbytes(rng.randint(2_000, 60_000) if big else rng.randint(0, 200)))
    return frames


_GENERATORS = {"small": _small_msg, "mixed": _mixed_msg}


def _encode_handle(h: RingHandle) -> bytes:
    return msgspec.msgpack.encode(h)


def _decode_handle(b: bytes) -> RingHandle:
    return msgspec.msgpack.decode(b, type=RingHandle)


# ---------------------------------------------------------------- child process entry points

def _reader_main(handle_b: bytes, rank: int, name: str, n_msgs: int, gen: str,
                 delay_s: float, conn: Connection) -> None:
    make = _GENERATORS[gen]
    result: dict[str, Any] = {"received": 0, "error": None}
    reader = ShmRingReader.attach(_decode_handle(handle_b), rank, name)
    try:
        for i in range(n_msgs):
            frames = reader.dequeue(timeout=RESULT_TIMEOUT_S)
            got = [bytes(f) for f in frames]
            if got != make(i):
                result["error"] = f"message {i}: got {[len(g) for g in got]} bytes/frame, " \
                                  f"first frame {got[:1]!r:.60}"
                break
            result["received"] = i + 1
            if delay_s:
                time.sleep(delay_s)
    except Exception as e:  # reported to the test, which fails with it
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        reader.close()
        conn.send_bytes(msgspec.msgpack.encode(result))


def _idle_reader_main(handle_b: bytes, n_msgs: int, conn: Connection) -> None:
    reader = ShmRingReader.attach(_decode_handle(handle_b), 0, "idle-reader")
    conn.send_bytes(b"ready")
    latencies_ns = []
    try:
        for _ in range(n_msgs):
            (frame,) = reader.dequeue(timeout=RESULT_TIMEOUT_S)
            latencies_ns.append(time.monotonic_ns() - struct.unpack("<q", frame)[0])
    finally:
        reader.close()
        conn.send_bytes(msgspec.msgpack.encode(latencies_ns))


def _stuck_reader_main(handle_b: bytes, rank: int, name: str, conn: Connection) -> None:
    reader = ShmRingReader.attach(_decode_handle(handle_b), rank, name)
    reader.dequeue(timeout=RESULT_TIMEOUT_S)
    conn.send_bytes(b"read one")
    time.sleep(60)  # holds its slot and never reads again; the test SIGKILLs us


def _writer_main(conn: Connection) -> None:
    writer = ShmRingWriter.create(1, slot_bytes=256, n_slots=2)
    conn.send_bytes(_encode_handle(writer.handle))
    writer.enqueue([b"hello"])
    time.sleep(60)  # the test SIGKILLs us


# ---------------------------------------------------------------- helpers

@pytest.fixture
def procs() -> Iterator[list[mp.process.BaseProcess]]:
    started: list[mp.process.BaseProcess] = []
    yield started
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)


def _start(procs: list, target: Any, *args: Any) -> tuple[mp.process.BaseProcess, Connection]:
    recv_end, send_end = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=target, args=(*args, send_end), daemon=True)
    p.start()
    send_end.close()
    procs.append(p)
    return p, recv_end


def _result(conn: Connection) -> Any:
    assert conn.poll(RESULT_TIMEOUT_S), "child did not report in time"
    return msgspec.msgpack.decode(conn.recv_bytes())


def _run_broadcast(procs: list, n_readers: int, n_msgs: int, gen: str, slot_bytes: int,
                   n_slots: int, delays: list[float] | None = None) -> tuple[ShmRingWriter, float]:
    """Writer here, readers in child processes that verify every message; returns the (closed)
    writer and how long the writer took to enqueue everything."""
    make = _GENERATORS[gen]
    delays = delays or [0.0] * n_readers
    writer = ShmRingWriter.create(n_readers, slot_bytes=slot_bytes, n_slots=n_slots)
    try:
        conns = [_start(procs, _reader_main, _encode_handle(writer.handle), r, f"worker-{r}",
                        n_msgs, gen, delays[r])[1] for r in range(n_readers)]
        start = time.monotonic()
        for i in range(n_msgs):
            writer.enqueue(make(i), timeout=RESULT_TIMEOUT_S)
        enqueue_s = time.monotonic() - start
        for r, conn in enumerate(conns):
            res = _result(conn)
            assert res["error"] is None, f"worker-{r}: {res['error']}"
            assert res["received"] == n_msgs
        return writer, enqueue_s
    finally:
        writer.close()


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("n_readers", [1, 3])
def test_order_survives_many_wraparounds(procs: list, n_readers: int) -> None:
    # 1000 messages through 4 slots: 250 laps; every reader checks every message's content.
    _run_broadcast(procs, n_readers, n_msgs=1000, gen="small", slot_bytes=512, n_slots=4)


def test_readers_at_different_speeds_get_everything_in_order(procs: list) -> None:
    n_msgs, n_slots, delay = 300, 2, 0.002
    _, enqueue_s = _run_broadcast(procs, 3, n_msgs=n_msgs, gen="small", slot_bytes=512,
                                  n_slots=n_slots, delays=[0.0, 0.0, delay])
    # The writer can only run n_slots ahead of the slow reader: back-pressure, not overwriting.
    assert enqueue_s > (n_msgs - n_slots - 1) * delay * 0.9
    # It sleeps on almost every message (delay > spin); were the slow reader's doorbell not
    # waking it, every n_slots messages would cost the 0.1 s bounded poll: 15 s in all.
    assert enqueue_s < 6.0, enqueue_s


def test_overflow_interleaved_with_small_messages_keeps_order(procs: list) -> None:
    n_msgs = 300
    writer, _ = _run_broadcast(procs, 2, n_msgs=n_msgs, gen="mixed", slot_bytes=1024, n_slots=4)
    totals = [sum(map(len, _mixed_msg(i))) for i in range(n_msgs)]
    # Anything over the slot must have overflowed; with <= 4 frames the slot header and frame
    # alignment take < 256 bytes, so anything below slot_bytes - 256 must have stayed inline.
    assert sum(t > 1024 for t in totals) <= writer.n_overflow <= sum(t > 1024 - 256 for t in totals)
    assert 0 < writer.n_overflow < n_msgs


_frame = st.binary(max_size=3000).flatmap(
    lambda b: st.sampled_from([b, bytearray(b), memoryview(b)]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.lists(st.lists(_frame, max_size=5), min_size=1, max_size=3),
                        min_size=1, max_size=6),
       copy=st.booleans())
def test_random_frames_round_trip_exactly(batches: list[list[list[Any]]], copy: bool) -> None:
    # Batches of up to n_slots - 1 messages are in flight at once (the reader holds one slot).
    with ShmRingWriter.create(2, slot_bytes=1024, n_slots=4) as writer, \
            ShmRingReader.attach(writer.handle, 0, "a") as ra, \
            ShmRingReader.attach(writer.handle, 1, "b") as rb:
        for batch in batches:
            for msg in batch:
                writer.enqueue(msg, timeout=5)
            for msg in batch:
                want = [bytes(f) for f in msg]
                for reader in (ra, rb):
                    got = reader.dequeue(timeout=5, copy=copy)
                    assert [bytes(f) for f in got] == want


def test_killed_reader_is_reported_by_name(procs: list) -> None:
    writer = ShmRingWriter.create(2, slot_bytes=256, n_slots=4)
    try:
        fast = ShmRingReader.attach(writer.handle, 0, "worker-0")
        victim, conn = _start(procs, _stuck_reader_main, _encode_handle(writer.handle), 1,
                              "worker-1")
        writer.enqueue([b"first"])
        fast.dequeue()
        assert conn.poll(RESULT_TIMEOUT_S) and conn.recv_bytes() == b"read one"
        killed_at: list[float] = []

        def kill() -> None:
            killed_at.append(time.monotonic())
            os.kill(victim.pid, signal.SIGKILL)

        timer = threading.Timer(0.5, kill)
        timer.start()
        try:
            with pytest.raises(RingReaderDied) as exc:
                for i in range(10):  # fills the ring, then blocks on worker-1's held slot
                    writer.enqueue([b"m%d" % i], timeout=10)
                    fast.dequeue()
        finally:
            timer.cancel()
        assert killed_at, "writer raised before the reader was killed"
        assert time.monotonic() - killed_at[0] < 3.0
        assert "'worker-1'" in str(exc.value) and f"pid {victim.pid}" in str(exc.value)
        fast.close()
    finally:
        writer.close()


def test_killed_writer_is_detected_by_blocked_reader(procs: list) -> None:
    victim, conn = _start(procs, _writer_main)
    assert conn.poll(RESULT_TIMEOUT_S)
    handle = _decode_handle(conn.recv_bytes())
    try:
        with ShmRingReader.attach(handle, 0, "worker-0") as reader:
            assert reader.dequeue_bytes(timeout=RESULT_TIMEOUT_S) == b"hello"
            timer = threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL))
            timer.start()
            start = time.monotonic()
            with pytest.raises(RingWriterDied, match=f"pid {victim.pid}"):
                reader.dequeue(timeout=10)
            assert time.monotonic() - start < 3.0
    finally:
        unlink_ring(handle)  # the killed writer could not unlink its segment
    assert not os.path.exists(f"/dev/shm/{handle.shm_name}")


def test_idle_reader_uses_little_cpu_and_wakes_promptly(procs: list) -> None:
    n_msgs = 10
    with ShmRingWriter.create(1, slot_bytes=256, n_slots=4) as writer:
        reader, conn = _start(procs, _idle_reader_main, _encode_handle(writer.handle), n_msgs)
        assert conn.poll(RESULT_TIMEOUT_S) and conn.recv_bytes() == b"ready"
        time.sleep(0.3)  # past the spin phase, into the blocking wait
        proc = psutil.Process(reader.pid)
        before = proc.cpu_times()
        t0 = time.monotonic()
        time.sleep(2.0)
        after = proc.cpu_times()
        elapsed = time.monotonic() - t0
        busy = (after.user - before.user) + (after.system - before.system)
        # A reader that spins takes a whole core; a sleeping one wakes ten times a second
        # (its bounded poll). Under a loaded 2-core CI box that measured up to 4.5 %, hence
        # the margin.
        assert busy / elapsed < 0.10, f"idle reader used {busy / elapsed:.1%} of a core"
        # Messages 50 ms apart always find the reader asleep; the writer's poke must wake it
        # well before the 100 ms bounded poll would.
        for _ in range(n_msgs):
            writer.enqueue([struct.pack("<q", time.monotonic_ns())])
            time.sleep(0.05)
        latencies_ms = [ns / 1e6 for ns in _result(conn)]
    assert len(latencies_ms) == n_msgs
    assert statistics.median(latencies_ms) < 5.0, latencies_ms


def test_dequeue_timeout_raises_timeout_error() -> None:
    with ShmRingWriter.create(1, slot_bytes=256, n_slots=2) as writer, \
            ShmRingReader.attach(writer.handle, 0, "worker-0") as reader:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            reader.dequeue(timeout=0.2)
        assert 0.2 <= time.monotonic() - start < 1.0
        writer.enqueue_bytes(b"after")  # a timed-out dequeue leaves the reader usable
        assert reader.dequeue_bytes(timeout=1) == b"after"


def test_enqueue_timeout_names_the_slow_reader() -> None:
    with ShmRingWriter.create(2, slot_bytes=256, n_slots=2) as writer, \
            ShmRingReader.attach(writer.handle, 0, "worker-0") as fast, \
            ShmRingReader.attach(writer.handle, 1, "worker-1"):
        with pytest.raises(TimeoutError, match="'worker-1'") as exc:
            for i in range(3):
                writer.enqueue([b"%d" % i], timeout=0.2)
                fast.dequeue(copy=True)
        assert "'worker-0'" not in str(exc.value)


def test_closed_writer_drains_then_raises_ring_closed() -> None:
    writer = ShmRingWriter.create(1, slot_bytes=256, n_slots=4)
    with ShmRingReader.attach(writer.handle, 0, "worker-0") as reader:
        writer.enqueue_bytes(b"a")
        writer.enqueue_bytes(b"b")
        writer.close()
        assert not os.path.exists(f"/dev/shm/{writer.handle.shm_name}")
        assert [reader.dequeue_bytes(timeout=1) for _ in range(2)] == [b"a", b"b"]
        with pytest.raises(RingClosed):
            reader.dequeue(timeout=1)


def test_handle_is_a_plain_msgspec_struct() -> None:
    with ShmRingWriter.create(3, slot_bytes=4096, n_slots=5) as writer:
        encoded = msgspec.msgpack.encode(writer.handle)
        assert _decode_handle(encoded) == writer.handle
        assert isinstance(msgspec.msgpack.decode(encoded), list)  # array_like
        h = writer.handle
        assert (h.n_readers, h.n_slots, h.slot_bytes) == (3, 5, 4096)
