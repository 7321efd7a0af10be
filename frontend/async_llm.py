"""``AsyncLLM``: the engine for asyncio code (the HTTP server is one user).

    engine = AsyncLLM.from_engine_args(EngineArgs())
    async for out in engine.generate("Hello", SamplingParams(output_kind=OutputKind.DELTA), "r1"):
        print(out.outputs[0].text, end="")

Outputs stream per request through a collector queue filled by one background task that reads
the engine client and runs the ``OutputProcessor``. Cancelling the consuming task (or breaking out
of the loop) aborts the request in the engine.

By default the engine runs in its own process (``tidal.frontend.mp_client``); ``mode="thread"``
keeps it in a thread of this one, and ``AsyncLLM.from_address`` connects to a running
``engine-core`` instead (several frontends may share one).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from tidal.engine_core.config import EngineArgs, EngineConfig
from tidal.engine_core.control import (
    ControlCall,
    ControlResult,
    GetKVStats,
    KVStats,
    ResetPrefixCache,
)
from tidal.engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.validation import validate_request
from tidal.frontend.output_processor import OutputProcessor
from tidal.frontend.outputs import EmbeddingOutput, RequestOutput
from tidal.frontend.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in a thread, off the event loop.
_INLINE_TOKENIZE_CHARS = 2048


class EngineDeadError(RuntimeError):
    """The engine (or one of its workers) died; every in-flight and new request fails with it."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (others are unaffected); the message says why."""


