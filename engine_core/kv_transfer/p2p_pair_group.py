"""Two-rank torch.distributed groups for the P2P KV transport (one per producer-consumer pair).

The groups are built straight on a store (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never
through ``init_process_group``: that would claim the process's default group, which the engine's
own parallel groups (and a second pair) need. The producer hosts one ``TCPStore`` per send
server, listening on ``kv_ip`` only (a socket we bind and hand over; torch's own would listen on
every interface); each pair gets a random key prefix, told to the consumer over the ZMQ
control socket, so two consumers' rendezvous never mix. Producer is rank 0, consumer rank 1.

Waits never block forever: ``wait`` polls a send or receive against a deadline and a pair whose
transfer timed out is dropped (the peer may still be mid-operation; a fresh pair is built for
the next pull).

NCCL notes: the two ranks must be on distinct GPUs; NCCL's own bootstrap sockets follow
``NCCL_SOCKET_IFNAME`` (outside this module's reach).
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
NCCL_WATCHDOG_S = 1800.0
# Most NCCL communicators one pair may hold (``build_pair``'s ``streams``); each holds GPU
# buffers and an NCCL stream.
MAX_STREAMS = 4


class PairError(RuntimeError):
    """A pair could not be built, or one of its transfers failed or timed out."""


def new_pair_key() -> str:
    return f"tidal-kv-pair/{uuid.uuid4().hex}"


class PairStoreHost:
    """The producer's rendezvous store, listening on ``host`` only."""

    def __init__(self, host: str, timeout_s: float) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self._sock.listen(64)
        self.host = host
        self.port = self._sock.getsockname()[1]
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self.store: Any = dist.TCPStore(host, self.port, None, True, timeout, False, False,
                                            self._sock.fileno())
        except (RuntimeError, TypeError) as exc:
            # Fail closed: a store of its own would listen on every interface, not ``host``.
            self._sock.close()
            raise PairError(
                "this torch's TCPStore cannot take a pre-bound listening socket "
                f"({exc}); its own would listen on every interface rather than {host}, so "
                "gloo / nccl pairs are refused here (use transport zmq)") from None
        # The store owns the socket now (it closes it when dropped): not closed twice.
        self._sock.detach()

    def close(self) -> None:
        """Drop the store (its server stops and closes the listening socket); pairs built on
        it should be closed first."""
        self.store = None


class _Works:
    """The works of one batch of ops spread over a pair's communicators: done once each
    communicator's last one is (each runs its ops in order)."""

    __slots__ = ("works",)

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self, *args: Any) -> bool:
        ok = True
        for w in self.works:
            ok = w.wait(*args) is not False and ok
        return ok


