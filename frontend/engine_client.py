"""Clients through which frontends talk to an EngineCore.

``InprocClient`` steps an EngineCore in the caller's own process (offline ``LLM``);
``ThreadedAsyncClient`` runs one in a background thread for ``AsyncLLM``. The clients for an
EngineCore in another process (spawned, or reached by address) are in ``mp_client``;
``make_async_client`` picks one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import ControlCall, ControlResult
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
)

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncEngineClient

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

    def call(self, call: ControlCall) -> ControlResult:
        return self.core.handle_control(call)

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
        # Where outputs go: the event loop in use and its queue, replaced together (one
        # attribute, so the engine thread never sees a loop with another loop's queue).
        self._sink: tuple[asyncio.AbstractEventLoop,
                          asyncio.Queue[EngineCoreOutputs | BaseException]] | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sink is None or self._sink[0] is not loop:
            # First use, or a new event loop (successive asyncio.run calls): rebind.
            queue_: asyncio.Queue[EngineCoreOutputs | BaseException] = asyncio.Queue()
            if self._dead is not None:
                queue_.put_nowait(self._dead)
            self._sink = (loop, queue_)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
            self._thread.start()

    async def add_request(self, req: EngineCoreRequest) -> None:
        self._start()
        self._inbox.put(("add", req))

    async def abort_requests(self, request_ids: list[str]) -> None:
        self._start()
        self._inbox.put(("abort", list(request_ids)))

    async def call(self, call: ControlCall) -> ControlResult:
        """Run a control call in the engine thread, between two steps."""
        self._start()
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._inbox.put(("control", (call, fut)))
        return await fut

    async def get_outputs(self) -> EngineCoreOutputs:
        self._start()
        assert self._sink is not None
        item = await self._sink[1].get()
        if isinstance(item, BaseException):
            from tidal.frontend.async_llm import EngineDeadError

            raise EngineDeadError(f"the engine thread failed: {item}") from item
        return item

    def _emit(self, item: EngineCoreOutputs | BaseException) -> None:
        sink = self._sink
        assert sink is not None
        try:
            sink[0].call_soon_threadsafe(sink[1].put_nowait, item)
        except RuntimeError:  # that loop is closed: nobody is waiting for this any more
            logger.debug("dropped engine output for a closed event loop")

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
        elif kind == "control":
            call, fut = payload
            try:
                result, error = self.core.handle_control(call), None
            except Exception as exc:  # noqa: BLE001 - the caller gets it
                result, error = None, exc
            try:
                fut.get_loop().call_soon_threadsafe(_settle, fut, result, error)
            except RuntimeError:
                pass  # the caller's loop is closed
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
            self._dead = exc
            self._emit(exc)

    def shutdown(self) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.core.shutdown()


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def make_async_client(config: EngineConfig, mode: str = "process",
                      **kwargs: Any) -> AsyncEngineClient:
    """The client ``AsyncLLM`` uses.

    ``mode="process"`` (default) spawns an EngineCore process (``kwargs``: see
    ``EngineConnection.spawn``, e.g. ``listen``); ``mode="thread"`` runs the engine in a thread
    of this process (no isolation; tests, debugging). To reach a running ``engine-core``, use
    ``MPAsyncClient.connect(address)`` (``AsyncLLM.from_address``).
    """
    if mode == "thread":
        if kwargs:
            raise ValueError(f"the thread client takes no options, got {sorted(kwargs)}")
        return ThreadedAsyncClient(config)
    if mode == "process":
        from tidal.frontend.mp_client import MPAsyncClient

        return MPAsyncClient.spawn(config, **kwargs)
    raise ValueError(f"unknown engine client mode {mode!r} (use 'process' or 'thread')")
