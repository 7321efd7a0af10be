"""Moves one request's KV blocks between two engines of one host: the P2pConnector's tensors.

The producer (prefill) worker runs a ``KVSendServer``: a ZeroMQ ROUTER thread that serves the
blocks of the requests its scheduler registered (and only those: a peer cannot read other
requests' blocks by guessing ids). The consumer (decode) worker pulls with a ``KVPullClient``
straight into its own KV cache. Control messages are msgspec structs (msgpack, never pickle);
the tensors travel as raw ZeroMQ frames (sent without a copy on the producer, received without
one and copied once into the consumer's cache).

A pull goes chunk by chunk, each chunk some whole layers of the request's blocks and at most
``buffer_bytes`` (at least one layer): the producer stages the next chunk only when the consumer
asks for it, so its send buffer is bounded and a slow consumer holds the producer back
(back-pressure) instead of piling up copies. The consumer's last message (``KVDone``) releases
the request on the producer; a request nobody pulls is released after ``send_timeout_s``.

Tensors are staged through host memory (a GPU cache is copied to the host and back); NCCL
between two GPUs is not wired yet (``P2pConnector.check_config`` refuses
``transport="nccl"``).
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass

import msgspec
import torch
import zmq

from tidal.engine_core.sockets import recv_frames, send_frames

logger = logging.getLogger(__name__)

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)
# Most blocks one pull may ask for (a request's blocks are bounded by max_model_len anyway; this
# bounds what a malformed message can make the producer stage).
MAX_PULL_BLOCKS = 1 << 20


class KVTransferError(RuntimeError):
    """A pull failed (the producer is gone, timed out, refused or sent something else)."""


class KVPull(msgspec.Struct, tag="pull", **_WIRE):
    """Consumer -> producer: chunk ``chunk`` of blocks [start, end) of ``request_id``'s table."""

    request_id: str
    start_block: int
    end_block: int
    digest: str  # the consumer's prompt digest: served only if it is the request's
    chunk: int = 0


class KVDone(msgspec.Struct, tag="done", **_WIRE):
    """Consumer -> producer: the consumer has what it needs; release the blocks (only for the
    request's own prompt digest: nobody else can make the producer drop them)."""

    request_id: str
    digest: str


class KVChunk(msgspec.Struct, tag="chunk", **_WIRE):
    """Producer -> consumer: layers [first_layer, first_layer + num_layers) of the asked blocks,
    one frame per layer after this header (each ``shape`` of ``dtype``, C order), or an error."""

    request_id: str
    chunk: int = 0
    first_layer: int = 0
    num_layers: int = 0
    num_total_layers: int = 0
    dtype: str = ""
    shapes: list[list[int]] = []
    error: str | None = None


_ToProducer = KVPull | KVDone
_to_producer = msgspec.msgpack.Decoder(_ToProducer)
_to_consumer = msgspec.msgpack.Decoder(KVChunk)
_encode = msgspec.msgpack.encode


def block_axis(cache: torch.Tensor) -> int:
    """The block index's dimension of one layer's cache: ``[2, blocks, ...]`` (K and V) or MLA's
    ``[blocks, block_size, latent]``."""
    return 0 if cache.dim() == 3 else 1


def layer_block_bytes(cache: torch.Tensor) -> int:
    """Bytes one block of this layer's cache holds."""
    return cache.numel() // cache.shape[block_axis(cache)] * cache.element_size()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (numpy knows no bfloat16 or float8)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


@dataclass(slots=True)
class _Outgoing:
    block_ids: list[int]
    digest: str
    registered_at: float
    ready: bool = False  # the step that computed its last prompt chunk has run


