"""``AsyncLLM``: the engine for asyncio code (the HTTP server is one user).

    engine = AsyncLLM.from_engine_args(EngineArgs())
    async for out in engine.generate("Hello", SamplingParams(output_kind=OutputKind.DELTA), "r1"):
        print(out.outputs[0].text, end="")

Engine outputs arrive once per engine step, straight from the client's socket reader into the
``OutputProcessor``, which marks each request with news ready in its ``OutputCollector``; the
consumer takes what is ready when it runs again (several steps' text in one output if it fell
behind). Cancelling the consuming task (or breaking out of the loop) aborts the request in the
engine; ``abort(request_id)`` ends its stream with finish reason ``abort``.

By default the engine runs in its own process (``tidal.frontend.mp_client``); ``mode="thread"``
keeps it in a thread of this one, and ``AsyncLLM.from_address`` connects to a running
``engine-core`` instead (several frontends may share one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from tidal.engine_core.config import EngineArgs, EngineConfig
from tidal.engine_core.control import (
    ControlCall,
    ControlResult,
    AddLora,
    GetKVStats,
    KVStats,
    ListLoras,
    LoRAIds,
    RemoveLora,
    ResetPrefixCache,
)
from tidal.engine_core.lora_adapter import LoRAAdapterError
from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.protocol import EngineCoreRequest, OutputBatch, SchedulerStats
from tidal.engine_core.sampling_params import SamplingParams
from tidal.engine_core.validation import validate_request
from tidal.frontend.beam_search import AsyncBeamSearchRun, BeamSearchParams, beam_search_stream
from tidal.frontend.output_processor import OutputCollector, OutputProcessor, StepRecord
from tidal.frontend.outputs import EmbeddingOutput, RequestOutput
from tidal.frontend.prompt_inputs import PromptType, parse_prompt, with_salt
from tidal.frontend.tokenizer import apply_chat_template, encode_prompt, load_tokenizer

logger = logging.getLogger(__name__)

# Prompts longer than this (characters) are tokenized in a thread, off the event loop.
_INLINE_TOKENIZE_CHARS = 2048


class EngineDeadError(RuntimeError):
    """The engine (or one of its workers) died; every in-flight and new request fails with it."""


class EngineUnavailableError(EngineDeadError):
    """The engine reached by address is gone for now (it died, shut down or went silent): the
    requests in flight then fail with it, and new ones until the client has reconnected to an
    EngineCore at the same address."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (others are unaffected); the message says why."""


