"""Stored ``/v1/responses`` across the API server processes of one server
(``--api-server-count N``).

Each API server keeps the responses it answered (``response_store``); the kernel spreads
connections over the processes, so a follow-up (``previous_response_id``, ``GET`` / ``DELETE
/v1/responses/{id}``, its ``input_items``, cancelling a background response) may land on
another one. A process that does not hold the id asks its
peers: every API server answers lookups on an IPC socket of its own (a ZMQ ROUTER in a folder
only this server's user can enter, created by the supervisor), and the asking one sends the
question to every peer at once and takes the answer of the one that holds it. Messages are
msgspec structs (no pickle); the conversation travels as the JSON it is stored as.

A lookup costs one IPC round trip per peer, concurrently (well under a millisecond), and only
on a miss in the local store. A peer that does not answer within ``_TIMEOUT_S`` counts as not
holding the id (a dead API server ends the whole server anyway).

A background response's stream (``GET ...?stream=true``) is replayed from whichever process
takes the request: one that does not run it asks its peers for the events (op ``events``,
answered at once, so the reader gets its response headers without waiting for an event),
then follows the one that has them by long polls (each answered once there are events past
the reader's, the stream is over, or ``POLL_WAIT_S`` has passed), a bounded slice at a time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec

from tidal.frontend.server.response_background import EventLog
from tidal.frontend.server.response_store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

_TIMEOUT_S = 2.0
_MAX_ID_BYTES = 256  # ids this server makes are ~30 characters
# An ``events`` ask is answered at the latest after this long, with no events if none came (the
# asker asks again). The asker waits ``_TIMEOUT_S`` more for the answer, and asks again after
# a timeout, ``POLL_RETRIES`` times in a row before it gives the stream up (a keeper that
# stalls for a moment does not cut its readers' streams).
POLL_WAIT_S = 1.0
POLL_RETRIES = 3
# An ``events`` answer holds events up to this many bytes (and at least one, however large),
# so a long log travels in slices.
EVENTS_BYTES = 1 << 20


class PeerStreamLost(Exception):
    """The peer that kept a background stream no longer answers for it (it stopped answering,
    or dropped the log) before its last event."""


class PeerAsk(msgspec.Struct, frozen=True):
    op: str  # "get" | "delete" | "cancel" | "events"
    response_id: str
    after: int = -1  # events: the reader's last event number
    # events: wait (up to POLL_WAIT_S) for an event past ``after``; False: answer at once
    # with what the log holds (the first ask, which finds the keeper).
    wait: bool = True


class PeerAnswer(msgspec.Struct, frozen=True):
    found: bool
    messages: bytes = b""  # the stored conversation, JSON
    body: bytes = b""  # the response object, JSON
    input_items: bytes = b"[]"  # the request's input items, JSON
    status: str = "completed"
    events: list[bytes] = msgspec.field(default_factory=list)  # events: those after ``after``
    done: bool = False  # events: these end the stream
    total: int = 0  # events: how many the log holds now


_ask_decoder = msgspec.msgpack.Decoder(PeerAsk)
_answer_decoder = msgspec.msgpack.Decoder(PeerAnswer)
_encoder = msgspec.msgpack.Encoder()


class ResponsePeers:
    """This API server's side: answers its peers from ``store`` on ``addresses[index]`` and
    asks the other addresses for ids it does not hold."""

    def __init__(self, index: int, addresses: list[str], store: ResponseStore,
                 cancel: Callable[[str, bool], Awaitable[bool]] | None = None,
                 logs: Callable[[str], EventLog | None] | None = None) -> None:
        """``cancel(id, delete)``: ends this process's background response of that id, if it
        runs one (True once it is over and stored as cancelled; ``delete``: it is being
        deleted). ``logs(id)``: this process's event log of that background stream, if it
        keeps one."""
        import zmq
        import zmq.asyncio

        if not 0 <= index < len(addresses):
            raise ValueError(f"API server index {index} out of {len(addresses)} peer addresses")
        self.index = index
        self.addresses = list(addresses)
        self.store = store
        self.cancel_local = cancel
        self.logs = logs
        self._ctx = zmq.asyncio.Context()
        self._server = self._ctx.socket(zmq.ROUTER)
        self._server.setsockopt(zmq.LINGER, 0)
        self._server.bind(addresses[index])
        self._task: asyncio.Task[None] | None = None
        self._cancels: set[asyncio.Task[None]] = set()

    @property
    def peers(self) -> list[str]:
        return [a for i, a in enumerate(self.addresses) if i != self.index]

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._answer_loop(),
                                                            name="tidal-response-peers")

    async def close(self) -> None:
        cancels = list(self._cancels)
        for task in cancels:
            task.cancel()
        await asyncio.gather(*cancels, return_exceptions=True)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._server.close(0)
        self._ctx.term()

    # --- answering -------------------------------------------------------------------------

    async def _answer_loop(self) -> None:
        while True:
            frames = await self._server.recv_multipart()
            if len(frames) != 3 or len(frames[2]) > _MAX_ID_BYTES + 64:
                logger.warning("response peers: dropped a malformed lookup (%d frames)",
                               len(frames))
                continue
            ident, empty, payload = frames
            try:
                ask = _ask_decoder.decode(payload)
            except msgspec.DecodeError as exc:
                logger.warning("response peers: dropped an undecodable lookup: %s", exc)
                continue
            if ask.op in ("cancel", "delete", "events"):
                # Answered once a background response it runs is over (other lookups go on
                # meanwhile): a deleted one must not go on generating. Events: once there are
                # new ones (a long poll).
                answer = self._answer_events if ask.op == "events" else self._answer_cancel
                task = asyncio.get_running_loop().create_task(answer(ident, ask))
                self._cancels.add(task)
                task.add_done_callback(self._cancels.discard)
                continue
            await self._server.send_multipart([ident, empty, _encoder.encode(self._answer(ask))])

    def _answer(self, ask: PeerAsk) -> PeerAnswer:
        if ask.op == "delete":
            return PeerAnswer(self.store.delete(ask.response_id))
        stored = self.store.get(ask.response_id) if ask.op == "get" else None
        if stored is None:
            return PeerAnswer(False)
        return PeerAnswer(True, msgspec.json.encode(stored.messages), stored.body,
                          msgspec.json.encode(stored.input_items), stored.status)

    async def _answer_cancel(self, ident: bytes, ask: PeerAsk) -> None:
        found = self.cancel_local is not None and await self.cancel_local(
            ask.response_id, ask.op == "delete")
        if ask.op == "delete":
            answer = self._answer(ask)
        else:
            answer = self._answer(PeerAsk("get", ask.response_id)) if found \
                else PeerAnswer(False)
        await self._server.send_multipart([ident, b"", _encoder.encode(answer)])

    async def _answer_events(self, ident: bytes, ask: PeerAsk) -> None:
        log = self.logs(ask.response_id) if self.logs is not None else None
        if log is None:
            answer = PeerAnswer(False)
        else:
            if ask.wait:
                await log.wait_past(ask.after, POLL_WAIT_S)
            first = max(ask.after + 1, 0)
            events: list[bytes] = []
            size = 0
            for payload in log.payloads[first:]:
                if events and size + len(payload) > EVENTS_BYTES:
                    break
                events.append(payload)
                size += len(payload)
            total = len(log.payloads)
            answer = PeerAnswer(True, events=events, total=total,
                                done=log.done and first + len(events) >= total)
        await self._server.send_multipart([ident, b"", _encoder.encode(answer)])

    # --- asking ----------------------------------------------------------------------------

    async def find_events(self, response_id: str, after: int) -> tuple[str, PeerAnswer] | None:
        """The peer that keeps the background stream ``response_id`` and its first answer
        (the events after number ``after`` it holds now, perhaps none: the reader gets its
        response headers at once, and ``follow_events`` waits for more), or None."""
        if len(response_id.encode()) > _MAX_ID_BYTES:
            return None
        payload = _encoder.encode(PeerAsk("events", response_id, after, wait=False))
        answers = await asyncio.gather(*(self._ask(a, payload, _TIMEOUT_S) for a in self.peers))
        return next(((a, ans) for a, ans in zip(self.peers, answers)
                     if ans is not None and ans.found), None)

    async def follow_events(self, address: str, response_id: str, after: int,
                            first: PeerAnswer) -> AsyncIterator[tuple[list[bytes], bool]]:
        """``EventLog.follow`` of the stream a peer keeps, from its ``first`` answer on;
        ``PeerStreamLost`` if the peer drops the log, or does not answer ``POLL_RETRIES`` asks
        in a row, before the last event."""
        answer: PeerAnswer | None = first
        misses = 0
        while True:
            if answer is not None:
                if not answer.found:
                    raise PeerStreamLost(f"{address} no longer keeps the stream of "
                                         f"{response_id}")
                misses = 0
                after += len(answer.events)
                yield answer.events, answer.done
                if answer.done:
                    return
            else:
                misses += 1
                if misses >= POLL_RETRIES:
                    raise PeerStreamLost(f"{address} did not answer for the stream of "
                                         f"{response_id} {misses} times in a row")
            answer = await self._ask(address, _encoder.encode(
                PeerAsk("events", response_id, after)), POLL_WAIT_S + _TIMEOUT_S)

    async def get(self, response_id: str) -> StoredResponse | None:
        """The response as the peer that holds it stored it, or None."""
        return _found(await self._ask_all(PeerAsk("get", response_id)))

    async def cancel(self, response_id: str) -> StoredResponse | None:
        """The background response, once the peer that runs it has cancelled it; None if no
        peer runs it."""
        return _found(await self._ask_all(PeerAsk("cancel", response_id)))

    async def delete(self, response_id: str) -> bool:
        """Whether a peer held (and now dropped) the response."""
        return any(a.found for a in await self._ask_all(PeerAsk("delete", response_id)))

    async def _ask_all(self, ask: PeerAsk) -> list[PeerAnswer]:
        if len(ask.response_id.encode()) > _MAX_ID_BYTES:
            return []
        payload = _encoder.encode(ask)
        answers = await asyncio.gather(*(self._ask(address, payload) for address in self.peers))
        return [PeerAnswer(False) if a is None else a for a in answers]

    async def _ask(self, address: str, payload: bytes,
                   timeout: float = _TIMEOUT_S) -> PeerAnswer | None:
        """The peer's answer; None if it gave none within ``timeout`` seconds (or the
        exchange failed)."""
        import zmq

        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(address)
            await sock.send(payload)
            if not await sock.poll(int(timeout * 1000)):
                logger.warning("response peers: %s did not answer within %.1f s", address,
                               timeout)
                return None
            return _answer_decoder.decode(await sock.recv())
        except (msgspec.DecodeError, zmq.ZMQError) as exc:
            logger.warning("response peers: lookup at %s failed: %s", address, exc)
            return None
        finally:
            sock.close(0)


def _found(answers: list[PeerAnswer]) -> StoredResponse | None:
    for answer in answers:
        if answer.found:
            return StoredResponse(msgspec.json.decode(answer.messages), answer.body,
                                  len(answer.body) + len(answer.messages),
                                  msgspec.json.decode(answer.input_items), answer.status)
    return None


async def find_response(store: ResponseStore, peers: ResponsePeers | None,
                        response_id: str) -> StoredResponse | None:
    """``response_id`` from this process's store, else from the peer that holds it."""
    stored = store.get(response_id)
    if stored is None and peers is not None:
        stored = await peers.get(response_id)
    return stored


async def forget_response(store: ResponseStore, peers: ResponsePeers | None,
                          response_id: str) -> bool:
    if store.delete(response_id):
        return True
    return peers is not None and await peers.delete(response_id)


def peer_addresses(folder: str, count: int) -> list[str]:
    """The IPC addresses of ``count`` API servers, in a folder of the supervisor's."""
    return [f"ipc://{folder}/responses-{i}" for i in range(count)]


__all__ = ["PeerStreamLost", "ResponsePeers", "find_response", "forget_response",
           "peer_addresses"]
