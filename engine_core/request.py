"""The EngineCore's state for one request (separate from the wire type it arrived as)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.protocol import EngineCoreRequest, FinishReason
from tidal.engine_core.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved against max_model_len
    eos_token_ids: frozenset[int]
    arrival_time: float = 0.0
    cache_salt: str | None = None
    client_index: int = 0
    lora_request: LoRARequest | None = None
    # For the KV connector (disaggregated prefill/decode): the request's kv_transfer_params.
    kv_transfer_params: dict[str, object] | None = None
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 until scheduled
    num_preemptions: int = 0
    # Engine-clock times for the frontend's per-request phase metrics (queue, prefill, decode):
    # when the request entered the scheduler, and when it was first scheduled (0: not yet).
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    prompt_logprobs_sent: int = 1  # prompt positions below this were delivered (0 never is)
    # Tokens scheduled to be sampled by steps still in flight (async scheduling, pipeline
    # parallelism): their positions exist for scheduling, their values are not known yet.
    num_placeholders: int = 0
    # Known tokens the workers have been sent (pipeline parallelism forwards the rest).
    num_tokens_sent: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Prefix-cache hashes of this request's full blocks, filled incrementally (see block_hash).
    block_hashes: list[bytes] = field(default_factory=list)
    # Derived once, for the scheduler's cheap pre-test of ``check_stop``: the token ids that can
    # end this request (``min_tokens``/``ignore_eos`` may still keep it running), and the token
    # count at which it ends for length (``max_tokens`` reached; the scheduler lowers it to the
    # model's context length on intake).
    stop_candidates: frozenset[int] = field(init=False)
    length_limit: int = field(init=False)
    num_prompt_tokens: int = field(init=False)  # a plain attribute: read in hot loops
    # Under a grammar: its next mask needs its previous token, so it never decodes on a
    # placeholder (async scheduling skips it while its token is in flight).
    structured: bool = field(init=False)
    # Its grammar (or reasoning markers) is still compiling: it may compute every known token
    # but the last, so its prompt prefills meanwhile, and samples nothing until it is clear.
    grammar_wait: bool = False

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.stop_candidates = self.eos_token_ids.union(self.sampling_params.stop_token_ids)
        self.length_limit = self.num_prompt_tokens + self.max_tokens
        self.structured = self.sampling_params.structured_outputs is not None

    @classmethod
    def from_engine_request(
        cls, req: EngineCoreRequest, max_model_len: int, eos_token_ids: frozenset[int]
    ) -> Request:
        params = req.sampling_params
        budget = max_model_len - len(req.prompt_token_ids)
        max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
        return cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=eos_token_ids,
            arrival_time=req.arrival_time,
            cache_salt=req.cache_salt,
            client_index=req.client_index,
            lora_request=req.lora_request,
            kv_transfer_params=req.kv_transfer_params,
            all_token_ids=list(req.prompt_token_ids),
        )

    @property
    def lora_int_id(self) -> int:
        """The LoRA adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def check_stop(self, token_id: int, max_model_len: int) -> bool:
        """Finish the request if ``token_id`` (just appended) ends it; True if it did."""
        params = self.sampling_params
        n_out = self.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return self.finish(FinishReason.STOP)
            if token_id in params.stop_token_ids:
                return self.finish(FinishReason.STOP, stop_reason=token_id)
        if n_out >= self.max_tokens or self.num_tokens >= max_model_len:
            return self.finish(FinishReason.LENGTH)
        return False

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> bool:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return True
