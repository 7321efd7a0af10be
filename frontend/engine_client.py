"""Clients through which frontends talk to an EngineCore.

``InprocClient`` steps an EngineCore in the caller's own process (offline ``LLM``);
``ThreadedAsyncClient`` runs one in a background thread for ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Iterable
from typing import Any

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)

logger = logging.getLogger(__name__)


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config  # resolved (KV blocks measured)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.core.add_request(req)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.core.abort_requests(request_ids)

    def step(self) -> EngineCoreOutputs:
        return self.core.step()

    def shutdown(self) -> None:
        self.core.shutdown()


class ThreadedAsyncClient:
    """An ``AsyncEngineClient`` running the EngineCore in a background thread of this process.

    No process isolation: for tests, debugging and embedding in a single process. The thread
    blocks on its inbox while idle.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._outputs = asyncio.Queue()
            self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
            self._thread.start()

    async def add_request(self, req: EngineCoreRequest) -> None:
        self._start()
        self._inbox.put(("add", req))

    async def abort_requests(self, request_ids: list[str]) -> None:
        self._start()
        self._inbox.put(("abort", list(request_ids)))

    async def get_outputs(self) -> EngineCoreOutputs:
        self._start()
        assert self._outputs is not None
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            from tidal.frontend.async_llm import EngineDeadError

            raise EngineDeadError(f"the engine thread failed: {item}") from item
        return item

    def _emit(self, item: EngineCoreOutputs | BaseException) -> None:
        assert self._loop is not None and self._outputs is not None
        self._loop.call_soon_threadsafe(self._outputs.put_nowait, item)

    def _handle(self, kind: str, payload: Any) -> bool:
        if kind == "stop":
            return False
        if kind == "add":
            try:
                self.core.add_request(payload)
            except ValueError as exc:
                self._emit(EngineCoreOutputs(outputs=[EngineCoreOutput(
                    request_id=payload.request_id, finish_reason=FinishReason.ERROR,
                    error=str(exc))]))
        elif kind == "abort":
            self.core.abort_requests(payload)
        return True

    def _run(self) -> None:
        try:
            while True:
                if not self.core.has_unfinished_requests():
                    if not self._handle(*self._inbox.get()):
                        return
                while True:
                    try:
                        msg = self._inbox.get_nowait()
                    except queue.Empty:
                        break
                    if not self._handle(*msg):
                        return
                outs = self.core.step()
                if outs.outputs:
                    self._emit(outs)
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            logger.exception("engine thread failed")
            self._emit(exc)

    def shutdown(self) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.core.shutdown()


def make_async_client(config: EngineConfig, mode: str = "thread") -> ThreadedAsyncClient:
    """The client ``AsyncLLM`` uses: ``mode="thread"`` runs the engine in this process."""
    if mode == "thread":
        return ThreadedAsyncClient(config)
    raise ValueError(f"unknown engine client mode {mode!r}")
