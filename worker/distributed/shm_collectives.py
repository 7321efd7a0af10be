"""Collectives between the CPU ranks of one host over one shared-memory segment, instead of
gloo's TCP loopback: all-reduce (sum), all-gather, broadcast, barrier, and point-to-point
send/recv. ``ParallelGroup`` uses it for every CPU group of the multiprocess executor
(``ParallelConfig.cpu_collectives``); gloo stays for the rendezvous that sets it up.

Layout (one segment per group; little-endian 8-byte words; offsets 64-byte aligned, data
4096-byte aligned)::

    header     magic, version, world, slot_bytes, mailbox slots, mailbox slot bytes
    ranks      world records, one cache line each: arrive counter, state, pid
    mailboxes  world x world controls (src, dst), two cache lines each:
               sent counter and the byte length of each slot (src writes) | received (dst)
    slots      2 buffers x world ranks x slot_bytes: collective payloads
    mail       world x world x mailbox slots x mailbox slot bytes: point-to-point payloads

Collectives. Every collective operation (and every slot-sized piece of a larger tensor) is one
step of a sequence that all ranks walk in the same order: rank r writes its payload into its
own slot of buffer ``seq % 2``, publishes ``arrive[r] = seq``, waits until every rank's
``arrive`` is at least ``seq``, then reads the slots it needs. Two buffers make one wait per
step enough: a rank writes buffer ``b`` again at step ``seq + 2`` only after every rank arrived
at ``seq + 1``, which each did only after it finished reading step ``seq``. The all-reduce is
one-shot (each rank adds every slot) and adds in gloo's ring order (``gloo_order``), so float
sums are bit-identical to gloo's for the same inputs.

Point-to-point. Each ordered pair has a mailbox of a few slots, a single-producer
single-consumer queue: the sender waits for a free slot (``sent - received < slots``), writes
the piece and its length, then bumps ``sent``; the receiver waits for ``sent``, checks the
length against the tensor it receives into, copies and bumps ``received``. ``send`` never
blocks: what does not fit yet stays queued (the caller keeps the tensor unchanged until the
handle's ``wait()``, as with torch's ``isend``) and is pushed whenever this rank waits for
anything (a receive, a collective, ``wait()``), so two ranks sending to each other before
receiving cannot deadlock.

Memory ordering. Each counter is an aligned 8-byte word stored after the data it publishes
and loaded before the data it guards, which x86-64's total store order keeps in order without
fences (as in ``shm_broadcast``); a rank only ever writes its own words. Weakly ordered CPUs
(ARM) would need real barriers and are not claimed to work.

Waiting. A waiting rank polls for ``_SPIN_S`` (50 us), then sleeps in ``poll`` on its own
doorbell, a Unix datagram socket in the abstract namespace:
a rank that publishes a word (``arrive``, ``sent``, ``received``) rings the doorbells of the
peers whose ``asleep`` word is set. So a balanced step never leaves user space, and an
oversubscribed host (more ranks and other processes than cores) is not burnt by spinners:
waiting ranks block in the kernel, as gloo's do. "Set asleep, load counter" against "store
counter, load asleep" is the Dekker pattern, which x86 breaks by letting a load pass an earlier
store, so both sides run a full fence in between (an uncontended lock round trip, as in
``shm_broadcast``). The sleep is bounded by ``_LIVENESS_S``: while it waits, a rank checks the
peer it waits for: a peer process that is gone (or a zombie, or a new process under a reused
pid) raises `PeerDiedError` naming its rank and pid; a peer that closed its end or failed
raises `ShmCollectiveError`; a live peer is waited for up to ``timeout`` (gloo's own limit)
before `TimeoutError`. A rank that raises marks itself failed, so its other peers stop waiting
for it too.

Lifetime. Group rank 0 creates the segment in /dev/shm under a random name and sends the name
over the group's gloo group; once every rank has mapped it, rank 0 unlinks it, so it lives
exactly as long as the mappings and nothing is left behind however the processes end.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import psutil
import torch

from tidal.worker.distributed.gloo_order import ring_chunks, ring_order

logger = logging.getLogger(__name__)

SLOT_BYTES = 1 << 20  # one rank's payload of one collective step; larger tensors go in pieces
MAILBOX_SLOTS = 4
MAILBOX_SLOT_BYTES = 1 << 20
TIMEOUT_S = 300.0  # gloo's limit for one operation (parallel_state.RENDEZVOUS_TIMEOUT)

_MAGIC = 0x5444_4C43_4F4C_4C31  # "TDLCOLL1"
_VERSION = 1
_NAME_BYTES = 64
_HEADER_WORDS = 8
_RANK_STRIDE = 64
_MAILBOX_STRIDE = 128
_ACKED_OFF = 64  # the receiver's counter: its own cache line
_MAX_MAILBOX_SLOTS = 7  # lengths fit the sender's cache line after its counter
_PAGE = 4096
_FREE, _ATTACHED, _CLOSED, _FAILED = 0, 1, 2, 3

_EMPTY = torch.empty(0, dtype=torch.uint8)
_SPIN = 200  # polls before looking at the clock (~10 us of Python)
_SPIN_S = 5e-5  # then poll until this long, then sleep on the doorbell
_LIVENESS_S = 0.05  # how often a waiter checks the peer it waits for (its longest sleep)


class ShmCollectiveError(RuntimeError):
    """The shared-memory group is unusable: a peer left it, or it was misused."""


class PeerDiedError(ShmCollectiveError):
    """The process of a rank this one waited for is gone."""


class _Outgoing:
    """A message handed to ``send``: the handle ``send`` returns. Its pieces go into the
    mailbox as slots free up; ``wait()`` returns once the last one is in (the tensor may then
    change)."""

    __slots__ = ("group", "dst", "data", "pieces", "next", "done")

    def __init__(self, group: ShmCollectives, dst: int, data: torch.Tensor,
                 pieces: int) -> None:
        self.group = group
        self.dst = dst
        self.data = data  # the message's bytes (a view of the caller's tensor, or a copy)
        self.pieces = pieces
        self.next = 0  # the next piece to write
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.group._push(self.dst, block=True)
        return True

    def is_completed(self) -> bool:
        return self.done


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(slots=True, frozen=True)
class _Layout:
    world: int
    slot_bytes: int
    mailbox_slots: int
    mailbox_slot_bytes: int
    ranks_off: int
    mailboxes_off: int
    slots_off: int
    mail_off: int
    total: int

    @classmethod
    def of(cls, world: int, slot_bytes: int, mailbox_slots: int,
           mailbox_slot_bytes: int) -> _Layout:
        if not 1 <= mailbox_slots <= _MAX_MAILBOX_SLOTS:
            raise ValueError(f"mailbox_slots must be 1..{_MAX_MAILBOX_SLOTS}, got {mailbox_slots}")
        if slot_bytes < 64 or mailbox_slot_bytes < 64:
            raise ValueError("slot sizes must be at least 64 bytes")
        slot_bytes = _align(slot_bytes, 64)
        mailbox_slot_bytes = _align(mailbox_slot_bytes, 64)
        ranks_off = _HEADER_WORDS * 8
        mailboxes_off = _align(ranks_off + world * _RANK_STRIDE, 64)
        slots_off = _align(mailboxes_off + world * world * _MAILBOX_STRIDE, _PAGE)
        mail_off = slots_off + 2 * world * slot_bytes
        total = _align(mail_off + world * world * mailbox_slots * mailbox_slot_bytes, _PAGE)
        return cls(world, slot_bytes, mailbox_slots, mailbox_slot_bytes, ranks_off,
                   mailboxes_off, slots_off, mail_off, total)

    # Word indices (8-byte) of the control fields.
    def arrive(self, rank: int) -> int:
        return (self.ranks_off + rank * _RANK_STRIDE) // 8

    def state(self, rank: int) -> int:
        return self.arrive(rank) + 1

    def pid(self, rank: int) -> int:
        return self.arrive(rank) + 2

    def asleep(self, rank: int) -> int:
        return self.arrive(rank) + 3

    def sent(self, src: int, dst: int) -> int:
        return (self.mailboxes_off + (src * self.world + dst) * _MAILBOX_STRIDE) // 8

    def length(self, src: int, dst: int, slot: int) -> int:
        return self.sent(src, dst) + 1 + slot

    def received(self, src: int, dst: int) -> int:
        return self.sent(src, dst) + _ACKED_OFF // 8

    # Byte offsets of the payloads.
    def slot(self, buf: int, rank: int) -> int:
        return self.slots_off + (buf * self.world + rank) * self.slot_bytes

    def mail(self, src: int, dst: int, slot: int) -> int:
        return self.mail_off + ((src * self.world + dst) * self.mailbox_slots + slot) \
            * self.mailbox_slot_bytes


def _alive(proc: psutil.Process) -> bool:
    try:
        # is_running also compares the creation time: a reused pid is not our peer.
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ShmCollectives:
    """One rank's end of a shared-memory group. Build it with `create` (collective over the
    group's gloo group). Not thread-safe: one thread per rank drives it."""

    def __init__(self, mm: mmap.mmap, layout: _Layout, rank: int, ranks: tuple[int, ...],
                 pids: list[int], name: str, timeout: float = TIMEOUT_S,
                 bell: tuple[socket.socket, select.poll] | None = None) -> None:
        self.rank = rank
        self.world = layout.world
        self.ranks = ranks  # global ranks, by group rank (for messages)
        self.pids = pids
        self.name = name
        self.timeout = timeout
        self._lay = layout
        self._mm: mmap.mmap | None = mm
        self._ctl = memoryview(mm).cast("q")
        self._mem = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))
        self._procs: list[psutil.Process | None] = []
        for r, pid in enumerate(pids):
            proc = None
            if r != rank:
                try:
                    proc = psutil.Process(pid)
                except psutil.NoSuchProcess:
                    proc = None  # already gone: the first wait on it says so
            self._procs.append(proc)
        self._seq = int(self._ctl[layout.arrive(rank)])
        self._my_arrive = layout.arrive(rank)
        self._peer_arrive = [(layout.arrive(r), r) for r in range(self.world) if r != rank]
        self._my_asleep = layout.asleep(rank)
        self._asleep = [layout.asleep(r) for r in range(self.world)]
        self._peers = [r for r in range(self.world) if r != rank]
        self._bell, self._poller = bell if bell is not None else _doorbell(name, rank)
        self._bells = [_bell_addr(name, r) for r in range(self.world)]
        self._fence_lock = threading.Lock()
        # Byte views of every collective slot, [buf][rank]; typed views are made on demand.
        self._slots = [[self._mem[layout.slot(b, r):layout.slot(b, r) + layout.slot_bytes]
                        for r in range(self.world)] for b in range(2)]
        self._typed: dict[torch.dtype, list[list[torch.Tensor]]] = {}
        self._sent_n = [0] * self.world  # mailbox pieces sent to / received from each peer
        self._recv_n = [0] * self.world
        self._pending: list[deque[_Outgoing]] = [deque() for _ in range(self.world)]
        self._n_pending = 0
        self._mail = [[[self._mem[layout.mail(s, d, k):
                                  layout.mail(s, d, k) + layout.mailbox_slot_bytes]
                        for k in range(layout.mailbox_slots)] if s != d else []
                       for d in range(self.world)] for s in range(self.world)]

    # --- set-up --------------------------------------------------------------------------------

    @classmethod
    def create(cls, cpu_group: Any, rank: int, ranks: tuple[int, ...], *,
               slot_bytes: int = SLOT_BYTES, mailbox_slots: int = MAILBOX_SLOTS,
               mailbox_slot_bytes: int = MAILBOX_SLOT_BYTES,
               timeout: float = TIMEOUT_S) -> ShmCollectives:
        """Set up the group's segment: collective over ``cpu_group`` (gloo), whose members are
        ``ranks`` (global ranks by group rank); this process is group rank ``rank``."""
        dist = torch.distributed
        world = len(ranks)
        lay = _Layout.of(world, slot_bytes, mailbox_slots, mailbox_slot_bytes)
        name = ""
        mm: mmap.mmap | None = None
        bell: tuple[socket.socket, select.poll] | None = None
        error = ""
        if rank == 0:
            try:
                name, mm = _create_segment(lay)
            except OSError as exc:
                error = f"cannot create the shared-memory segment: {exc}"
        name_t = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        encoded = name.encode()
        name_t[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        dist.broadcast(name_t, src=ranks[0], group=cpu_group)
        name = bytes(name_t.tolist()).rstrip(b"\0").decode()
        try:
            if rank != 0 and name:
                try:
                    mm = _attach_segment(name, lay)
                except (OSError, ValueError) as exc:
                    error = f"cannot map the shared-memory segment {name}: {exc}"
            if mm is not None:
                try:
                    bell = _doorbell(name, rank)  # bound before anyone can ring it
                except OSError as exc:
                    error = f"cannot bind the doorbell socket: {exc}"
                    mm.close()
                    mm = None
            if mm is not None:
                ctl = memoryview(mm).cast("q")
                ctl[lay.pid(rank)] = os.getpid()
                ctl[lay.state(rank)] = _ATTACHED
                ctl.release()
            # Every rank's pid and whether it mapped the segment; then nobody needs the name.
            mine = torch.tensor([int(mm is not None), os.getpid()], dtype=torch.int64)
            everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]
            dist.all_gather(everyone, mine, group=cpu_group)
        finally:
            if rank == 0 and name:
                _unlink(name)
        failed = [ranks[r] for r, t in enumerate(everyone) if not int(t[0])]
        if failed:
            if mm is not None:
                mm.close()
            if bell is not None:
                bell[0].close()
            raise ShmCollectiveError(
                f"shared-memory collectives for ranks {list(ranks)}: rank(s) {failed} could not "
                f"map the segment{': ' + error if error else ''} (use --cpu-collectives gloo)")
        assert mm is not None
        pids = [int(t[1]) for t in everyone]
        logger.debug("rank %d: shared-memory collectives with ranks %s (%d bytes)",
                     ranks[rank], list(ranks), lay.total)
        return cls(mm, lay, rank, tuple(ranks), pids, name, timeout, bell)

    def close(self) -> None:
        """Leave the group (peers waiting on this rank fail at their next liveness check).
        Idempotent."""
        self._release(_CLOSED)

    def _release(self, state: int) -> None:
        if self._mm is None:
            return
        self._ctl[self._lay.state(self.rank)] = state
        self._ctl.release()
        self._slots = []
        self._typed = {}
        self._mail = []
        self._pending = [deque() for _ in range(self.world)]  # unsent messages are dropped
        self._n_pending = 0
        del self._mem
        self._bell.close()
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:
            logger.debug("shm group %s: mapping kept alive by outstanding views", self.name)

    @property
    def closed(self) -> bool:
        return self._mm is None

    # --- collectives -------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group in place (returns ``x``), bit-identical to gloo's sum."""
        if x.dtype == torch.bool or x.is_complex():
            raise TypeError(f"all_reduce (sum) does not take {x.dtype} tensors")
        # In memory order, as gloo reduces it: that decides which ring chunk an element is in.
        flat = _memory_order(x)
        n = flat.numel()
        per = self._lay.slot_bytes // flat.element_size()
        world = self.world
        chunks = ring_chunks(n, flat.element_size(), world) if world > 2 else []
        try:
            for lo in range(0, n, per):
                hi = min(n, lo + per)
                slots = self._typed_slots(flat.dtype, (self._seq + 1) & 1)
                slots[self.rank][:hi - lo].copy_(flat[lo:hi])
                self._step("all_reduce")
                if world == 2:
                    # A single addition: commutative, so it equals gloo's whatever the order.
                    flat[lo:hi].add_(slots[1 - self.rank][:hi - lo])
                    continue
                for c, (c_lo, c_hi) in enumerate(chunks):
                    a, b = max(lo, c_lo), min(hi, c_hi)
                    if a >= b:
                        continue
                    order = ring_order(c, world)
                    out = flat[a:b]
                    torch.add(slots[order[1]][a - lo:b - lo], slots[order[0]][a - lo:b - lo],
                              out=out)
                    for r in order[2:]:
                        out.add_(slots[r][a - lo:b - lo])
        except BaseException:
            self._fail()
            raise
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather_into(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` laid end to end in ``out`` (``world`` times its size, contiguous),
        in group-rank order; returns ``out``."""
        if not out.is_contiguous() or out.numel() != self.world * x.numel() \
                or out.dtype != x.dtype:
            raise ValueError(f"all_gather: out must be a contiguous {x.dtype} tensor of "
                             f"{self.world} x {x.numel()} elements, got {out.dtype} "
                             f"{tuple(out.shape)}")
        xb = _bytes(_flat(x))
        ob = _bytes(out.view(-1))
        nb = xb.numel()
        step = self._lay.slot_bytes
        try:
            for lo in range(0, nb, step):
                hi = min(nb, lo + step)
                slots = self._slots[(self._seq + 1) & 1]
                slots[self.rank][:hi - lo].copy_(xb[lo:hi])
                self._step("all_gather")
                for r in range(self.world):
                    src = xb[lo:hi] if r == self.rank else slots[r][:hi - lo]
                    ob[r * nb + lo:r * nb + hi].copy_(src)
        except BaseException:
            self._fail()
            raise
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` of group rank ``src`` copied into ``x`` on every rank (returns ``x``)."""
        if not 0 <= src < self.world:
            raise ValueError(f"broadcast: src {src} is not a rank of a group of {self.world}")
        flat = _flat(x)
        xb = _bytes(flat)
        nb = xb.numel()
        step = self._lay.slot_bytes
        try:
            for lo in range(0, nb, step):
                hi = min(nb, lo + step)
                slots = self._slots[(self._seq + 1) & 1]
                if self.rank == src:
                    slots[src][:hi - lo].copy_(xb[lo:hi])
                self._step("broadcast")
                if self.rank != src:
                    xb[lo:hi].copy_(slots[src][:hi - lo])
        except BaseException:
            self._fail()
            raise
        if self.rank != src and not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        return x

    def barrier(self) -> None:
        try:
            self._step("barrier")
        except BaseException:
            self._fail()
            raise

    # --- point to point ------------------------------------------------------------------------

    def send(self, x: torch.Tensor, dst: int) -> _Outgoing:
        """Send ``x`` to group rank ``dst``: its pieces go into the mailbox now as far as it
        has room, the rest during this rank's later waits or at ``wait()`` on the returned
        handle. Keep ``x`` unchanged until ``wait()`` returns (as with torch's ``isend``)."""
        self._check_peer_index(dst, "send")
        xb = _bytes(_flat(x))
        pieces = max(1, -(-xb.numel() // self._lay.mailbox_slot_bytes))  # empty: one piece
        out = _Outgoing(self, dst, xb, pieces)
        self._pending[dst].append(out)
        self._n_pending += 1
        self._push(dst, block=False)
        return out

    def _push(self, dst: int, block: bool) -> None:
        """Write queued pieces for ``dst`` while its mailbox has room; with ``block``, until
        the queue is empty."""
        lay = self._lay
        ctl = self._ctl
        me = self.rank
        step = lay.mailbox_slot_bytes
        received = lay.received(me, dst)
        sent = lay.sent(me, dst)
        queue = self._pending[dst]
        try:
            while queue:
                head = queue[0]
                m = self._sent_n[dst]
                need = m - lay.mailbox_slots + 1
                if ctl[received] < need:
                    if not block:
                        return
                    self._wait(received, need, dst, "send")
                    continue  # the wait may have pushed pieces itself
                lo = head.next * step
                hi = min(head.data.numel(), lo + step)
                k = m % lay.mailbox_slots
                if hi > lo:
                    self._mail[me][dst][k][:hi - lo].copy_(head.data[lo:hi])
                ctl[lay.length(me, dst, k)] = hi - lo
                self._sent_n[dst] = m + 1
                ctl[sent] = m + 1
                self._wake(dst)
                head.next += 1
                if head.next == head.pieces:
                    head.done = True
                    head.data = _EMPTY
                    queue.popleft()
                    self._n_pending -= 1
        except BaseException:
            self._fail()
            raise

    def _progress(self) -> None:
        """Push queued sends without blocking: a rank waiting to receive (or in a collective)
        still feeds its own receivers, so sends never deadlock against receives."""
        for dst, queue in enumerate(self._pending):
            if queue:
                self._push(dst, block=False)

    def recv(self, x: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``x`` from group rank ``src`` (blocks until it arrived); returns
        ``x``. The sender's tensor must have the same number of bytes."""
        self._check_peer_index(src, "recv")
        flat = _flat(x)
        xb = _bytes(flat)
        lay = self._lay
        ctl = self._ctl
        me = self.rank
        step = lay.mailbox_slot_bytes
        sent = lay.sent(src, me)
        received = lay.received(src, me)
        try:
            for lo in range(0, max(1, xb.numel()), step):
                hi = min(xb.numel(), lo + step)
                m = self._recv_n[src]
                if ctl[sent] < m + 1:
                    self._wait(sent, m + 1, src, "recv")
                k = m % lay.mailbox_slots
                got = int(ctl[lay.length(src, me, k)])
                if got != hi - lo:
                    raise ShmCollectiveError(
                        f"recv from rank {self.ranks[src]}: message piece of {got} bytes where "
                        f"{hi - lo} were expected ({xb.numel()} bytes in all): the sender's "
                        "tensor has another size")
                if hi > lo:
                    xb[lo:hi].copy_(self._mail[src][me][k][:hi - lo])
                self._recv_n[src] = m + 1
                ctl[received] = m + 1
                self._wake(src)
        except BaseException:
            self._fail()
            raise
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        return x

    # --- internals ------------------------------------------------------------------------------

    def _check_peer_index(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.world or peer == self.rank:
            raise ValueError(f"{what}: {peer} is not another rank of a group of {self.world}")

    def _typed_slots(self, dtype: torch.dtype, buf: int) -> list[torch.Tensor]:
        views = self._typed.get(dtype)
        if views is None:
            views = [[s.view(dtype) for s in row] for row in self._slots]
            self._typed[dtype] = views
        return views[buf]

    def _step(self, what: str) -> None:
        """Arrive at the next step and wait until every rank has."""
        if self._mm is None:
            raise ShmCollectiveError(f"{what}: this rank's shared-memory group is closed")
        seq = self._seq + 1
        self._seq = seq
        ctl = self._ctl
        ctl[self._my_arrive] = seq
        self._fence()
        for peer in self._peers:
            if ctl[self._asleep[peer]]:
                _ring(self._bell, self._bells[peer])
        for idx, peer in self._peer_arrive:
            if ctl[idx] < seq:
                self._wait(idx, seq, peer, what)

    def _wait(self, idx: int, target: int, peer: int, what: str) -> None:
        """Until control word ``idx`` (owned by group rank ``peer``) reaches ``target``."""
        ctl = self._ctl
        for _ in range(_SPIN):
            if ctl[idx] >= target:
                return
        start = time.perf_counter()
        check_at = start + _LIVENESS_S
        while True:
            if self._n_pending:
                self._progress()
            if ctl[idx] >= target:
                return
            now = time.perf_counter()
            if now >= check_at:
                self._check_peer(peer, what, now - start)
                check_at = now + _LIVENESS_S
            if now - start < _SPIN_S:
                continue
            # Sleep until a peer rings (it does after publishing, if it sees this flag) or the
            # next liveness check. Flag, fence, re-check: against the peer's publish, fence,
            # look at the flag, one of the two sees the other (Dekker).
            ctl[self._my_asleep] = 1
            self._fence()
            if ctl[idx] < target:
                self._poller.poll(max(1, int((check_at - now) * 1000) + 1))
                _drain(self._bell)
            ctl[self._my_asleep] = 0

    def _wake(self, peer: int) -> None:
        """Ring ``peer``'s doorbell if it sleeps (after publishing a word it may wait on)."""
        self._fence()
        if self._ctl[self._asleep[peer]]:
            _ring(self._bell, self._bells[peer])

    def _fence(self) -> None:
        # CPython cannot emit a fence, but an uncontended lock round trip executes an atomic
        # read-modify-write, which is a full barrier on x86 (as in shm_broadcast).
        self._fence_lock.acquire()
        self._fence_lock.release()

    def _check_peer(self, peer: int, what: str, waited: float) -> None:
        lay = self._lay
        rank, pid = self.ranks[peer], self.pids[peer]
        state = int(self._ctl[lay.state(peer)])
        if state in (_CLOSED, _FAILED):
            why = "closed its end" if state == _CLOSED else "failed"
            raise ShmCollectiveError(
                f"rank {rank} (pid {pid}) {why} while rank {self.ranks[self.rank]} waited for "
                f"it in {what} over shared memory")
        proc = self._procs[peer]
        if proc is None or not _alive(proc):
            raise PeerDiedError(
                f"rank {rank} (pid {pid}) died while rank {self.ranks[self.rank]} waited for "
                f"it in {what} over shared memory")
        if waited > self.timeout:
            raise TimeoutError(
                f"rank {rank} (pid {pid}) did not reach {what} within {self.timeout:.0f} s "
                f"(rank {self.ranks[self.rank]} waited over shared memory)")

    def _fail(self) -> None:
        # Peers waiting on this rank stop at their next liveness check instead of timing out.
        if self._mm is not None:
            self._ctl[self._lay.state(self.rank)] = _FAILED


def _memory_order(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as a 1-D view in the order they lie in memory, when they are dense (a
    transposed tensor, say); else a contiguous copy in logical order."""
    if x.is_cuda:
        raise ValueError("shared-memory collectives take CPU tensors")
    if x.is_contiguous():
        return x.view(-1)
    perm = sorted(range(x.dim()), key=lambda d: (-x.stride(d), -x.size(d)))
    dense = x.permute(perm)
    return dense.view(-1) if dense.is_contiguous() else x.contiguous().view(-1)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 1-D contiguous tensor: a view where it can be, else a copy."""
    if x.is_cuda:
        raise ValueError("shared-memory collectives take CPU tensors")
    return x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)


def _bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _bell_addr(name: str, rank: int) -> bytes:
    # Linux abstract namespace: nothing on the filesystem, gone with the process.
    return f"\0{name}-b{rank}".encode()


def _doorbell(name: str, rank: int) -> tuple[socket.socket, select.poll]:
    bell = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        bell.setblocking(False)
        bell.bind(_bell_addr(name, rank))
    except BaseException:
        bell.close()
        raise
    poller = select.poll()
    poller.register(bell, select.POLLIN)
    return bell, poller


def _ring(bell: socket.socket, addr: bytes) -> None:
    try:
        bell.sendto(b"\x01", addr)
    except (BlockingIOError, ConnectionRefusedError, FileNotFoundError):
        pass  # its bell is full already (it will wake), or it is gone (liveness tells)


def _drain(bell: socket.socket) -> None:
    try:
        while True:
            bell.recv(64)
    except BlockingIOError:
        pass


def _header(lay: _Layout) -> list[int]:
    return [_MAGIC, _VERSION, lay.world, lay.slot_bytes, lay.mailbox_slots,
            lay.mailbox_slot_bytes]


def _segment_path(name: str) -> str:
    return f"/dev/shm/{name}"


def _create_segment(lay: _Layout) -> tuple[str, mmap.mmap]:
    name = f"tidal-coll-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(_segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, lay.total)  # zero-filled: every counter starts at 0
        mm = mmap.mmap(fd, lay.total)
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise
    os.close(fd)
    ctl = memoryview(mm).cast("q")
    for i, word in enumerate(_header(lay)):
        ctl[i] = word
    ctl.release()
    return name, mm


def _attach_segment(name: str, lay: _Layout) -> mmap.mmap:
    fd = os.open(_segment_path(name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size != lay.total:
            raise ValueError(f"segment {name} has {os.fstat(fd).st_size} bytes, expected "
                             f"{lay.total}")
        mm = mmap.mmap(fd, lay.total)
    finally:
        os.close(fd)
    ctl = memoryview(mm).cast("q")
    header = list(ctl[0:6])
    ctl.release()
    want = _header(lay)
    if header != want:
        mm.close()
        raise ValueError(f"segment {name}: header {header} != {want}")
    return mm


def _unlink(name: str) -> None:
    try:
        os.unlink(_segment_path(name))
    except FileNotFoundError:
        pass
