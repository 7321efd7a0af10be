"""Moves one request's KV blocks between two engines of one host: the P2pConnector's tensors.

The producer (prefill) worker runs a ``KVSendServer``: a ZeroMQ ROUTER thread that serves the
blocks of the requests its scheduler registered (and only those: a peer cannot read other
requests' blocks by guessing ids). The consumer (decode) worker pulls with a ``KVPullClient``
straight into its own KV cache. Control messages are msgspec structs (msgpack, never pickle).

A pull goes chunk by chunk, each chunk some whole layers of the request's blocks and at most
``buffer_bytes`` (at least one layer): the producer stages the next chunk only when the consumer
asks for it, so its send buffer is bounded and a slow consumer holds the producer back
(back-pressure) instead of piling up copies. The consumer's last message (``KVDone``) releases
the request on the producer; a request nobody pulls is released after ``send_timeout_s``.

Two ways for the tensors (the consumer picks, the producer serves both): ``zmq`` stages them
through host memory as raw ZeroMQ frames (sent without a copy, copied once into the consumer's
cache); ``gloo`` / ``nccl`` send each chunk as one staging tensor (its layers' blocks gathered
layer after layer) over a two-rank torch.distributed group per producer-consumer pair
(``p2p_pair_group``), built on the first pull after a ZMQ handshake (``KVPairHello`` ->
``KVPairInfo``: the producer's store address and the pair's key). Over NCCL a chunk goes from
the producer's GPU cache to the consumer's without touching host memory, and two chunks may be
in flight (the pair's window): the producer gathers chunk k+1 while chunk k is on the wire, the
consumer asks for k+1 before scattering k; so at most two staged chunks per pair exist on
either side. Runs of blocks consecutive on both sides skip the staging altogether: each layer's
K / V slice of such a run goes straight from one cache into the other (``p2p_direct_runs``; a
fresh long prompt is usually one run), and a chunk's sends go one by one, round-robin over the
pair's NCCL communicators (``PairGroup``); only the scattered rest is staged (and bounded by
the buffer). Control messages stay on ZMQ either way.

A pull into one run of blocks here (a fresh prompt's usual case, at least ``min_direct_bytes``
a slice) is *posted*: the consumer posts every layer's K / V receives straight into its cache,
then asks (``KVPull.posted`` says what it posted), then reads the header. The producer answers
and sends exactly those slices, from its cache where its blocks are one run too, else gathered
a few layers at a time within the send buffer; when it refuses it sends zeros of the posted
sizes instead (``KVChunk.filled``), so the pair stays in step. The round trip and the
producer's planning are then off the pull's latency (measured on two H200s: the first reply
came 1.3 ms into a 1 GiB pull before, a third of the pull).
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import ipaddress
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from tidal.engine_core.kv_transfer.p2p_direct_runs import (
    DIRECT_MIN_BYTES,
    CacheBytes,
    all_contiguous,
    check_direct,
    min_direct_blocks,
    plan_direct,
    run_lengths,
    run_slices,
    staged_positions,
)
from tidal.engine_core.kv_transfer.p2p_pair_group import (
    BACKENDS,
    MAX_STREAMS,
    PairError,
    PairGroup,
    PairStoreHost,
    build_pair,
    connect_store,
    new_pair_key,
    staging_device,
)
from tidal.engine_core.sockets import recv_frames, send_frames

logger = logging.getLogger(__name__)

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)
# Most blocks one pull may ask for (a request's blocks are bounded by max_model_len anyway; this
# bounds what a malformed message can make the producer stage).
MAX_PULL_BLOCKS = 1 << 20
MAX_POSTED_LAYERS = 4096  # (layers a posted pull may name)
# Pairs one producer keeps (one per consumer process that pulled over gloo / nccl), and the
# longest a pair's build or one chunk's send/receive may take.
MAX_PAIRS = 64
PAIR_TIMEOUT_S = 30.0
# How long the serving thread waits for a consumer to join a pair it said hello for (its
# only thread: a peer that never joins stalls every pull this long). A real consumer joins
# right after the answer.
PAIR_BUILD_TIMEOUT_S = 5.0


class KVTransferError(RuntimeError):
    """A pull failed (the producer is gone, timed out, refused or sent something else)."""


class KVRefused(KVTransferError):
    """The producer answered, refusing (unknown request, other prompt): the exchange itself
    went fine, so the connection (and its pair) stays usable."""


UNKNOWN_PAIR = "unknown pair"
UNAUTHORIZED = ("unauthorized: this producer asks for a shared secret; set TIDAL_KV_AUTH_KEY "
                "to the producer's on this engine")


MAX_CONTROL_BYTES = 1 << 20  # a consumer's message to a producer (``KVSendServer``)


class KVPull(msgspec.Struct, tag="pull", **_WIRE):
    """Consumer -> producer: chunk ``chunk`` of blocks [start, end) of ``request_id``'s table."""

    request_id: str
    start_block: int
    end_block: int
    digest: str  # the consumer's prompt digest: served only if it is the request's
    chunk: int = 0
    pair: str = ""  # a pair's key: the chunk goes over that group, not as frames
    # Over a pair: the run lengths of the consumer's destination block ids (consecutive ids),
    # so runs consecutive on both sides go cache to cache (``p2p_direct_runs``); empty: none.
    runs: list[int] = []
    auth: str = ""  # the shared secret ($TIDAL_KV_AUTH_KEY), when the producer asks one
    # Over a pair, receives posted before this was sent (``KVPullClient`` does, for a pull into
    # one run of blocks): per layer [halves, one half's block bytes], flat. The consumer posted
    # each layer's halves of the whole pull, in order, straight into its cache; the producer
    # sends exactly those (or zeros of their sizes, saying why: ``KVChunk.filled``).
    posted: list[int] = []