class AsyncEngineClient(Protocol):
    """How ``AsyncLLM`` reaches an EngineCore: in a thread, a child process, or by address.

    Sends never block (a client may gather the sends of one event-loop turn into one message);
    outputs are delivered to the handlers given to ``attach``, in the event loop running then.
    """

    config: EngineConfig  # resolved (KV blocks known)
    # time.monotonic() of the engine's latest sign of progress (a step finished)
    last_progress: float

    def attach(self, on_outputs: Callable[[OutputBatch], None],
               on_dead: Callable[[EngineDeadError], None]) -> None:
        """Deliver outputs in the running event loop (again for a new loop: successive
        ``asyncio.run`` calls). ``on_dead`` is called once if the engine dies."""
        ...

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    async def call(self, call: ControlCall) -> ControlResult:
        """Run a typed control call in the engine (``tidal.engine_core.control``)."""
        ...

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine is dead, once the client knows it is; None while it lives."""
        ...

    def shutdown(self) -> None: ...


StatObserver = Callable[[SchedulerStats | None, StepRecord], None]


class AsyncLLM:
    def __init__(self, client: AsyncEngineClient, tokenizer: Any,
                 stream_interval: int = 1) -> None:
        """``stream_interval``: DELTA streams get news at the first token, then every
        ``stream_interval`` tokens and at the end (1: every step)."""
        self.client = client
        self.config = client.config
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(tokenizer, stream_interval)
        self._dead: BaseException | None = None
        # Since when this frontend has had requests in the engine, if none was progress since.
        self._busy_since = time.monotonic()
        self._observers: list[StatObserver] = []
        # Called with (engine index, sequences) for what this frontend aborts in the engines.
        self._abort_observers: list[Callable[[int, int], None]] = []
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tidal-tokenize")
        # Running beam searches by request id (``abort`` ends them too).
        self.beam_searches: dict[str, AsyncBeamSearchRun] = {}

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, mode: str = "process",
                         skip_tokenizer_init: bool = False, stream_interval: int = 1,
                         **client_kwargs: Any) -> AsyncLLM:
        """Start an engine for ``args``: in its own process (``mode="process"``, the default)
        or in a thread of this one (``mode="thread"``). ``client_kwargs`` go to the client (see
        ``tidal.frontend.engine_client.make_async_client``). ``skip_tokenizer_init``: token-id
        prompts only, no text in the outputs."""
        from tidal.frontend.engine_client import make_async_client

        config = args.create_config()
        if config.parallel.data_parallel_size > 1:
            if mode != "process" or client_kwargs:
                raise ValueError("data_parallel_size > 1 runs each rank in a process of its "
                                 "own: not yet supported with mode='thread' or client options "
                                 f"({sorted(client_kwargs)})")
            from tidal.frontend.dp_client import spawn_dp_client

            client = spawn_dp_client(config)
            try:
                tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
            except BaseException:
                client.shutdown()
                raise
            return cls(client, tokenizer, stream_interval)
        if mode != "process":
            tokenizer = None if skip_tokenizer_init else load_tokenizer(config.model)
            return cls(make_async_client(config, mode, **client_kwargs), tokenizer,
                       stream_interval)
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
        return cls(MPAsyncClient(conn), tokenizer, stream_interval)

    @classmethod
    def from_address(cls, address: str, *, tokenizer: str | None = None,
                     skip_tokenizer_init: bool = False, timeout_s: float | None = None,
                     stream_interval: int = 1, **client_kwargs: Any) -> AsyncLLM:
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
        return cls(client, tok, stream_interval)

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

    def add_abort_observer(self, observer: Callable[[int, int], None]) -> None:
        """Called with (engine index, sequences) whenever requests are aborted in an engine
        (client gone, ``abort``, a drain timeout): the engine never reports those as
        finished to this frontend."""
        self._abort_observers.append(observer)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def check_health(self) -> None:
        self._raise_if_dead()

    def _raise_if_dead(self) -> None:
        # The client may know before it told us (e.g. it was never attached to a loop).
        if self._dead is None and (lost := self.client.dead_error) is not None:
            if isinstance(lost, EngineUnavailableError):
                raise EngineUnavailableError(str(lost))  # for now: the client reconnects
            self._mark_dead(lost)
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def seconds_without_progress(self) -> float:
        """How long this frontend's unfinished requests have waited without the engine
        finishing a step (0.0 with none): the server's measure of a stalled engine."""
        if not self.processor.requests:
            return 0.0
        since = max(self._busy_since, self.client.last_progress)
        return max(0.0, time.monotonic() - since)

    async def control(self, call: ControlCall) -> ControlResult:
        """Run a typed control call in the engine; returns ``type(call).result_type``."""
        self._raise_if_dead()
        self._attach()
        return await self.client.call(call)

    async def get_kv_stats(self) -> KVStats:
        stats = await self.control(GetKVStats())
        assert isinstance(stats, KVStats)
        return stats

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests hold blocks."""
        return bool(await self.control(ResetPrefixCache()))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a LoRA adapter, its files checked against the model (the workers load it
        on first use); False when it was registered already. Raises ``LoRAAdapterError`` (a
        ValueError naming the problem) for an adapter that cannot be served."""
        from tidal.frontend.llm import lora_error

        if self.config.lora is None:
            raise LoRAAdapterError("LoRA adapters need the engine started with --enable-lora")
        try:
            return bool(await self.control(AddLora(lora_request)))
        except RuntimeError as exc:  # from an engine process: mp_client.ControlCallError
            raise lora_error(exc) from None

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Forget a LoRA adapter; False when it was not registered."""
        return bool(await self.control(RemoveLora(lora_int_id)))

    async def list_loras(self) -> list[int]:
        """The registered LoRA adapters' ids, ascending."""
        ids = await self.control(ListLoras())
        assert isinstance(ids, LoRAIds)
        return list(ids.ids)

    # --- requests -----------------------------------------------------------------------------

    async def tokenize(self, prompt: str) -> list[int]:
        if len(prompt) <= _INLINE_TOKENIZE_CHARS:
            return encode_prompt(self.tokenizer, prompt)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, encode_prompt, self.tokenizer,
                                          prompt)

    async def apply_chat_template(self, messages: list[dict[str, Any]],
                                  add_generation_prompt: bool = True,
                                  chat_template: str | None = None,
                                  continue_final_message: bool = False,
                                  tools: list[dict[str, Any]] | None = None,
                                  template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """``continue_final_message``: leave the last message open for the model to continue
        (HF's argument; exclusive with ``add_generation_prompt``). ``tools`` and
        ``template_kwargs`` (e.g. ``enable_thinking``) are variables of the template."""
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = dict(template_kwargs or {})
        if tools:
            extra["tools"] = tools
        return await loop.run_in_executor(
            self._tokenize_pool,
            lambda: apply_chat_template(self.tokenizer, messages, add_generation_prompt,
                                        chat_template,
                                        continue_final_message=continue_final_message,
                                        **extra))

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        collector: OutputCollector | None = None,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> OutputCollector:
        """Start a request; its outputs (the kind set by ``params.output_kind``) are read from
        the returned collector (``collector`` if given: one consumer may read several
        requests through one). Raises ``ValueError`` for an invalid request (nothing reaches
        the engine then) and ``EngineDeadError``."""
        self._raise_if_dead()
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        if isinstance(prompt, Mapping):  # vLLM's prompt dicts (tidal.frontend.prompt_inputs)
            parsed = parse_prompt(prompt)
            text, ids, cache_salt = parsed.text, parsed.token_ids, with_salt(parsed, cache_salt)
        if self.tokenizer is None and (ids is None or params.stop):
            raise ValueError("text prompts and stop strings need a tokenizer "
                             "(this engine was started with skip_tokenizer_init)")
        if lora_request is not None and self.config.lora is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} needs the engine started "
                             "with --enable-lora")
        ids = await self.tokenize(text) if ids is None else list(ids)
        validate_request(ids, params, self.config)
        self._raise_if_dead()  # tokenizing may have waited
        self._attach()
        collector = collector or OutputCollector()
        engine_reqs = self.processor.add_request(request_id, text, ids, params, arrival_time,
                                                 cache_salt, collector)
        if lora_request is not None:
            for req in engine_reqs:
                req.lora_request = lora_request
        if kv_transfer_params is not None:  # (the server checked them: one engine request)
            for req in engine_reqs:
                req.kv_transfer_params = kv_transfer_params
        self.client.add_requests(engine_reqs)
        return collector

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request (the kind set by ``params.output_kind``).

        Raises ``ValueError`` for an invalid request (before anything reaches the engine),
        ``EngineDeadError`` if the engine dies, ``RequestFailedError`` if the engine failed this
        request alone. ``abort(request_id)`` ends the stream with a last output whose finish
        reason is ``abort``.
        """
        collector = await self.add_request(request_id, prompt, params, cache_salt=cache_salt,
                                           arrival_time=arrival_time, lora_request=lora_request)
        finished = False
        try:
            while not finished:
                for out in collector.take() or await collector.get():
                    assert isinstance(out, RequestOutput)
                    finished = out.finished
                    failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
                    if failed is not None and failed.error is not None and finished:
                        raise RequestFailedError(failed.error)
                    yield out
        finally:
            if not finished:
                self.abort_quietly([request_id])

    async def encode(self, prompt: str | list[int], request_id: str) -> EmbeddingOutput:
        """The embedding of one prompt (the engine must serve an embedding model)."""
        if self.config.model.task != "embed":
            raise ValueError(f"{self.config.model.served_model_name} is not an embedding model")
        self._raise_if_dead()
        text = prompt if isinstance(prompt, str) else None
        ids = await self.tokenize(prompt) if text is not None else list(prompt)
        validate_request(ids, SamplingParams(max_tokens=1), self.config)
        self._raise_if_dead()
        self._attach()
        collector = OutputCollector()
        req = self.processor.add_embedding_request(request_id, text, ids, collector=collector)
        done = False
        try:
            self.client.add_requests([req])
            (item,) = await collector.get()
            done = True
            assert isinstance(item, EmbeddingOutput)
            if item.error is not None:
                raise RequestFailedError(item.error)
            return item
        finally:
            if not done:
                self.abort_quietly([request_id])

    def beam_search(self, prompt: PromptType, params: BeamSearchParams, request_id: str, *,
                    cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Beam search (``tidal.frontend.beam_search``), as vLLM's ``beam_search``: yields one
        output when the search ends, a completion per returned beam, best first.
        ``abort(request_id)`` ends it early (its open beams finish with ``abort``)."""
        return beam_search_stream(self, prompt, params, request_id, cache_salt)

    async def abort(self, request_id: str) -> None:
        """End a request: the engine stops it, and its stream ends with a last output whose
        finish reason is ``abort``."""
        if (search := self.beam_searches.get(request_id)) is not None:
            search.abort()
        self._abort_in_engine(self.processor.finish_aborted(request_id))

    def abort_quietly(self, request_ids: list[str]) -> None:
        """Forget requests whose consumer is gone, and stop them in the engine."""
        self._abort_in_engine([eid for rid in request_ids
                               for eid in self.processor.abort_request(rid)])

    def _abort_in_engine(self, engine_ids: list[str]) -> None:
        if engine_ids and self._dead is None:
            if self._abort_observers:
                # (Before the abort: a data-parallel client forgets the rank then.)
                engine_of = getattr(self.client, "engine_of", None)
                counts = Counter(0 if engine_of is None else engine_of(eid)
                                 for eid in engine_ids)
                for observer in self._abort_observers:
                    for engine, n in counts.items():
                        observer(engine, n)
            try:
                self.client.abort_requests(engine_ids)
            except EngineDeadError:
                pass

    # --- outputs ------------------------------------------------------------------------------

    def _attach(self) -> None:
        if not self.processor.requests:  # work begins: no progress was owed before now
            self._busy_since = time.monotonic()
        self.client.attach(self._on_outputs, self._mark_dead)

    def _on_outputs(self, batch: OutputBatch) -> None:
        """One engine step: runs in the event loop, straight from the client's socket reader
        (no task or queue per step)."""
        processed = self.processor.process_outputs(batch)
        if processed.abort_engine_ids:
            self.client.abort_requests(processed.abort_engine_ids)
        for observer in self._observers:
            observer(batch.scheduler_stats, processed.record)

    def _mark_dead(self, exc: BaseException) -> None:
        err = exc if isinstance(exc, EngineDeadError) else EngineDeadError(
            f"the engine failed: {exc}")
        if isinstance(err, EngineUnavailableError):
            # Not for good: the client reconnects. What ran there is lost all the same.
            logger.error("engine unavailable: %s", err)
            self.processor.fail_all(err)
            return
        if self._dead is None:
            logger.error("engine is dead: %s", err)
            self._dead = err
        self.processor.fail_all(err)

    def shutdown(self) -> None:
        self.client.shutdown()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

