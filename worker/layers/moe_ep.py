"""Expert parallelism for the MoE layers (``--enable-expert-parallel``, vLLM's semantics).

The experts of every MoE layer are split over the expert-parallel (EP) group, the DP x TP
workers: EP rank ``dp_rank * tp_size + tp_rank`` holds a contiguous range of ``E / ep_size``
whole experts (vLLM's default "linear" placement) instead of every expert's tensor-parallel
shard. Attention and the dense layers stay as they are (TP inside each DP engine); the router
is replicated.

A layer's forward on this rank:

1. dispatch: within one engine the tokens are already on every TP rank; across DP engines
   (``DPExpertGroup``) each rank all-gathers every engine's hidden states and router logits,
   padded to the step's largest token count (the counts are exchanged once per forward, at
   its first MoE layer, over gloo);
2. the rank's own experts run on all those tokens (``fused_moe`` with the ids of experts held
   elsewhere mapped to a sentinel the kernels skip, so a token's routed experts are the only
   weights read);
3. combine: a reduce-scatter over the DP engines gives each its tokens' sums, then the MoE
   layer's tensor-parallel all-reduce sums over the engine's TP ranks, as without EP.

With ``--all2all-backend alltoallv`` an eager step's layer runs differently: this rank routes
its own tokens first and sends each only to the engines whose worker of this tensor rank holds
one of its experts, with its weights and those experts' slots there (uneven all-to-alls, their
sizes agreed per layer in one small gloo all-reduce, so never inside a CUDA graph: the decode
graphs keep the gather); the partial sums come back by the reverse all-to-all and are added up
per token. It moves fewer rows where a token's experts often sit on one engine (few experts a
token, many engines) and pays a host round trip per layer.

Every DP rank must run every MoE layer's collectives in every step: a rank without tokens
joins with zero rows (``run_empty_step``, driven by the lockstep busy loop through an empty
step). The cross-engine exchange starts once the worker is ready (``activate``): start-up's
profile and warm-up forwards run on each engine alone, local experts only (their outputs are
thrown away).

Dual batch overlap (``--enable-dbo``, across engines only): a step of at least
``--dbo-token-threshold`` tokens over all engines splits each rank's tokens in two halves
inside every MoE layer; the second half's gather is in flight while the first's experts run,
and the first's reduce-scatter while the second's run (async collectives: NCCL's own stream,
gloo's threads). Attention is not split. Without a threshold given it is measured once the
engines meet (``calibrate_dbo``): the first MoE layer timed with and without the overlap at
step sizes 128, 256, ... tokens, every rank together; the overlap applies from the smallest
size from which it was at least ``DBO_MIN_GAIN`` times faster at every larger size measured
(two sizes at least), or nowhere, so it never runs where it measured slower. Router logits of another dtype than
the hidden states (DeepSeek-V2's float32 gate) travel in a second gather beside the first.

CUDA graphs (decode steps): once the engines meet, each captures its decode graphs with the
exchange inside (``static_exchange``: every rank holds the graph's full row count, padding
included, so no counts are exchanged and every gathered row is kept); the engines agree
before each step whether all of them replay the graph of one size (``SchedulerOutput.
dp_graph_batch``) or all run eagerly as above. Dual batch overlap applies inside the graphs
too, from the same threshold (the graph's rows over all engines, padding included): the two
micro-batches' collectives are captured on NCCL's stream beside the experts' work.

Memory: start-up's profile forward runs each engine alone, so the KV cache sizing reserves
what the exchange adds at the largest step (``exchange_headroom_bytes``): every engine's rows
gathered, and the experts' activations over all of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from tidal.engine_core.expert_parallel_config import ALL2ALL_BACKENDS
from tidal.worker.distributed.parallel_state import ParallelGroup

if TYPE_CHECKING:
    from tidal.worker.distributed.expert_parallel import DPExpertGroup
    from tidal.worker.layers.fused_moe import FusedMoE

logger = logging.getLogger(__name__)

_CURRENT: ContextVar[ExpertParallel | None] = ContextVar("tidal_expert_parallel", default=None)


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    """Which experts EP rank ``rank`` of ``size`` holds: a contiguous range."""

    rank: int
    size: int
    num_experts: int

    @property
    def experts(self) -> range:
        n = self.num_experts // self.size
        return range(self.rank * n, (self.rank + 1) * n)

    def describe(self) -> str:
        r = self.experts
        return f"experts {r.start}..{r.stop - 1} of {self.num_experts}, rank {self.rank}/{self.size}"


def place_experts(num_experts: int, rank: int, size: int) -> ExpertPlacement:
    """EP rank ``rank``'s experts; ``ValueError`` unless ``size`` divides ``num_experts``."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"expert-parallel rank {rank} of {size}")
    if num_experts % size:
        raise ValueError(f"{num_experts} experts do not split over {size} expert-parallel "
                         "ranks (the expert count must be a multiple of DP x TP)")
    return ExpertPlacement(rank, size, num_experts)


