"""Runs the engine requests of one API request (one per prompt, each with ``n`` samples) and
reads their outputs through one ``OutputCollector``: each read returns what every prompt has
produced since the previous read, so a handler that fell behind (its client reads slowly, or the
event loop was busy) sends the text of several steps at once instead of queueing per step.

Leaving the stream early (client gone: aiohttp cancels the handler; or an error) aborts every
prompt's request in the engine, which frees its KV blocks at the next step. ``abort()`` (drain
timeout) ends the stream early too, marking it ``aborted`` so the handler can finish each open
choice with ``finish_reason="abort"``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.async_llm import RequestFailedError
from tidal.frontend.output_processor import OutputCollector
from tidal.frontend.outputs import RequestOutput
from tidal.frontend.server.admission import Admission, Ticket

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class _Aborted(Exception):
    """Ends the collector's wait when the drain timeout aborts the request."""


class Generation:
    def __init__(self, engine: AsyncLLM, admission: Admission, ticket: Ticket, request_id: str,
                 prompts: list[list[int]], params: SamplingParams,
                 cache_salt: str | None = None, *,
                 lora_request: LoRARequest | None = None,
                 kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.engine = engine
        self.admission = admission
        self.ticket = ticket
        self.request_id = request_id
        self.prompts = prompts
        self.params = params
        self.cache_salt = cache_salt
        self.lora_request = lora_request
        # Sent with the (one) engine request; the answer comes back on its finishing output.
        self.kv_transfer_params = kv_transfer_params
        self.kv_transfer_answer: dict[str, Any] | None = None
        self.aborted = False
        self.failed = False  # a prompt's engine request failed (the error goes to the client)
        self._collector = OutputCollector()
        self._index = {self.engine_id(i): i for i in range(len(prompts))}
        self._open: set[str] = set()  # engine request ids started and not finished
        self._started: set[tuple[int, int]] = set()  # (prompt, choice) with a first output
        # Prompt tokens served from the prefix cache, per prompt (known once it finishes).
        self._cached: dict[int, int] = {}

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens of all prompts that the prefix cache supplied (for usage)."""
        return sum(self._cached.values())

    def engine_id(self, prompt_index: int) -> str:
        return f"{self.request_id}-{prompt_index}"

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            # Stopped in the engine first: nothing new reaches the collector, so a consumer
            # that is behind reads what is there and then ends, instead of finding news on
            # every read and never the abort.
            self.close()
            self._collector.fail(_Aborted())

    async def stream(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """Every read: ``(prompt index, delta output)`` for each prompt with news, in order."""
        self.ticket.abort = self.abort
        if self.aborted:  # (a background response cancelled before it started)
            return
        try:
            for i, ids in enumerate(self.prompts):
                rid = self.engine_id(i)
                await self.engine.add_request(rid, ids, self.params, collector=self._collector,
                                              cache_salt=self.cache_salt,
                                              lora_request=self.lora_request,
                                              kv_transfer_params=self.kv_transfer_params)
                self._open.add(rid)
            while self._open:
                try:
                    outs = self._collector.take() or await self._collector.get()
                except _Aborted:
                    return
                except Exception:
                    self.failed = True  # the engine died: no sequence ended as an abort
                    raise
                batch = []
                for out in outs:
                    assert isinstance(out, RequestOutput)
                    batch.append((self._note(out), out))
                yield batch
        finally:
            self.close()

    def _note(self, out: RequestOutput) -> int:
        index = self._index[out.request_id]
        started = self._started
        for c in out.outputs:
            if (index, c.index) not in started:
                started.add((index, c.index))
                self.admission.started(self.ticket, 1)
            if c.finish_reason == "error" and c.error is not None:
                self.failed = True
                raise RequestFailedError(c.error)
        if out.num_cached_tokens:
            self._cached[index] = max(self._cached.get(index, 0), out.num_cached_tokens)
        if out.finished:
            self._open.discard(out.request_id)
            if out.kv_transfer_params is not None:
                self.kv_transfer_answer = dict(out.kv_transfer_params)
        return index

    def close(self) -> None:
        """Abort whatever still runs in the engine."""
        if self._open:
            open_ids, self._open = list(self._open), set()
            self.engine.abort_quietly(open_ids)
