"""Start-up warm-up: before the engine says it is ready, run once every kernel specialisation and
first-use cost that serving will meet, through the worker's real step path.

Why. Triton compiles a kernel per specialisation (constexprs, pointer dtypes, whether each
pointer is 16-byte aligned, whether each integer argument is 1 or divisible by 16), and the
first step to meet one stalls the whole batch for the compile. The profiling run and the graph
capture meet only some: profiling runs one request on fresh tensors, while serving reads the
step buffers' views (the sequence lengths sit at an offset that need not be 16-byte aligned), mixes
decodes with prefills (the attention plan's tile sizes follow the longest query; the request
count is an integer argument), and samples with kernels the graphs never contain (batch-1 LM
head GEMV, the few-row argmax). Torch kernels load lazily on first launch, and profiling ends
with ``empty_cache``, so the first wide sampling batch would grow the allocator again.

How. The worker feeds its own ``execute_model`` fake ``SchedulerOutput``s of dummy requests
(ids ``__warmup-N``) whose KV blocks are free blocks (nothing is cached at start-up, so writing
into them is harmless), as the EngineCore would: new requests (a pretend prefix hit where a row
needs context), chunked prefills, cached requests, decodes launched while the previous step is
still in flight (async scheduling), then it finishes them all, resolves every pending output,
and restores the RNG states, so serving starts exactly as without a warm-up. Every rank runs the
same steps in the same order (they follow from the config, the KV block count and the GPU
model), so tensor-parallel collectives and pipeline sends pair up as in serving.

What runs:
1. sampling rounds: one greedy request alone (LM-head GEMV and argmax of one row, a step
   where nothing samples); a batch with every sampling feature (greedy,
   temperature with top-k/top-p/min-p, seeded, logprobs with the most top-logprobs, prompt
   logprobs, penalties, logit_bias, min_tokens bans, a chunked prompt finishing next to decodes,
   a prefix hit); a temperature-only batch (the all-random path: the one-pass draw), its
   decodes under grammar masks that allow every token (the same draw reading masks: every
   row's, then all rows' but the first).
2. wide sampling (GPU): the largest decode batch, greedy and then with truncation and
   logprobs, so the allocator holds the sampler's peak and the wide kernels are loaded.
3. attention launches (GPU, Triton or CUDA attention): one mixed step per distinct launch of the
   attention kernels (plan for the longest query, request-count class, token-count class; for
   the CUDA backend also the decode rows' count mod 4, which sets the alignment of the metadata
   slices its Triton half reads), and one decode step per distinct launch of decode batches
   that run eagerly (above the largest captured graph, or no graphs at all).

Not covered, by design: penalties on the widest batch (a [batch, vocab] count table that the
KV budget did not reserve; penalised batches grow the allocator when they come), kernels that
depend on context length (none: launches depend on shapes only, see ``ops.attention_plan``).
On a CPU nothing is compiled just in time, so only two steps of the every-feature batch run
there, with prompts of a few tokens (they keep the warm-up path itself tested on every machine).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal.engine_core.protocol import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tidal.engine_core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.worker.model_runner import ModelRunner
    from tidal.worker.worker import Worker

logger = logging.getLogger(__name__)

WARMUP_ID_PREFIX = "__warmup-"
# Largest query length the attention-launch scan looks at: the Triton plan's tile stops growing
# at 128 rows (query positions x heads per KV head), so every launch shows up below this.
_SCAN_QUERY_LEN = 160
# Request counts per step the mixed-step scan combines: 1, divisible by 16, neither.
_SCAN_PREFILL_ROWS = (1, 2, 3, 15, 16, 17, 31, 32, 33)


def _int_class(v: int) -> int:
    """How Triton specialises an integer argument: equal to 1, divisible by 16, or neither."""
    return 1 if v == 1 else 16 if v % 16 == 0 else 0


@dataclass(slots=True)
class WarmupReport:
    steps: int = 0
    sampling_steps: int = 0
    wide_steps: int = 0
    attention_steps: int = 0
    moe_calls: int = 0
    skipped: str = ""  # why parts did not run, for the log

    def describe(self) -> str:
        parts = [f"{self.steps} steps: {self.sampling_steps} sampling, {self.wide_steps} wide, "
                 f"{self.attention_steps} attention-launch"]
        if self.moe_calls:
            parts.append(f"{self.moe_calls} MoE-layer launch-config calls")
        if self.skipped:
            parts.append(self.skipped)
        return "; ".join(parts)


@dataclass(slots=True)
class _Dummy:
    req_id: str
    prompt: list[int]
    params: SamplingParams
    blocks: list[int]
    computed: int  # tokens computed so far (the scheduler's count)
    tokens: int  # prompt + sampled tokens the worker holds
    new: bool = True  # not yet sent to the worker


class _ToyScheduler:
    """Dummy requests, free KV blocks, and the ``SchedulerOutput``s that drive them: what the
    real scheduler would send for the same requests."""

    def __init__(self, num_blocks: int, block_size: int, vocab_size: int,
                 forward_tokens: bool) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        # Pipeline stages that do not sample learn sampled tokens from the scheduler.
        self.forward_tokens = forward_tokens
        self._free = list(range(num_blocks - 1, -1, -1))
        self._finished: list[str] = []
        self._ids = itertools.count()
        self._steps = itertools.count()
        self.live: dict[str, _Dummy] = {}
        self.num_kv_groups = 1

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, prompt_len: int, params: SamplingParams, computed: int = 0) -> _Dummy:
        """A request of ``prompt_len`` tokens, the first ``computed`` of them a pretend prefix
        hit (their KV is whatever the free blocks hold: harmless for timing)."""
        n = next(self._ids)
        prompt = [(17 + 31 * i + 101 * n) % self.vocab_size for i in range(prompt_len)]
        d = _Dummy(f"{WARMUP_ID_PREFIX}{n}", prompt, params, [], computed, prompt_len)
        self.live[d.req_id] = d
        return d

    def _grow(self, d: _Dummy, tokens: int) -> list[int]:
        need = self.blocks_for(tokens) - len(d.blocks)
        if need > len(self._free):
            raise RuntimeError("warm-up ran out of KV blocks (the plan checks this first)")
        new = [self._free.pop() for _ in range(max(0, need))]
        d.blocks.extend(new)
        return new

    def step(self, sched: list[tuple[_Dummy, int]]) -> SchedulerOutput:
        """One step computing ``n`` tokens of each listed request; cached requests go first,
        as the scheduler orders them."""
        order = [x for x in sched if not x[0].new] + [x for x in sched if x[0].new]
        cr = CachedRequestData()
        new_reqs: list[NewRequestData] = []
        for d, n in order:
            if d.computed + n > d.tokens:
                raise ValueError(f"{d.req_id}: {n} tokens scheduled past its end")
            added = self._grow(d, d.computed + n)
            if d.new:
                new_reqs.append(NewRequestData(
                    d.req_id, list(d.prompt), [], d.params, list(d.blocks), d.computed,
                    group_block_ids=[list(d.blocks)] * (self.num_kv_groups - 1)))
                continue
            if added:
                cr.new_block_index.append(len(cr.req_ids))
                cr.new_block_ids.append(added)
                if self.num_kv_groups > 1:
                    cr.new_group_block_ids.append([added] * (self.num_kv_groups - 1))
            cr.req_ids.append(d.req_id)
            cr.num_computed_tokens.append(d.computed)
            if self.forward_tokens:
                sampled = max(0, d.computed + n - max(d.computed, len(d.prompt)))
                cr.new_token_ids.append([1 % self.vocab_size] * sampled)
        num = [n for _, n in order]
        so = SchedulerOutput(step_id=next(self._steps), new_reqs=new_reqs, cached_reqs=cr,
                             num_scheduled_tokens=num, total_num_scheduled_tokens=sum(num),
                             finished_req_ids=self._finished)
        self._finished = []
        for d, n in order:
            d.new = False
            d.computed += n
            if d.computed >= d.tokens:  # reached its end: the worker samples one token
                d.tokens += 1
        return so

    def finish(self, dummies: list[_Dummy]) -> None:
        for d in dummies:
            if self.live.pop(d.req_id, None) is not None:
                self._free.extend(reversed(d.blocks))
                self._finished.append(d.req_id)

    def finish_all(self) -> SchedulerOutput:
        """The step that drops every remaining request (no tokens)."""
        self.finish(list(self.live.values()))
        so = SchedulerOutput(step_id=next(self._steps), finished_req_ids=self._finished)
        self._finished = []
        return so


class _Driver:
    """Runs steps on the worker the way the EngineCore does: with async scheduling a step's
    output is collected only after the next step was launched."""

    def __init__(self, worker: Worker, toy: _ToyScheduler) -> None:
        self.worker = worker
        self.toy = toy
        self.pending: Any = None
        self.steps = 0

    def run(self, sched: list[tuple[_Dummy, int]], mask_from: int | None = None) -> None:
        so = self.toy.step(sched)
        if mask_from is not None:  # requests under a grammar mask allowing every token
            ids = (list(so.cached_reqs.req_ids) + [r.req_id for r in so.new_reqs])[mask_from:]
            so.grammar_req_ids = ids
            so.grammar_bitmask = np.full((len(ids), (self.toy.vocab_size + 31) // 32), -1,
                                         dtype=np.int32)
        self.launch(so)

    def launch(self, so: SchedulerOutput) -> None:
        out = self.worker.execute_model(so)
        self.steps += 1
        prev, self.pending = self.pending, None
        if hasattr(out, "get_output"):
            self.pending = out
        elif out is not None:
            self._check(out)
        if prev is not None:
            self._check(prev.get_output())

    def flush(self) -> None:
        prev, self.pending = self.pending, None
        if prev is not None:
            self._check(prev.get_output())

    def _check(self, out: ModelRunnerOutput) -> None:
        if out.failed:
            raise RuntimeError(f"warm-up step failed: {out.failed}")
        vocab = self.toy.vocab_size
        for ids in out.sampled_token_ids:
            if not all(0 <= t < vocab for t in ids):
                raise RuntimeError(f"warm-up sampled a token outside the vocabulary: {ids}")


class Warmup:
    """Plans and runs the warm-up of one worker (see the module docstring)."""

    def __init__(self, worker: Worker, num_blocks: int, full: bool | None = None,
                 attention: str | None = None) -> None:
        """``full``: run the GPU parts (default: on a GPU); ``attention``: plan the launches of
        this attention backend (default: the runner's). Tests override both to drive the GPU
        plan through a CPU runner."""
        runner: ModelRunner = worker.runner  # type: ignore[assignment]
        self.worker = worker
        self.runner = runner
        cfg = runner.config
        self.on_gpu = runner.on_gpu if full is None else full
        self.attention = attention or runner.attn_impl.name
        self.budget = cfg.scheduler.max_num_batched_tokens
        self.max_reqs = cfg.scheduler.max_num_seqs
        self.max_len = cfg.model.max_model_len
        self.block_size = runner.block_size
        self.vocab = runner.vocab_size
        self.max_logprobs = cfg.runner.max_logprobs
        pp = worker.pp
        self.toy = _ToyScheduler(num_blocks, self.block_size, self.vocab,
                                 forward_tokens=pp is not None and pp.world_size > 1)
        # Several KV groups: every group's table gets the same blocks (timing only).
        self.toy.num_kv_groups = getattr(runner, "num_kv_groups", 1)
        self.driver = _Driver(worker, self.toy)
        self.report = WarmupReport()
        self._plans: dict[int, Any] = {}  # longest query -> mixed attention plan

    # --- running ------------------------------------------------------------------------------

    def run(self) -> WarmupReport:
        cpu_rng = torch.get_rng_state()
        dev = self.runner.device
        gpu_rng = torch.cuda.get_rng_state(dev) if self.runner.on_gpu else None
        try:
            self._sampling_rounds()
            if self.on_gpu:
                self._wide_rounds()
                self._moe_configs()
                # Mixed steps above the largest mixed graph run eagerly, with launch variants
                # the graphs' capture did not compile: warm those up with the graphs aside.
                self.runner.mixed_graphs_on = False
                try:
                    self._attention_steps()
                finally:
                    self.runner.mixed_graphs_on = True
            else:
                self.report.skipped = "CPU: nothing is compiled just in time, so only a " \
                                      "small sampling round ran"
            self.driver.launch(self.toy.finish_all())
            self.driver.flush()
        finally:
            # Serving must draw the same random numbers as an engine that never warmed up.
            torch.set_rng_state(cpu_rng)
            if gpu_rng is not None:
                torch.cuda.set_rng_state(gpu_rng, dev)
        self.runner.finish_inflight()
        left = [r for r in self.runner.batch.row_of if r.startswith(WARMUP_ID_PREFIX)]
        if left:
            raise RuntimeError(f"warm-up left {len(left)} request(s) behind")
        self.runner.forget_steps()
        if self.runner.on_gpu:
            torch.cuda.synchronize(dev)
        self.report.steps = self.driver.steps
        return self.report

    def _fits(self, rows: int, tokens: int, blocks: int) -> bool:
        return (rows <= self.max_reqs and tokens <= self.budget
                and blocks <= self.toy.free_blocks)

    # --- 1. sampling rounds -------------------------------------------------------------------

    def _round(self, reqs: list[tuple[int, int, SamplingParams]], decodes: int,
               chunked: bool, masked: bool = False) -> int:
        """Requests ``(prompt length, prefix hit, params)`` computed in one step (the first one,
        if ``chunked``, only halfway: it finishes its prompt next to the others' first decode),
        then ``decodes`` decode steps (``masked``: under grammar masks, every row's on the
        first, all but the first row's after), then finished. Returns the steps run (0: did
        not fit)."""
        room = self.max_len - decodes - 2
        reqs = [(min(n, room), min(c, max(0, min(n, room) - 1)), p) for n, c, p in reqs]
        while reqs:
            # The whole prompt work bounds both steps it is split over.
            tokens = sum(n - c for n, c, _ in reqs)
            blocks = sum(self.toy.blocks_for(n + decodes + 1) for n, _, _ in reqs)
            if self._fits(len(reqs), tokens, blocks) and room >= 2:
                break
            reqs = reqs[:-1]
        if not reqs:
            return 0
        dummies = [self.toy.add(n, p, c) for n, c, p in reqs]
        todo = {d.req_id: len(d.prompt) - d.computed for d in dummies}
        if chunked:
            todo[dummies[0].req_id] = max(1, todo[dummies[0].req_id] // 2)
        steps = 0
        self.driver.run([(d, todo[d.req_id]) for d in dummies])
        steps += 1
        for i in range(decodes):
            # Each request computes what it lacks: a decode (1 token) or the rest of its prompt.
            self.driver.run([(d, d.tokens - d.computed) for d in dummies],
                            min(i, 1) if masked else None)
            steps += 1
        self.toy.finish(dummies)
        return steps

    def _sampling_rounds(self) -> None:
        if not self.on_gpu:
            # Nothing to compile: one prefill step and one decode step of tiny prompts keep
            # every sampling feature's path exercised (and tested) at a few steps' cost.
            self.report.sampling_steps = self._round(self._every_feature(tiny=True),
                                                     decodes=1, chunked=True)
            return
        greedy = SamplingParams(temperature=0.0)
        # One greedy request, its prompt in two chunks: a step where nothing samples, then the
        # one-row LM head and argmax; then one-row decodes.
        n = self._round([(self.block_size + 5, 0, greedy)], decodes=2, chunked=True)
        n += self._round(self._every_feature(tiny=False), decodes=2, chunked=True)
        # The all-random path (no sort, no extras); no penalised row either, so with async
        # scheduling the decodes take their inputs from the previous step's device tokens:
        # some rows (next to a prompt's last chunk), then every row in the same order.
        plain = SamplingParams(temperature=1.0)
        n += self._round([(17, 0, plain), (5, 0, plain), (11, 0, plain)], decodes=2,
                         chunked=True, masked=True)
        self.report.sampling_steps = n

    def _every_feature(self, tiny: bool) -> list[tuple[int, int, SamplingParams]]:
        """(prompt length, prefix hit, params) of a batch using every sampling feature; the
        first request's prompt is the one chunked. ``tiny``: prompts of a few tokens."""
        V, bs = self.vocab, self.block_size
        top = min(20, self.max_logprobs)
        stop = min(3, V - 1)
        chunked, hit = (4, 1) if tiny else (2 * bs + 3, bs)
        short = (lambda n: 2 + n % 2) if tiny else (lambda n: n)
        return [
            (chunked, 0, SamplingParams(temperature=0.0)),  # finishes next to decodes
            (short(5), 0, SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)),
            (short(7), 0, SamplingParams(temperature=1.0, seed=1234)),
            (short(9), 0, SamplingParams(temperature=0.7, logprobs=top)),
            (2 * hit + 1, hit, SamplingParams(temperature=0.0, prompt_logprobs=min(5, top))),
            (short(6), 0, SamplingParams(temperature=1.0, presence_penalty=0.5,
                                         frequency_penalty=0.5, repetition_penalty=1.2)),
            (short(4), 0, SamplingParams(temperature=1.0,
                                         logit_bias={0: 2.0, min(5, V - 1): -3.0})),
            (short(3), 0, SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[stop])),
            (short(8), 0, SamplingParams(temperature=0.0, logprobs=0)),
        ]

    # --- 2. wide sampling ---------------------------------------------------------------------

    def _wide_rounds(self) -> None:
        """The widest decode batch, greedy and then with truncation and logprobs (a step of
        one decode token per request: a pretend prefix of a block less one token)."""
        ctx = max(1, self.block_size - 1)
        rows = min(self.max_reqs, self.budget, self.toy.free_blocks)
        if rows < 2 or ctx + 2 > self.max_len:
            return
        top = min(20, self.max_logprobs)
        n = 0
        for params in (SamplingParams(temperature=0.0),
                       SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05,
                                      logprobs=top)):
            dummies = [self.toy.add(ctx + 1, params, ctx) for _ in range(rows)]
            self.driver.run([(d, 1) for d in dummies])
            self.toy.finish(dummies)
            n += 1
        self.report.wide_steps = n

    def _moe_configs(self) -> None:
        """Every MoE launch config a step within the token budget can pick (``moe_configs``
        chooses one per token-count bucket), through one layer of each expert shape: whole
        steps warm up only the token counts they happen to run, and a bucket first met while
        serving compiled for about a second (DeepSeek-V2-Lite on an H100)."""
        from tidal.worker.layers.fused_moe import FusedMoE
        from tidal.worker.ops.moe_configs import M_BUCKETS

        model = self.runner.model
        if model is None:
            return
        seen: set[tuple] = set()
        dev, dtype = self.runner.device, self.runner.dtype
        for mod in model.modules():
            if not isinstance(mod, FusedMoE):
                continue
            key = (mod.num_experts, mod.hidden_size, mod.shard_size, mod.routing,
                   mod.w13.dtype)
            if key in seen:
                continue
            seen.add(key)
            with torch.inference_mode():
                for m in M_BUCKETS:
                    if m > self.budget:
                        break
                    mod(torch.randn(m, mod.hidden_size, device=dev, dtype=dtype),
                        torch.randn(m, mod.num_experts, device=dev, dtype=dtype))
                    self.report.moe_calls += 1

    # --- 3. attention launches ----------------------------------------------------------------

    def _attention_steps(self) -> None:
        impl = self.attention
        if impl not in ("triton", "cuda"):
            self.report.skipped = f"{impl} attention: no attention kernel is compiled"
            return
        shapes, sizes = self.mixed_shapes(impl), self.eager_decode_sizes(impl)
        logger.debug("warm-up: %s attention, mixed steps (decode rows, prompts, prompt "
                     "length) %s, eager decode batches %s", impl, shapes, sizes)
        for decodes, prefills, q in shapes:
            self._mixed_step(decodes, prefills, q)
        for rows in sizes:
            self._mixed_step(rows, 0, 1)
        self.report.attention_steps = len(shapes) + len(sizes)

    def _mixed_step(self, decodes: int, prefills: int, q: int) -> None:
        """One step of ``decodes`` one-token rows with context, then ``prefills`` prompts of
        ``q`` tokens; everything finished after it."""
        ctx = max(1, min(self.block_size // 2, self.max_len - 2))
        dummies = [self.toy.add(ctx + 1, SamplingParams(temperature=0.0), ctx)
                   for _ in range(decodes)]
        dummies += [self.toy.add(q, SamplingParams(temperature=0.0)) for _ in range(prefills)]
        self.driver.run([(d, d.tokens - d.computed) for d in dummies])
        self.toy.finish(dummies)

    def _layer_shape(self) -> tuple[int, int, int]:
        assert self.runner.model is not None
        layer = self.runner.model.attention_layers()[0]
        return layer.num_heads, layer.num_kv_heads, layer.head_dim

    def _triton_key(self, num_tokens: int, num_reqs: int, max_q: int) -> tuple:
        """What a Triton attention launch specialises on: its plan (tile sizes, warps, stages,
        splits; not the grid), and the Triton class of its integer arguments."""
        from tidal.worker.ops.attention_plan import plan_triton_attention

        heads, kv_heads, head_dim = self._layer_shape()
        plan = plan_triton_attention(num_tokens, num_reqs, max_q, heads, kv_heads, head_dim,
                                     self.runner.dtype, self.runner.device,
                                     kv_dtype=self.runner.kv_dtype)
        return (dataclasses.replace(plan, grid0=0), _int_class(num_reqs),
                _int_class(plan.num_splits))

    def mixed_key(self, impl: str, decodes: int, prefills: int, q: int) -> Hashable:
        """The attention launches of a step of ``decodes`` one-token rows then ``prefills`` rows
        whose longest query is ``q`` (> 1) tokens, as far as kernel specialisation goes (plus
        the token count's class, in case a kernel specialises on it)."""
        plan = self._plans.get(q)
        if plan is None:  # mixed plans depend on the longest query only (not the grid)
            plan = self._plans[q] = self._triton_key(q, 1, q)[0]
        tokens = decodes + prefills * q
        if impl == "cuda":
            # Its decode kernel is prebuilt; its Triton half gets the prompt rows, with the
            # metadata sliced past the decode rows (pointer alignment follows decodes % 4).
            return (plan, _int_class(prefills), tokens % 16 == 0, decodes % 4)
        return (plan, _int_class(decodes + prefills), tokens % 16 == 0)

    def decode_key(self, impl: str, rows: int) -> Hashable:
        """The attention launches of an eager decode step of ``rows`` requests."""
        if impl == "cuda":  # the prebuilt decode kernel; only the one-row path differs
            return (rows == 1,)
        return self._triton_key(rows, rows, 1)

    def mixed_shapes(self, impl: str) -> list[tuple[int, int, int]]:
        """(decode rows, prompt rows, prompt length) of the cheapest mixed step for each
        distinct ``mixed_key``. Longer prompts and more rows than scanned add no key: the
        plan's tile stops growing below ``_SCAN_QUERY_LEN`` and a row count's class repeats."""
        ctx_blocks = self.toy.blocks_for(max(1, self.block_size // 2) + 1)
        q_hi = min(_SCAN_QUERY_LEN, self.budget, self.max_len - 2)
        decode_rows = range(0, 20)  # every class of row and token counts, mod 4 and 16
        best: dict[Hashable, tuple[int, tuple[int, int, int]]] = {}
        for q in range(2, q_hi + 1):
            for decodes in decode_rows:
                for prefills in _SCAN_PREFILL_ROWS:
                    rows = decodes + prefills
                    tokens = decodes + prefills * q
                    blocks = decodes * ctx_blocks + prefills * self.toy.blocks_for(q)
                    if not self._fits(rows, tokens, blocks):
                        continue
                    key = self.mixed_key(impl, decodes, prefills, q)
                    if key not in best or tokens < best[key][0]:
                        best[key] = (tokens, (decodes, prefills, q))
        return sorted(shape for _, shape in best.values())

    def eager_decode_sizes(self, impl: str) -> list[int]:
        """Decode batch sizes, one per distinct ``decode_key``, among those that run eagerly
        (no captured graph of that size or larger)."""
        graphs = self.runner.graphs
        ctx_blocks = self.toy.blocks_for(max(1, self.block_size // 2) + 1)
        best: dict[Hashable, int] = {}
        for rows in range(1, self.max_reqs + 1):
            if graphs is not None and graphs.size_for(rows) is not None:
                continue
            if not self._fits(rows, rows, rows * ctx_blocks):
                break
            best.setdefault(self.decode_key(impl, rows), rows)
        return sorted(best.values())


def warm_up(worker: Worker, num_blocks: int) -> WarmupReport:
    """Run the warm-up on ``worker`` (its KV cache allocated, its graphs captured)."""
    from tidal.worker.model_runner import ModelRunner

    if not isinstance(worker.runner, ModelRunner):
        return WarmupReport(skipped="embedding model: its encoder runs torch kernels only, "
                                    "nothing to compile")
    # Stages on different devices (--pp-devices) must run the same steps, or their pipeline
    # sends would not pair up: each runs the CPU's short plan (a GPU stage's first requests
    # then compile its kernels). Tensor ranks on different devices (--tp-devices) likewise,
    # or their all-reduces would not pair up.
    par = worker.config.parallel
    full = False if par.pp_devices or par.tp_devices else None
    return Warmup(worker, num_blocks, full=full).run()