@dataclass(slots=True)
class PairGroup:
    """One side of a two-rank group: ``send`` / ``recv`` whole tensors to the other rank.

    An NCCL pair may hold several communicators (``groups``, each with its own NCCL stream):
    a batch of tensors goes round-robin over them, so one communicator's per-operation
    handshake overlaps another's data. (Measured on two H100s, 1 GiB as 64 sends of 16 MiB:
    one communicator, one op after another, 283 GB/s; the same as one NCCL group call,
    160 GB/s; one 1 GiB send, 354 GB/s.) Both sides spread a batch alike, so each
    communicator's sends and receives pair up in order. (Posting an op costs 25-45 us of
    host time, and posting each communicator's from a thread of its own was slower still on
    two H200s: 64 receives posted in 3.3-3.7 ms against 2.4-2.6 from one thread.)"""

    backend: str
    rank: int
    groups: list[Any]  # ProcessGroupGloo | ProcessGroupNCCL; gloo: one
    timeout_s: float
    device: torch.device

    @property
    def peer(self) -> int:
        return 1 - self.rank

    @property
    def window(self) -> int:
        """Transfers one side may have in flight: NCCL's run on the GPU while the next chunk is
        staged (or scattered); gloo's are finished one by one."""
        return 2 if self.backend == "nccl" else 1

    def send(self, tensor: torch.Tensor) -> None:
        self.finish(self.start_send(tensor), "send")

    def recv(self, tensor: torch.Tensor) -> None:
        self.finish(self.start_recv(tensor), "receive")

    def start_send(self, tensor: torch.Tensor, stripe: int = 0) -> Any:
        """Queue ``tensor`` to the peer (on NCCL's stream, after the current stream's work);
        ``tensor`` must live until ``finish``."""
        try:
            return self.groups[stripe].send([tensor], self.peer, 0)
        except RuntimeError as exc:
            raise PairError(f"{self.backend} send failed: {exc}") from None

    def start_recv(self, tensor: torch.Tensor, stripe: int = 0) -> Any:
        try:
            return self.groups[stripe].recv([tensor], self.peer, 0)
        except RuntimeError as exc:
            raise PairError(f"{self.backend} receive failed: {exc}") from None

    def start_sends(self, tensors: list[torch.Tensor], first: int = 0) -> Any:
        """Queue every tensor to the peer, in order; one work for them all (``finish``).
        ``first``: the first tensor's place in a batch the peer receives in one call (the
        communicators are taken round-robin from there, as the peer's are)."""
        return self._start_many(self.start_send, tensors, "send", first)

    def start_recvs(self, tensors: list[torch.Tensor], first: int = 0) -> Any:
        """Post receives into every tensor, in the peer's send order; one work for them all."""
        return self._start_many(self.start_recv, tensors, "receive", first)

    def _start_many(self, start: Any, tensors: list[torch.Tensor], what: str,
                    first: int = 0) -> Any:
        n = len(self.groups)
        if len(tensors) == 1:
            return start(tensors[0], first % n)
        if self.backend == "gloo":
            # (One by one: each send completes once the peer has posted its receive, and the
            # peer posts them in this order.)
            for t in tensors[:-1]:
                self.finish(start(t), what)
            return start(tensors[-1])
        # NCCL: op after op, not one group call (a group of many ops to one peer ran at less
        # than 60 % of the same ops queued), spread round-robin over the communicators.
        last: list[Any] = [None] * n
        for i, t in enumerate(tensors, first):
            last[i % n] = start(t, i % n)
        return _Works([w for w in last if w is not None])

    def close(self) -> None:
        """Give the group up; an NCCL communicator is aborted, so an operation stuck on a
        peer that died ends instead of spinning on the GPU (best effort)."""
        if self.backend != "nccl":
            return
        for group in self.groups:
            for name in ("abort", "_abort", "shutdown", "_shutdown"):
                fn = getattr(group, name, None)
                if fn is not None:
                    try:
                        fn()
                    except Exception as exc:  # noqa: BLE001 - best effort on a broken pair
                        logger.debug("closing an NCCL pair: %s", exc)
                    break

    def finish(self, work: Any, what: str) -> None:
        """Block until ``work`` is done (at most ``timeout_s``), then order the current stream
        after it. Only a finished NCCL op is waited on by a stream, so a peer that died never
        stalls a compute stream."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.00002
        try:
            if self.backend == "gloo":
                # (Gloo's send/recv works complete only inside ``wait``, which takes a timeout.)
                if not work.wait(datetime.timedelta(seconds=self.timeout_s)):
                    raise PairError(f"gloo {what} did not finish within {self.timeout_s:g} s")
                return
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise PairError(f"{self.backend} {what} did not finish within "
                                    f"{self.timeout_s:g} s")
                time.sleep(pause)
                # (A short cap: a 1 GiB pull takes ~3 ms over NVLink; sleeping past its end
                # costs more than polling.)
                pause = min(pause * 2, 0.0002)
            work.wait()  # raises the transfer's error, if any; orders NCCL on this stream
        except PairError:
            raise
        except RuntimeError as exc:
            raise PairError(f"{self.backend} {what} failed: {exc}") from None


def build_pair(backend: str, store: Any, key: str, rank: int, timeout_s: float,
               device: torch.device, host: str,
               build_timeout_s: float | None = None, streams: int = 1) -> PairGroup:
    """This process's rank of the pair ``key`` on ``store`` (blocks until the peer joins, at
    most ``build_timeout_s``, by default ``timeout_s``: an operation's limit); ``host``: the
    address gloo listens on for this rank. ``streams``: NCCL communicators (both sides must
    ask for the same number; gloo has one)."""
    if backend not in BACKENDS:
        raise PairError(f"unknown pair backend {backend!r} (known: {', '.join(BACKENDS)})")
    n = 1 if backend == "gloo" else max(1, min(int(streams), MAX_STREAMS))
    pair = PairGroup(backend, rank, [], timeout_s, device)
    try:
        for k in range(n):
            prefixed = dist.PrefixStore(key if k == 0 else f"{key}/{k}", store)
            pair.groups.append(_build_one(backend, prefixed, rank, timeout_s, device, host,
                                          build_timeout_s))
    except PairError:
        pair.close()  # (the communicators built before the one that failed)
        raise
    return pair


def _build_one(backend: str, prefixed: Any, rank: int, timeout_s: float, device: torch.device,
               host: str, build_timeout_s: float | None) -> Any:
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            # (Its rendezvous waits this long; each send / recv is waited on with its own
            # explicit timeout, ``PairGroup.finish``.)
            opts._timeout = timeout if build_timeout_s is None \
                else datetime.timedelta(seconds=build_timeout_s)
            group = dist.ProcessGroupGloo(prefixed, rank, 2, opts)
        else:
            if device.type != "cuda":
                raise PairError("the nccl pair backend needs a CUDA KV cache")
            torch.cuda.set_device(device)  # this thread's NCCL ops run on the cache's GPU
            nccl = dist.ProcessGroupNCCL
            # NCCL's watchdog tears the process down when an op outlives the group's timeout:
            # a consumer that dies mid-transfer must not take the producer with it that soon
            # (``wait`` gives up on the pair after ``timeout_s`` anyway).
            watchdog = datetime.timedelta(seconds=max(timeout_s, NCCL_WATCHDOG_S))
            try:
                opts = nccl.Options()
                opts._timeout = watchdog
                group = nccl(prefixed, rank, 2, opts)
            except (AttributeError, TypeError):
                group = nccl(prefixed, rank, 2, watchdog)
            # (As torch's own group construction does; both ranks meet in the store here.)
            seq = getattr(group, "_set_sequence_number_for_group", None)
            if seq is not None:
                seq()
    except PairError:
        raise
    except (RuntimeError, ValueError) as exc:
        raise PairError(f"building the {backend} pair failed: {exc}") from None
    return group


def connect_store(host: str, port: int, timeout_s: float) -> Any:
    """The consumer's client of a producer's ``PairStoreHost``."""
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as exc:
        raise PairError(f"cannot reach the producer's store {host}:{port}: {exc}") from None


def staging_device(backend: str, cache_device: torch.device) -> torch.device:
    """Where a chunk is gathered for the wire: NCCL sends from the cache's GPU, gloo from host
    memory."""
    return cache_device if backend == "nccl" else torch.device("cpu")
