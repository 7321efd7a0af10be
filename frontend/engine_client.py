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
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import ControlCall, ControlResult
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    OutputBatch,
)

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncEngineClient, EngineDeadError

logger = logging.getLogger(__name__)


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config  # resolved (KV blocks measured)

    def add_request(self, req: EngineCoreRequest) -> None:
        self.core.add_request(req)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.core.abort_requests(request_ids)

    def step(self) -> OutputBatch:
        outs = self.core.step()
        return OutputBatch.pack(outs.outputs, outs.timestamp, outs.scheduler_stats)

    def call(self, call: ControlCall) -> ControlResult:
        return self.core.handle_control(call)

    def shutdown(self) -> None:
        self.core.shutdown()


class ThreadedAsyncClient:
    """An ``AsyncEngineClient`` running the EngineCore in a background thread of this process.

    No process isolation: for tests, debugging and embedding in a single process. The thread
    blocks on its inbox while idle, and hands each step's outputs (packed as an
    ``OutputBatch``) to the event loop with ``call_soon_threadsafe``.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.config = self.core.config
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Where outputs go: the event loop in use and its handlers, replaced together (one
        # attribute, so the engine thread never sees a loop with another loop's handlers).
        self._sink: tuple[asyncio.AbstractEventLoop, Callable[[OutputBatch], None],
                          Callable[[EngineDeadError], None]] | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None
        # When the engine thread last finished a step (a float: written there, read anywhere).
        self.last_progress = time.monotonic()

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def attach(self, on_outputs: Callable[[OutputBatch], None],
               on_dead: Callable[[EngineDeadError], None]) -> None:
        loop = asyncio.get_running_loop()
        if self._sink is None or self._sink[0] is not loop:
            self._sink = (loop, on_outputs, on_dead)
            if self._dead is not None:
                loop.call_soon(on_dead, _dead_error(self._dead))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
            self._thread.start()

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        for req in reqs:
            self._inbox.put(("add", req))

    def abort_requests(self, request_ids: list[str]) -> None:
        self._inbox.put(("abort", list(request_ids)))

    async def call(self, call: ControlCall) -> ControlResult:
        """Run a control call in the engine thread, between two steps."""
        fut: asyncio.Future[ControlResult] = asyncio.get_running_loop().create_future()
        self._inbox.put(("control", (call, fut)))
        return await fut

    def _emit(self, item: OutputBatch | BaseException) -> None:
        sink = self._sink
        if sink is None:
            return
        loop, on_outputs, on_dead = sink
        try:
            if isinstance(item, BaseException):
                loop.call_soon_threadsafe(on_dead, _dead_error(item))
            else:
                loop.call_soon_threadsafe(_deliver, on_outputs, on_dead, item)
        except RuntimeError:  # that loop is closed: nobody is waiting for this any more
            logger.debug("dropped engine output for a closed event loop")

    def _handle(self, kind: str, payload: Any) -> bool:
        if kind == "stop":
            return False
        if kind == "add":
            try:
                self.core.add_request(payload)
            except ValueError as exc:
                self._emit(OutputBatch(details=[EngineCoreOutput(
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
                self.last_progress = time.monotonic()
                if outs.outputs:
                    self._emit(OutputBatch.pack(outs.outputs, outs.timestamp,
                                                outs.scheduler_stats))
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            logger.exception("engine thread failed")
            self._dead = exc
            self._emit(exc)

    def shutdown(self) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.core.shutdown()


def _deliver(on_outputs: Callable[[OutputBatch], None],
             on_dead: Callable[[EngineDeadError], None], batch: OutputBatch) -> None:
    """A bug in output processing fails every request (as the process client does), instead
    of a logged callback error and streams that never end."""
    try:
        on_outputs(batch)
    except Exception as exc:  # noqa: BLE001 - fatal, reported to every waiting request
        logger.exception("processing the engine's outputs failed")
        on_dead(_dead_error(RuntimeError(f"engine output processing failed: {exc}")))


def _dead_error(exc: BaseException) -> EngineDeadError:
    from tidal.frontend.async_llm import EngineDeadError

    return exc if isinstance(exc, EngineDeadError) else EngineDeadError(
        f"the engine thread failed: {exc}")


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
