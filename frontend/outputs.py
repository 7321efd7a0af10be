"""What callers of ``LLM`` and ``AsyncLLM`` get back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the distribution
    decoded_token: str | None = None


# One position: token id -> its log-probability (the chosen token and the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why the request failed (finish_reason "error")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set once finished, with a KV connector that answers the client (a disaggregated prefill
    # instance: where the decode instance pulls this request's KV from).
    kv_transfer_params: dict[str, object] | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was received
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class EmbeddingOutput:
    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    error: str | None = None  # the engine failed this request

    @property
    def finished(self) -> bool:
        return True
