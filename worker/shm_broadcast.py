"""Shared-memory broadcast ring: one writer process, N reader processes.

The EngineCore broadcasts every step's scheduler output to its GPU workers through a
`ShmRingWriter`; each worker reads it with a `ShmRingReader`. A message is a list of
already-encoded byte frames (msgspec structs, raw numpy buffers); the ring never sees Python
objects and never pickles.

Layout (one shared-memory segment, all little-endian, offsets 64-byte aligned)::

    header   magic, version, n_readers, n_slots, slot_bytes, writer_pid, closed, writer asleep
    readers  n_readers records: pid, state (free/attached/closed), asleep flag, name
    flags    n_slots rows: [written, read_0 .. read_{n-1}] one byte each
    slots    n_slots x slot_bytes: seq, kind, n_frames, frame lengths, 16-aligned frames

Protocol. The writer takes slot ``seq % n_slots`` once it was never written or every reader
has set its read flag. It clears ``written`` (so nobody reads a half-written slot), writes the
payload, clears the read flags, then sets ``written``. A reader waits for ``written == 1 and
read[rank] == 0``, checks the slot's ``seq`` against the one it expects, reads, and sets its
read flag. Readers hand out zero-copy memoryviews and set the read flag at the start of the
*next* `dequeue`, so returned views are valid until then (and a reader that stops dequeuing
keeps one slot busy).

Memory ordering. Every flag is a single byte (so no torn writes), stored after the data it
publishes and loaded before the data it guards. Publishing thus needs stores kept in order and
loads kept in order, which x86-64 (TSO) guarantees without fences; the one store-then-load case
(going to sleep, below) uses `_fence`. On weakly ordered CPUs (ARM) the protocol would need
real barriers (a small C helper) and is not claimed to be correct there.

Overflow. A message that does not fit in a slot still takes the next slot, which then holds an
OVERFLOW marker (seq, frame count) instead of the payload; the frames travel over a per-reader
ZeroMQ PUSH->PULL ``ipc://`` socket, prefixed with the seq. Slots are consumed strictly in seq
order and each reader's socket is FIFO, so small and large messages stay in order for every
reader; since an overflow message still occupies a slot, the sockets never hold more than
``n_slots`` messages per reader. Per-reader PUSH rather than PUB/SUB because PUB silently drops
messages to subscribers that have not joined yet or are over their high-water mark.

Blocking. A waiting endpoint spins (with ``sched_yield``, so a busy 2-core box is not starved)
for ``spin_s``, then sets its ``asleep`` byte, re-checks, and blocks in ``poll`` on its own Unix
datagram socket (a doorbell). The other side, after changing a flag the sleeper may wait on,
sends it a 1-byte datagram (non-blocking, errors ignored) only if that byte is set, so a busy
ring makes no syscalls. Readers wait for a written slot; the writer (only when the ring is full,
i.e. under back-pressure) waits for read flags, and readers ring its bell when they release a
slot. A raw datagram socket rather than ZeroMQ because a zmq message crosses two I/O threads:
waking a sleeping process took ~190 us with zmq and ~90 us with a datagram on the 2-core dev
VM. "Store asleep, load flag" against "store flag, load asleep" is the Dekker pattern, which
x86 breaks by letting a load pass an earlier store; both sides therefore run a full fence in
between (`_fence`: an uncontended lock round trip, whose atomic read-modify-write is a full
barrier on x86). The poll is still bounded by ``_SLEEP_POLL_S`` (0.1 s) so a sleeper notices a
dead peer, and so a poke sent before the sleeper had bound its doorbell (it is dropped) costs at
most that much; ~10 wake-ups a second keep an idle endpoint well under 1% of a core.

Sockets use Linux abstract-namespace addresses, so nothing is left on the filesystem if a
process dies; readers must share the writer's network namespace (same host, same container).

Liveness. Readers record their pid and name. A writer blocked on a slot checks the readers that
have not read it every ``_LIVENESS_S``: a dead (or zombie) process raises `RingReaderDied`
naming it; a live one is waited for, up to the optional ``timeout`` (a `TimeoutError` naming
it). A blocked reader likewise checks the writer pid (`RingWriterDied`) and the closed flag
(`RingClosed`, raised only once all published messages have been consumed).

The handle (`RingHandle`) is a small msgspec struct that can be passed to spawned processes.
Neither class is thread-safe: one thread per endpoint.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import msgspec
import psutil
import zmq

logger = logging.getLogger(__name__)

Frame = bytes | bytearray | memoryview

_MAGIC = b"TDRG"
_VERSION = 1
# magic, version, n_readers, n_slots, slot_bytes, writer_pid, closed, writer asleep
_HEADER = struct.Struct("<4sIIIQqBB")
_CLOSED_OFF, _WRITER_ASLEEP_OFF = 32, 33
_READER_REC = struct.Struct("<qBB6x48s")  # pid, state, asleep, name
_STATE_OFF, _ASLEEP_OFF = 8, 9
_SLOT_HDR = struct.Struct("<QII")  # seq, kind, n_frames
_SEQ = struct.Struct("<Q")
_KIND_INLINE, _KIND_OVERFLOW = 1, 2
_FREE, _ATTACHED, _CLOSED = 0, 1, 2

# Waking a sleeping process costs ~100-250 us on the dev VM; spinning 0.5 ms catches messages
# that follow each other closely (an engine step's broadcast soon after the previous replies)
# for at most 0.5 ms of burnt CPU per wait. Readers can override it per attach.
_SPIN_S = 5e-4
_SLEEP_POLL_S = 0.1  # bound on a sleeper's poll: liveness checks, pokes dropped before bind
_LIVENESS_S = 0.1  # how often a blocked endpoint asks psutil about its peer (~0.1 ms a check)


class RingError(RuntimeError):
    """The ring is unusable: peer gone, corrupted, misused."""


class RingReaderDied(RingError):
    """A reader the writer is waiting for is dead or has closed its end."""


class RingWriterDied(RingError):
    """The writer process died while a reader was waiting for a message."""


class RingClosed(RingError):
    """The writer closed the ring and every published message has been consumed."""


class RingHandle(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """Everything a reader needs to attach; cheap to msgspec-encode into a spawn argument."""

    shm_name: str
    n_readers: int
    n_slots: int
    slot_bytes: int
    # Abstract-namespace socket prefix: reader r's overflow socket is ipc://@{prefix}-o{r},
    # its doorbell the datagram address "\0{prefix}-w{r}"; the writer's doorbell is -w.
    sock_prefix: str


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _overflow_addr(h: RingHandle, rank: int) -> str:
    return f"ipc://@{h.sock_prefix}-o{rank}"


def _doorbell_addr(h: RingHandle, rank: int | None) -> bytes:
    return f"\0{h.sock_prefix}-w{'' if rank is None else rank}".encode()


def _doorbell() -> tuple[socket.socket, select.poll]:
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    bell.setblocking(False)
    poller = select.poll()
    poller.register(bell, select.POLLIN)
    return bell, poller


def _ring(bell: socket.socket, addr: bytes) -> None:
    try:
        bell.sendto(b"\x01", addr)
    except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
        pass  # bell already full (it will wake), or not bound yet (its bounded poll covers it)


def _drain(bell: socket.socket) -> None:
    try:
        while True:
            bell.recv(64)
    except BlockingIOError:
        pass


def _fence(lock: threading.Lock) -> None:
    # CPython cannot emit a fence, but an uncontended lock round trip executes an atomic
    # read-modify-write (lock cmpxchg / xadd), which is a full barrier on x86.
    lock.acquire()
    lock.release()


@dataclass(slots=True, frozen=True)
class _Layout:
    n_readers: int
    n_slots: int
    slot_bytes: int
    readers_off: int
    flags_off: int
    flag_stride: int
    slots_off: int
    slot_stride: int
    total: int

    @classmethod
    def of(cls, n_readers: int, n_slots: int, slot_bytes: int) -> _Layout:
        readers_off = 64
        flags_off = readers_off + n_readers * _READER_REC.size
        flag_stride = _align(1 + n_readers, 64)  # one cache line per slot's flags row
        slots_off = _align(flags_off + n_slots * flag_stride, 64)
        slot_stride = _align(slot_bytes, 64)
        return cls(n_readers, n_slots, slot_bytes, readers_off, flags_off, flag_stride,
                   slots_off, slot_stride, slots_off + n_slots * slot_stride)

    def reader(self, rank: int) -> int:
        return self.readers_off + rank * _READER_REC.size

    def written(self, slot: int) -> int:
        return self.flags_off + slot * self.flag_stride

    def slot(self, slot: int) -> int:
        return self.slots_off + slot * self.slot_stride


def _as_bytes_view(frame: Frame) -> memoryview:
    mv = frame if isinstance(frame, memoryview) else memoryview(frame)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")  # raises TypeError for non-contiguous buffers, which we cannot store
    return mv


def _inline_lengths_size(n_frames: int) -> int:
    return _align(_SLOT_HDR.size + 8 * n_frames, 16)


def _alive(proc: psutil.Process) -> bool:
    # is_running() guards against pid reuse via the create time; a SIGKILLed child stays a
    # zombie until its parent reaps it, so a zombie counts as dead.
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _overflow_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # HWM 0: PUSH blocks rather than drops, and the ring bounds the queue to n_slots anyway.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


@dataclass(slots=True)
class _ReaderInfo:
    """Writer-side cache of what it knows about one reader."""

    rank: int
    pid: int = 0
    name: str = ""
    proc: psutil.Process | None = None


@dataclass(slots=True)
class _WriterState:
    shm: shared_memory.SharedMemory
    buf: memoryview
    ctx: zmq.Context
    overflow: list[zmq.Socket]
    bell: socket.socket  # bound: readers ring it; also used to ring theirs
    poller: select.poll
    readers: list[_ReaderInfo]
    fence: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0


class ShmRingWriter:
    """The single writer end. Create with `create`; ship `handle` to the readers."""

    def __init__(self, handle: RingHandle, layout: _Layout, state: _WriterState) -> None:
        self._handle = handle
        self._lay = layout
        self._st: _WriterState | None = state
        self._all_read = b"\x01" * layout.n_readers
        self._none_read = b"\x00" * layout.n_readers
        self._n_overflow = 0
        # Offsets precomputed: enqueue is a few microseconds of Python, so lookups matter.
        self._wflag = [layout.written(s) for s in range(layout.n_slots)]
        self._base = [layout.slot(s) for s in range(layout.n_slots)]
        self._asleep = [layout.reader(r) + _ASLEEP_OFF for r in range(layout.n_readers)]
        self._bells = [_doorbell_addr(handle, r) for r in range(layout.n_readers)]

    @classmethod
    def create(cls, n_readers: int, slot_bytes: int = 1 << 20, n_slots: int = 8) -> ShmRingWriter:
        """Create the segment (about n_slots x slot_bytes) and sockets for ``n_readers`` readers.

        A message is stored inline when a 16-byte header, 8 bytes per frame and its frames
        (each 16-byte aligned) fit in ``slot_bytes``; bigger ones take the overflow path.
        """
        if n_readers < 1 or n_slots < 1:
            raise ValueError(f"need n_readers >= 1 and n_slots >= 1, got {n_readers}, {n_slots}")
        if slot_bytes < _inline_lengths_size(1):
            raise ValueError(f"slot_bytes={slot_bytes} too small")
        lay = _Layout.of(n_readers, n_slots, slot_bytes)
        name = f"tidal-ring-{os.getpid()}-{secrets.token_hex(4)}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=lay.total)
        handle = RingHandle(shm.name, n_readers, n_slots, slot_bytes, name)
        with contextlib.ExitStack() as undo:  # unwinds everything below if creation fails
            undo.callback(shm.unlink)
            undo.callback(shm.close)
            ctx = zmq.Context()
            undo.callback(ctx.destroy, linger=0)
            overflow = [_overflow_socket(ctx, zmq.PUSH) for _ in range(n_readers)]
            for rank, sock in enumerate(overflow):
                sock.bind(_overflow_addr(handle, rank))
            bell, poller = _doorbell()
            undo.enter_context(bell)
            bell.bind(_doorbell_addr(handle, None))
            undo.pop_all()
        buf = shm.buf
        _HEADER.pack_into(buf, 0, _MAGIC, _VERSION, n_readers, n_slots, slot_bytes, os.getpid(),
                          0, 0)
        state = _WriterState(shm, buf, ctx, overflow, bell, poller,
                             [_ReaderInfo(r) for r in range(n_readers)])
        logger.debug("created ring %s: %d readers, %d slots x %d bytes",
                     shm.name, n_readers, n_slots, slot_bytes)
        return cls(handle, lay, state)

    @property
    def handle(self) -> RingHandle:
        return self._handle

    @property
    def n_overflow(self) -> int:
        """How many messages took the overflow path (for tests and tuning slot_bytes)."""
        return self._n_overflow

    def _state(self) -> _WriterState:
        if self._st is None:
            raise RingError("ring writer is closed")
        return self._st

    def enqueue(self, frames: Sequence[Frame], timeout: float | None = None) -> None:
        """Publish one message (a list of contiguous buffers) to every reader.

        Blocks while the next slot is still unread by some reader; raises `RingReaderDied` if
        that reader is dead or closed, `TimeoutError` (naming it) after ``timeout`` seconds.
        The frames are copied (into the slot, or into ZeroMQ), so callers may reuse them.
        """
        st = self._state()
        lay, buf = self._lay, st.buf
        slot = st.seq % lay.n_slots
        views = [f if type(f) is bytes else _as_bytes_view(f) for f in frames]
        wflag = self._wflag[slot]
        rflags = slice(wflag + 1, wflag + 1 + lay.n_readers)
        if not (buf[wflag] == 0 or buf[rflags] == self._all_read):
            self._wait_slot_free(st, slot, timeout)

        base = self._base[slot]
        sizes = [len(v) for v in views]  # bytes, or a 1-D "B" memoryview: len == nbytes
        offsets: list[int] = []
        pos = _inline_lengths_size(len(views))
        for n in sizes:
            offsets.append(pos)
            pos = (pos + n + 15) & ~15
        if (offsets[-1] + sizes[-1] if sizes else pos) <= lay.slot_bytes:
            buf[wflag] = 0  # readers must ignore the slot while it is rewritten
            _SLOT_HDR.pack_into(buf, base, st.seq, _KIND_INLINE, len(views))
            struct.pack_into(f"<{len(views)}Q", buf, base + _SLOT_HDR.size, *sizes)
            for off, n, v in zip(offsets, sizes, views):
                buf[base + off:base + off + n] = v
        else:
            self._send_overflow(st, views, timeout)
            buf[wflag] = 0
            _SLOT_HDR.pack_into(buf, base, st.seq, _KIND_OVERFLOW, len(views))
            self._n_overflow += 1
        buf[rflags] = self._none_read
        buf[wflag] = 1
        st.seq += 1
        _fence(st.fence)  # the publish above must be visible before we read the asleep bytes
        for rank, asleep in enumerate(self._asleep):
            if buf[asleep]:
                _ring(st.bell, self._bells[rank])

    def enqueue_bytes(self, data: Frame, timeout: float | None = None) -> None:
        self.enqueue((data,), timeout)

    def _send_overflow(self, st: _WriterState, views: list[bytes | memoryview],
                       timeout: float | None) -> None:
        # One copy into immutable bytes shared by all readers' sends, so zmq can go zero-copy
        # without the caller's buffer being mutated under it after we return.
        parts = [_SEQ.pack(st.seq)] + [v if type(v) is bytes else bytes(v) for v in views]
        deadline = None if timeout is None else time.monotonic() + timeout
        # A bound PUSH with no connected peer is not writable. Wait until every reader is
        # connected before sending to any, so a timeout here leaves no partial message behind;
        # after that, HWM 0 means the sends cannot block.
        for rank, sock in enumerate(st.overflow):
            while not sock.poll(int(_LIVENESS_S * 1000), zmq.POLLOUT):
                self._check_reader(st, rank)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"ring {self._handle.shm_name}: {self._describe(st, rank)} "
                                       "did not connect its overflow socket")
        for sock in st.overflow:
            sock.send_multipart(parts, copy=False)

    def _wait_slot_free(self, st: _WriterState, slot: int, timeout: float | None) -> None:
        lay, buf = self._lay, st.buf
        wflag = self._wflag[slot]
        rflags = slice(wflag + 1, wflag + 1 + lay.n_readers)
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = now + _SPIN_S
        while time.monotonic() < spin_until:
            if buf[rflags] == self._all_read:
                return
            os.sched_yield()
        _drain(st.bell)
        buf[_WRITER_ASLEEP_OFF] = 1
        _fence(st.fence)  # readers must see asleep=1, or we must see their read flags (Dekker)
        try:
            next_check = now + _LIVENESS_S
            woke = False
            while True:
                if buf[rflags] == self._all_read:
                    return
                if woke:
                    _drain(st.bell)
                now = time.monotonic()
                if now >= next_check:
                    for rank in self._laggards(st, slot):
                        self._check_reader(st, rank)
                    next_check = now + _LIVENESS_S
                if deadline is not None and now >= deadline:
                    slow = ", ".join(self._describe(st, r) for r in self._laggards(st, slot))
                    raise TimeoutError(f"ring {self._handle.shm_name}: slot {slot} not yet read "
                                       f"after {timeout}s by {slow}")
                wait = min(_SLEEP_POLL_S, next_check - now)
                if deadline is not None:
                    wait = min(wait, deadline - now)
                woke = bool(st.poller.poll(max(1, round(wait * 1000))))
        finally:
            buf[_WRITER_ASLEEP_OFF] = 0

    def _laggards(self, st: _WriterState, slot: int) -> list[int]:
        base = self._lay.written(slot) + 1
        return [r for r in range(self._lay.n_readers) if not st.buf[base + r]]

    def _refresh(self, st: _WriterState, rank: int) -> tuple[int, _ReaderInfo]:
        pid, state, _, raw = _READER_REC.unpack_from(st.buf, self._lay.reader(rank))
        info = st.readers[rank]
        info.name = raw.rstrip(b"\x00").decode(errors="replace")
        if pid and pid != info.pid:
            # Tiny window: if the reader died and its pid was reused before this first look,
            # we would track the wrong process. Accepted; it needs a full pid wrap-around.
            info.pid = pid
            try:
                info.proc = psutil.Process(pid)
            except psutil.NoSuchProcess:
                info.proc = None
        return state, info

    def _describe(self, st: _WriterState, rank: int) -> str:
        state, info = self._refresh(st, rank)
        if state == _FREE:
            return f"reader rank {rank} (not attached)"
        return f"reader {info.name!r} (pid {info.pid})"

    def _check_reader(self, st: _WriterState, rank: int) -> None:
        state, info = self._refresh(st, rank)
        if state == _CLOSED:
            raise RingReaderDied(f"reader {info.name!r} (pid {info.pid}) closed its end")
        if state == _ATTACHED and (info.proc is None or not _alive(info.proc)):
            raise RingReaderDied(f"reader {info.name!r} (pid {info.pid}) died")

    def close(self) -> None:
        """Tell readers the stream ended, tear down sockets, unlink the segment.

        Readers still drain messages already in slots; overflow payloads not yet delivered
        are dropped (sockets close with linger 0 so a dead reader cannot stall shutdown).
        """
        st, self._st = self._st, None
        if st is None:
            return
        st.buf[_CLOSED_OFF] = 1
        _fence(st.fence)
        for addr in self._bells:
            _ring(st.bell, addr)
        for sock in st.overflow:
            sock.close(linger=0)
        st.ctx.term()
        st.bell.close()
        st.shm.close()
        st.shm.unlink()
        logger.debug("closed ring %s after %d messages", self._handle.shm_name, st.seq)

    def __enter__(self) -> ShmRingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _ReaderState:
    mm: mmap.mmap
    buf: memoryview
    rbuf: memoryview  # read-only alias handed out to callers
    ctx: zmq.Context
    overflow: zmq.Socket
    bell: socket.socket  # bound: the writer rings it; also used to ring the writer's
    poller: select.poll
    writer: psutil.Process
    writer_pid: int
    fence: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0
    held_slot: int = -1  # slot whose views the caller may still be using


class ShmRingReader:
    """One reader end, attached by rank (0 <= rank < n_readers) and a name for diagnostics."""

    def __init__(self, handle: RingHandle, rank: int, name: str, layout: _Layout,
                 state: _ReaderState, spin_s: float) -> None:
        self._handle = handle
        self.rank = rank
        self.name = name
        self._lay = layout
        self._st: _ReaderState | None = state
        self._spin_s = spin_s
        self._wflag = [layout.written(s) for s in range(layout.n_slots)]
        self._base = [layout.slot(s) for s in range(layout.n_slots)]
        self._writer_bell = _doorbell_addr(handle, None)

    @classmethod
    def attach(cls, handle: RingHandle, rank: int, name: str,
               spin_s: float = _SPIN_S) -> ShmRingReader:
        """Attach as reader ``rank``; ``spin_s``: how long `dequeue` busy-polls before sleeping."""
        if not 0 <= rank < handle.n_readers:
            raise ValueError(f"rank {rank} out of range for {handle.n_readers} readers")
        lay = _Layout.of(handle.n_readers, handle.n_slots, handle.slot_bytes)
        # Map /dev/shm directly instead of SharedMemory(name): on Python < 3.13 attaching
        # registers the segment with this process's resource tracker, which would unlink it
        # (and warn) when the reader exits.
        fd = os.open(f"/dev/shm/{handle.shm_name.lstrip('/')}", os.O_RDWR)
        try:
            mm = mmap.mmap(fd, lay.total)
        finally:
            os.close(fd)
        with contextlib.ExitStack() as undo:  # unwinds everything below if attaching fails
            undo.callback(mm.close)
            buf = memoryview(mm)
            undo.callback(buf.release)
            writer_pid = cls._check_header(handle, lay, buf, rank)
            try:
                writer = psutil.Process(writer_pid)
            except psutil.NoSuchProcess:
                writer = None
            if writer is None or not _alive(writer):
                raise RingWriterDied(f"ring {handle.shm_name}: writer (pid {writer_pid}) is gone")
            bell, poller = _doorbell()
            undo.enter_context(bell)
            bell.bind(_doorbell_addr(handle, rank))
            ctx = zmq.Context()
            undo.callback(ctx.destroy, linger=0)
            overflow = _overflow_socket(ctx, zmq.PULL)
            overflow.connect(_overflow_addr(handle, rank))
            undo.pop_all()
        rec = lay.reader(rank)
        _READER_REC.pack_into(buf, rec, os.getpid(), _FREE, 0, name.encode()[:48])
        buf[rec + _STATE_OFF] = _ATTACHED  # last, so the writer never sees a half-written record
        logger.debug("reader %r attached to ring %s as rank %d", name, handle.shm_name, rank)
        state = _ReaderState(mm, buf, buf.toreadonly(), ctx, overflow, bell, poller, writer,
                             writer_pid)
        return cls(handle, rank, name, lay, state, spin_s)

    @staticmethod
    def _check_header(handle: RingHandle, lay: _Layout, buf: memoryview, rank: int) -> int:
        magic, version, n_readers, n_slots, slot_bytes, writer_pid, *_ = _HEADER.unpack_from(buf)
        if (magic, version, n_readers, n_slots, slot_bytes) != (
                _MAGIC, _VERSION, handle.n_readers, handle.n_slots, handle.slot_bytes):
            raise RingError(f"ring {handle.shm_name}: header does not match handle {handle}")
        if buf[lay.reader(rank) + _STATE_OFF] != _FREE:
            raise RingError(f"ring {handle.shm_name}: rank {rank} is already taken")
        return writer_pid

    def _state(self) -> _ReaderState:
        if self._st is None:
            raise RingError(f"reader {self.name!r} is closed")
        return self._st

    def dequeue(self, timeout: float | None = None, copy: bool = False) -> list[memoryview | bytes]:
        """Next message's frames, in the writer's order.

        With ``copy=False`` inline frames are read-only memoryviews into shared memory, valid
        only until the next `dequeue`/`close` (the slot is released then); overflow frames are
        memoryviews of ZeroMQ frames and stay valid. ``copy=True`` returns bytes and releases the
        slot at once. Raises `TimeoutError`, `RingWriterDied` or `RingClosed`.
        """
        st = self._state()
        lay, buf = self._lay, st.buf
        if st.held_slot >= 0:
            self._release(st, self._wflag[st.held_slot] + 1 + self.rank)
            st.held_slot = -1
        slot = st.seq % lay.n_slots
        wflag = self._wflag[slot]
        rflag = wflag + 1 + self.rank
        if not (buf[wflag] == 1 and buf[rflag] == 0):
            self._wait_ready(st, wflag, rflag, timeout)

        base = self._base[slot]
        seq, kind, n_frames = _SLOT_HDR.unpack_from(buf, base)
        if seq != st.seq:
            raise RingError(f"ring {self._handle.shm_name}: reader {self.name!r} expected seq "
                            f"{st.seq} in slot {slot}, found {seq}")
        frames: list[memoryview | bytes]
        if kind == _KIND_OVERFLOW:
            frames = self._recv_overflow(st, n_frames, timeout, copy)
            self._release(st, rflag)
        else:
            lengths = struct.unpack_from(f"<{n_frames}Q", buf, base + _SLOT_HDR.size)
            pos = base + _inline_lengths_size(n_frames)
            frames = []
            for n in lengths:
                frames.append(st.rbuf[pos:pos + n])
                pos = (pos + n + 15) & ~15
            if copy:
                frames = [f.tobytes() for f in frames]
                self._release(st, rflag)
            else:
                st.held_slot = slot
        st.seq += 1
        return frames

    def _release(self, st: _ReaderState, rflag: int) -> None:
        st.buf[rflag] = 1
        _fence(st.fence)  # the writer must see the flag, or we must see it asleep (Dekker)
        if st.buf[_WRITER_ASLEEP_OFF]:
            _ring(st.bell, self._writer_bell)

    def dequeue_bytes(self, timeout: float | None = None) -> bytes:
        """`dequeue` for single-frame messages, as a bytes copy."""
        frames = self.dequeue(timeout, copy=True)
        if len(frames) != 1:
            raise RingError(f"expected a single-frame message, got {len(frames)} frames")
        return bytes(frames[0])

    def _check_writer(self, st: _ReaderState, liveness: bool) -> None:
        if st.buf[_CLOSED_OFF]:
            raise RingClosed(f"ring {self._handle.shm_name} was closed by its writer")
        if liveness and not _alive(st.writer):
            raise RingWriterDied(f"ring {self._handle.shm_name}: writer (pid {st.writer_pid}) "
                                 f"died; reader {self.name!r} waited for message {st.seq}")

    def _wait_ready(self, st: _ReaderState, wflag: int, rflag: int, timeout: float | None) -> None:
        buf = st.buf
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = now + (self._spin_s if timeout is None else min(self._spin_s, timeout))
        while time.monotonic() < spin_until:
            if buf[wflag] == 1 and buf[rflag] == 0:
                return
            os.sched_yield()
        _drain(st.bell)  # stale pokes from an earlier sleep would make poll return at once
        asleep = self._lay.reader(self.rank) + _ASLEEP_OFF
        buf[asleep] = 1
        _fence(st.fence)  # the writer must see asleep=1, or we must see its slot (Dekker)
        try:
            next_check = 0.0
            woke = False
            while True:
                if buf[wflag] == 1 and buf[rflag] == 0:
                    return  # the poke stays queued: draining it here would add to wake latency
                if woke:
                    _drain(st.bell)
                now = time.monotonic()
                self._check_writer(st, liveness=now >= next_check)
                if now >= next_check:
                    next_check = now + _LIVENESS_S
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"reader {self.name!r}: no message within {timeout}s")
                wait = _SLEEP_POLL_S if deadline is None else min(_SLEEP_POLL_S, deadline - now)
                woke = bool(st.poller.poll(max(1, round(wait * 1000))))
        finally:
            buf[asleep] = 0

    def _recv_overflow(self, st: _ReaderState, n_frames: int, timeout: float | None,
                       copy: bool) -> list[memoryview | bytes]:
        deadline = None if timeout is None else time.monotonic() + timeout
        wait = _LIVENESS_S
        while not st.overflow.poll(max(1, round(wait * 1000))):
            self._check_writer(st, liveness=True)
            if deadline is not None:
                wait = min(_LIVENESS_S, deadline - time.monotonic())
            if wait <= 0:
                raise TimeoutError(f"reader {self.name!r}: overflow payload for message {st.seq} "
                                   f"did not arrive within {timeout}s")
        parts = st.overflow.recv_multipart(copy=False)
        (seq,) = _SEQ.unpack(parts[0].buffer)
        if seq != st.seq or len(parts) != n_frames + 1:
            raise RingError(f"ring {self._handle.shm_name}: reader {self.name!r} expected "
                            f"overflow message {st.seq} with {n_frames} frames, got {seq} "
                            f"with {len(parts) - 1}")
        return [p.bytes if copy else p.buffer for p in parts[1:]]

    def close(self) -> None:
        """Detach: the writer will raise `RingReaderDied` if it later waits on this reader."""
        st, self._st = self._st, None
        if st is None:
            return
        rec = self._lay.reader(self.rank)
        st.buf[rec + _ASLEEP_OFF] = 0
        st.buf[rec + _STATE_OFF] = _CLOSED
        st.overflow.close(linger=0)
        st.ctx.term()
        st.bell.close()
        st.rbuf.release()
        st.buf.release()
        try:
            st.mm.close()
        except BufferError:
            # The caller still holds frames from the last dequeue; the mapping goes away when
            # they are garbage-collected. The segment itself belongs to the writer.
            logger.debug("reader %r: mapping kept alive by outstanding frames", self.name)

    def __enter__(self) -> ShmRingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unlink_ring(handle: RingHandle) -> None:
    """Remove the segment of a ring whose writer died without `close()`.

    Goes through SharedMemory so the resource tracker's books stay balanced (register, then
    unregister) when it is shared with the dead writer, as with spawned children. Sockets are
    in the abstract namespace and vanish with their processes.
    """
    try:
        shm = shared_memory.SharedMemory(name=handle.shm_name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()
