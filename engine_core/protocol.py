"""Wire types: everything that crosses a process boundary, as msgspec structs.

frontend ⇄ EngineCore: ``EngineCoreRequest`` in, ``EngineCoreOutputs`` out, each wrapped in a
tagged envelope (``FrontendMessage`` / ``EngineMessage``) on the sockets.
EngineCore ⇄ workers: ``SchedulerOutput`` in, ``ModelRunnerOutput`` out.
Arrays are numpy arrays; the serializer sends large ones as separate zero-copy frames.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.control import ControlCall, ControlResult
from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.sampling_params import SamplingParams

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS, a stop token or a stop string
    LENGTH = 1  # max_tokens or the model's context
    ABORT = 2  # aborted by the client or the frontend
    ERROR = 3  # this request failed; others are unaffected

    def __str__(self) -> str:  # the OpenAI spelling
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, **_WIRE):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None
    # Which frontend sent it (the engine routes outputs back by this index).
    client_index: int = 0
    # The LoRA adapter it runs with; None: the base model.
    lora_request: LoRARequest | None = None
    # Disaggregated prefill/decode (vLLM's request extension, read by the KV connector):
    # {"do_remote_decode": true} on the prefill side, the producer's answer on the decode side.
    # (Any, not object: the socket decoder's hook would take object for a custom type.)
    kv_transfer_params: dict[str, Any] | None = None


class LogprobsArrays(msgspec.Struct, **_WIRE):
    """Log-probabilities of ``T`` positions: column 0 is the chosen token, then the top-N."""

    token_ids: np.ndarray  # int32 [T, 1 + N]
    logprobs: np.ndarray  # float32 [T, 1 + N]
    ranks: np.ndarray  # int32 [T], 1-based rank of the chosen token in the distribution

    def slice(self, start: int, end: int) -> LogprobsArrays:
        return LogprobsArrays(
            self.token_ids[start:end], self.logprobs[start:end], self.ranks[start:end]
        )

    @staticmethod
    def concat(parts: list[LogprobsArrays]) -> LogprobsArrays:
        if len(parts) == 1:
            return parts[0]
        return LogprobsArrays(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


class EngineCoreOutput(msgspec.Struct, **_WIRE):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: LogprobsArrays | None = None
    # Prompt logprobs for prompt positions [start, start + T); position 0 never has one.
    new_prompt_logprobs: LogprobsArrays | None = None
    prompt_logprobs_start: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    pooled: np.ndarray | None = None  # embedding models: the request's vector (float32)
    # Only on a request's first output with tokens (with ``num_cached_tokens`` set): when it
    # entered the engine and was first scheduled, on the engine's clock (as ``timestamp``), for
    # the frontend's queue / prefill / decode metrics.
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    # On the finishing output only: what the KV connector hands the client (a producer's
    # answer: where the decode side pulls this request's KV from).
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, **_WIRE):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0  # since the previous report
    prefix_cache_queries: int = 0  # tokens looked up, since the previous report
    prefix_cache_hits: int = 0  # tokens found, since the previous report
    num_prompt_tokens: int = 0  # computed this step (prefill work)
    num_generation_tokens: int = 0  # sampled this step
    # Tokens scheduled by each step since the previous report (one entry as a rule; more when
    # reports of steps without outputs were folded in), for the tokens-per-step histogram.
    iteration_tokens: list[int] = []
    # Several KV groups only: the share of the KV pool each group holds (the total is
    # ``kv_cache_usage``).
    kv_cache_usage_groups: list[float] = []
    # Structured outputs since the previous report: grammar compile times (seconds), and the
    # kind (json, json_object, regex, choice, grammar, structural_tag) of each constrained
    # request whose grammar became ready (or failed); the ``*_backends`` lists run beside them
    # (guidance | xgrammar: the backend that compiled it, after any fallback).
    grammar_compile_s: list[float] = []
    structured_requests: list[str] = []
    grammar_compile_backends: list[str] = []
    structured_request_backends: list[str] = []
    # Speculative decoding since the previous report (vLLM's spec-decode counters): requests
    # that verified drafts, draft tokens verified, drafts accepted, and accepted per position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Steps that had drafts at hand but verified none (the off-switch), by reason.
    spec_off_steps_batch_size: int = 0
    spec_off_steps_acceptance: int = 0
    # KV connector (engine_core/kv_transfer) since the previous report, in tokens: looked up
    # beyond the local prefix cache, found there (loaded, not recomputed: vLLM's
    # ``connector_prefix_cache_*``), and saved out of the KV pool (the host tier's stores).
    kv_connector_queries: int = 0
    kv_connector_hits: int = 0
    kv_connector_stores: int = 0
    # MoE models since the previous report: each expert's routings (tokens x top-k, summed
    # over the MoE layers), and the expert-parallel ranks they split over in contiguous
    # ranges (1: no expert parallelism); empty / 0: not counted.
    moe_expert_load: list[int] = []
    moe_ep_ranks: int = 0

    def add_counters(self, earlier: SchedulerStats) -> None:
        """Fold in the counters of an earlier report that was never delivered (the gauges here
        are newer and stay)."""
        self.spec_num_drafts += earlier.spec_num_drafts
        self.spec_num_draft_tokens += earlier.spec_num_draft_tokens
        self.spec_num_accepted_tokens += earlier.spec_num_accepted_tokens
        self.spec_off_steps_batch_size += earlier.spec_off_steps_batch_size
        self.spec_off_steps_acceptance += earlier.spec_off_steps_acceptance
        self.kv_connector_queries += earlier.kv_connector_queries
        self.kv_connector_hits += earlier.kv_connector_hits
        self.kv_connector_stores += earlier.kv_connector_stores
        if earlier.spec_accepted_per_pos:
            self.spec_accepted_per_pos = add_per_pos(earlier.spec_accepted_per_pos,
                                                     self.spec_accepted_per_pos)
        if earlier.moe_expert_load:
            self.moe_expert_load = add_per_pos(earlier.moe_expert_load, self.moe_expert_load)
            self.moe_ep_ranks = self.moe_ep_ranks or earlier.moe_ep_ranks
        self.num_preemptions += earlier.num_preemptions
        self.prefix_cache_queries += earlier.prefix_cache_queries
        self.prefix_cache_hits += earlier.prefix_cache_hits
        self.num_prompt_tokens += earlier.num_prompt_tokens
        self.num_generation_tokens += earlier.num_generation_tokens
        if earlier.iteration_tokens:
            self.iteration_tokens = earlier.iteration_tokens + self.iteration_tokens
        if earlier.grammar_compile_s:
            self.grammar_compile_s = earlier.grammar_compile_s + self.grammar_compile_s
        if earlier.structured_requests:
            self.structured_requests = earlier.structured_requests + self.structured_requests
            self.structured_request_backends = (earlier.structured_request_backends
                                                + self.structured_request_backends)
        if earlier.grammar_compile_backends:
            self.grammar_compile_backends = (earlier.grammar_compile_backends
                                             + self.grammar_compile_backends)

    def gauges(self) -> SchedulerStats:
        """The state part only (counters zero): what every frontend but one gets, so counters
        summed over frontends count each event once."""
        return SchedulerStats(self.num_running, self.num_waiting, self.kv_cache_usage,
                              kv_cache_usage_groups=self.kv_cache_usage_groups)


def add_per_pos(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two per-position counts (the shorter one padded with zeros)."""
    if len(a) < len(b):
        a, b = b, a
    return [x + (b[i] if i < len(b) else 0) for i, x in enumerate(a)]


