"""Background responses of ``/v1/responses`` (``background: true``).

The request is answered at once with the response ``queued``; its generation runs in a task of
the API server that took it, which keeps the stored response current (``in_progress`` once
tokens flow, then ``completed`` / ``incomplete`` / ``cancelled`` / ``failed``) for ``GET``
polling. ``POST /v1/responses/{id}/cancel`` ends it early (on another API server of the same
server, through ``response_peers``). With ``stream: true`` its events go to an ``EventLog``
that the POST's stream and later ``GET ...?stream=true&starting_after=N`` read. A background
response holds its admission ticket while it runs, so the queue bound (429) and the shutdown
drain count it like any other request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from tidal.frontend.server.errors import APIError

logger = logging.getLogger(__name__)

# How long a cancel waits for the generation to wind down (one engine step, normally) before
# it answers with the response as stored then.
CANCEL_WAIT_S = 1.0


class EventLog:
    """A background response's stream events in order (index = ``sequence_number``): the
    stream its ``POST`` returns and ``GET ...?stream=true&starting_after=N`` read it, while it
    runs and for a while after (``KEPT_LOGS``)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []
        self.num_bytes = 0
        self.done = False
        self._changed = asyncio.Event()

    async def send(self, payloads: list[bytes], last: bool) -> None:
        """``serving_responses._produce``'s sender: never raises (no client behind it)."""
        self.payloads.extend(payloads)
        self.num_bytes += sum(map(len, payloads))
        if last:
            self.done = True
        self._changed.set()

    def close(self) -> None:
        """No more events (a generation that ended without its final ones ends its readers)."""
        self.done = True
        self._changed.set()

    async def wait_past(self, after: int, timeout: float) -> None:
        """Return once there is an event after number ``after`` or the log is done, or after
        ``timeout`` seconds (a peer's long poll: ``response_peers``)."""
        if len(self.payloads) > after + 1 or self.done:
            return
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def follow(self, after: int) -> AsyncIterator[tuple[list[bytes], bool]]:
        """The events after number ``after`` as they come: (new ones, whether that is all)."""
        pos = max(after + 1, 0)
        while True:
            if pos < len(self.payloads) or self.done:
                chunk = self.payloads[pos:]
                pos += len(chunk)
                yield chunk, self.done
                if self.done:
                    return
                continue
            self._changed.clear()
            await self._changed.wait()


# Finished background streams kept for replay, per API server process: the most recent, this
# many at most and at most ``kept_bytes`` of events (the response store's byte bound).
KEPT_LOGS = 64
# A replay writes this many events at a time (a long log is not joined whole for each reader).
REPLAY_SLICE = 256


@dataclass(slots=True)
class _Running:
    task: asyncio.Task[None]
    abort: Callable[[], None]  # ends the generation early (Generation.abort)
    # Stores the response as cancelled now (a cancel that did not see it wind down in time).
    cancelled: Callable[[], None]


class BackgroundResponses:
    """This API server's background responses still running, by response id: at most
    ``limit`` at once (they outlive their connection, so the connection bound does not
    bound them)."""

    def __init__(self, limit: int = 500, kept_bytes: int = 64 << 20) -> None:
        self.limit = limit
        self.kept_bytes = kept_bytes
        self._running: dict[str, _Running] = {}
        self._logs: OrderedDict[str, EventLog] = OrderedDict()  # streamed ones, by id
        self._deleted: set[str] = set()  # running ones deleted: their log goes as they end

    def log_of(self, response_id: str) -> EventLog | None:
        """The stream events of a background response streamed from this process."""
        return self._logs.get(response_id)

    def is_deleted(self, response_id: str) -> bool:
        """Deleted while it runs: what it would store as it winds down is dropped."""
        return response_id in self._deleted

    def __len__(self) -> int:
        return len(self._running)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._running

    def check_room(self) -> None:
        """Raise the 429 a background request gets while ``limit`` of them run."""
        if len(self._running) >= self.limit:
            raise APIError(429, f"{len(self._running)} background responses are running on "
                           f"this server (limit {self.limit}); retry later, or cancel one",
                           code="too_many_background_responses",
                           headers={"Retry-After": "1"})

    def start(self, response_id: str, work: Coroutine[Any, Any, None],
              abort: Callable[[], None], cancelled: Callable[[], None],
              log: EventLog | None = None) -> None:
        """Run ``work`` (which stores the response as it goes and when it ends, and with
        ``log`` writes its stream events there) in a task."""
        task = asyncio.get_running_loop().create_task(work, name=f"tidal-{response_id}")
        self._running[response_id] = _Running(task, abort, cancelled)
        if log is not None:
            self._logs[response_id] = log
        task.add_done_callback(lambda t: self._done(response_id, t))

    def _done(self, response_id: str, task: asyncio.Task[None]) -> None:
        self._running.pop(response_id, None)
        log = self._logs.get(response_id)
        if log is not None:
            log.close()
            self._logs.move_to_end(response_id)
            if response_id in self._deleted:
                del self._logs[response_id]
            finished = [k for k in self._logs if k not in self._running]  # oldest first
            total = sum(self._logs[k].num_bytes for k in finished)
            while finished and (len(finished) > KEPT_LOGS or total > self.kept_bytes):
                total -= self._logs.pop(finished.pop(0)).num_bytes
        self._deleted.discard(response_id)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background response %s failed", response_id,
                         exc_info=task.exception())

    async def cancel(self, response_id: str, delete: bool = False) -> bool:
        """End the response early if it runs here; True if it did (it is stored as
        ``cancelled`` once its generation has wound down, within ``CANCEL_WAIT_S``).
        ``delete``: it is being deleted, so its stream is not kept for replay either."""
        running = self._running.get(response_id)
        if delete:
            if running is None:
                self._logs.pop(response_id, None)
            else:
                self._deleted.add(response_id)
        if running is None:
            return False
        running.abort()
        await asyncio.wait({running.task}, timeout=CANCEL_WAIT_S)
        if not running.task.done():
            running.cancelled()
        return True

    async def close(self) -> None:
        """Stop whatever still runs (the server is going down after its drain)."""
        tasks = [r.task for r in self._running.values()]
        for running in list(self._running.values()):
            running.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
        for task in tasks:
            task.cancel()
        # Their tickets and engine requests are released before the engine goes.
        await asyncio.gather(*tasks, return_exceptions=True)
