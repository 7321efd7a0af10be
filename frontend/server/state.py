"""What every request handler of one server reads: the engine, the limits, admission, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tidal.frontend.server.admission import Admission, Ticket
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.metrics import ServerMetrics
from tidal.frontend.server.sampling import ServerLimits

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM


@dataclass(slots=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float = 30.0
    limits: ServerLimits = field(default_factory=ServerLimits)
    chat_template: str | None = None  # overrides the model's own
    access_log: bool = False
    stream_interval: int = 1  # tokens between stream chunks (the first and last always go)


@dataclass(slots=True)
class ServerState:
    engine: AsyncLLM
    settings: ServerSettings
    admission: Admission
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    task: str  # "generate" | "embed"
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def limits(self) -> ServerLimits:
        return self.settings.limits

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def release(self, ticket: Ticket, num_aborted: int) -> None:
        """A request's handler is done: free its admission slot, and count the sequences it
        left unfinished (client gone, drain timeout) as aborted."""
        self.admission.release(ticket)
        self.metrics.request_gone(num_aborted)
        if self.admission.num_in_flight == 0:
            self.metrics.engine_idle()

    def check_model(self, name: str | None) -> str:
        """The served model's name if ``name`` asks for it (or for nothing); else a 404."""
        if name is None or name == "" or name == self.model_name:
            return self.model_name
        shown = name if len(name) <= 100 else name[:100] + "..."
        raise APIError(404, f"the model {shown!r} does not exist on this server; it serves "
                       f"{self.model_name!r} (GET /v1/models lists it)", param="model",
                       code="model_not_found")

    def require_task(self, task: str, endpoint: str) -> None:
        if self.task != task:
            what = "an embedding model" if self.task == "embed" else "a generative model"
            raise APIError(400, f"{endpoint} is not available: {self.model_name!r} is {what}; "
                           + ("use /v1/embeddings" if self.task == "embed"
                              else "serve an embedding model (--task embed) for /v1/embeddings"),
                           param="model", code="wrong_model_task")


STATE_KEY: web.AppKey[ServerState] = web.AppKey("tidal_state", ServerState)


def get_state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]