class EngineCoreOutputs(msgspec.Struct, **_WIRE):
    """One step's outputs as the scheduler makes them (one struct per request); frontends
    receive them packed into an ``OutputBatch``."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    engine_index: int = 0


def _has_details(out: EngineCoreOutput) -> bool:
    return (out.finish_reason is not None or out.new_logprobs is not None
            or out.new_prompt_logprobs is not None or out.error is not None
            or out.pooled is not None or out.scheduled_ts != 0.0)


class OutputBatch(msgspec.Struct, **_WIRE):
    """One step's outputs for one frontend, columnar: what the frontend's output processor reads.

    Row ``i`` is request ``req_ids[i]`` with at least one new token: its tokens are
    ``token_ids[offsets[i]:offsets[i + 1]]`` where ``offsets`` is the running sum of
    ``token_counts`` (``None``: one token per row, every decode step without speculation).
    Everything else (a finish, logprobs, prompt logprobs, an error, an embedding) travels in
    ``details``, one ``EngineCoreOutput`` per request that has any, with its tokens left out
    (they are in the rows); the few requests in ``details`` are matched to rows by id. A plain
    decode step thus decodes into one list of ids and one array, not a struct per request.
    """

    req_ids: list[str] = []
    token_ids: np.ndarray | None = None  # int32 [sum of token_counts]
    token_counts: np.ndarray | None = None  # int32 [len(req_ids)]; None: one token per row
    details: list[EngineCoreOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None
    engine_index: int = 0

    @staticmethod
    def pack(outputs: list[EngineCoreOutput], timestamp: float = 0.0,
             scheduler_stats: SchedulerStats | None = None,
             engine_index: int = 0) -> OutputBatch:
        req_ids: list[str] = []
        tokens: list[int] = []
        counts: list[int] = []
        details: list[EngineCoreOutput] = []
        single = True
        for out in outputs:
            ids = out.new_token_ids
            if ids:
                req_ids.append(out.request_id)
                if len(ids) == 1:
                    tokens.append(ids[0])
                else:
                    tokens.extend(ids)
                    single = False
                counts.append(len(ids))
            if _has_details(out):
                details.append(msgspec.structs.replace(out, new_token_ids=[]) if ids else out)
        return OutputBatch(
            req_ids=req_ids,
            token_ids=np.array(tokens, dtype=np.int32) if tokens else None,
            token_counts=None if single else np.array(counts, dtype=np.int32),
            details=details, timestamp=timestamp, scheduler_stats=scheduler_stats,
            engine_index=engine_index)

    @property
    def num_tokens(self) -> int:
        return 0 if self.token_ids is None else len(self.token_ids)

    def token_lists(self) -> list[list[int]]:
        """Each row's new tokens (allocates: for tests and the offline path)."""
        if self.token_ids is None:
            return [[] for _ in self.req_ids]
        flat = self.token_ids.tolist()
        if self.token_counts is None:
            return [[t] for t in flat]
        out, start = [], 0
        for n in self.token_counts.tolist():
            out.append(flat[start:start + n])
            start += n
        return out

    def unpack(self) -> list[EngineCoreOutput]:
        """One ``EngineCoreOutput`` per request again, tokens and details merged (rows first,
        then the requests with details only)."""
        details = {d.request_id: d for d in self.details}
        outs = []
        for rid, ids in zip(self.req_ids, self.token_lists()):
            d = details.pop(rid, None)
            outs.append(EngineCoreOutput(rid, ids) if d is None
                        else msgspec.structs.replace(d, new_token_ids=ids))
        outs.extend(details.values())
        return outs


