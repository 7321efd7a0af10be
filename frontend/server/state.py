"""What every request handler of one server reads: the engine, the limits, admission, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tidal.engine_core.lora_request import LoRARequest
from tidal.frontend.server.admission import Admission, Ticket
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.metrics import ServerMetrics
from tidal.frontend.server.response_background import BackgroundResponses
from tidal.frontend.server.response_store import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ENTRIES,
    ResponseStore,
)
from tidal.frontend.server.lora_models import LoRAModels, LoRAModule
from tidal.frontend.server.sampling import ServerLimits
from tidal.frontend.server.server_plugins import ServerPlugins

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.server.response_peers import ResponsePeers


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
    # /health answers 503 engine_stalled once requests wait this long with no engine step done
    engine_stall_timeout: float = 60.0
    metrics_prefix: str = "tidal"  # /metrics names are "{prefix}:{vLLM's family name}"
    # Connection guard (see ``connections``): per API server process; None: from the
    # open-file limit.
    max_connections: int | None = None
    header_timeout: float = 10.0  # s from a connection's (or request's) first byte to its header
    body_timeout: float = 60.0  # s from a request's header to the end of its body
    keep_alive_timeout: float = 75.0  # s an idle kept-alive connection stays open
    root_path: str = ""  # --root-path: routes are served under it too ("" or "/prefix")
    enable_server_load_tracking: bool = False  # GET /load counts requests in flight
    engine_connect_timeout: float = 30.0  # seconds for a standalone engine-core to answer
    # usage.prompt_tokens_details (cached prompt tokens) in responses
    enable_prompt_tokens_details: bool = False
    # logprob tokens as "token_id:<id>" unless a request says otherwise
    return_tokens_as_token_ids: bool = False
    # Chat output parsers (frontend/server/chat_parsing.py): names as vLLM's flags take them.
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_parser_plugin: str | None = None  # a Python file that registers tool parsers
    # /v1/responses kept for previous_response_id (frontend/server/response_store.py)
    max_stored_responses: int = DEFAULT_MAX_ENTRIES
    max_stored_response_bytes: int = DEFAULT_MAX_BYTES
    # LoRA adapters by model name (lora_models.py): --lora-modules, --lora-resolver-dir.
    lora_modules: tuple[LoRAModule, ...] = ()
    lora_resolver_dir: str | None = None
    # Load / unload endpoints ($TIDAL_ALLOW_RUNTIME_LORA_UPDATING, read by the CLI).
    allow_runtime_lora_updating: bool = False
    # --disable-log-stats: no stat logger plugins (server_plugins.py).
    disable_log_stats: bool = False


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
    responses: ResponseStore = field(default_factory=ResponseStore)  # of /v1/responses
    background: BackgroundResponses = field(default_factory=BackgroundResponses)  # running
    # The other API server processes' stores (--api-server-count > 1; response_peers.py).
    response_peers: ResponsePeers | None = None
    plugins: ServerPlugins = field(default_factory=ServerPlugins)
    loras: LoRAModels | None = None  # None: the engine runs no LoRA (--enable-lora off)

    @property
    def limits(self) -> ServerLimits:
        return self.settings.limits

    @property
    def tokenizer(self) -> Any:
        return self.engine.get_tokenizer()

    def release(self, ticket: Ticket) -> None:
        """A request's handler is done: free its admission slot. (The sequences it left
        unfinished were aborted in the engine: ``ServerMetrics.aborted`` counted them.)"""
        self.admission.release(ticket)
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

    async def resolve_model(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The model name a request's ``model`` asks for and the LoRA adapter it names (None:
        the base model); an unknown name goes to the LoRA resolvers, then is a 404."""
        if name is None or name == "" or name == self.model_name or self.loras is None:
            return self.check_model(name), None
        lora = await self.loras.lookup(name)
        return (name, lora) if lora is not None else (self.model_name, None)

    def require_task(self, task: str, endpoint: str) -> None:
        if self.task != task:
            what = "an embedding model" if self.task == "embed" else "a generative model"
            raise APIError(400, f"{endpoint} is not available: {self.model_name!r} is {what}; "
                           + ("use /v1/embeddings" if self.task == "embed"
                              else "serve an embedding model (--task embed) for /v1/embeddings"),
                           param="model", code="wrong_model_task")


def normalize_root_path(value: str) -> str:
    """``--root-path`` as the routes use it: "" for none, else "/a/b" (one leading slash, no
    trailing one). Raises ValueError for what cannot be a path prefix."""
    value = value.strip()
    if value in ("", "/"):
        return ""
    if not value.startswith("/"):
        raise ValueError(f"must start with '/', got {value!r}")
    if any(c in value for c in "?#%\\ \t") or "//" in value or any(
            part in (".", "..") for part in value.split("/")):
        raise ValueError(f"must be a plain URL path like /llm or /team/llm, got {value!r}")
    return value.rstrip("/")


STATE_KEY: web.AppKey[ServerState] = web.AppKey("tidal_state", ServerState)


def get_state(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]
