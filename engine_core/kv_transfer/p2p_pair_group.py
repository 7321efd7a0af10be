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


class _StreamPoint:
    """A work-like handle for ops queued on a stream: done once the stream passes here."""

    __slots__ = ("_event",)

    def __init__(self, stream: Any) -> None:
        self._event = torch.cuda.Event()
        self._event.record(stream)

    def is_completed(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        """(Ordered on that stream already.)"""


@dataclass(slots=True)
class PairGroup:
    """One side of a two-rank group: ``send`` / ``recv`` whole tensors to the other rank."""

    backend: str
    rank: int
    group: Any  # ProcessGroupGloo | ProcessGroupNCCL
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

    def start_send(self, tensor: torch.Tensor) -> Any:
        """Queue ``tensor`` to the peer (on NCCL's stream, after the current stream's work);
        ``tensor`` must live until ``finish``."""
        try:
            return self.group.send([tensor], self.peer, 0)
        except RuntimeError as exc:
            raise PairError(f"{self.backend} send failed: {exc}") from None

    def start_recv(self, tensor: torch.Tensor) -> Any:
        try:
            return self.group.recv([tensor], self.peer, 0)
        except RuntimeError as exc:
            raise PairError(f"{self.backend} receive failed: {exc}") from None

    def start_sends(self, tensors: list[torch.Tensor]) -> Any:
        """Queue every tensor to the peer, in order; one work for them all (``finish``)."""
        return self._start_many(self.start_send, tensors, "send")

    def start_recvs(self, tensors: list[torch.Tensor]) -> Any:
        """Post receives into every tensor, in the peer's send order; one work for them all."""
        return self._start_many(self.start_recv, tensors, "receive")

    def _start_many(self, start: Any, tensors: list[torch.Tensor], what: str) -> Any:
        if len(tensors) == 1:
            return start(tensors[0])
        if self.backend == "gloo":
            # (One by one: each send completes once the peer has posted its receive, and the
            # peer posts them in this order.)
            for t in tensors[:-1]:
                self.finish(start(t), what)
            return start(tensors[-1])
        # NCCL: one group call (ncclGroupStart/End), so many sends of one chunk run as one
        # launch instead of serializing, each behind the last one's handshake.
        begin = getattr(self.group, "_start_coalescing", None)
        end = getattr(self.group, "_end_coalescing", None)
        coalesce = begin is not None and end is not None
        if coalesce:
            try:
                begin()
            except (RuntimeError, TypeError) as exc:
                logger.debug("no coalesced NCCL p2p (%s): one call per tensor", exc)
                coalesce = False
        work = None
        try:
            for t in tensors:
                work = start(t)
        finally:
            if coalesce:
                try:
                    work = end()
                except RuntimeError as exc:
                    raise PairError(f"{self.backend} {what} failed: {exc}") from None
        if work is None:
            # (A torch whose coalesced block ran on the current stream returns no work: that
            # stream reaching this point means every op has finished.)
            work = _StreamPoint(torch.cuda.current_stream(self.device))
        # (Without a group the ops run in order on one NCCL stream: the last one's work
        # finishing means every one has.)
        return work

    def close(self) -> None:
        """Give the group up; an NCCL communicator is aborted, so an operation stuck on a
        peer that died ends instead of spinning on the GPU (best effort)."""
        if self.backend != "nccl":
            return
        for name in ("abort", "_abort", "shutdown", "_shutdown"):
            fn = getattr(self.group, name, None)
            if fn is not None:
                try:
                    fn()
                except Exception as exc:  # noqa: BLE001 - best effort on a broken pair
                    logger.debug("closing an NCCL pair: %s", exc)
                return

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
               build_timeout_s: float | None = None) -> PairGroup:
    """This process's rank of the pair ``key`` on ``store`` (blocks until the peer joins, at
    most ``build_timeout_s``, by default ``timeout_s``: an operation's limit); ``host``: the
    address gloo listens on for this rank."""
    if backend not in BACKENDS:
        raise PairError(f"unknown pair backend {backend!r} (known: {', '.join(BACKENDS)})")
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(key, store)
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
    return PairGroup(backend, rank, group, timeout_s, device)


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