# --- EngineCore -> workers -------------------------------------------------------------------


class NewRequestData(msgspec.Struct, **_WIRE):
    """A request the worker has not seen (or must rebuild, after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]  # KV group 0's block table
    num_computed_tokens: int
    # Prompt logprobs already delivered for positions below this (a resumed request skips them).
    prompt_logprobs_from: int = 0
    # The block tables of KV groups 1.. (``kv_groups``); empty with one group (not on the wire).
    group_block_ids: list[list[int]] = []
    # The LoRA adapter it runs with; None: the base model.
    lora_request: LoRARequest | None = None


class CachedRequestData(msgspec.Struct, **_WIRE):
    """Requests the worker already holds: only what changed (parallel lists, one entry each,
    except the block lists: most steps give new blocks to few requests)."""

    req_ids: list[str] = []
    num_computed_tokens: list[int] = []
    # New blocks, sparse: request ``req_ids[new_block_index[k]]`` gained ``new_block_ids[k]``.
    new_block_index: list[int] = []
    new_block_ids: list[list[int]] = []
    # Only with pipeline parallelism (stages that do not sample never see the sampled tokens):
    # tokens sampled since the request was last scheduled; they end at the last position
    # scheduled this step. Empty lists otherwise.
    new_token_ids: list[list[int]] = []
    # Several KV groups only (empty, and not on the wire, with one): parallel to
    # ``new_block_ids``, the new entries of groups 1.. (``new_block_ids`` holds group 0's).
    new_group_block_ids: list[list[list[int]]] = []


class SchedulerOutput(msgspec.Struct, **_WIRE):
    step_id: int
    new_reqs: list[NewRequestData] = []
    cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # Tokens to compute this step (at least 1), one entry per request in batch order: the
    # cached requests first (as in ``cached_reqs.req_ids``), then the new ones (``new_reqs``).
    num_scheduled_tokens: list[int] = []
    total_num_scheduled_tokens: int = 0
    # The worker drops these (finished, aborted or preempted since the last step).
    finished_req_ids: list[str] = []
    # Structured outputs: the requests that sample under a grammar this step, and row i of the
    # bitmask (int32 [len, ceil(vocab / 32)], bit t of word w allows token 32 w + t) is the
    # next-token mask of grammar_req_ids[i] (engine_core/structured_output).
    grammar_req_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding: the draft tokens each request verifies this step (it was scheduled
    # 1 + len(drafts) tokens: its last sampled token, then the drafts as inputs).
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Whether the workers propose drafts after this step: not while the off-switch would not
    # schedule them next step (e.g. above its batch size), when proposing is pure cost.
    propose_drafts: bool = True
    # Async scheduling with a draft model / EAGLE-3 / MTP head: this step was scheduled before
    # the step before it came back, and that step verified drafts. The computed counts of its
    # requests then assume every one of those drafts accepted (the workers step each back by
    # the drafts that step rejected, which they know), and a draft list of -1s stands for the
    # drafts the workers proposed after that step (they still hold them, on the device).
    spec_in_flight: bool = False
    # KV connector only: its scheduler side's ``KVConnectorMetadata`` for this step, msgpack
    # bytes the worker side decodes as its ``metadata_type`` (engine_core/kv_transfer).
    kv_connector_metadata: bytes = b""
    # Expert parallelism across data-parallel engines (worker/layers/moe_ep): the largest
    # decode batch over the engines this step, when every engine runs a decode batch (agreed
    # before the step, engine_core/dp_lockstep); each then replays the CUDA graph of the size
    # that batch pads to, the exchange of that many rows per engine inside. 0: every engine
    # runs this step eagerly, exchanging its real token count.
    dp_graph_batch: int = 0

    @property
    def req_ids(self) -> list[str]:
        """The scheduled requests in batch order (parallel to ``num_scheduled_tokens``)."""
        ids = self.cached_reqs.req_ids
        return ids + [r.req_id for r in self.new_reqs] if self.new_reqs else list(ids)

    def scheduled(self) -> dict[str, int]:
        """req_id -> tokens to compute this step, in batch order."""
        return dict(zip(self.req_ids, self.num_scheduled_tokens))


class ModelRunnerOutput(msgspec.Struct, **_WIRE):
    req_ids: list[str] = []  # requests that sampled this step, in batch order
    sampled_token_ids: list[list[int]] = []
    logprobs: LogprobsArrays | None = None  # one row per sampled token, same order
    prompt_logprobs: dict[str, tuple[int, LogprobsArrays]] = {}  # req_id -> (start, arrays)
    failed: dict[str, str] = {}  # req_id -> why; those requests finish with ERROR
    pooled: dict[str, np.ndarray] = {}  # embedding models: req_id -> vector
    # Speculative decoding: the drafts proposed for each request's next step, parallel to
    # ``req_ids`` (empty when speculation is off).
    spec_token_ids: list[list[int]] = []
    # KV connector only: requests whose asynchronous KV sends / loads finished since the last
    # step (the worker side's ``get_finished``).
    kv_finished_sending: list[str] = []
    kv_finished_recving: list[str] = []
    # KV connector only: pool blocks a synchronous load failed to fill this step; the scheduler
    # drops the outputs of the requests holding them and recomputes those requests.
    kv_invalid_block_ids: list[int] = []
    # MoE models: each expert's routings (tokens x top-k, summed over the MoE layers) since
    # the previous output that carried them (worker/layers/expert_load); empty: none.
    expert_load: list[int] = []



# --- frontend ⇄ EngineCore process: envelopes -------------------------------------------------
#
# Every message on a frontend⇄EngineCore socket is one member of a tagged union, so the receiver
# dispatches on the decoded type (never on a method name) and a frame of the wrong kind fails to
# decode instead of being misread. See ``core_proc`` for the sockets that carry them.

# Bumped whenever an envelope changes shape; the handshake refuses a mismatched peer.
PROTOCOL_VERSION = 11  # 3: EngineCoreOutput.queued_ts/scheduled_ts, SchedulerStats.iteration_tokens
# (and Heartbeat.steps); 4: SchedulerStats.kv_cache_usage_groups; 5: SchedulerStats.grammar_*
# and structured_requests; 6: SamplingParams.thinking_token_budget and reasoning_first,
# StructuredOutputsParams.structural_tag and backend (an older engine would drop them unseen);
# 7: SchedulerStats.grammar_compile_backends and structured_request_backends; 8:
# SchedulerStats.spec_* (speculative decoding counters) and EngineConfig.speculative; 9:
# EngineCoreRequest.lora_request, EngineConfig.lora and the LoRA control calls; 10:
# SchedulerStats.kv_connector_* and EngineConfig.kv_transfer, EngineCoreRequest and
# EngineCoreOutput.kv_transfer_params; 11: SchedulerStats.moe_expert_load and moe_ep_ranks


class Hello(msgspec.Struct, tag="hello", **_WIRE):
    """Frontend -> engine (handshake socket): where the engine should connect to reach it."""

    input_address: str  # the frontend's ROUTER; the engine connects a DEALER to it
    output_address: str  # the frontend's PULL; the engine connects a PUSH to it
    pid: int = 0
    protocol_version: int = PROTOCOL_VERSION


class Ready(msgspec.Struct, tag="ready", **_WIRE):
    """Engine -> frontend (handshake socket): the engine is serving this frontend."""

    engine_identity: bytes  # the engine DEALER's identity on the frontend's ROUTER
    client_index: int  # this frontend's index on the engine (outputs are routed by it)
    config: EngineConfig  # resolved: KV blocks known, max_model_len final
    engine_pid: int = 0
    heartbeat_interval_s: float = 0.0  # the engine sends at least one message this often


class HandshakeFailed(msgspec.Struct, tag="failed", **_WIRE):
    """Engine -> frontend (handshake socket): start-up failed or the HELLO was refused."""

    error: str


HandshakeMessage = Hello | Ready | HandshakeFailed


class EngineRegister(msgspec.Struct, tag="register", **_WIRE):
    """Engine -> frontend, once, on the input socket: until it arrives the frontend's ROUTER
    cannot route to the engine (its identity is not known yet)."""

    engine_identity: bytes


class AddRequests(msgspec.Struct, tag="add", **_WIRE):
    """New requests, in order: a frontend sends what it admitted in one event-loop turn at
    once (a burst of arrivals is one message, not one per request)."""

    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", **_WIRE):
    request_ids: list[str]


class ControlRequest(msgspec.Struct, tag="control", **_WIRE):
    call_id: int
    call: ControlCall


class Goodbye(msgspec.Struct, tag="bye", **_WIRE):
    """The frontend is leaving: the engine aborts its requests and forgets it."""


FrontendMessage = AddRequests | AbortRequests | ControlRequest | Goodbye


class CoreOutputs(msgspec.Struct, tag="out", **_WIRE):
    outputs: OutputBatch


class ControlResponse(msgspec.Struct, tag="control", **_WIRE):
    call_id: int
    result: ControlResult = None
    error: str | None = None


class Heartbeat(msgspec.Struct, tag="hb", **_WIRE):
    """Sent when nothing else was for a while, so a remote frontend can tell "idle" from "dead"."""

    # Engine steps finished so far: a frontend whose requests wait (behind other frontends'
    # work, or through prefill chunks that output nothing) sees progress, not a stall.
    steps: int = 0


class EngineDead(msgspec.Struct, tag="dead", **_WIRE):
    """The engine is going away (a fatal error or a shutdown); the reason says which."""

    reason: str


EngineMessage = CoreOutputs | ControlResponse | Heartbeat | EngineDead