def local_expert_ids(ids: torch.Tensor, experts: range) -> torch.Tensor:
    """Global expert ids -> this rank's slots; experts held elsewhere become ``len(experts)``,
    the sentinel the fused-MoE kernels skip."""
    n = len(experts)
    local = ids - experts.start
    return torch.where((local >= 0) & (local < n), local, torch.full_like(local, n))


@dataclass(frozen=True, slots=True)
class Exchange:
    """The shape of one cross-engine exchange: this rank's token rows, the largest rank's
    (every rank's rows are padded to it), which gathered rows are tokens (None: all), where
    this rank's rows start among the gathered tokens (padding dropped), and where they start
    among this rank's rows of the step (the second micro-batch's are after the first's)."""

    tokens: int
    tmax: int
    valid: torch.Tensor | None
    offset: int = 0
    start: int = 0

    @staticmethod
    def of(counts: list[int], rank: int, device: torch.device, start: int = 0) -> Exchange:
        tmax = max(counts)
        valid = None
        if any(c != tmax for c in counts):
            valid = torch.cat([torch.arange(r * tmax, r * tmax + c)
                               for r, c in enumerate(counts)]).to(device)
        return Exchange(counts[rank], tmax, valid, sum(counts[:rank]), start)


def exchange_headroom_bytes(*, dp_size: int, tokens: int, hidden: int, num_experts: int,
                            top_k: int, intermediate: int, dtype_bytes: int,
                            logits_bytes: int) -> int:
    """Device bytes one MoE layer's cross-engine exchange needs beyond what a forward of
    ``tokens`` rows on this engine alone needs (what start-up's profile measures): the
    buffers of every engine's ``dp_size * tokens`` rows, and the experts' temporaries over the
    rows the profile did not have. One layer's worth: a layer's buffers go before the next.
    An upper bound (it adds up buffers that are not all alive at once)."""
    if dp_size <= 1 or tokens <= 0:
        return 0
    rows = dp_size * tokens  # every engine's tokens, each padded to the largest count
    extra = rows - tokens
    row = hidden * dtype_bytes + num_experts * logits_bytes
    # This rank's padded [hidden | logits] rows, the gathered rows, their unpadded copy, and
    # the hidden part made contiguous for the experts.
    dispatch = tokens * row + 2 * rows * row + rows * hidden * dtype_bytes
    # Routing of the extra rows: float32 scores (and the biased choice), top-k weights and ids.
    routing = extra * (2 * num_experts * 4 + top_k * 8)
    # The experts over the extra rows: per (token, expert) pair the gate/up and activation
    # rows and the float32 output row; per token the float32 sum and its cast.
    experts = extra * (top_k * (3 * intermediate * dtype_bytes + 4 * hidden)
                       + hidden * (4 + dtype_bytes))
    # Combine: the padded output of every engine's rows, and this rank's summed rows.
    combine = rows * hidden * dtype_bytes + tokens * hidden * dtype_bytes
    return dispatch + routing + experts + combine