class KVSendServer:
    """The producer's side: serves registered requests' blocks until each is pulled or expires.

    ``register`` / ``mark_ready`` / ``take_finished`` are called from the worker's step thread;
    the serving thread only reads the cache blocks of registered requests, which the scheduler
    holds (no step writes them) until ``take_finished`` has reported them.
    """

    def __init__(self, kv_caches: list[torch.Tensor], address: str, buffer_bytes: float,
                 send_timeout_s: float) -> None:
        self.kv_caches = kv_caches
        self.buffer_bytes = max(1, int(buffer_bytes))
        self.send_timeout_s = send_timeout_s
        self._lock = threading.Lock()
        self._outgoing: dict[str, _Outgoing] = {}
        self._finished: set[str] = set()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        # The largest chunk staged so far (bytes): what the bounded send buffer really held.
        self.peak_staged_bytes = 0
        self.chunks_sent = 0
        self._thread = threading.Thread(target=self._serve, name="kv-send-server", daemon=True)
        self._thread.start()
        logger.info("P2P KV send server on %s (send buffer %d bytes)", self.address,
                    self.buffer_bytes)

    # --- step thread -------------------------------------------------------------------------

    def register(self, request_id: str, block_ids: list[int], digest: str,
                 ready: bool) -> None:
        """Serve ``request_id``'s ``block_ids`` (its whole table so far); ``ready`` once the
        step computing its last prompt tokens has run."""
        with self._lock:
            entry = self._outgoing.get(request_id)
            if entry is None:
                self._outgoing[request_id] = _Outgoing(list(block_ids), digest,
                                                       time.monotonic(), ready)
            else:
                # (Registered again each step it runs: not servable while a step writes it.)
                entry.block_ids = list(block_ids)
                entry.digest = digest
                entry.ready = ready

    def mark_ready(self, request_ids: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                entry = self._outgoing.get(rid)
                if entry is not None:
                    # The timeout runs from here: its scheduler holds the blocks from the end
                    # of this step on, and must not hear of an expiry before it holds them.
                    entry.ready = True
                    entry.registered_at = now

    def forget(self, request_id: str) -> None:
        """The scheduler dropped it (aborted or freed): nothing to serve any more."""
        with self._lock:
            self._outgoing.pop(request_id, None)
            self._finished.discard(request_id)

    def take_finished(self) -> set[str]:
        """Requests pulled (or expired unpulled) since the last call: their blocks may go."""
        now = time.monotonic()
        with self._lock:
            for rid, entry in list(self._outgoing.items()):
                if entry.ready and now - entry.registered_at > self.send_timeout_s:
                    logger.warning("KV of request %s was not pulled within %.0f s; releasing "
                                   "its blocks", rid, self.send_timeout_s)
                    del self._outgoing[rid]
                    self._finished.add(rid)
            done, self._finished = self._finished, set()
        return done

    def pending(self) -> int:
        with self._lock:
            return len(self._outgoing)

    # --- serving thread ----------------------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = recv_frames(self._sock, copy=True)
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if len(frames) != 2:
                continue  # not a DEALER peer speaking this protocol
            peer, body = frames
            try:
                msg = _to_producer.decode(body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.warning("dropping a malformed KV transfer message: %s", exc)
                continue
            if isinstance(msg, KVDone):
                with self._lock:
                    entry = self._outgoing.get(msg.request_id)
                    if entry is not None and entry.digest == msg.digest:
                        del self._outgoing[msg.request_id]
                        self._finished.add(msg.request_id)
                continue
            try:
                reply, tensors = self._chunk(msg)
            except Exception as exc:  # noqa: BLE001 - answered, the server keeps serving
                logger.exception("serving KV of %s failed", msg.request_id)
                reply, tensors = KVChunk(msg.request_id, msg.chunk, error=str(exc)), []
            frames_out = [peer, _encode(reply)] + [t.numpy() for t in tensors]
            try:
                send_frames(self._sock, frames_out, copy=False)
            except zmq.ZMQError as exc:
                logger.warning("could not answer a KV pull of %s: %s", msg.request_id, exc)

    def _chunk(self, msg: KVPull) -> tuple[KVChunk, list[torch.Tensor]]:
        with self._lock:
            entry = self._outgoing.get(msg.request_id)
            blocks = None if entry is None or not entry.ready else entry.block_ids
            digest = None if entry is None else entry.digest
        if blocks is None:
            why = "unknown" if entry is None else "not computed yet"
            return KVChunk(msg.request_id, msg.chunk,
                           error=f"request {msg.request_id!r} is {why} here"), []
        if msg.digest != digest:
            return KVChunk(msg.request_id, msg.chunk,
                           error="the pull's prompt differs from the request's"), []
        if not 0 <= msg.start_block < msg.end_block <= min(len(blocks), MAX_PULL_BLOCKS):
            return KVChunk(msg.request_id, msg.chunk,
                           error=f"blocks [{msg.start_block}, {msg.end_block}) are out of the "
                                 f"request's {len(blocks)}"), []
        ids = blocks[msg.start_block:msg.end_block]
        caches = self.kv_caches
        per_layer = max(layer_block_bytes(c) for c in caches) * len(ids)
        layers = max(1, self.buffer_bytes // per_layer)  # whole layers within the buffer
        first = msg.chunk * layers
        if not 0 <= first < len(caches):
            return KVChunk(msg.request_id, msg.chunk, error=f"no chunk {msg.chunk}"), []
        last = min(len(caches), first + layers)
        index = torch.tensor(ids, dtype=torch.long, device=caches[0].device)
        staged = []
        shapes = []
        for cache in caches[first:last]:
            part = cache.index_select(block_axis(cache), index)
            shapes.append(list(part.shape))
            staged.append(_raw(part).cpu())
        self.peak_staged_bytes = max(self.peak_staged_bytes,
                                     sum(t.numel() for t in staged))
        self.chunks_sent += 1
        return KVChunk(msg.request_id, msg.chunk, first, last - first, len(caches),
                       str(caches[0].dtype).removeprefix("torch."), shapes), staged

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)
        self._ctx.term()


class KVPullClient:
    """The consumer's side: pulls a request's blocks from a producer into the local cache."""

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float) -> None:
        self.kv_caches = kv_caches
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self.bytes_received = 0

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        """A failed exchange may leave a late reply queued: start the next one afresh."""
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(linger=0)

    def pull(self, address: str, request_id: str, start_block: int,
             local_block_ids: list[int], digest: str) -> int:
        """Copy the producer's blocks [start_block, start_block + len(local_block_ids)) of
        ``request_id`` into ``local_block_ids`` of this cache, layer by layer; returns the bytes
        received. Raises ``KVTransferError`` (nothing is released on the producer then but by
        its timeout; the caller recomputes)."""
        end_block = start_block + len(local_block_ids)
        deadline = time.monotonic() + self.timeout_s
        sock = self._socket(address)
        caches = self.kv_caches
        index = torch.tensor(local_block_ids, dtype=torch.long, device=caches[0].device)
        received = 0
        chunk = 0
        try:
            while True:
                sock.send(_encode(KVPull(request_id, start_block, end_block, digest, chunk)))
                frames = self._recv(sock, deadline)
                reply = _to_consumer.decode(frames[0].buffer)
                if reply.error is not None:
                    raise KVTransferError(f"the producer refused: {reply.error}")
                if (reply.request_id != request_id or reply.chunk != chunk
                        or reply.num_total_layers != len(caches)
                        or len(frames) - 1 != reply.num_layers
                        or len(reply.shapes) != reply.num_layers
                        or reply.first_layer + reply.num_layers > len(caches)
                        or reply.num_layers < 1):
                    raise KVTransferError("the producer's reply does not match the pull (a "
                                          "different model or KV layout?)")
                for k, frame in enumerate(frames[1:]):
                    cache = caches[reply.first_layer + k]
                    want = list(cache.shape)
                    want[block_axis(cache)] = len(local_block_ids)
                    if reply.shapes[k] != want or \
                            reply.dtype != str(cache.dtype).removeprefix("torch."):
                        raise KVTransferError(
                            f"layer {reply.first_layer + k}: the producer sent {reply.dtype} "
                            f"{reply.shapes[k]}, this cache holds {cache.dtype} {want}")
                    with warnings.catch_warnings():
                        # Read-only frame memory: only read, by the copy into the cache.
                        warnings.simplefilter("ignore", UserWarning)
                        raw = torch.frombuffer(frame.buffer, dtype=torch.uint8)
                    part = raw.view(cache.dtype).view(want).to(cache.device)
                    cache.index_copy_(block_axis(cache), index, part)
                    received += raw.numel()
                if reply.first_layer + reply.num_layers >= len(caches):
                    break
                chunk += 1
            sock.send(_encode(KVDone(request_id, digest)))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop(address)
            raise KVTransferError(f"undecodable reply from the producer: {exc}") from None
        except KVTransferError:
            self._drop(address)
            raise
        except zmq.ZMQError as exc:
            self._drop(address)
            raise KVTransferError(f"transport error: {exc}") from None
        self.bytes_received += received
        return received

    def release(self, address: str, request_id: str, digest: str) -> None:
        """Tell the producer this consumer needs nothing of ``request_id`` (it had the blocks
        already): it may free them now rather than at its timeout. Best effort, no answer."""
        try:
            self._socket(address).send(_encode(KVDone(request_id, digest)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("could not release %s at %s: %s", request_id, address, exc)

    def _recv(self, sock: zmq.Socket, deadline: float) -> list[zmq.Frame]:
        left = deadline - time.monotonic()
        if left <= 0 or not sock.poll(int(left * 1000), zmq.POLLIN):
            raise KVTransferError(f"no answer from the producer within {self.timeout_s:g} s")
        return recv_frames(sock, zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        for address in list(self._socks):
            self._drop(address)
        self._ctx.term()
