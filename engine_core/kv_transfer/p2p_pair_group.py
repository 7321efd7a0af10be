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
            self.store = dist.TCPStore(host, self.port, None, True, timeout, False, False,
                                       self._sock.fileno())
        except (RuntimeError, TypeError) as exc:
            # (A torch whose store backend cannot take a listening socket: its own binds every
            # interface. The store holds only random-keyed rendezvous entries.)
            logger.warning("TCPStore refused a listening socket (%s); its own listens on every "
                           "interface", exc)
            self._sock.close()
            self.store = dist.TCPStore(host, 0, None, True, timeout, False)
            self.port = self.store.port

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


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
                pause = min(pause * 2, 0.005)
            work.wait()  # raises the transfer's error, if any; orders NCCL on this stream
        except PairError:
            raise
        except RuntimeError as exc:
            raise PairError(f"{self.backend} {what} failed: {exc}") from None


def build_pair(backend: str, store: Any, key: str, rank: int, timeout_s: float,
               device: torch.device, host: str) -> PairGroup:
    """This process's rank of the pair ``key`` on ``store`` (blocks until the peer joins, at
    most ``timeout_s``); ``host``: the address gloo listens on for this rank."""
    if backend not in BACKENDS:
        raise PairError(f"unknown pair backend {backend!r} (known: {', '.join(BACKENDS)})")
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(key, store)
    try:
        if backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
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