def split_counts(counts: list[int]) -> tuple[list[int], list[int]]:
    """Each rank's tokens as two micro-batches (dual batch overlap): the first half rounded
    up, then the rest."""
    first = [(c + 1) // 2 for c in counts]
    return first, [c - f for c, f in zip(counts, first)]


# ``dbo_threshold`` DBO_MEASURE: measure at start-up which step sizes the overlap speeds up
# (``ExpertParallel.calibrate_dbo``); until then the overlap is off.
DBO_MEASURE = 0
# The overlap must make the exchange at least this much faster at a step size (and at every
# larger one measured) to be used there: a margin over the timing's noise.
DBO_MIN_GAIN = 1.05
DBO_LADDER_START = 128  # tokens over all engines
DBO_LADDER_MAX = 16384


def dbo_ladder(dp_size: int, max_tokens: int) -> list[int]:
    """The step sizes (tokens over all engines) the overlap is measured at: 128, 256, ... up to
    ``DBO_LADDER_MAX`` and every engine's ``max_tokens`` (its largest step)."""
    sizes = []
    total = DBO_LADDER_START
    while total <= min(DBO_LADDER_MAX, dp_size * max_tokens):
        sizes.append(total)
        total *= 2
    return sizes


def dbo_threshold_from(sizes: list[int], ratios: list[float]) -> int | None:
    """The smallest size from which every measured ratio (one exchange's time over the
    overlapped one's) is at least ``DBO_MIN_GAIN``, that run holding the two largest sizes at
    least (one ratio alone is too easily noise: on a busy CPU the largest size's came out
    1.05-1.15x in runs whose other sizes were 0.4-0.8x); None otherwise."""
    run = 0
    for ratio in reversed(ratios):
        if ratio < DBO_MIN_GAIN:
            break
        run += 1
    if run == 0 or run < min(2, len(sizes)):
        return None
    return sizes[len(sizes) - run]


@dataclass(frozen=True, slots=True)
class DboMeasurement:
    """What ``calibrate_dbo`` measured and decided (the start-up log's line)."""

    sizes: list[int]  # tokens over all engines
    ratios: list[float]  # one exchange's time / the overlapped one's: > 1, the overlap faster
    threshold: int | None

    def describe(self) -> str:
        measured = ", ".join(f"{s}: {r:.2f}x" for s, r in zip(self.sizes, self.ratios))
        if not self.sizes:
            return "off: no step size to measure (max-num-batched-tokens below 128 an engine)"
        if self.threshold is None:
            return (f"off: never {DBO_MIN_GAIN:.2f}x faster at the largest steps (one MoE "
                    f"layer, tokens over the engines: {measured})")
        return (f"on from {self.threshold} tokens per step over the engines (one MoE layer, "
                f"exchange without / with the overlap: {measured})")


class ExpertParallel:
    """One model's expert parallelism on this worker: its place in the EP group, the
    cross-engine group (None: EP within the engine's TP group only), and the per-step state of
    the cross-engine exchange.

    ``dbo_threshold`` (dual batch overlap, None: off; ``DBO_MEASURE``: off until
    ``calibrate_dbo`` sets it): a step of at least that many tokens over all engines exchanges
    in two micro-batches, the second's gather in flight while the first's experts run, the
    first's reduce-scatter while the second's run. Every rank decides alike, from the agreed
    counts."""

    def __init__(self, tp: ParallelGroup, dp_rank: int = 0, dp_size: int = 1,
                 dp_group: DPExpertGroup | None = None,
                 dtype: torch.dtype = torch.float32, dbo_threshold: int | None = None,
                 all2all: str = "allgather_reducescatter") -> None:
        if all2all not in ALL2ALL_BACKENDS:
            raise ValueError(f"all2all backend {all2all!r}: expected one of {ALL2ALL_BACKENDS}")
        self.tp = tp
        self.all2all = all2all
        self.dtype = dtype  # the model's (the empty step's inputs)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.dp = dp_group
        self.dbo_threshold = dbo_threshold
        self.rank = dp_rank * tp.world_size + tp.rank
        self.size = dp_size * tp.world_size
        self.layers: list[FusedMoE] = []  # this model's EP layers, in forward order (``bind``)
        self.active = False  # the cross-engine exchange is on (``activate``)
        self._next = 0  # the layer the current forward reaches next
        self._whole = Exchange(0, 0, None)  # the current forward's exchange
        self._halves: tuple[Exchange, Exchange] | None = None  # ... as two (overlap on)
        self.overlapped_steps = 0  # eager forwards that exchanged in two micro-batches
        # "alltoallv": layers exchanged that way, the rows they sent to other engines, and what
        # the gather would have sent them (every row to every other engine).
        self.alltoallv_layers = 0
        self.alltoallv_rows_sent = 0
        self.alltoallv_rows_gathered = 0
        # The router logits' dtype (DeepSeek-V2's are float32 in a bfloat16 model), seen at
        # the first forward: an empty step's exchange must match the other ranks'.
        self.logits_dtype: torch.dtype | None = None
        self._step_tokens = 0  # the current forward's tokens over all engines
        # Inside ``static_exchange`` (graph capture): every rank's forward has as many rows.
        self._static = False

    # --- start-up -----------------------------------------------------------------------------

    def place(self, num_experts: int) -> ExpertPlacement:
        return place_experts(num_experts, self.rank, self.size)

    def bind(self, model: nn.Module) -> None:
        """Remember ``model``'s EP layers (module order: the order a forward runs them)."""
        from tidal.worker.layers.fused_moe import FusedMoE

        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.ep is self]
        if self.layers:
            dbo = ("" if self.dbo_threshold is None else
                   "; dual batch overlap from the step size measured once the engines meet"
                   if self.dbo_threshold == DBO_MEASURE else
                   f"; dual batch overlap from {self.dbo_threshold} tokens per step")
            logger.info("expert parallel rank %d/%d: %d MoE layers, %s; %s%s", self.rank,
                        self.size, len(self.layers), self.layers[0].placement.describe(),
                        f"tokens exchanged with {self.dp_size} data-parallel engines"
                        if self.dp is not None else "within the tensor-parallel group", dbo)

    def activate(self) -> None:
        """The worker is ready: from now on every forward exchanges tokens across engines."""
        self.active = self.dp is not None and bool(self.layers)

    @contextmanager
    def static_exchange(self) -> Iterator[None]:
        """Forwards inside run with every rank's row count equal to this rank's (the decode
        graphs' capture, on every rank at the same sizes in the same order): nothing is
        exchanged on the host, so the collectives are all the graph holds."""
        self._static = True
        try:
            yield
        finally:
            self._static = False

    def exchange_headroom(self, tokens: int) -> int:
        """``exchange_headroom_bytes`` for this model's largest MoE layer at ``tokens`` tokens
        per engine (0 without a cross-engine exchange)."""
        if self.dp_size <= 1 or not self.layers:
            return 0
        dtype_bytes = self.dtype.itemsize
        logits_bytes = (self.logits_dtype or self.dtype).itemsize
        return max(exchange_headroom_bytes(
            dp_size=self.dp_size, tokens=tokens, hidden=moe.hidden_size,
            num_experts=moe.num_experts, top_k=moe.routing.top_k,
            intermediate=moe.w13.shape[1] // 2, dtype_bytes=dtype_bytes,
            logits_bytes=logits_bytes) for moe in self.layers)

    def calibrate_dbo(self, max_tokens: int, reps: int = 5,
                      timed: Callable[[int], tuple[float, float]] | None = None
                      ) -> DboMeasurement | None:
        """With ``dbo_threshold`` ``DBO_MEASURE`` (once ``active``, before the decode graphs'
        capture, on every worker of every engine together): time the first MoE layer's exchange
        and experts at each ``dbo_ladder`` size, evenly split over the engines, without and
        with the overlap, and set the threshold from the ratios (``dbo_threshold_from``; None:
        off). Every worker decides from the same numbers: the times are summed over the
        engines and the engine's tensor-parallel ranks. ``timed(tokens_per_rank)`` -> (without,
        with) replaces the measurement (tests). None when there is nothing to measure."""
        if self.dbo_threshold != DBO_MEASURE or not self.active:
            return None
        assert self.dp is not None
        sizes = dbo_ladder(self.dp_size, max_tokens)
        measure = timed or (lambda t: self._time_exchange(t, reps))
        times = [s for total in sizes for s in measure(total // self.dp_size)]
        times = self.dp.sum_floats(times) if times else []
        if times and self.tp.world_size > 1:
            summed = self.tp.all_reduce(torch.tensor(times, dtype=torch.float32,
                                                     device=self.layers[0].w13.device))
            times = summed.tolist()
        ratios = [round(off / max(on, 1e-12), 3) for off, on in zip(times[::2], times[1::2])]
        self.dbo_threshold = dbo_threshold_from(sizes, ratios)
        measured = DboMeasurement(sizes, ratios, self.dbo_threshold)
        if self.rank == 0:
            logger.info("dual batch overlap: %s", measured.describe())
        return measured

    def _time_exchange(self, tokens: int, reps: int) -> tuple[float, float]:
        """Seconds of the first MoE layer over ``tokens`` rows on every rank (random inputs),
        exchanged in one go and as two micro-batches: each the fastest of ``reps`` runs, the
        two kinds alternating (so a slow spell of the machine hits both), after a warm-up."""
        moe = self.layers[0]
        device = moe.w13.device
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(tokens, moe.hidden_size, generator=gen, device=device).to(self.dtype)
        logits = torch.randn(tokens, moe.num_experts, generator=gen,
                             device=device).to(self.logits_dtype or self.dtype)
        counts = [tokens] * self.dp_size
        whole = Exchange.of(counts, self.dp_rank, device)
        first, second = split_counts(counts)
        halves = (Exchange.of(first, self.dp_rank, device),
                  Exchange.of(second, self.dp_rank, device, start=first[self.dp_rank]))
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

        def once(overlap: bool) -> float:
            sync()
            start = time.perf_counter()
            if overlap:
                self._halves = halves
                self._overlapped(moe, x, logits, None)
            else:
                x_all, logits_all = self._dispatch(whole, x, logits)
                self._combine(whole, self._local_experts(moe, x_all, logits_all, None))
            self._halves = None
            sync()
            return time.perf_counter() - start

        with torch.inference_mode():
            once(False), once(True)  # (warm-up: the kernels' first launch, the buffers)
            runs = [(once(False), once(True)) for _ in range(reps)]
        return min(r[0] for r in runs), min(r[1] for r in runs)

    def close(self) -> None:
        """Forget the model's layers (they hold its expert weights) and leave the cross-engine
        group (its process groups and store connection): the runner is releasing the model."""
        self.active = False
        self.layers = []
        self._whole = Exchange(0, 0, None)
        self._halves = None
        if self.dp is not None:
            self.dp.close()
            self.dp = None

    # --- forward ------------------------------------------------------------------------------

    def forward(self, moe: FusedMoE, x: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None) -> torch.Tensor:
        """``moe``'s output for this rank's tokens ``x [T, H]`` (summed over every EP rank's
        experts when the layer reduces its results)."""
        if x.shape[0]:
            self.logits_dtype = router_logits.dtype
        if not self.active:
            out = self._local_experts(moe, x, router_logits, correction_bias)
        else:
            self._enter(moe, x.shape[0])
            if self.all2all == "alltoallv" and not self._static and self._halves is None:
                out = self._alltoallv(moe, x, router_logits, correction_bias)
            elif self._halves is not None:
                if moe is self.layers[0] and not self._static:  # (not a graph's capture)
                    self._count_overlap()
                out = self._overlapped(moe, x, router_logits, correction_bias)
            else:
                x_all, logits_all = self._dispatch(self._whole, x, router_logits)
                out = self._local_experts(moe, x_all, logits_all, correction_bias,
                                          mine=self._whole)
                out = self._combine(self._whole, out)
        # (Every TP rank of an engine holds the same tokens: all of them skip an empty sum.)
        if moe.reduce_results and out.shape[0]:
            out = self.tp.all_reduce(out)
        return out

    def run_empty_step(self) -> None:
        """Join every EP layer's collectives with no tokens (a DP rank without work in a step
        the others run); nothing to do without a cross-engine exchange."""
        if not self.active:
            return
        logits_dtype = self.logits_dtype or self.dtype
        for moe in self.layers:
            device = moe.w13.device
            moe(torch.empty(0, moe.hidden_size, dtype=self.dtype, device=device),
                torch.empty(0, moe.num_experts, dtype=logits_dtype, device=device))

    def _count_overlap(self) -> None:
        if not self.overlapped_steps:
            logger.info("expert parallel rank %d: first step with dual batch overlap "
                        "(%d tokens over the engines, threshold %s)", self.rank,
                        self._step_tokens, self.dbo_threshold)
        self.overlapped_steps += 1

    def _enter(self, moe: FusedMoE, tokens: int) -> None:
        """Check the forward reaches the layers in order; at the first, agree on the step's
        token counts with the other engines."""
        if moe is self.layers[0]:
            self._next = 0
            assert self.dp is not None
            # (Inside a capture every rank holds as many rows: nothing to ask the others.)
            counts = ([tokens] * self.dp_size if self._static
                      else self.dp.token_counts(tokens))
            device = moe.w13.device
            self._whole = Exchange.of(counts, self.dp_rank, device)
            self._step_tokens = sum(counts)
            self._halves = None
            # (Two micro-batches need two tokens on some rank; the decision is every rank's.)
            if self.dbo_threshold and sum(counts) >= self.dbo_threshold and max(counts) >= 2:
                first, second = split_counts(counts)
                self._halves = (Exchange.of(first, self.dp_rank, device),
                                Exchange.of(second, self.dp_rank, device,
                                            start=first[self.dp_rank]))
        elif self._next >= len(self.layers) or moe is not self.layers[self._next]:
            raise RuntimeError("expert parallel: MoE layers ran out of order (every rank must "
                               "run every layer's collectives in the same order)")
        elif tokens != self._whole.tokens:
            raise RuntimeError(f"expert parallel: {tokens} tokens in a layer of a forward that "
                               f"began with {self._whole.tokens}")
        self._next += 1

    def _start_dispatch(self, ex: Exchange, x: torch.Tensor,
                        logits: torch.Tensor) -> list[tuple[torch.Tensor, Any]]:
        """Begin gathering every engine's rows: one gather of ``[hidden | logits]`` when the
        two share a dtype (the usual case), else one of each (every rank decides alike: the
        dtypes are the model's)."""
        assert self.dp is not None
        t, h = x.shape
        if logits.dtype == x.dtype:
            pack = x.new_zeros((ex.tmax, h + logits.shape[1]))
            pack[:t, :h] = x
            pack[:t, h:] = logits
            sends = [pack]
        else:
            xpack = x.new_zeros((ex.tmax, h))
            xpack[:t] = x
            lpack = logits.new_zeros((ex.tmax, logits.shape[1]))
            lpack[:t] = logits
            sends = [xpack, lpack]
        return [self.dp.start_all_gather(send) for send in sends]

    def _finish_dispatch(self, ex: Exchange, started: list[tuple[torch.Tensor, Any]],
                         h: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every engine's tokens and router logits of a begun dispatch, padded rows dropped."""
        for _, work in started:
            work.wait()
        got = [self._select(ex, gathered) for gathered, _ in started]
        if len(got) == 1:
            return got[0][:, :h], got[0][:, h:]
        return got[0], got[1]

    def _select(self, ex: Exchange, gathered: torch.Tensor) -> torch.Tensor:
        return gathered if ex.valid is None else gathered.index_select(0, ex.valid)

    def _dispatch(self, ex: Exchange, x: torch.Tensor,
                  logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every engine's tokens and router logits, padded rows dropped."""
        if ex.tmax == 0:
            return x, logits
        return self._finish_dispatch(ex, self._start_dispatch(ex, x, logits), x.shape[1])

    def _start_combine(self, ex: Exchange, out: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Begin summing each engine's rows of ``out`` (every engine's tokens) over the
        engines; the result holds this rank's ``ex.tokens`` rows first."""
        assert self.dp is not None
        if ex.valid is None:
            padded = out.contiguous()
        else:
            padded = out.new_zeros((self.dp_size * ex.tmax, out.shape[1]))
            padded.index_copy_(0, ex.valid, out)
        return self.dp.start_reduce_scatter(padded)

    def _combine(self, ex: Exchange, out: torch.Tensor) -> torch.Tensor:
        if ex.tmax == 0:
            return out
        mine, work = self._start_combine(ex, out)
        work.wait()
        return mine[:ex.tokens]

    def _overlapped(self, moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor,
                    correction_bias: torch.Tensor | None) -> torch.Tensor:
        """Dual batch overlap: two micro-batches, each one's exchange in flight while the
        other's experts run."""
        assert self._halves is not None
        first, second = self._halves
        a = first.tokens
        h = x.shape[1]
        parts = ((first, x[:a], logits[:a]), (second, x[a:], logits[a:]))
        gathers = [self._start_dispatch(ex, xs, ls) if ex.tmax else None
                   for ex, xs, ls in parts]
        combines = []
        for (ex, xs, _), gather in zip(parts, gathers):
            if gather is None:
                combines.append(None)
                continue
            x_all, logits_all = self._finish_dispatch(ex, gather, h)
            out = self._local_experts(moe, x_all, logits_all, correction_bias, mine=ex)
            combines.append(self._start_combine(ex, out))
        outs = []
        for (ex, xs, _), combine in zip(parts, combines):
            if combine is None:
                outs.append(xs.new_zeros((0, moe.hidden_size)))
                continue
            mine, work = combine
            work.wait()
            outs.append(mine[:ex.tokens])
        return torch.cat(outs)

    def _alltoallv(self, moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor,
                   correction_bias: torch.Tensor | None) -> torch.Tensor:
        """``moe``'s experts of this tensor rank over this engine's rows, exchanged by
        all-to-all: routed here, each row goes only to the engines whose worker of this tensor
        rank holds one of its experts (with its weights and those experts' slots there), each
        engine runs its experts on the rows it got, and the partial sums come back to be added
        up per row (in float32)."""
        assert self.dp is not None
        t, h = x.shape
        k = moe.routing.top_k
        if t:
            load = moe.expert_load
            count = load.into(moe.expert_load_index) if load is not None else None
            weights, ids = moe.kernels.select_experts(logits, moe.routing, correction_bias,
                                                      count)
        else:
            weights = torch.empty((0, k), dtype=torch.float32, device=x.device)
            ids = torch.empty((0, k), dtype=torch.int32, device=x.device)
        per_rank = moe.num_experts // self.size
        # Each engine's EP rank of this tensor rank, and which of them each row needs: the
        # (engine, row) pairs in engine order are the rows to send, in one pass.
        ranks = torch.arange(self.dp_size, device=x.device) * self.tp.world_size + self.tp.rank
        need = ((ids // per_rank).unsqueeze(1) == ranks.view(1, -1, 1)).any(dim=2)  # [T, D]
        pairs = need.t().reshape(-1).nonzero().flatten()
        order, engine = pairs % max(t, 1), pairs // max(t, 1)
        send = need.sum(dim=0).tolist()
        # Their routing as the receiving engine holds it: weights, and slots among its
        # experts (the sentinel ``per_rank`` for a pick held elsewhere).
        slots = ids.index_select(0, order) - (ranks[engine] * per_rank).unsqueeze(1)
        slots = torch.where((slots >= 0) & (slots < per_rank), slots,
                            torch.full_like(slots, per_rank))
        # (Slots travel as float32, exact for small integers, beside the float32 weights.)
        route = torch.cat([weights.index_select(0, order), slots.float()], dim=1)
        matrix = self.dp.pair_counts(send)
        recv = [matrix[e][self.dp_rank] for e in range(self.dp_size)]
        x_in, route_in = self._all_to_all_rows(x.index_select(0, order), route, send, recv)
        if x_in.shape[0]:
            out_in = moe.kernels.fused_moe(
                x_in, moe.w13, moe.w2, route_in[:, :k].contiguous(),
                route_in[:, k:].to(torch.int32), moe.w13_weight_scale, moe.w2_weight_scale,
                partial=True)
        else:
            out_in = x_in.new_zeros((0, h))
        back = self.dp.all_to_all(out_in, recv, send)
        out = torch.zeros((t, h), dtype=torch.float32, device=x.device)
        out.index_add_(0, order, back.float())
        if not self.alltoallv_layers:
            logger.info("expert parallel rank %d: first layer exchanged by all-to-all",
                        self.rank)
        self.alltoallv_layers += 1
        self.alltoallv_rows_sent += sum(send) - send[self.dp_rank]
        self.alltoallv_rows_gathered += t * (self.dp_size - 1)
        return out.to(x.dtype)

    def _all_to_all_rows(self, rows: torch.Tensor, route: torch.Tensor, send: list[int],
                         recv: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` and their float32 ``route`` by one all-to-all where the rows' dtype packs
        float32 (2- and 4-byte dtypes: the route's bytes as extra columns), else two."""
        assert self.dp is not None
        size = rows.element_size()
        if 4 % size:
            return (self.dp.all_to_all(rows, send, recv),
                    self.dp.all_to_all(route, send, recv))
        h = rows.shape[1]
        got = self.dp.all_to_all(torch.cat([rows, route.view(rows.dtype)], dim=1), send, recv)
        return got[:, :h].contiguous(), got[:, h:].contiguous().view(torch.float32)

    @staticmethod
    def _local_experts(moe: FusedMoE, x: torch.Tensor, logits: torch.Tensor,
                       correction_bias: torch.Tensor | None,
                       mine: Exchange | None = None) -> torch.Tensor:
        """``moe``'s experts held here over ``x``: this engine's rows, or every engine's
        gathered by the exchange ``mine``. Each engine routes every gathered row alike, and
        counts (for /metrics) only its own: each engine's load reaches the frontend with its
        own steps, and an idle engine counts nothing."""
        if x.shape[0] == 0:
            return x.new_zeros((0, moe.hidden_size))
        load = moe.expert_load
        count = load.into(moe.expert_load_index) if load is not None and mine is None else None
        weights, ids = moe.kernels.select_experts(logits, moe.routing, correction_bias, count)
        if load is not None and mine is not None:
            # (Its rows among the gathered ones: a graph's padding rows at their end are left
            # out by the step's real token count, as without the exchange.)
            load.into(moe.expert_load_index).add(ids[mine.offset:mine.offset + mine.tokens],
                                                 start=mine.start)
        partial = len(moe.local_experts) != moe.num_experts
        if partial:
            ids = local_expert_ids(ids, moe.local_experts)
        return moe.kernels.fused_moe(x.contiguous(), moe.w13, moe.w2, weights, ids,
                                     moe.w13_weight_scale, moe.w2_weight_scale, partial=partial)


def create(config: Any, tp: ParallelGroup, device: torch.device,
           dtype: torch.dtype) -> ExpertParallel | None:
    """This worker's ``ExpertParallel`` for ``config`` (None: EP off or the model has no
    experts). With DP > 1 it joins the cross-engine group (collective over the DP engines'
    workers of this TP rank: they all call it at start-up)."""
    par = config.parallel
    if not getattr(par, "enable_expert_parallel", False) or not config.model.arch.num_experts:
        return None
    group = None
    if par.data_parallel_size > 1:
        from tidal.worker.distributed.expert_parallel import DPExpertGroup

        group = DPExpertGroup(par.data_parallel_rank, par.data_parallel_size, tp.rank,
                              par.data_parallel_port, device)
    dbo = par.dbo_token_threshold if par.enable_dbo else None
    return ExpertParallel(tp, par.data_parallel_rank, par.data_parallel_size, group, dtype, dbo,
                          par.all2all_backend)


@contextmanager
def building(ep: ExpertParallel | None) -> Iterator[None]:
    """MoE layers built inside take their experts' placement from ``ep`` (None: all)."""
    token = _CURRENT.set(ep)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current_expert_parallel() -> ExpertParallel | None:
    return _CURRENT.get()
