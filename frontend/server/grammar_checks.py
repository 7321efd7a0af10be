"""A request's grammar checks off the event loop.

A request that carries a structured-outputs spec (``response_format``, ``structured_outputs``,
``guided_*``) or tools whose schemas a grammar will hold (an enforced ``tool_choice``, a
``strict`` tool) has them compiled while it is parsed, so a bad one is a 400 before the engine
(``structured.structured_params``, ``chat_parsing.check_tools``). A large schema takes tens of
milliseconds to compile (a 60-object schema: 25 ms on the 2-core box), and on the event loop
that would stall every other request's stream for as long. llguidance compiles without the GIL,
so those parsing steps run on a small pool of worker threads instead, while the loop goes on
streaming; a request with nothing to compile stays on the loop (a thread hop costs more than
its parsing). The spec's verdict is kept (``spec.validate``): the same schema again compiles
no more.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tidal.engine_core.sampling_params import SamplingParamError, SamplingParams
from tidal.engine_core.structured_output.spec import validate
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.structured import requested_forms

T = TypeVar("T")

# Compiles at once per API server process; more requests with grammars queue for a thread, up
# to MAX_PENDING_CHECKS in all (queued or compiling) per process: beyond that a 429, as a full
# queue gets (these checks run before a request is admitted, so admission does not bound them).
CHECK_THREADS = 4
MAX_PENDING_CHECKS = 256
_POOL: ThreadPoolExecutor | None = None
_pending = 0  # (touched on the event loop only)


def carries_grammar(req: Any) -> bool:
    """Whether parsing ``req`` (a chat or completions request) compiles a grammar: a
    structured-outputs form, or tools held to their schemas (``tool_choice`` "required" or
    named, or a ``strict`` tool under a choice other than "none")."""
    if requested_forms(req):
        return True
    tools = getattr(req, "tools", None)
    if not tools:
        return False
    choice = getattr(req, "tool_choice", None)
    if isinstance(choice, dict) or choice == "required":
        return True
    return choice != "none" and any(getattr(t.function, "strict", None) for t in tools)


async def parse_sampling(state: Any, req: Any, fn: Callable[..., SamplingParams], *args: Any,
                         **kwargs: Any) -> SamplingParams:
    """``parse_checked`` of a function that returns the request's sampling params, whose
    structured-outputs spec is then also checked as the engine's own request checks will
    (``common.check_prompt``: with the engine's ``--structured-outputs-backend``) on the same
    thread, so that check finds the verdict kept, and compiles nothing on the loop."""
    backend = state.engine.config.scheduler.structured_outputs_backend

    def parse() -> SamplingParams:
        params = fn(*args, **kwargs)
        if params.structured_outputs is not None:
            # A bad spec's verdict is kept too: check_prompt raises it as the 400 it is.
            with contextlib.suppress(SamplingParamError):
                validate(params.structured_outputs, backend)
        return params

    return await parse_checked(req, parse)


async def parse_checked(req: Any, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``: on a grammar-check thread when ``req`` carries a grammar
    (``carries_grammar``), else here. Its exceptions (400s) come back as raised."""
    if not carries_grammar(req):
        return fn(*args, **kwargs)
    global _POOL, _pending
    if _pending >= MAX_PENDING_CHECKS:
        raise APIError(429, f"{_pending} requests with schemas or grammars are being checked "
                       f"on this API server process (limit {MAX_PENDING_CHECKS}); retry later "
                       "with backoff", code="queue_full", headers={"Retry-After": "1"})
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=CHECK_THREADS,
                                   thread_name_prefix="tidal-grammar-check")
    # (In the request's context, as asyncio.to_thread runs its calls.)
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    _pending += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_POOL, call)
    finally:
        _pending -= 1
