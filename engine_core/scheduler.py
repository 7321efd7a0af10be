"""Token-budget scheduler: no prefill or decode phases.

Every request has ``num_computed_tokens`` and ``num_tokens``; each step hands out at most
``max_num_batched_tokens`` tokens so the first catches up with the second. Running requests are
served first (in admission order), then waiting ones are admitted first-come first-served.
A prompt longer than the remaining budget is split across steps (chunked prefill). When the KV
pool runs dry, the newest running request is preempted: its blocks are freed and it is later
recomputed from scratch (its already generated tokens become part of what it recomputes).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable

import msgspec

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.hybrid_kv_cache_manager import HybridKVCacheManager
from tidal.engine_core.kv_cache_manager import KVCacheManager
from tidal.engine_core.kv_transfer.connector_base import KVConnectorRole
from tidal.engine_core.kv_transfer.connector_registry import create_connector
from tidal.engine_core.kv_transfer.load_recovery import drop_outputs
from tidal.engine_core.protocol import (
    CachedRequestData,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    add_per_pos,
)
from tidal.engine_core.request import Request, RequestStatus
from tidal.engine_core.spec_off_switch import SpecOffSwitch

logger = logging.getLogger(__name__)


class Scheduler:
    # Schedule plain decodes through ``_schedule_decodes`` (tests turn it off to compare).
    decode_fast_path = True

    def __init__(self, config: EngineConfig) -> None:
        if config.cache.num_blocks is None:
            raise ValueError("the scheduler needs the resolved number of KV blocks")
        self.config = config
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.token_budget = config.scheduler.max_num_batched_tokens
        self.chunked_prefill = config.scheduler.enable_chunked_prefill
        self.max_model_len = config.model.max_model_len
        layout = config.kv_layout()
        # Several KV groups (sliding-window layers): per-group block tables over one pool; its
        # allocations come back as one list of new entries per group.
        self.hybrid_kv = layout.hybrid
        self.kv: KVCacheManager | HybridKVCacheManager
        if layout.hybrid:
            self.kv = HybridKVCacheManager(
                layout, config.cache.num_blocks, config.cache.block_size,
                config.cache.enable_prefix_caching, config.cache.prefix_hash_seed)
        else:
            self.kv = KVCacheManager(
                config.cache.num_blocks, config.cache.block_size,
                config.cache.enable_prefix_caching, config.cache.prefix_hash_seed,
            )
        logger.info("KV cache layout: %s", layout.describe())
        # KV connector (engine_core/kv_transfer), None when off: every hook below is one
        # ``is None`` test then. Its evicted-block hook goes on the pool only if it asks.
        self.connector = create_connector(config, KVConnectorRole.SCHEDULER)
        if self.connector is not None and self.connector.wants_evictions:
            self.kv.pool.on_evict = self.connector.on_block_evicted
        if self.connector is not None and self.connector.wants_cached_blocks:
            self.kv.pool.on_cache = self.connector.on_block_cached
        # Finished requests whose blocks stay held until the workers report their KV sent.
        self._kv_held: dict[str, Request] = {}
        # Live requests whose send the workers reported finished before the request finished
        # here (a send timeout shorter than a step, async scheduling): not held when they end.
        self._kv_sent_early: set[str] = set()
        # Asynchronous KV loads: requests waiting for theirs (blocks allocated, not
        # scheduled; also aborted ones, whose blocks the pull still writes), and requests whose
        # load is over -> their computed tokens (they are admitted from the queue again).
        self._kv_recving: dict[str, Request] = {}
        self._kv_loaded: dict[str, int] = {}
        # Parked requests -> when their load is given up (``_expire_kv_loads``); the connector's
        # per-load timeout times the loads queued ahead (they run one after another).
        self._kv_deadline: dict[str, float] = {}
        self._kv_load_timeout = None if self.connector is None \
            else self.connector.async_load_timeout_s
        # Requests the connector's admission answer failed -> why (``take_kv_rejected``).
        self._kv_rejected: dict[str, str] = {}
        # An empty step message of the connector: such a step sends b"" (workers skip it).
        self._kv_empty_meta = b"" if self.connector is None else msgspec.msgpack.encode(
            self.connector.metadata_type())
        # Requests restarted after a failed KV load -> the last step whose outputs of them are
        # garbage (launched before the failure was known): dropped (``_recover_failed_loads``).
        self._kv_discard: dict[str, int] = {}
        for i, group in enumerate(layout.groups):
            logger.debug("KV group %d: %s, layers %s", i, group.kind, list(group.layers))
        # Steps may be scheduled before earlier ones return (async scheduling, pipeline
        # parallelism). Async scheduling lets a request decode on a token still being sampled
        # (the worker fills it in); otherwise a request waits for its in-flight step.
        self.async_scheduling = config.scheduler.async_scheduling
        # Whether a constrained request may be scheduled while its last token is in flight:
        # only where the EngineCore fills its mask after that token arrives, before the step
        # samples (an executor with deferred sampling); else it sits out that step.
        self.grammar_in_flight_ok = False
        self.forward_tokens = config.parallel.pipeline_parallel_size > 1
        # With M pipeline stages up to M steps are in flight, and a request sits out while its
        # own step is: cap each step at 1/M of the sequences so every stage gets a share.
        self.max_reqs_per_step = max(1, self.max_num_seqs // config.parallel.pipeline_parallel_size)
        # Distinct LoRA adapters a running batch may hold (0: LoRA off).
        self.max_loras = config.lora.max_loras if config.lora is not None else 0
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Dropped since the last step; the workers are told to forget them.
        self._finished_ids: list[str] = []
        self._step_id = 0
        self._num_preemptions = 0
        self._prompt_tokens_step = 0
        self._generation_tokens_step = 0
        self._step_tokens: list[int] = []  # tokens scheduled by each step since the last report
        # Scheduled for the first time, first token not out yet: that output carries the
        # request's queue and schedule times (for the frontend's phase metrics).
        self._awaiting_first: dict[str, Request] = {}
        # Speculative decoding: the drafts the workers proposed for each request's next step
        # (dropped on preemption), and the acceptance counters since the last report.
        self._drafts: dict[str, list[int]] = {}
        k = config.speculative.num_speculative_tokens if config.speculative else 0
        self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
        self._spec_per_pos = [0] * k
        # MoE models: each expert's routings since the last report (the workers count them),
        # and the expert-parallel ranks the experts split over (1: none).
        self._expert_load: list[int] = []
        par = config.parallel
        self._ep_ranks = (par.data_parallel_size * par.tensor_parallel_size
                          if par.enable_expert_parallel else 1)
        # Per step, whether the drafts at hand are worth verifying (batch size, acceptance).
        self.spec_off: SpecOffSwitch | None = None
        self._proposed_last = True  # whether the workers proposed drafts after the last step
        # The id of the last step scheduled if it verified drafts and is not back yet; the id
        # of the last step scheduled while it is not back.
        self._verifying_step: int | None = None
        self._unseen_step: int | None = None
        # Async scheduling with drafts kept on the device (a model drafter, or the n-gram lookup
        # there): a request whose step is still in flight is scheduled again with placeholder
        # drafts (-1s) for what the workers propose after it, so speculative steps pipeline
        # like plain ones (``SchedulerOutput.spec_in_flight``).
        # (N-gram drafts looked up on the host, from the emitted tokens: those steps wait.)
        spec = config.speculative
        # (Not with sliding-window layers: their blocks below the window are freed by the
        # computed count, which would run ahead of what the step in flight still reads.)
        self.async_spec = bool(config.scheduler.async_scheduling and spec is not None
                               and spec.drafts_on_device and not self.hybrid_kv)
        self._k = spec.num_speculative_tokens if spec is not None else 0
        # N-gram lookups find drafts or not, request by request: placeholders for as many as
        # the request's last proposal seen had (the workers pad a shorter one).
        self._proposed_len: dict[str, int] | None = (
            {} if self.async_spec and spec is not None and spec.method == "ngram" else None)
        if config.speculative is not None:
            self.spec_off = SpecOffSwitch.from_config(config.speculative)
            logger.info("speculative decoding off-switch: %s", self.spec_off.describe())

    # --- intake -----------------------------------------------------------------------------

    def id_in_use(self, request_id: str) -> bool:
        """Whether ``add_request`` would refuse this id (a live request, or a finished one
        whose KV transfer is not over)."""
        return (request_id in self.requests or request_id in self._kv_recving
                or request_id in self._kv_held)

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if rid in self._kv_recving or rid in self._kv_held:
            # Its blocks (and a pull's report) are keyed by the id: a new request under it
            # would inherit them.
            raise ValueError(f"request id {rid!r} is still in use: the KV transfer of a "
                             "finished request with that id is not over yet")
        # Its one length limit: max_tokens or the model's context, whichever comes first.
        request.length_limit = min(request.length_limit, self.max_model_len)
        request.queued_ts = time.monotonic()
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], reason: FinishReason) -> list[Request]:
        """Finish requests from outside the step loop (aborts, stop strings). Unknown ids are
        ignored: the request may have finished on its own meanwhile."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif rid not in self._kv_recving:
                self.waiting.remove(req)
            req.finish(reason)
            self._release(req)
            done.append(req)
        return done

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        if self._kv_deadline:
            self._expire_kv_loads()
        budget = self.token_budget
        cached = CachedRequestData()
        # Tokens per scheduled request, in batch order (the cached requests, then new ones).
        num_scheduled: list[int] = []
        new_reqs: list[NewRequestData] = []
        preempted_now = False
        now = 0.0  # taken once, at the first request scheduled for the first time

        # Hot loop (every running request, every step): locals instead of attribute lookups,
        # the pending-token count inlined, and each request's counters advanced as soon as it is
        # scheduled (a request scheduled earlier in this loop is never a preemption victim:
        # victims come from the end of ``running``, past the current index).
        running = self.running
        allocate = self.kv.allocate_slots
        noop_limit = self.kv.noop_limit
        c_ids, c_computed = cached.req_ids, cached.num_computed_tokens
        c_block_index, c_block_ids = cached.new_block_index, cached.new_block_ids
        forward = self.forward_tokens
        async_ok = self.async_scheduling
        prompt_tokens = 0
        cap = self.max_reqs_per_step
        i = 0
        drafts_of = self._drafts
        spec_off = self.spec_off
        # Drafts the workers propose after the step in flight (if it proposes), for requests
        # scheduled again before it is back: placeholders.
        ahead = (self.async_spec and self._proposed_last
                 and self._unseen_step == self._step_id - 1)
        if spec_off is not None and (drafts_of or not self._proposed_last or ahead) \
                and not spec_off.decide(len(running)):
            # Not worth verifying this step: plain decodes (the fast path included). (A step
            # after one that proposed nothing decides too: the off-switch counts it, and its
            # probes come round.)
            drafts_of.clear()
            ahead = False
        spec_tokens: dict[str, list[int]] = {}
        # (Requests with drafts take the general loop: they compute more than one token.)
        if self.decode_fast_path and not forward and not drafts_of and not ahead \
                and min(budget, cap) >= len(running):
            i, prompt_tokens = self._schedule_decodes(cached, num_scheduled)
            budget -= len(num_scheduled)
        # The general loop: from the first request the fast path left (or the first of all).
        while i < len(running) and budget > 0 and len(num_scheduled) < cap:
            req = running[i]
            i += 1
            n_tokens = len(req.all_token_ids)
            placeholders = req.num_placeholders
            if placeholders and (
                not async_ok  # its next input token is still being sampled
                # its grammar mask needs that token first
                or (req.structured and not self.grammar_in_flight_ok)
                # stop once the token in flight surely reaches the length limit (drafts in
                # flight may be rejected: a step ahead then still has tokens to emit)
                or n_tokens + min(placeholders, 1) >= req.length_limit
            ):
                continue
            computed = req.num_computed_tokens
            num_new = n_tokens + placeholders - computed
            if req.grammar_wait:
                num_new = min(num_new, n_tokens - 1 - computed)  # nothing sampled yet
            if num_new <= 0:
                continue
            if num_new > budget:
                num_new = budget
            rid = req.request_id
            drafts = None
            if placeholders:
                if ahead and num_new == 1:
                    n = self._drafts_ahead(req, n_tokens + placeholders, budget)
                    if n:
                        drafts = [-1] * n
                        num_new += n
            elif drafts_of and num_new == 1 and rid in drafts_of:
                # A decode with drafts verifies them too: its last token and the drafts are
                # this step's inputs, so never more drafts than its row (max_model_len) or the
                # budget leave room for. Its max_tokens does not cut them: what it emits past
                # that is dropped (``_append_tokens``), and every request verifying k drafts
                # keeps the step uniform, which the proposer replays as one graph.
                drafts = drafts_of.pop(rid)
                room = min(self.max_model_len - n_tokens - 1, budget - 1)
                if len(drafts) > room:
                    drafts = drafts[:max(room, 0)]
                num_new += len(drafts)
            # Most steps the request's blocks suffice and allocate_slots would be a no-op.
            if computed + num_new > noop_limit.get(rid, -1):
                new_blocks = allocate(req, num_new)
                if new_blocks is None and drafts:
                    # Short of blocks: verify no drafts rather than preempt anyone for them.
                    drafts, num_new = None, 1
                    new_blocks = allocate(req, num_new)
                while new_blocks is None:
                    if num_new > 1 and self.hybrid_kv and running[-1] is req:
                        # Nothing left to preempt but itself: a sliding-window group needs
                        # fewer blocks for a shorter chunk (its window moves on meanwhile).
                        num_new //= 2
                        new_blocks = allocate(req, num_new)
                        continue
                    victim = running.pop()
                    self._preempt(victim)
                    preempted_now = True
                    if victim is req:
                        break
                    new_blocks = allocate(req, num_new)
                if new_blocks is None:
                    break  # ``req`` itself was preempted; everything after it too
                if new_blocks:
                    c_block_index.append(len(c_ids))
                    c_block_ids.append(new_blocks)
            c_ids.append(rid)
            c_computed.append(computed)
            num_scheduled.append(num_new)
            if drafts:
                spec_tokens[rid] = drafts
            if forward:
                cached.new_token_ids.append(req.all_token_ids[req.num_tokens_sent:])
                req.num_tokens_sent = n_tokens
            budget -= num_new
            # What the post-scheduling pass below does for admitted requests.
            n_prompt = req.num_prompt_tokens
            if computed < n_prompt:
                prompt_tokens += min(n_prompt - computed, num_new)
            computed += num_new
            req.num_computed_tokens = computed
            if drafts:
                # Up to 1 + len(drafts) tokens come out of this step: placeholders for all
                # (``_verified`` takes back the drafts' share).
                req.num_placeholders = placeholders + 1 + len(drafts)
            elif computed >= n_tokens + placeholders:
                req.num_placeholders = placeholders + 1

        # LoRA: the running batch holds at most max_loras distinct adapters (the workers'
        # device slots); a request whose adapter would exceed that is passed over this step
        # and keeps its place in the queue (the base model needs no slot).
        max_loras = self.max_loras
        if max_loras:
            active_loras = {r.lora_int_id for r in self.running if r.lora_request is not None}
            # Requests parked for an asynchronous KV load hold their adapter's slot too.
            active_loras.update(r.lora_int_id for r in self._kv_recving.values()
                                if r.lora_request is not None and not r.is_finished)
        # Passed over this step, keeping their places: an adapter over the limit, or a grammar
        # still compiling with nothing to prefill before its last token.
        skipped: list[Request] = []
        # Admitting while preempting would only thrash: the pool is already short. Requests
        # parked for an asynchronous KV load count as sequences (each is admitted once loaded).
        while (
            self.waiting
            and budget > 0
            and not preempted_now
            and len(self.running) + len(self._kv_recving) < self.max_num_seqs
            and len(num_scheduled) < cap
        ):
            req = self.waiting[0]
            if req.num_placeholders:
                break  # preempted with a step in flight: resume once its token is known
            if req.grammar_wait and (self.connector is not None or req.num_tokens < 2):
                # (A KV connector's lookups are not repeated for it: it waits for its grammar.)
                skipped.append(self.waiting.popleft())
                continue
            if max_loras and req.lora_request is not None:
                lora_id = req.lora_int_id
                if lora_id not in active_loras:
                    if len(active_loras) >= max_loras:
                        skipped.append(self.waiting.popleft())
                        continue
                    active_loras.add(lora_id)
            loaded = self._kv_loaded.get(req.request_id) if self._kv_loaded else None
            if loaded is not None:
                # Its asynchronous KV load is over: blocks allocated, loaded tokens computed.
                hits, num_hit, num_ext = [], loaded, 0
            else:
                hits = self.kv.get_computed_blocks(req)
                num_hit = len(hits) * self.kv.block_size
                # Tokens past the local hit that the KV connector loads instead (computed too).
                num_ext, load_async = (0, False) if self.connector is None \
                    else self._external_tokens(req, num_hit)
                if num_ext < 0:  # the connector's answer is unusable: that request fails alone
                    self._fail_admission(self.waiting.popleft())
                    continue
                if load_async:
                    if not self._start_async_load(req, hits, num_hit, num_ext):
                        break  # no room for its blocks yet
                    continue
            remaining = req.num_tokens - num_hit - num_ext
            if req.grammar_wait:
                remaining -= 1  # all but its last token until its grammar is compiled
                if remaining <= 0:
                    skipped.append(self.waiting.popleft())
                    continue
            if not self.chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            req.num_computed_tokens = num_hit + num_ext
            ok = self.kv.allocate_slots(req, num_new, hits) is not None
            while not ok and self.hybrid_kv and not self.running and num_new > 1:
                # Alone, it would wait forever: a shorter chunk needs fewer sliding-window
                # blocks (the config guarantees one token of a lone request always fits).
                num_new //= 2
                ok = self.kv.allocate_slots(req, num_new, hits) is not None
            if not ok:
                req.num_computed_tokens = 0
                break
            if loaded is not None:
                del self._kv_loaded[req.request_id]
            else:
                self.kv.record_lookup(req, num_hit)
            if self.connector is not None and loaded is None:
                self.connector.update_state_after_alloc(
                    req, self.kv.block_ids(req.request_id), num_ext)
                num_hit += num_ext  # a hit as far as the request's cached tokens go
            self.waiting.popleft()
            if not req.scheduled_ts:
                if not now:
                    now = time.monotonic()
                req.scheduled_ts = now
                self._awaiting_first[req.request_id] = req
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            req.num_tokens_sent = req.num_tokens
            self.running.append(req)
            new_reqs.append(
                NewRequestData(
                    req_id=req.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids if resumed else [],
                    sampling_params=req.sampling_params,
                    block_ids=self.kv.block_ids(req.request_id),
                    group_block_ids=self.kv.group_block_ids(req.request_id),
                    num_computed_tokens=req.num_computed_tokens,
                    prompt_logprobs_from=req.prompt_logprobs_sent,
                    lora_request=req.lora_request,
                )
            )
            num_scheduled.append(num_new)
            budget -= num_new
        if skipped:
            self.waiting.extendleft(reversed(skipped))

        if self.hybrid_kv and c_block_ids:
            # Each entry holds every group's new entries: group 0's go where one group's do.
            cached.new_group_block_ids = [e[1:] for e in c_block_ids]
            cached.new_block_ids = [e[0] for e in c_block_ids]
        total = self.token_budget - budget
        out = SchedulerOutput(
            step_id=self._step_id,
            new_reqs=new_reqs,
            cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_ids if total else [],
            scheduled_spec_decode_tokens=spec_tokens,
            propose_drafts=spec_off is None or spec_off.wants_drafts(len(running)),
            spec_in_flight=self._verifying_step == self._step_id - 1,
        )
        if not total:
            return out  # nothing runs; the workers learn of finished requests next time
        if self.connector is not None:
            self._attach_connector_meta(out)
        self._proposed_last = out.propose_drafts
        self._verifying_step = self._step_id if spec_tokens else None
        self._unseen_step = self._step_id
        self._finished_ids = []
        self._step_id += 1
        self._step_tokens.append(total)
        # Computed counts advance when scheduled, so the next step can be planned before this
        # one's results are back; a request that reaches its end samples a token this step.
        # (Running requests were advanced in the loop above; these are the admitted ones.)
        for new, n in zip(new_reqs, num_scheduled[len(c_ids):]):
            req = self.requests[new.req_id]
            prompt_tokens += max(0, min(req.num_prompt_tokens - req.num_computed_tokens, n))
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens + req.num_placeholders:
                req.num_placeholders += 1
        self._prompt_tokens_step = prompt_tokens
        return out

    def _schedule_decodes(self, cached: CachedRequestData,
                          num_scheduled: list[int]) -> tuple[int, int]:
        """Decode fast path: the leading running requests that take exactly one token each (a
        decode batch's steady state), scheduled exactly as the general loop in ``schedule``
        would, with less work per request. The caller guarantees the budget and the request cap
        cover every running request. Stops at the first request that needs the general loop (a
        prompt chunk, nothing to compute, a preemption); returns (running requests consumed,
        prompt tokens scheduled)."""
        running = self.running
        noop_limit = self.kv.noop_limit
        allocate = self.kv.allocate_slots
        async_ok = self.async_scheduling
        c_ids, c_computed = cached.req_ids, cached.num_computed_tokens
        c_block_index, c_block_ids = cached.new_block_index, cached.new_block_ids
        skipped = prompt_tokens = 0
        for req in running:
            n_tokens = len(req.all_token_ids)
            placeholders = req.num_placeholders
            if placeholders and (not async_ok
                                 or (req.structured and not self.grammar_in_flight_ok)
                                 or n_tokens + min(placeholders, 1) >= req.length_limit):
                skipped += 1  # as in the general loop: its tokens in flight come first
                continue
            computed = req.num_computed_tokens
            if req.grammar_wait and computed >= n_tokens - 1:
                skipped += 1  # prefilled up to its last token: it samples once compiled
                continue
            if n_tokens + placeholders - computed != 1:
                break
            rid = req.request_id
            if computed >= noop_limit[rid]:  # a running request always has a limit
                new_blocks = allocate(req, 1)
                if new_blocks is None:
                    break  # the general loop preempts (a failed allocation changed nothing)
                if new_blocks:
                    c_block_index.append(len(c_ids))
                    c_block_ids.append(new_blocks)
            c_ids.append(rid)
            c_computed.append(computed)
            if computed < req.num_prompt_tokens:
                prompt_tokens += 1
            req.num_computed_tokens = computed + 1
            # computed + 1 == n_tokens + placeholders: this step samples its next token.
            req.num_placeholders = placeholders + 1
        num_scheduled.extend([1] * len(c_ids))
        return len(c_ids) + skipped, prompt_tokens

    def _drafts_ahead(self, req: Request, max_tokens: int, budget: int) -> int:
        """Placeholder drafts for ``req``, scheduled while its step is in flight (at most
        ``max_tokens`` tokens once that step is back). Never more than the workers propose
        after that step, whatever it accepts: they propose ``k`` for a request with room left
        in its row and whose later positions sample as its first does (no penalties, which
        count earlier outputs; min_tokens reached, which bans stop tokens at some positions
        only): the same tests, on the fewest tokens the step can emit (one)."""
        sp = req.sampling_params
        if (sp.presence_penalty or sp.frequency_penalty or sp.repetition_penalty != 1.0
                or len(req.all_token_ids) - req.num_prompt_tokens + 1 < sp.min_tokens):
            return 0
        # (As for drafts at hand: max_model_len bounds them, not the request's max_tokens.)
        room = min(self.max_model_len - max_tokens - 1, budget - 1)
        n = max(0, min(self._k, room))
        if self._proposed_len is not None:
            n = min(n, self._proposed_len.get(req.request_id, n))
        return n

    @property
    def drafts(self) -> dict[str, list[int]]:
        """The drafts the workers proposed for each request's next step (verified when it is
        scheduled); the EngineCore trims those of constrained requests to what their grammar
        allows."""
        return self._drafts

    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if result.kv_invalid_block_ids or self._kv_discard:
            result = self._recover_failed_loads(sched, result)
        if self.connector is not None and (result.kv_finished_sending
                                           or result.kv_finished_recving):
            self._connector_output(result)
        if sched.step_id == self._unseen_step and sched.total_num_scheduled_tokens:
            self._unseen_step = None
        if sched.scheduled_spec_decode_tokens:
            self._verified(sched.scheduled_spec_decode_tokens, result)
            if sched.step_id == self._verifying_step:
                self._verifying_step = None
        if result.expert_load:
            self._expert_load = add_per_pos(self._expert_load, result.expert_load)
        if result.logprobs is None and not result.prompt_logprobs:
            self._generation_tokens_step += self._apply_plain_tokens(result, outputs)
        else:
            self._generation_tokens_step += self._apply_tokens(result, outputs)

        if result.prompt_logprobs:
            sampled = set(result.req_ids)
            for rid in result.prompt_logprobs:
                req = self.requests.get(rid)
                if req is None or req.is_finished or rid in sampled:
                    continue
                out = EngineCoreOutput(request_id=rid)
                self._attach_prompt_logprobs(req, result, out)
                if out.new_prompt_logprobs is not None:
                    outputs.append(out)

        for rid, vector in result.pooled.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            req.finish(FinishReason.STOP)
            out = EngineCoreOutput(request_id=rid, pooled=vector)
            self._finish_output(req, out)
            outputs.append(out)

        for rid, message in result.failed.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            logger.warning("request %s failed in the worker: %s", rid, message)
            req.finish(FinishReason.ERROR)
            out = EngineCoreOutput(request_id=rid, error=message)
            self._finish_output(req, out)
            outputs.append(out)
        if result.spec_token_ids:
            requests = self.requests
            lengths = self._proposed_len
            for rid, drafts in zip(result.req_ids, result.spec_token_ids):
                req = requests.get(rid)
                if lengths is not None and req is not None and not req.is_finished:
                    lengths[rid] = len(drafts)
                # (Not for a request scheduled again meanwhile: that step took placeholders
                # for these drafts, and brings its own.)
                if drafts and req is not None and req.status == RequestStatus.RUNNING \
                        and not req.num_placeholders:
                    self._drafts[rid] = drafts
        return outputs

    def _verified(self, spec: dict[str, list[int]], result: ModelRunnerOutput) -> None:
        """A step verified drafts: each request's KV is valid through its accepted drafts
        only, so its computed count steps back over the rejected ones (their slots are
        written again next step); and the acceptance counters."""
        emitted = dict(zip(result.req_ids, result.sampled_token_ids))
        per_pos = self._spec_per_pos
        spec_off = self.spec_off
        lengths = self._proposed_len
        for rid, drafts in spec.items():
            tokens = emitted.get(rid)
            req = self.requests.get(rid)
            if tokens is None or req is None:
                continue  # failed, or aborted while the step ran
            accepted = len(tokens) - 1
            # (The tokens that come out go on to take their one placeholder each step.)
            req.num_placeholders = max(req.num_placeholders - len(drafts), 0)
            if req.status == RequestStatus.RUNNING:  # (preempted: recomputed from 0)
                req.num_computed_tokens -= len(drafts) - accepted
            # The counters count proposed drafts only: placeholders past a shorter n-gram
            # lookup were padding (its length reached us with the step before's output), and
            # a pad that happens to match the target's token is no accepted draft.
            proposed = len(drafts)
            if lengths is not None and drafts[0] < 0:
                proposed = min(proposed, lengths.get(rid, proposed))
            hits = min(accepted, proposed)
            self._spec_drafts += proposed > 0
            self._spec_draft_tokens += proposed
            self._spec_accepted += hits
            for i in range(min(hits, len(per_pos))):
                per_pos[i] += 1
            if spec_off is not None:
                spec_off.observe(proposed, hits)

    def _apply_plain_tokens(self, result: ModelRunnerOutput,
                            outputs: list[EngineCoreOutput]) -> int:
        """The sampled tokens of a step without logprobs (every decode step, as a rule): one
        output per request, built as cheaply as possible. Returns the number of new tokens."""
        requests = self.requests
        max_len = self.max_model_len
        finished = RequestStatus.FINISHED
        awaiting = self._awaiting_first
        generated = 0
        for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
            req = requests.get(rid)
            if req is None or req.status is finished:
                continue  # aborted while the step ran
            if req.num_placeholders:
                req.num_placeholders -= 1
            # (Taken before a finish here releases the request.)
            first = awaiting.pop(rid, None) if awaiting else None
            if len(tokens) != 1:
                # Several tokens (speculative decoding): those up to the first that ends it.
                out = EngineCoreOutput(rid, self._append_tokens(req, tokens))
                generated += len(out.new_token_ids)
                if req.status is finished:
                    self._finish_output(req, out)
            else:
                token = tokens[0]
                all_ids = req.all_token_ids
                all_ids.append(token)
                # The runner's one-token list goes out as is (nothing mutates either).
                out = EngineCoreOutput(rid, tokens)
                generated += 1
                # ``check_stop`` only when it could stop the request: a stop token (before
                # min_tokens and ignore_eos are weighed) or the length limit reached.
                if (token in req.stop_candidates or len(all_ids) >= req.length_limit) \
                        and req.check_stop(token, max_len):
                    self._finish_output(req, out)
            if first is not None:
                _first_output(first, out)
            outputs.append(out)
        return generated

    def _apply_tokens(self, result: ModelRunnerOutput, outputs: list[EngineCoreOutput]) -> int:
        """The sampled tokens of a step, with their logprobs and prompt logprobs."""
        logprobs = result.logprobs
        has_prompt_lp = bool(result.prompt_logprobs)
        requests = self.requests
        finished = RequestStatus.FINISHED
        awaiting = self._awaiting_first
        generated = 0
        row = 0  # the request's first logprobs row: one row per sampled token, in order
        for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
            start = row
            row += len(tokens)
            req = requests.get(rid)
            if req is None or req.status is finished:
                continue  # aborted while the step ran
            if req.num_placeholders:
                req.num_placeholders -= 1
            first = awaiting.pop(rid, None) if awaiting else None
            accepted = self._append_tokens(req, tokens)
            generated += len(accepted)
            out = EngineCoreOutput(request_id=rid, new_token_ids=accepted)
            if logprobs is not None:
                out.new_logprobs = logprobs.slice(start, start + len(accepted))
            if has_prompt_lp:
                self._attach_prompt_logprobs(req, result, out)
            if first is not None:
                _first_output(first, out)
            if req.status is finished:
                self._finish_output(req, out)
            outputs.append(out)
        return generated

    def _append_tokens(self, req: Request, tokens: list[int]) -> list[int]:
        """Append sampled tokens up to the first that finishes the request; returns those."""
        max_len = self.max_model_len
        accepted = []
        for token in tokens:
            req.append_token(token)
            accepted.append(token)
            if req.check_stop(token, max_len):
                break
        return accepted

    def make_stats(self, num_generation_tokens: int | None = None) -> SchedulerStats:
        """Stats since the previous call. ``num_generation_tokens``: by default the tokens that
        ``update_from_output`` appended meanwhile."""
        if num_generation_tokens is None:
            num_generation_tokens = self._generation_tokens_step
        queries, hits = self.kv.take_stats()
        stats = SchedulerStats(
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_running=len(self.running),
            num_waiting=len(self.waiting) + sum(not r.is_finished
                                                for r in self._kv_recving.values()),
            kv_cache_usage=self.kv.usage,
            num_preemptions=self._num_preemptions,
            num_prompt_tokens=self._prompt_tokens_step,
            num_generation_tokens=num_generation_tokens,
            iteration_tokens=self._step_tokens,
            kv_cache_usage_groups=self.kv.group_usage() if self.hybrid_kv else [],
        )
        if self._spec_drafts:
            stats.spec_num_drafts = self._spec_drafts
            stats.spec_num_draft_tokens = self._spec_draft_tokens
            stats.spec_num_accepted_tokens = self._spec_accepted
            stats.spec_accepted_per_pos = self._spec_per_pos
            self._spec_drafts = self._spec_draft_tokens = self._spec_accepted = 0
            self._spec_per_pos = [0] * len(self._spec_per_pos)
        if self.spec_off is not None:
            stats.spec_off_steps_batch_size, stats.spec_off_steps_acceptance = \
                self.spec_off.take_counts()
        if self._expert_load:
            stats.moe_expert_load, stats.moe_ep_ranks = self._expert_load, self._ep_ranks
            self._expert_load = []
        if self.connector is not None:
            kv_stats = self.connector.take_stats()
            if kv_stats is not None:
                stats.kv_connector_queries = kv_stats.queries
                stats.kv_connector_hits = kv_stats.hits
                stats.kv_connector_stores = kv_stats.stores
        self._num_preemptions = 0
        self._prompt_tokens_step = 0
        self._generation_tokens_step = 0
        self._step_tokens = []
        return stats

    # --- internals --------------------------------------------------------------------------

    def _attach_prompt_logprobs(
        self, req: Request, result: ModelRunnerOutput, out: EngineCoreOutput
    ) -> None:
        chunk = result.prompt_logprobs.get(req.request_id)
        if chunk is None:
            return
        start, arrays = chunk
        skip = max(0, req.prompt_logprobs_sent - start)
        n = len(arrays.ranks)
        if skip >= n:
            return
        out.new_prompt_logprobs = arrays.slice(skip, n) if skip else arrays
        out.prompt_logprobs_start = start + skip
        req.prompt_logprobs_sent = start + n

    def _finish_output(self, req: Request, out: EngineCoreOutput) -> None:
        out.finish_reason = req.finish_reason
        out.stop_reason = req.stop_reason
        out.num_cached_tokens = max(req.num_cached_tokens, 0)
        # By membership, not status: ``req`` is FINISHED already, also when it was preempted
        # with a step in flight and that step's token finished it (it waits then).
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req, out)

    def _release(self, req: Request, out: EngineCoreOutput | None = None) -> None:
        if self.connector is None or not self._connector_holds(req, out):
            self.kv.free(req)
        if self._drafts:
            self._drafts.pop(req.request_id, None)
        if self._proposed_len:
            self._proposed_len.pop(req.request_id, None)
        if self._awaiting_first:
            self._awaiting_first.pop(req.request_id, None)
        if self._kv_loaded:
            self._kv_loaded.pop(req.request_id, None)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # --- KV connector -----------------------------------------------------------------------

    def _external_tokens(self, req: Request, num_hit: int) -> tuple[int, bool]:
        """Tokens of ``req`` past its local prefix hit that the connector loads, and whether
        the load is asynchronous; (-1, False) when the answer is unusable."""
        assert self.connector is not None
        name = type(self.connector).__name__
        num_ext, load_async = self.connector.get_num_new_matched_tokens(req, num_hit)
        bs = self.kv.block_size
        if load_async and self.hybrid_kv:
            # (Not detectable at start-up: a connector decides per request.)
            why = (f"KV connector {name} asked for an asynchronous KV load: not yet supported "
                   "with several KV groups (sliding-window layers)")
        elif num_ext % bs or num_hit + num_ext >= req.num_tokens or num_ext < 0:
            why = (f"KV connector {name} matched {num_ext} tokens past {num_hit}: not whole "
                   f"blocks of {bs} leaving one of the request's {req.num_tokens} tokens")
        else:
            return num_ext, load_async and num_ext > 0
        self._kv_rejected[req.request_id] = why
        return -1, False

    def _start_async_load(self, req: Request, hits: list, num_hit: int, num_ext: int) -> bool:
        """Admit ``req`` (the queue's head) for an asynchronous KV load: blocks for its local
        hit and the loaded tokens, kept out of the prefix cache until filled (no other request
        may hit them mid-pull). It waits in ``_kv_recving``, scheduled nowhere, until the
        workers report the load over (``_kv_load_done``). False: no room yet.

        Its blocks cover the whole prompt, the last token's slot included: once loaded it
        needs no more to be admitted (a pool filled by parked requests would otherwise leave
        each waiting for one block, forever). A reserve of one block per running request is
        left free for their next decode step."""
        assert self.connector is not None
        kv = self.kv
        need = -(-req.num_tokens // kv.block_size) - len(hits)
        need += sum(1 for b in hits if b.ref_cnt == 0)  # unheld hits leave the free list too
        if need + len(self.running) > kv.num_free_blocks:
            return False
        req.num_computed_tokens = num_hit
        caching, kv.enable_caching = kv.enable_caching, False
        try:
            ok = kv.allocate_slots(req, req.num_tokens - num_hit, hits) is not None
        finally:
            kv.enable_caching = caching
        if not ok:
            req.num_computed_tokens = 0
            return False
        kv.record_lookup(req, num_hit)
        self.connector.update_state_after_alloc(req, kv.block_ids(req.request_id), num_ext)
        self.waiting.popleft()
        req.num_computed_tokens = num_hit + num_ext
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit + num_ext
        self._kv_recving[req.request_id] = req
        if self._kv_load_timeout is not None:
            self._kv_deadline[req.request_id] = (
                time.monotonic() + self._kv_load_timeout * len(self._kv_recving))
        return True

    def _expire_kv_loads(self) -> None:
        """Give up parked requests whose load outlived its deadline (a wedged pull): each
        fails with an error. Not recomputed: the pull may still write its blocks, so they
        stay held (like an aborted request's) until the workers report the load over."""
        now = time.monotonic()
        for rid, deadline in list(self._kv_deadline.items()):
            if now < deadline:
                continue
            del self._kv_deadline[rid]
            req = self._kv_recving.get(rid)
            if req is None or req.is_finished:
                continue
            why = "its KV load did not finish in time"
            logger.error("request %s failed: %s", rid, why)
            self._kv_rejected[rid] = why
            req.finish(FinishReason.ERROR)
            self._release(req)

    def _kv_load_done(self, req: Request, invalid: list[int]) -> None:
        """``req``'s asynchronous load is over: back to the queue's head, its loaded tokens
        computed, or (a block left unfilled) to recompute its prompt from scratch."""
        if req.is_finished:  # aborted while its pull ran: its blocks were held for the pull
            self.kv.free(req)
            return
        bad = set(invalid)
        if bad and any(b.block_id in bad for b in self.kv.req_blocks.get(req.request_id, ())):
            logger.warning("request %s: its KV load failed; computing its prompt here",
                           req.request_id)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.num_cached_tokens = -1  # counted when it is admitted anew
        else:
            self._kv_loaded[req.request_id] = req.num_computed_tokens
        self.waiting.appendleft(req)

    def _fail_admission(self, req: Request) -> None:
        """Finish ``req`` with an error before it ever runs (``take_kv_rejected`` reports it)."""
        why = self._kv_rejected[req.request_id]
        logger.error("request %s failed: %s", req.request_id, why)
        req.finish(FinishReason.ERROR)
        self._release(req)

    def take_kv_rejected(self) -> list[EngineCoreOutput]:
        """Outputs of requests the KV connector failed at admission (``_external_tokens``)."""
        rejected, self._kv_rejected = self._kv_rejected, {}
        return [EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=why)
                for rid, why in rejected.items()]

    @property
    def has_held_kv(self) -> bool:
        """Whether finished requests' blocks are held for a KV transfer, or requests wait for
        an asynchronous load (the workers must be polled for its end even when nothing else
        runs)."""
        return bool(self._kv_held or self._kv_recving)

    def _connector_holds(self, req: Request, out: EngineCoreOutput | None) -> bool:
        """Tell the connector ``req`` finished; True when it keeps the blocks until the
        workers report the request's KV sent (``_connector_output``)."""
        assert self.connector is not None
        delay, params = self.connector.request_finished(
            req, self.kv.block_ids(req.request_id))
        if params is not None and out is not None:
            out.kv_transfer_params = params
        rid = req.request_id
        if self._kv_recving and rid in self._kv_recving:
            return True  # its pull still writes the blocks: freed when it is reported over
        if self._kv_sent_early and rid in self._kv_sent_early:
            self._kv_sent_early.discard(rid)
            if delay:  # its send ended (timed out) before it finished here: nothing to wait for
                self.connector.update_connector_output([rid], [])
                return False
        if delay:
            self._kv_held[rid] = req
        return delay

    def _connector_output(self, result: ModelRunnerOutput) -> None:
        """The workers' finished transfers: sent requests' held blocks go back to the pool."""
        assert self.connector is not None
        for rid in result.kv_finished_sending:
            req = self._kv_held.pop(rid, None)
            if req is not None:
                self.kv.free(req)
            elif rid in self.requests:
                # Reported before the request finished here (its output is behind this one):
                # remembered, so its blocks are not held for a send that is over.
                self._kv_sent_early.add(rid)
        for rid in result.kv_finished_recving:
            req = self._kv_recving.pop(rid, None)
            if req is not None:
                if self._kv_deadline:
                    self._kv_deadline.pop(rid, None)
                self._kv_load_done(req, result.kv_invalid_block_ids)
        self.connector.update_connector_output(result.kv_finished_sending,
                                               result.kv_finished_recving)

    def kv_poll_output(self) -> SchedulerOutput | None:
        """An empty step for the connector's sake, or None when none is needed: while finished
        requests' blocks are held for a transfer, the workers must be asked now and then (their
        ``get_finished``) even when nothing is scheduled, or an idle engine (or one whose queue
        waits for those very blocks) would hold them for good."""
        if not (self._kv_held or self._kv_recving):
            return None
        assert self.connector is not None
        out = SchedulerOutput(step_id=self._step_id, finished_req_ids=self._finished_ids)
        self._finished_ids = []
        self._attach_connector_meta(out)
        return out

    def _attach_connector_meta(self, out: SchedulerOutput) -> None:
        """This step's connector metadata; left b"" when it is empty and nothing is held, so
        the workers make no connector call at all that step (the host tier with nothing to
        copy). While blocks are held the workers must be asked for finished sends: sent even
        when empty then."""
        assert self.connector is not None
        raw = msgspec.msgpack.encode(self.connector.build_connector_meta(out))
        if self._kv_held or self._kv_recving or raw != self._kv_empty_meta:
            out.kv_connector_metadata = raw

    def _recover_failed_loads(self, sched: SchedulerOutput,
                              result: ModelRunnerOutput) -> ModelRunnerOutput:
        """A synchronous KV load left blocks unfilled: every running request holding one ran
        on garbage. They start over (their blocks leave the prefix cache, they go back to the
        queue's head and recompute; the connector does not load them again), and their outputs
        of every step launched so far are dropped: late, never wrong."""
        invalid = set(result.kv_invalid_block_ids)
        if invalid:
            for block_id in invalid:
                # Not ``on_evict``: a host tier must not keep the garbage these blocks hold.
                self.kv.pool.drop_cached(block_id)
            last_launched = self._step_id - 1
            for req in [r for r in self.running
                        if any(b.block_id in invalid
                               for b in self.kv.req_blocks.get(r.request_id, ()))]:
                logger.warning("request %s: its KV load failed; recomputing it",
                               req.request_id)
                self.running.remove(req)
                self._preempt(req)
                self._num_preemptions -= 1  # a restart, not a preemption for lack of blocks
                req.num_placeholders = 0  # the tokens in flight are dropped, not awaited
                req.num_cached_tokens = -1  # counted again when it is admitted anew
                self._kv_discard[req.request_id] = last_launched
        drop = {rid for rid, last in self._kv_discard.items() if sched.step_id <= last}
        for rid, last in list(self._kv_discard.items()):
            if sched.step_id >= last:
                del self._kv_discard[rid]
        return drop_outputs(result, drop) if drop else result

    def _preempt(self, req: Request) -> None:
        logger.debug("preempting %s (%d tokens computed)", req.request_id, req.num_computed_tokens)
        self.kv.free(req)
        if self._drafts:
            self._drafts.pop(req.request_id, None)  # recomputed from scratch, drafts later
        if self._proposed_len:
            self._proposed_len.pop(req.request_id, None)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self._num_preemptions += 1
        self._finished_ids.append(req.request_id)
        self.waiting.appendleft(req)


def _first_output(req: Request, out: EngineCoreOutput) -> None:
    """Mark a request's first output with tokens: its prefix-cache hit and its queue and
    schedule times (the frontend turns them into per-request phase metrics)."""
    out.queued_ts = req.queued_ts
    out.scheduled_ts = req.scheduled_ts
    out.num_cached_tokens = max(req.num_cached_tokens, 0)