class AsyncEngineClient(Protocol):
    """How ``AsyncLLM`` reaches an EngineCore: in a thread, a child process, or by address."""

    config: EngineConfig  # resolved (KV blocks known)

    async def add_request(self, req: EngineCoreRequest) -> None: ...

    async def abort_requests(self, request_ids: list[str]) -> None: ...

    async def get_outputs(self) -> EngineCoreOutputs:
        """Wait for the next batch of outputs; raises EngineDeadError if the engine died."""
        ...

    async def call(self, call: ControlCall) -> ControlResult:
        """Run a typed control call in the engine (``tidal.engine_core.control``)."""
        ...

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine is dead, once the client knows it is; None while it lives."""
        ...

    def shutdown(self) -> None: ...


StatObserver = Callable[[SchedulerStats | None, list[RequestOutput]], None]


class AsyncLLM:
    def __init__(self, client: AsyncEngineClient, tokenizer: Any) -> None:
        self.client = client
        self.config = client.config
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer)
        self._collectors: dict[str, asyncio.Queue[Any]] = {}
        self._output_task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._observers: list[StatObserver] = []
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-tokenize")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, mode: str = "process",
                         skip_tokenizer_init: bool = False, **client_kwargs: Any) -> AsyncLLM:
        """Start an engine for ``args``: in its own process (``mode="process"``, the default)
        or in a thread of this one (``mode="thread"``). ``client_kwargs`` go to the client (see
        ``tidal.frontend.engine_client.make_async_client``). ``skip_tokenizer_init``: token-id
        prompts only, no text in the outputs."""
        from tidal.frontend.engine_client import make_async_client

        config = args.create_config()
        if mode != "process":
            tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
            return cls(make_async_client(config, mode, **client_kwargs), tokenizer)
        from tidal.frontend.mp_client import EngineConnection, MPAsyncClient

        # The engine process starts (imports, loads the model) while this one loads the
        # tokenizer.
        conn = EngineConnection.spawn(config, **client_kwargs)
        try:
            tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
            conn.wait_ready()
        except BaseException:
            conn.close()
            raise
        return cls(MPAsyncClient(conn), tokenizer)

    @classmethod
    def from_address(cls, address: str, *, tokenizer: str | None = None,
                     skip_tokenizer_init: bool = False, timeout_s: float | None = None,
                     **client_kwargs: Any) -> AsyncLLM:
        """Connect to a running ``engine-core`` at ``address`` (``tcp://HOST:PORT`` or
        ``ipc://PATH``). The tokenizer is the engine's model's unless ``tokenizer`` names
        another path (the engine's may not exist on this host)."""
        from tidal.frontend.mp_client import MPAsyncClient

        client = MPAsyncClient.connect(address, timeout_s, **client_kwargs)
        try:
            model = client.config.model
            if tokenizer is not None:
                import msgspec

                model = msgspec.structs.replace(model, tokenizer=tokenizer)
            tok = None if skip_tokenizer_init else load_tokenizer(model)
        except BaseException:
            client.shutdown()
            raise
        return cls(client, tok)

    # --- state --------------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._dead

    def add_stat_observer(self, observer: StatObserver) -> None:
        """Called after every engine step with its scheduler stats and the outputs it made."""
        self._observers.append(observer)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def check_health(self) -> None:
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        # The client may know before the output task does (e.g. no request in flight).
        if self._dead is None and self.client.dead_error is not None:
            self._mark_dead(self.client.dead_error)
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    async def control(self, call: ControlCall) -> ControlResult:
        """Run a typed control call in the engine; returns ``type(call).result_type``."""
        self._raise_if_dead()
        return await self.client.call(call)

    async def get_kv_stats(self) -> KVStats:
        stats = await self.control(GetKVStats())
        assert isinstance(stats, KVStats)
        return stats

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return bool(await self.control(ResetPrefixCache()))

    # --- requests -----------------------------------------------------------------------------

    async def tokenize(self, prompt: str) -> list[int]:
        if len(prompt) <= _INLINE_TOKENIZE_CHARS:
            return encode_prompt(self.tokenizer, prompt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, encode_prompt, self.tokenizer,
                                          prompt)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool = True,
                                  chat_template: str | None = None) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, apply_chat_template,
                                          self.tokenizer, messages, add_generation_prompt,
                                          chat_template)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (the kind set by ``params.output_kind``).

        Raises ``ValueError`` for an invalid request (before anything reaches the engine),
        ``EngineDeadError`` if the engine dies, ``RequestFailedError`` if the engine failed this
        request alone.
        """
        self._raise_if_dead()
        text = prompt if isinstance(prompt, str) else None
        if self.tokenizer is None and (text is not None or params.stop):
            raise ValueError("text prompts and stop strings need a tokenizer "
                             "(this engine was started with skip_tokenizer_init)")
        ids = await self.tokenize(prompt) if text is not None else list(prompt)
        validate_request(ids, params, self.config)
        self._ensure_output_task()
        engine_reqs = self.processor.add_request(request_id, text, ids, params, arrival_time,
                                                 cache_salt)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._collectors[request_id] = queue
        finished = False
        try:
            for req in engine_reqs:
                await self.client.add_request(req)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                failed = next((c for c in item.outputs if c.finish_reason == "error"), None)
                if failed is not None and failed.error is not None and finished:
                    raise RequestFailedError(failed.error)
                yield item
                if finished:
                    return
        finally:
            self._collectors.pop(request_id, None)
            if not finished:
                await self._abort_quietly(request_id)

    async def encode(self, prompt: str | list[int], request_id: str) -> EmbeddingOutput:
        """The embedding of one prompt (the engine must serve an embedding model)."""
        if self.config.model.task != "embed":
            raise ValueError(f"{self.config.model.served_model_name} is not an embedding model")
        self._raise_if_dead()
        text = prompt if isinstance(prompt, str) else None
        ids = await self.tokenize(prompt) if text is not None else list(prompt)
        validate_request(ids, SamplingParams(max_tokens=1), self.config)
        self._ensure_output_task()
        req = self.processor.add_embedding_request(request_id, text, ids)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._collectors[request_id] = queue
        done = False
        try:
            await self.client.add_request(req)
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            done = True
            if item.error is not None:
                raise RequestFailedError(item.error)
            return item
        finally:
            self._collectors.pop(request_id, None)
            if not done:
                await self._abort_quietly(request_id)

    async def abort(self, request_id: str) -> None:
        queue = self._collectors.get(request_id)
        await self._abort_quietly(request_id)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} was aborted"))

    async def _abort_quietly(self, request_id: str) -> None:
        engine_ids = self.processor.abort_request(request_id)
        if engine_ids and self._dead is None:
            try:
                await self.client.abort_requests(engine_ids)
            except EngineDeadError:
                pass

    # --- the output loop ----------------------------------------------------------------------

    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop(),
                                                                       name="tidal-outputs")

    async def _output_loop(self) -> None:
        try:
            while True:
                outputs = await self.client.get_outputs()
                processed = self.processor.process_outputs(outputs.outputs)
                for out in processed.request_outputs:
                    queue = self._collectors.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                if processed.abort_engine_ids:
                    await self.client.abort_requests(processed.abort_engine_ids)
                for observer in self._observers:
                    observer(outputs.scheduler_stats, processed.request_outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the engine is gone: fail everyone
            self._mark_dead(exc)

    def _mark_dead(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine failed: {exc}")
        if self._dead is None:
            logger.error("engine is dead: %s", err)
        self._dead = err
        self.processor.fail_all(str(err))
        for queue in self._collectors.values():
            queue.put_nowait(err)

    def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
        self.client.shutdown()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