class KVPairHello(msgspec.Struct, tag="hello", **_WIRE):
    """Consumer -> producer: build a two-rank ``backend`` group with me (gloo or nccl), of
    ``streams`` NCCL communicators."""

    backend: str
    streams: int = 1
    auth: str = ""


class KVPairInfo(msgspec.Struct, tag="pair", **_WIRE):
    """Producer -> consumer: join pair ``key`` as rank 1 at the store ``host:port`` (the
    producer joins as rank 0 right after sending this), or why not."""

    key: str = ""
    host: str = ""
    port: int = 0
    error: str | None = None
    streams: int = 1  # the communicators both sides build (the hello's, capped)


class KVDone(msgspec.Struct, tag="done", **_WIRE):
    """Consumer -> producer: the consumer has what it needs; release the blocks (only for the
    request's own prompt digest: nobody else can make the producer drop them)."""

    request_id: str
    digest: str
    auth: str = ""


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
    nbytes: int = 0  # over a pair: the staging tensor's bytes (it follows on the group)
    # Over a pair: flat [offset, length, ...] of the asked blocks sent straight between the
    # caches after the staging tensor (which holds only the other blocks; 0 bytes if none).
    direct: list[int] = []
    # An error to a pull with posted receives: they were filled with zeros, so the pair is
    # still in step (the consumer drops the blocks and may use the pair again).
    filled: bool = False


_ToProducer = KVPull | KVDone | KVPairHello
_to_producer = msgspec.msgpack.Decoder(_ToProducer)
_to_consumer = msgspec.msgpack.Decoder(KVChunk | KVPairInfo)
_encode = msgspec.msgpack.encode


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def block_axis(cache: torch.Tensor) -> int:
    """The block index's dimension of one layer's cache: ``[2, blocks, ...]`` (K and V) or MLA's
    ``[blocks, block_size, latent]``."""
    return 0 if cache.dim() == 3 else 1


def layer_block_bytes(cache: torch.Tensor) -> int:
    """Bytes one block of this layer's cache holds."""
    return cache.numel() // cache.shape[block_axis(cache)] * cache.element_size()


# Largest receive a pull may say it posted (one layer's half of its blocks): what a malformed
# message can make a producer send zeros of.
MAX_POSTED_BYTES = 1 << 31


def _posted_sizes(msg: KVPull) -> list[int]:
    """The byte sizes of a pull's posted receives, in order (per layer, per half). Raises
    ``ValueError`` for a malformed list."""
    posted, n = msg.posted, msg.end_block - msg.start_block
    if len(posted) % 2 or not 0 < n <= MAX_PULL_BLOCKS or len(posted) > 2 * MAX_POSTED_LAYERS:
        raise ValueError("malformed posted receives")
    sizes = []
    for k in range(0, len(posted), 2):
        halves, block_bytes = posted[k], posted[k + 1]
        if halves not in (1, 2) or not 0 < block_bytes * n <= MAX_POSTED_BYTES:
            raise ValueError("malformed posted receives")
        sizes += [block_bytes * n] * halves
    return sizes


