"""Runs the engine requests of one API request (one per prompt, each with ``n`` samples) and
merges their delta outputs into one stream of ``(prompt index, RequestOutput)``.

Leaving the stream early (client gone: aiohttp cancels the handler; or an error) cancels every
prompt's task, and ``AsyncLLM.generate`` aborts a cancelled request in the engine, which frees its
KV blocks at the next step. ``abort()`` (drain timeout) ends the stream early too, marking it
``aborted`` so the handler can finish each open choice with ``finish_reason="abort"``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.outputs import RequestOutput
from tidal.frontend.server.admission import Admission, Ticket

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

_DONE = object()
_ABORTED = object()


class Generation:
    def __init__(self, engine: AsyncLLM, admission: Admission, ticket: Ticket, request_id: str,
                 prompts: list[list[int]], params: SamplingParams,
                 cache_salt: str | None = None) -> None:
        self.engine = engine
        self.admission = admission
        self.ticket = ticket
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.cache_salt = cache_salt
        self.aborted = False
        self.failed = False  # a prompt's engine request raised (the error goes to the client)
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        # Prompt tokens served from the prefix cache, per prompt (known once it finishes).
        self._cached: dict[int, int] = {}

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens of all prompts that the prefix cache supplied (for usage)."""
        return sum(self._cached.values())

    def engine_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def engine_ids(self) -> list[str]:
        return [self.engine_id(i) for i in range(len(self.prompts))]

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            self._queue.put_nowait(_ABORTED)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        self.ticket.abort = self.abort
        self._tasks = [
            asyncio.create_task(self._run(i, ids), name=f"tidal-gen-{self.engine_id(i)}")
            for i, ids in enumerate(self.prompts)
        ]
        remaining = len(self._tasks)
        try:
            while remaining:
                item = await self._queue.get()
                if item is _DONE:
                    remaining -= 1
                elif item is _ABORTED:
                    return
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item  # type: ignore[misc]
        finally:
            await self.close()

    async def close(self) -> None:
        """Cancel whatever still runs (each cancelled request is aborted in the engine)."""
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    async def _run(self, index: int, ids: list[int]) -> None:
        seen: set[int] = set()
        try:
            async for out in self.engine.generate(ids, self.params, self.engine_id(index),
                                                  cache_salt=self.cache_salt):
                for c in out.outputs:
                    if c.index not in seen:
                        seen.add(c.index)
                        self.admission.started(self.ticket, 1)
                if out.num_cached_tokens:
                    self._cached[index] = max(self._cached.get(index, 0), out.num_cached_tokens)
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            self.failed = True
            self._queue.put_nowait(exc)
            return
        self._queue.put_nowait(_DONE)