def _none() -> list[torch.Tensor]:
    return []


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (numpy knows no bfloat16 or float8)."""
    return t.contiguous().view(torch.uint8).reshape(-1)


@dataclass(slots=True)
class _Outgoing:
    block_ids: list[int]
    digest: str
    registered_at: float
    ready: bool = False  # the step that computed its last prompt chunk has run
    # (A GPU cache) recorded after that step's forward on the step thread's stream: a copy
    # out on another stream waits for it.
    computed: torch.cuda.Event | None = None


class KVSendServer:
    """The producer's side: serves registered requests' blocks until each is pulled or expires.

    ``register`` / ``mark_ready`` / ``take_finished`` are called from the worker's step thread;
    the serving thread only reads the cache blocks of registered requests, which the scheduler
    holds (no step writes them) until ``take_finished`` has reported them.
    """

    def __init__(self, kv_caches: list[torch.Tensor], address: str, buffer_bytes: float,
                 send_timeout_s: float, min_direct_bytes: int = DIRECT_MIN_BYTES,
                 auth_key: str | None = None) -> None:
        # Every consumer message must carry it (compared in constant time); None: none asked.
        self._auth = None if auth_key is None else auth_key.encode()
        self.refused_unauthorized = 0
        self.buffer_bytes = max(1, int(buffer_bytes))
        self.send_timeout_s = send_timeout_s
        self._min_direct_bytes = min_direct_bytes
        self.rebind(kv_caches)
        self.direct_bytes = 0  # sent straight from the cache, over every pull
        self._lock = threading.Lock()
        self._outgoing: dict[str, _Outgoing] = {}
        self._finished: set[str] = set()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # Consumers send small control messages (a pull names at most one run length per
        # block of a request): a peer sending more is cut off before anything is decoded.
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._sock.bind(address)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        # The largest chunk staged so far (bytes): what the bounded send buffer really held.
        self.peak_staged_bytes = 0
        self.chunks_sent = 0
        # Host milliseconds of the last chunk served over a pair, from its message's arrival:
        # earlier sends out of the window, chunk planned, header answered, every send posted
        # (the producer's half of a pull's phases).
        self.last_serve_ms: dict[str, float] = {}
        # Pairs (gloo / nccl), built on a consumer's hello; the serving thread alone uses them.
        self._host = self.address.rsplit(":", 1)[0].removeprefix("tcp://").strip("[]")
        self._store: PairStoreHost | None = None
        self._pairs: dict[str, PairGroup] = {}  # least recently used first
        self._pair_peers: dict[str, bytes] = {}  # pair key -> the ZMQ identity that made it
        # Per pair, sends not known finished (work, staging tensor): at most its window.
        self._sending: dict[str, collections.deque] = {}
        self._stream = None  # the serving thread's CUDA stream (a GPU cache)
        self._thread = threading.Thread(target=self._serve, name="kv-send-server", daemon=True)
        self._thread.start()
        logger.info("P2P KV send server on %s (send buffer %d bytes%s)", self.address,
                    self.buffer_bytes, ", shared secret required" if self._auth else "")
        if self._auth is None and not _loopback(self._host):
            logger.warning("P2P KV send server on %s, not a loopback address, without a shared "
                           "secret: set TIDAL_KV_AUTH_KEY on both engines so that only they "
                           "can pull, pair or release", self.address)

    def rebind(self, kv_caches: list[torch.Tensor]) -> None:
        """Serve from ``kv_caches`` (allocated again: what is derived from them goes too, so
        no send reads the old cache's memory)."""
        self.kv_caches = kv_caches
        # Runs of at least this many blocks go cache to cache over a pair (not staged).
        self.min_direct_blocks = min_direct_blocks(kv_caches, self._min_direct_bytes)
        self._contiguous = all_contiguous(kv_caches)
        self._bytes = [CacheBytes.of(c) for c in kv_caches] if self._contiguous else []
        # What a posted pull's receives must be to match this cache (``KVPull.posted``).
        self._layout = [x for b in self._bytes for x in (b.halves, b.block_bytes)]

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
        event = None
        if request_ids and self.kv_caches[0].is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.kv_caches[0].device))
        with self._lock:
            for rid in request_ids:
                entry = self._outgoing.get(rid)
                if entry is not None:
                    entry.computed = event
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
        try:
            self._serve_loop()
        finally:  # (closed by the thread that uses it)
            self._sock.close(linger=0)

    def _serve_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    continue
                frames = recv_frames(self._sock, copy=True)
                arrived = time.perf_counter()
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
            if self._auth is not None and not hmac.compare_digest(msg.auth.encode(),
                                                                  self._auth):
                self._refuse_unauthorized(peer, msg)
                continue
            if isinstance(msg, KVPairHello):
                self._pair_with(peer, msg)
                continue
            if isinstance(msg, KVDone):
                with self._lock:
                    entry = self._outgoing.get(msg.request_id)
                    if entry is not None and entry.digest == msg.digest:
                        del self._outgoing[msg.request_id]
                        self._finished.add(msg.request_id)
                continue
            if msg.pair:
                self._serve_pair_chunk(peer, msg, arrived)
                continue
            try:
                reply, tensors = self._chunk(msg)
            except Exception as exc:  # noqa: BLE001 - answered, the server keeps serving
                logger.exception("serving KV of %s failed", msg.request_id)
                reply, tensors = KVChunk(msg.request_id, msg.chunk, error=str(exc)), _none
            self._answer(peer, [_encode(reply)] + [t.numpy() for t in tensors()],
                         msg.request_id)

    def _refuse_unauthorized(self, peer: bytes, msg: KVPull | KVDone | KVPairHello) -> None:
        """A message without the shared secret: a pull or hello is answered with why (the
        consumer then recomputes), a release is dropped (the timeout frees the blocks)."""
        self.refused_unauthorized += 1
        if self.refused_unauthorized in (1, 10, 100) or self.refused_unauthorized % 1000 == 0:
            logger.warning("refused %d KV transfer message(s) without the shared secret",
                           self.refused_unauthorized)
        if isinstance(msg, KVPairHello):
            self._answer(peer, [_encode(KVPairInfo(error=UNAUTHORIZED))], "")
        elif isinstance(msg, KVPull):
            self._answer(peer, [_encode(KVChunk(msg.request_id, msg.chunk,
                                                error=UNAUTHORIZED))], msg.request_id)

    def _answer(self, peer: bytes, frames: list, request_id: str) -> bool:
        try:
            send_frames(self._sock, [peer] + frames, copy=False)
            return True
        except zmq.ZMQError as exc:
            logger.warning("could not answer a KV message of %s: %s", request_id, exc)
            return False

    def _pair_with(self, peer: bytes, hello: KVPairHello) -> None:
        """Answer a consumer's hello, then join the new pair as rank 0 (blocks this thread
        until the consumer joins or the timeout passes: the consumer joins right away)."""
        device = self.kv_caches[0].device
        error = None
        if hello.backend not in BACKENDS:
            error = f"unknown pair backend {hello.backend!r}"
        elif hello.backend == "nccl" and device.type != "cuda":
            error = "this producer's KV cache is not on a CUDA device (no nccl)"
        if error is not None:
            self._answer(peer, [_encode(KVPairInfo(error=error))], "")
            return
        timeout = min(self.send_timeout_s, PAIR_TIMEOUT_S)
        try:
            if self._store is None:
                # (Its timeout bounds the rendezvous: how long a peer that never joins holds
                # this thread.)
                self._store = PairStoreHost(self._host,
                                            min(self.send_timeout_s, PAIR_BUILD_TIMEOUT_S))
        except (OSError, RuntimeError) as exc:
            self._answer(peer, [_encode(KVPairInfo(error=f"no store: {exc}"))], "")
            return
        while len(self._pairs) >= MAX_PAIRS:
            # The least recently used goes (its consumer hears "unknown pair" and builds a
            # new one), not a busy one.
            self._drop_pair(next(iter(self._pairs)))
        key = new_pair_key()
        streams = 1 if hello.backend == "gloo" else max(1, min(hello.streams, MAX_STREAMS))
        if not self._answer(peer, [_encode(KVPairInfo(key, self._store.host,
                                                      self._store.port, streams=streams))],
                            ""):
            return
        try:
            self._pairs[key] = build_pair(hello.backend, self._store.store, key, 0, timeout,
                                          device, self._host,
                                          min(timeout, PAIR_BUILD_TIMEOUT_S), streams)
            self._pair_peers[key] = peer
            logger.info("P2P KV %s pair %s built", hello.backend, key)
        except PairError as exc:
            logger.warning("P2P KV pair with a consumer failed: %s", exc)

    def _serve_pair_chunk(self, peer: bytes, msg: KVPull, arrived: float) -> None:
        """One chunk over the pair: the header on ZMQ, then on the group the staging tensor
        (blocks not in a direct run) and the direct runs' cache slices, op by op."""
        pair = self._pairs.get(msg.pair)
        if pair is not None and self._pair_peers.get(msg.pair) != peer:
            # (Another peer naming a pair it did not build: refused like an unknown one.)
            logger.warning("a KV pull named pair %s from another peer; refused", msg.pair)
            pair = None
        if pair is None:
            self._answer(peer, [_encode(KVChunk(msg.request_id, msg.chunk,
                                                error=UNKNOWN_PAIR))], msg.request_id)
            return
        self._pairs[msg.pair] = self._pairs.pop(msg.pair)  # most recently used now
        sending = self._sending.setdefault(msg.pair, collections.deque())
        if msg.posted:
            self._serve_posted(peer, msg, pair, sending, arrived)
            return
        try:
            # Back-pressure: a new chunk is staged only while fewer than the pair's window of
            # sends are unfinished (NCCL's run on while the next chunk is gathered).
            while len(sending) >= pair.window:
                pair.finish(sending.popleft()[0], "send")
        except PairError as exc:
            self._pair_failed(msg, exc)
            return
        waited = time.perf_counter()
        try:
            reply, tensors = self._chunk(msg, pair.backend)
        except Exception as exc:  # noqa: BLE001 - answered, the server keeps serving
            logger.exception("serving KV of %s failed", msg.request_id)
            reply, tensors = KVChunk(msg.request_id, msg.chunk, error=str(exc)), _none
        chunked = time.perf_counter()
        # (The header goes first: a pair's first NCCL op initialises its communicator, which
        # blocks until the consumer, on reading the header, does the same.)
        if not self._answer(peer, [_encode(reply)], msg.request_id):
            return
        answered = time.perf_counter()
        staged = tensors()
        if not staged:
            return
        try:
            # (The tensors stay referenced until their send is finished.)
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    sending.append((pair.start_sends(staged), staged))
            else:
                sending.append((pair.start_sends(staged), staged))
            self.last_serve_ms = {
                k: round((t - arrived) * 1e3, 3) for k, t in (
                    ("window", waited), ("chunk", chunked), ("header", answered),
                    ("posted", time.perf_counter()))}
            last = reply.first_layer + reply.num_layers >= reply.num_total_layers
            while sending and (last or len(sending) >= pair.window):
                # (After a pull's last chunk nothing stays staged between pulls.)
                pair.finish(sending.popleft()[0], "send")
        except PairError as exc:
            self._pair_failed(msg, exc)

    def _pair_failed(self, msg: KVPull, exc: PairError) -> None:
        # (The consumer is gone or stuck: this pair is not used again.)
        logger.warning("sending KV of %s failed: %s; dropping the pair", msg.request_id, exc)
        self._drop_pair(msg.pair)

    def _drop_pair(self, key: str) -> None:
        pair = self._pairs.pop(key, None)
        self._sending.pop(key, None)
        self._pair_peers.pop(key, None)
        if pair is not None:
            pair.close()

    def _serve_posted(self, peer: bytes, msg: KVPull, pair: PairGroup,
                      sending: collections.deque, arrived: float) -> None:
        """A pull whose receives the consumer posted before asking: answer the header, then
        send each layer's halves of the asked blocks, in order (straight from the cache when
        the blocks are one run here, else gathered a few layers at a time within the send
        buffer); on a refusal, zeros of the posted sizes (the pair stays in step)."""
        try:
            sizes = _posted_sizes(msg)
        except ValueError as exc:
            # (Malformed: what it posted is unknown, so nothing is sent; it drops the pair.)
            self._answer(peer, [_encode(KVChunk(msg.request_id, 0, error=str(exc)))],
                         msg.request_id)
            return
        try:
            reply, ids, computed = self._posted_plan(msg)
        except Exception as exc:  # noqa: BLE001 - answered, the server keeps serving
            logger.exception("serving KV of %s failed", msg.request_id)
            reply, ids, computed = KVChunk(msg.request_id, 0, error=str(exc)), [], None
        if reply.error is not None:
            reply.filled = True
        if not self._answer(peer, [_encode(reply)], msg.request_id):
            return
        answered = time.perf_counter()
        try:
            if reply.error is not None:
                self._send_zeros(pair, sending, sizes)
            else:
                self._wait_computed(computed)
                ctx = torch.cuda.stream(self._stream) if self._stream is not None \
                    else contextlib.nullcontext()
                with ctx:
                    self._send_posted(pair, sending, ids, msg.end_block - msg.start_block)
            self.last_serve_ms = {"header": round((answered - arrived) * 1e3, 3),
                                  "posted": round((time.perf_counter() - arrived) * 1e3, 3)}
            while sending:  # (nothing stays staged between pulls)
                pair.finish(sending.popleft()[0], "send")
        except PairError as exc:
            self._pair_failed(msg, exc)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory staging: keep serving
            # (Part of what the consumer posted may never come: it times out on this pair
            # and recomputes; the pair is not used again.)
            logger.exception("sending KV of %s failed", msg.request_id)
            self._pair_failed(msg, PairError(str(exc)))

    def _posted_plan(self, msg: KVPull
                     ) -> tuple[KVChunk, list[int], torch.cuda.Event | None]:
        """The header of a posted pull (or why not), its source block ids and the event of
        the step that computed them."""
        ids, computed, error = self._asked(msg)
        if error is not None:
            return KVChunk(msg.request_id, 0, error=error), [], None
        caches = self.kv_caches
        if not self._contiguous or msg.posted != self._layout:
            return KVChunk(msg.request_id, 0, error="the posted receives do not match this "
                           "KV cache's layout (a different model?)"), [], None
        shapes = []
        for cache in caches:
            shape = list(cache.shape)
            shape[block_axis(cache)] = len(ids)
            shapes.append(shape)
        self.chunks_sent += 1
        return KVChunk(msg.request_id, 0, 0, len(caches), len(caches),
                       str(caches[0].dtype).removeprefix("torch."), shapes,
                       direct=[0, len(ids)]), ids, computed

    def _send_posted(self, pair: PairGroup, sending: collections.deque, ids: list[int],
                     n: int) -> None:
        if run_lengths(ids) == [n]:
            parts = [p for b in self._bytes for p in run_slices(b, ids[0], n)]
            # Counted before the sends start: the consumer may hold every byte (and its caller
            # read this counter) before start_sends returns here.
            self.direct_bytes += sum(p.numel() for p in parts)
            sending.append((pair.start_sends(parts), parts))
            return
        caches = self.kv_caches
        per_layer = max(layer_block_bytes(c) for c in caches) * n
        step = max(1, self.buffer_bytes // per_layer)
        sent = 0  # (parts so far: the consumer posted them all in one batch)
        for first in range(0, len(caches), step):
            group = caches[first:first + step]
            while len(sending) >= pair.window:  # (bounds the staged layers: back-pressure)
                pair.finish(sending.popleft()[0], "send")
            flat = self._stage_flat(group, ids, pair.backend)
            self.peak_staged_bytes = max(self.peak_staged_bytes, flat.numel())
            parts = []
            offset = 0
            for b in self._bytes[first:first + step]:
                for _ in range(b.halves):
                    parts.append(flat.narrow(0, offset, n * b.block_bytes))
                    offset += n * b.block_bytes
            sending.append((pair.start_sends(parts, sent), flat))
            sent += len(parts)

    def _send_zeros(self, pair: PairGroup, sending: collections.deque,
                    sizes: list[int]) -> None:
        """Fill a refused pull's posted receives (its blocks are dropped there)."""
        zeros = torch.zeros(max(sizes), dtype=torch.uint8,
                            device=staging_device(pair.backend, self.kv_caches[0].device))
        parts = [zeros.narrow(0, 0, size) for size in sizes]
        sending.append((pair.start_sends(parts), zeros))

    def _asked(self, msg: KVPull) -> tuple[list[int], torch.cuda.Event | None, str | None]:
        """The source block ids a pull asks for and their step's event, or why not."""
        with self._lock:
            entry = self._outgoing.get(msg.request_id)
            blocks = None if entry is None or not entry.ready else entry.block_ids
            digest = None if entry is None else entry.digest
            computed = None if entry is None else entry.computed
        if blocks is None:
            why = "unknown" if entry is None else "not computed yet"
            return [], None, f"request {msg.request_id!r} is {why} here"
        if msg.digest != digest:
            return [], None, "the pull's prompt differs from the request's"
        if not 0 <= msg.start_block < msg.end_block <= min(len(blocks), MAX_PULL_BLOCKS):
            return [], None, (f"blocks [{msg.start_block}, {msg.end_block}) are out of the "
                              f"request's {len(blocks)}")
        return blocks[msg.start_block:msg.end_block], computed, None

    def _chunk(self, msg: KVPull, backend: str = "zmq"
               ) -> tuple[KVChunk, Callable[[], list[torch.Tensor]]]:
        """The chunk ``msg`` asks for: its header, and what makes its tensors (called after the
        header is answered: a chunk of direct runs alone is cut then, so that the consumer's
        cutting of its own slices overlaps ours; anything staged is staged before, so that a
        staging failure is answered as an error)."""
        ids, computed, error = self._asked(msg)
        if error is not None:
            return KVChunk(msg.request_id, msg.chunk, error=error), _none
        caches = self.kv_caches
        direct: list[int] = []
        if backend != "zmq" and msg.runs and self._contiguous and \
                staging_device(backend, caches[0].device) == caches[0].device:
            try:
                direct = plan_direct(ids, msg.runs, self.min_direct_blocks)
            except ValueError as exc:
                return KVChunk(msg.request_id, msg.chunk, error=str(exc)), _none
        runs = [(direct[k], direct[k + 1]) for k in range(0, len(direct), 2)]
        staged_ids = [ids[i] for i in staged_positions(len(ids), runs)]
        per_layer = max(layer_block_bytes(c) for c in caches) * len(staged_ids)
        # Whole layers within the buffer (it bounds only what is staged: a chunk of direct
        # runs alone holds every layer).
        layers = max(1, self.buffer_bytes // per_layer) if per_layer else len(caches)
        first = msg.chunk * layers
        if not 0 <= first < len(caches):
            return KVChunk(msg.request_id, msg.chunk, error=f"no chunk {msg.chunk}"), _none
        last = min(len(caches), first + layers)
        dtype = str(caches[0].dtype).removeprefix("torch.")
        if backend != "zmq":
            shapes = []
            for cache in caches[first:last]:
                shape = list(cache.shape)
                shape[block_axis(cache)] = len(ids)
                shapes.append(shape)
            self._wait_computed(computed)
            flat = None
            if staged_ids:
                flat = self._stage_flat(caches[first:last], staged_ids, backend)
                self.peak_staged_bytes = max(self.peak_staged_bytes, flat.numel())
            views = self._bytes[first:last]

            def tensors() -> list[torch.Tensor]:
                out = [] if flat is None else [flat]
                for view in views:
                    for offset, length in runs:
                        out += run_slices(view, ids[offset], length)
                self.direct_bytes += sum(length for _, length in runs) * \
                    sum(v.block_bytes * v.halves for v in views)
                return out

            self.chunks_sent += 1
            return KVChunk(msg.request_id, msg.chunk, first, last - first, len(caches),
                           dtype, shapes, nbytes=0 if flat is None else flat.numel(),
                           direct=direct), tensors
        if computed is not None:
            computed.synchronize()  # the forward that wrote these blocks has run
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
                       dtype, shapes), lambda: staged

    def _wait_computed(self, computed: torch.cuda.Event | None) -> None:
        """Order the serving stream (a GPU cache) after the forward that wrote the blocks:
        the staging gather and the group's sends queued on it read them after it."""
        device = self.kv_caches[0].device
        if device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(device)
        if computed is not None and self._stream is not None:
            self._stream.wait_event(computed)

    def _stage_flat(self, caches: list[torch.Tensor], ids: list[int], backend: str
                    ) -> torch.Tensor:
        """The blocks ``ids`` of ``caches`` gathered into one uint8 staging tensor (on the GPU
        for nccl, in host memory for gloo), layer after layer (after ``_wait_computed``)."""
        device = caches[0].device
        shapes = []
        for cache in caches:
            shape = list(cache.shape)
            shape[block_axis(cache)] = len(ids)
            shapes.append(shape)
        sizes = [math.prod(sh) * c.element_size() for sh, c in zip(shapes, caches)]
        ctx = torch.cuda.stream(self._stream) if self._stream is not None \
            else contextlib.nullcontext()
        with ctx:
            # (Allocated on the stream that uses them: the caching allocator reuses memory in
            # that stream's order, so the next chunk's never overwrites this one's mid-gather.)
            index = torch.tensor(ids, dtype=torch.long, device=device)
            out = torch.empty(sum(sizes), dtype=torch.uint8,
                              device=staging_device(backend, device))
            offset = 0
            for cache, shape, size in zip(caches, shapes, sizes):
                dst = out[offset:offset + size].view(cache.dtype).view(shape)
                if dst.device == device:
                    torch.index_select(cache, block_axis(cache), index, out=dst)
                else:
                    dst.copy_(cache.index_select(block_axis(cache), index))
                offset += size
        return out

    def close(self) -> None:
        """Stop serving: abort the pairs first (an NCCL op the serving thread waits on then
        ends), let the thread close its socket itself, then drop the store."""
        self._stop.set()
        for pair in list(self._pairs.values()):  # (best effort: the thread may drop one too)
            pair.close()
        self._thread.join(timeout=PAIR_BUILD_TIMEOUT_S + 2.0)
        if self._thread.is_alive():
            # Its socket stays open (closing it from here, or ``term``, could hang or crash
            # the thread mid-call); it is a daemon and ends with the process.
            logger.warning("the KV send server's thread did not stop in time; leaving it")
            return
        self._ctx.term()
        self._pairs.clear()
        self._pair_peers.clear()
        self._sending.clear()
        if self._store is not None:
            self._store.close()
            self._store = None


class KVPullClient:
    """The consumer's side: pulls a request's blocks from a producer into the local cache.

    ``backend``: "zmq" (frames through host memory) or a pair backend, "gloo" / "nccl" (one
    two-rank group per producer, built on the first pull from it; ``streams``: its NCCL
    communicators, ``PairGroup``). Not thread-safe: one thread pulls (the step thread, or the
    consumer's pull thread)."""

    def __init__(self, kv_caches: list[torch.Tensor], timeout_s: float,
                 backend: str = "zmq", streams: int = 1, auth_key: str | None = None,
                 min_direct_bytes: int = DIRECT_MIN_BYTES) -> None:
        self.timeout_s = timeout_s
        self._auth = auth_key or ""  # sent with every message (a producer may ask for it)
        self.backend = backend
        self.streams = max(1, min(int(streams), MAX_STREAMS))
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}
        self._pairs: dict[str, tuple[str, PairGroup]] = {}  # address -> (key, group)
        self.bytes_received = 0
        self.bytes_direct = 0  # of those, received straight into the cache (no staging)
        # Host milliseconds of the last pull from its start: first ask sent, first reply in
        # and checked, every receive posted, everything landed (where a slow pull loses its
        # time; benchmarks read it).
        self.last_phases_ms: dict[str, float] = {}
        self._min_direct_bytes = min_direct_bytes
        self.rebind(kv_caches)

    def rebind(self, kv_caches: list[torch.Tensor]) -> None:
        """Pull into ``kv_caches`` (allocated again: what is derived from them goes too, so
        no receive lands in the old cache's memory)."""
        self.kv_caches = kv_caches
        device = kv_caches[0].device if kv_caches else torch.device("cpu")
        # Direct runs need slices the pair's backend reads in place (NCCL: GPU, gloo: host).
        self._direct = self.backend in BACKENDS and all_contiguous(kv_caches) and \
            staging_device(self.backend, device) == device
        self._bytes = [CacheBytes.of(c) for c in kv_caches] if self._direct else []
        # A pull into one run of at least this many blocks posts its receives before asking
        # (``KVPull.posted``): the producer's planning and the round trip leave its latency.
        self.min_posted_blocks = min_direct_blocks(kv_caches, self._min_direct_bytes) \
            if self._direct else 0
        self._layout = [x for b in self._bytes for x in (b.halves, b.block_bytes)]

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._socks.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._socks[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        """A failed exchange may leave a late reply queued: start the next one afresh (and a
        pair that may be mid-transfer is not used again)."""
        sock = self._socks.pop(address, None)
        if sock is not None:
            sock.close(linger=0)
        known = self._pairs.pop(address, None)
        if known is not None:
            known[1].close()

    def _pair(self, address: str, deadline: float) -> tuple[str, PairGroup]:
        """The pair with the producer at ``address``, built now if there is none."""
        known = self._pairs.get(address)
        if known is not None:
            return known
        sock = self._socket(address)
        sock.send(_encode(KVPairHello(self.backend, self.streams, self._auth)))
        info = _to_consumer.decode(self._recv(sock, deadline)[0].buffer)
        if not isinstance(info, KVPairInfo):
            raise KVTransferError("the producer answered a pair hello with something else")
        if info.error is not None:
            raise KVTransferError(f"the producer refused a {self.backend} pair: {info.error}")
        left = max(deadline - time.monotonic(), 0.1)
        device = self.kv_caches[0].device
        host = address.rsplit(":", 1)[0].removeprefix("tcp://").strip("[]")
        if not 1 <= info.streams <= self.streams:
            raise KVTransferError(f"the producer answered {info.streams} NCCL streams for our "
                                  f"{self.streams}")
        try:
            store = connect_store(info.host, info.port, left)
            group = build_pair(self.backend, store, info.key, 1, self.timeout_s, device, host,
                               streams=info.streams)
        except PairError as exc:
            raise KVTransferError(str(exc)) from None
        self._pairs[address] = (info.key, group)
        return info.key, group

    def pull(self, address: str, request_id: str, start_block: int,
             local_block_ids: list[int], digest: str) -> int:
        """Copy the producer's blocks [start_block, start_block + len(local_block_ids)) of
        ``request_id`` into ``local_block_ids`` of this cache, layer by layer; returns the bytes
        received. Raises ``KVTransferError`` (nothing is released on the producer then but by
        its timeout; the caller recomputes)."""
        end_block = start_block + len(local_block_ids)
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        deadline = time.monotonic() + self.timeout_s
        caches = self.kv_caches
        runs = run_lengths(local_block_ids) if self._direct else []
        received = direct = 0
        chunk = 0
        inflight: collections.deque = collections.deque()  # receives not landed yet
        try:
            key, group = ("", None) if self.backend == "zmq" else self._pair(address, deadline)
            sock = self._socket(address)
            # (A fresh prompt's usual case: one run here, long enough to go cache to cache.)
            posted = group is not None and len(runs) == 1 and runs[0] >= self.min_posted_blocks
            if posted:
                received = direct = self._pull_posted(sock, group, key, request_id,
                                                      start_block, local_block_ids, digest,
                                                      deadline, phases, t0)
            while not posted:
                sock.send(_encode(KVPull(request_id, start_block, end_block, digest, chunk,
                                         key, runs, self._auth)))
                phases.setdefault("asked", time.perf_counter() - t0)
                frames = self._recv(sock, deadline)
                phases.setdefault("first_reply", time.perf_counter() - t0)
                reply = _to_consumer.decode(frames[0].buffer)
                if not isinstance(reply, KVChunk):
                    raise KVTransferError("the producer answered a pull with something else")
                if reply.error is not None:
                    if reply.error == UNKNOWN_PAIR:
                        raise KVTransferError("the producer dropped our pair")
                    raise KVRefused(f"the producer refused: {reply.error}")
                n_parts = reply.num_layers if group is None else 0
                if (reply.request_id != request_id or reply.chunk != chunk
                        or reply.num_total_layers != len(caches)
                        or len(frames) - 1 != n_parts
                        or len(reply.shapes) != reply.num_layers
                        or reply.first_layer + reply.num_layers > len(caches)
                        or reply.num_layers < 1):
                    raise KVTransferError("the producer's reply does not match the pull (a "
                                          "different model or KV layout?)")
                layers = caches[reply.first_layer:reply.first_layer + reply.num_layers]
                for k, cache in enumerate(layers):
                    want = list(cache.shape)
                    want[block_axis(cache)] = len(local_block_ids)
                    if reply.shapes[k] != want or \
                            reply.dtype != str(cache.dtype).removeprefix("torch."):
                        raise KVTransferError(
                            f"layer {reply.first_layer + k}: the producer sent {reply.dtype} "
                            f"{reply.shapes[k]}, this cache holds {cache.dtype} {want}")
                phases.setdefault("checked", time.perf_counter() - t0)
                if group is None:
                    index = torch.tensor(local_block_ids, dtype=torch.long,
                                         device=caches[0].device)
                    received += self._copy_frames(frames[1:], layers, reply.shapes, index)
                else:
                    if reply.direct and not runs:
                        raise KVTransferError("the producer sent direct runs unasked")
                    staged, landed = self._start_recv(group, layers, reply, inflight,
                                                      local_block_ids)
                    received += staged + landed
                    direct += landed
                    # The next chunk is asked for while this one arrives (within the window).
                    while len(inflight) >= group.window:
                        self._land(group, inflight.popleft())
                if reply.first_layer + reply.num_layers >= len(caches):
                    break
                chunk += 1
            phases.setdefault("posted", time.perf_counter() - t0)
            while inflight:
                self._land(group, inflight.popleft())
            phases.setdefault("landed", time.perf_counter() - t0)
            sock.send(_encode(KVDone(request_id, digest, self._auth)))
            self.last_phases_ms = {k: round(v * 1e3, 3) for k, v in phases.items()}
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop(address)
            raise KVTransferError(f"undecodable reply from the producer: {exc}") from None
        except KVRefused:
            raise
        except KVTransferError:
            self._drop(address)
            raise
        except PairError as exc:
            self._drop(address)
            raise KVTransferError(str(exc)) from None
        except zmq.ZMQError as exc:
            self._drop(address)
            raise KVTransferError(f"transport error: {exc}") from None
        self.bytes_received += received
        self.bytes_direct += direct
        return received

    def _pull_posted(self, sock: zmq.Socket, group: PairGroup, key: str, request_id: str,
                     start_block: int, local_block_ids: list[int], digest: str,
                     deadline: float, phases: dict[str, float], t0: float) -> int:
        """A pull into one run of blocks: ask, post every layer's halves straight into the
        cache, then read the header (the producer sends exactly those, or zeros on a
        refusal). Returns the bytes received."""
        n = len(local_block_ids)
        sock.send(_encode(KVPull(request_id, start_block, start_block + n, digest, 0, key,
                                 [n], self._auth, self._layout)))
        phases["asked"] = time.perf_counter() - t0
        parts = [p for b in self._bytes for p in run_slices(b, local_block_ids[0], n)]
        work = group.start_recvs(parts)
        phases["posted"] = time.perf_counter() - t0
        frames = self._recv(sock, deadline)
        phases["first_reply"] = time.perf_counter() - t0
        reply = _to_consumer.decode(frames[0].buffer)
        if not isinstance(reply, KVChunk) or len(frames) != 1:
            raise KVTransferError("the producer answered a pull with something else")
        if reply.error is not None:
            if reply.error == UNKNOWN_PAIR:
                raise KVTransferError("the producer dropped our pair")
            if not reply.filled:  # (our receives stay posted: the pair is out of step)
                raise KVTransferError(f"the producer refused: {reply.error}")
            group.finish(work, "receive")  # (zeros, into blocks the caller drops)
            raise KVRefused(f"the producer refused: {reply.error}")
        caches = self.kv_caches
        if (reply.request_id != request_id or reply.first_layer != 0
                or reply.num_layers != len(caches) or reply.num_total_layers != len(caches)
                or reply.direct != [0, n] or reply.nbytes or len(reply.shapes) != len(caches)):
            raise KVTransferError("the producer's reply does not match the pull (a "
                                  "different model or KV layout?)")
        for k, cache in enumerate(caches):
            want = list(cache.shape)
            want[block_axis(cache)] = n
            if reply.shapes[k] != want or \
                    reply.dtype != str(cache.dtype).removeprefix("torch."):
                raise KVTransferError(
                    f"layer {k}: the producer sent {reply.dtype} {reply.shapes[k]}, this "
                    f"cache holds {cache.dtype} {want}")
        phases["checked"] = time.perf_counter() - t0
        group.finish(work, "receive")
        phases["landed"] = time.perf_counter() - t0
        return sum(p.numel() for p in parts)

    @staticmethod
    def _copy_frames(frames: list[zmq.Frame], layers: list[torch.Tensor],
                     shapes: list[list[int]], index: torch.Tensor) -> int:
        received = 0
        for frame, cache, want in zip(frames, layers, shapes):
            with warnings.catch_warnings():
                # Read-only frame memory: only read, by the copy into the cache.
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(frame.buffer, dtype=torch.uint8)
            if raw.numel() != math.prod(want) * cache.element_size():
                raise KVTransferError("a layer's frame has the wrong size")
            part = raw.view(cache.dtype).view(want).to(cache.device)
            cache.index_copy_(block_axis(cache), index, part)
            received += raw.numel()
        return received

    def _start_recv(self, group: PairGroup, layers: list[torch.Tensor], reply: KVChunk,
                    inflight: collections.deque, local_block_ids: list[int]
                    ) -> tuple[int, int]:
        """Post the receives of the chunk off the pair: its staging tensor (the blocks outside
        the direct runs), then each direct run's slices straight into this cache. Returns
        (staged bytes, direct bytes)."""
        try:
            runs = check_direct(reply.direct, local_block_ids)
        except ValueError as exc:
            raise KVTransferError(f"the producer's direct runs: {exc}") from None
        staged = [local_block_ids[i] for i in staged_positions(len(local_block_ids), runs)]
        shapes = []
        for cache, shape in zip(layers, reply.shapes):
            shape = list(shape)
            shape[block_axis(cache)] = len(staged)
            shapes.append(shape)
        sizes = [math.prod(sh) * c.element_size() for sh, c in zip(shapes, layers)]
        if reply.nbytes != sum(sizes):
            raise KVTransferError(f"the producer announced {reply.nbytes} staged bytes, the "
                                  f"chunk's staged blocks hold {sum(sizes)}")
        device = layers[0].device
        tensors: list[torch.Tensor] = []
        flat = index = None
        if staged:
            flat = torch.empty(reply.nbytes, dtype=torch.uint8,
                               device=staging_device(group.backend, device))
            index = torch.tensor(staged, dtype=torch.long, device=device)
            tensors.append(flat)
        views = self._bytes[reply.first_layer:reply.first_layer + len(layers)]
        for view in views:
            for offset, length in runs:
                tensors += run_slices(view, local_block_ids[offset], length)
        direct = sum(length for _, length in runs) * \
            sum(v.block_bytes * v.halves for v in views)
        inflight.append((group.start_recvs(tensors), flat, index, layers, shapes, sizes))
        return reply.nbytes, direct

    @staticmethod
    def _land(group: PairGroup, entry: tuple) -> None:
        """Wait for one chunk's posted receives, then scatter its staging tensor (if any)
        into its layers' blocks (the direct runs landed in place)."""
        work, flat, index, layers, shapes, sizes = entry
        group.finish(work, "receive")
        if flat is None:
            return
        offset = 0
        for cache, shape, size in zip(layers, shapes, sizes):
            part = flat[offset:offset + size].view(cache.dtype).view(shape)
            cache.index_copy_(block_axis(cache), index, part.to(cache.device, non_blocking=True))
            offset += size

    def release(self, address: str, request_id: str, digest: str) -> None:
        """Tell the producer this consumer needs nothing of ``request_id`` (it had the blocks
        already): it may free them now rather than at its timeout. Best effort, no answer."""
        try:
            self._socket(address).send(_encode(KVDone(request_id, digest, self._auth)),
                                       zmq.NOBLOCK)
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
