"""Runs one scheduler step on one worker: applies the step's diffs to the persistent batch,
prepares inputs with vectorised numpy into pinned buffers, runs the model (a CUDA graph for
decode batches), samples on the device, and reports the new tokens.

With async scheduling the step's output is handed back unfinished (``PendingStep``): the sampled
ids travel to the host on a side stream while the CPU already prepares the next step, and a
request whose next input is a token still in flight gets it straight from this step's sampled
ids on the device (a placeholder fill), never through the host.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.protocol import LogprobsArrays, ModelRunnerOutput, SchedulerOutput
from tidal.worker.attention.backend import AttentionMetadata
from tidal.worker.attention.fp8_kv import check_device as check_fp8_kv_device
from tidal.worker.attention.fp8_kv import kv_cache_torch_dtype
from tidal.worker.compilation.compiled_model import CompiledForward
from tidal.worker.compilation.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from tidal.worker.cpu_offload import LayerOffloader, device_weight_bytes, offloading
from tidal.worker.cuda_graphs import CudaGraphRunner, capture_sizes, mixed_capture_sizes
from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.layers import expert_load, moe_ep
from tidal.worker.layers.expert_load import ExpertLoad
from tidal.worker.layers.fused_moe import FusedMoE
from tidal.worker.attention.selector import attention_impl
from tidal.worker.input_batch import InputBatch
from tidal.worker.kernel_policy import kernels_for
from tidal.worker.kv_transfer.connector_hooks import ConnectorHooks
from tidal.worker.loader.model_loader import load_model, torch_dtype
from tidal.worker.lora.manager import LoRAManager
from tidal.worker.models.decoder import DecoderForCausalLM
from tidal.worker.sample.metadata import (
    SamplingMetadata,
    SamplingMetadataBuilder,
    needs_token_history,
    position_seed,
)
from tidal.worker.sample.grammar_mask import MaskStaging, grammar_rows
from tidal.worker.sample.logits_processors import LogitsProcessors
from tidal.worker.sample.sampler import Sampler, SamplerOutput
from tidal.worker.spec_decode.proposal import Proposal
from tidal.worker.spec_decode.spec_step import SpeculativeStep, VerifyLaunch
from tidal.worker.step_buffers import StepBuffers, to_device

logger = logging.getLogger(__name__)

__all__ = ["IntermediateTensors", "ModelRunner", "PendingStep", "position_seed"]

DEFAULT_CPU_KV_BYTES = 2 << 30


@dataclass(slots=True)
class IntermediateTensors:
    """What a pipeline stage hands the next one: hidden states and residuals of this step's
    tokens."""

    hidden: torch.Tensor
    residual: torch.Tensor | None


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    rows: np.ndarray  # batch rows, in batch order
    cu: np.ndarray  # query_start_loc on the host
    seq_lens: np.ndarray
    sample_mask: np.ndarray  # which requests sample this step
    all_sample: bool
    logits_indices: torch.Tensor | None  # None: every token samples, in order
    sampling: SamplingMetadata | None
    graph_size: int | None  # the captured batch size this step replays, if any
    # The captured token count of a mixed step's graph, if it replays one.
    mixed_graph_tokens: int | None = None


@dataclass(slots=True, eq=False)
class SampleLater:
    """A step whose forward pass and logits are launched but whose sampling waits for its
    grammar masks (``ModelRunner.finish_sample``): the EngineCore fills them from the previous
    step's tokens while the device runs this step."""

    so: SchedulerOutput
    logits: torch.Tensor
    sampling: SamplingMetadata
    sample_rows: np.ndarray
    sampled_ids: list[str]
    result: ModelRunnerOutput
    failed: dict[str, str]


@dataclass(slots=True, eq=False)
class PendingStep:
    """A step whose sampled tokens may still be on their way to the host. ``get_output()``
    waits for them (only for them), writes them into the persistent batch and returns the
    step's ``ModelRunnerOutput``."""

    runner: ModelRunner
    result: ModelRunnerOutput
    req_ids: list[str]  # requests that sampled (kept ones only)
    rows: np.ndarray
    positions: np.ndarray  # where each sampled token goes in its row
    generations: np.ndarray
    membership: int  # the batch's when the step was launched
    tokens_dev: torch.Tensor  # sampled ids on the device, all sampling rows (placeholder fill)
    tokens_host: torch.Tensor | None  # kept rows' ids, copied on the side stream
    logprobs_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    copied: torch.cuda.Event | None
    # Each expert's routings since the previous step that sampled (``layers.expert_load``),
    # on its way to the host with the tokens; None: not counted.
    expert_load_host: torch.Tensor | None = None
    done: bool = False
    # A step booked by ``ModelRunner.sample_lazily``: samples it (on first need, else before
    # the next step's device work) and fills in the fields above; None once launched.
    launch: Callable[[], None] | None = None

    def get_output(self) -> ModelRunnerOutput:
        if not self.done:
            self.runner._resolve_through(self)
        return self.result

    def _resolve(self) -> None:
        if self.launch is not None:
            self.launch()
        if self.copied is not None:
            self.copied.synchronize()
        result = self.result
        if self.tokens_host is not None:
            tokens = self.tokens_host.numpy()
            self.runner.batch.fill_placeholders(self.rows, self.positions, self.generations,
                                                tokens, self.membership)
            result.req_ids = self.req_ids
            result.sampled_token_ids = [[t] for t in tokens.tolist()]
        if self.logprobs_host is not None:
            ids, vals, ranks = self.logprobs_host
            result.logprobs = LogprobsArrays(ids.numpy(), vals.numpy(), ranks.numpy())
        if self.expert_load_host is not None:
            result.expert_load = self.expert_load_host.tolist()
        self.tokens_host = self.logprobs_host = self.expert_load_host = None
        self.done = True


@dataclass(slots=True, eq=False)
class PendingSpecStep:
    """A speculative step launched with async scheduling: its verification runs on the
    device, and (EAGLE-3 / MTP) its proposal behind it. The next step's ``execute_model``
    resolves it first (``_resolve``: the emitted tokens to the host and into the rows, the
    proposal launched if it was not, left on the device for that step's drafts); its output
    (``get_output``) also waits for the drafts' copy to the host."""

    runner: ModelRunner
    later: SampleLater
    launch: VerifyLaunch
    proposal: Proposal | None = None
    done: bool = False

    def get_output(self) -> ModelRunnerOutput:
        if not self.done:
            self.runner._resolve_through(self)
        result = self.later.result
        if self.proposal is not None:
            result.spec_token_ids = self.proposal.lists()
            self.proposal = None
        return result

    def _resolve(self) -> None:
        self.runner._finish_spec_step(self)
        self.done = True


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor into pinned host memory on the current stream. The caching
    host allocator keeps the block from reuse until the copy has completed."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def dummy_chunk_lens(tokens: int, reqs: int, max_len: int) -> list[int]:
    """Query lengths of a dummy mixed batch of ``tokens`` tokens over ``reqs`` requests, none
    longer than ``max_len``: long chunks first, then one-token requests."""
    if not reqs <= tokens <= reqs * max_len:
        raise ValueError(f"{tokens} tokens do not fit {reqs} requests of 1..{max_len}")
    lens = []
    left = tokens
    for i in range(reqs):
        take = min(max_len, left - (reqs - i - 1))
        lens.append(take)
        left -= take
    return lens


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        self.config = config
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.tp = tp or single_group()
        self.pp = pp or single_group()
        self.arch = config.model.arch
        self.vocab_size = self.arch.vocab_size
        self.block_size = config.cache.block_size
        self.dtype = torch_dtype(config.model.dtype)
        # The KV cache's element type: the model's, or FP8 e4m3 (--kv-cache-dtype fp8).
        self.kv_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, self.dtype)
        # Every kernel choice, resolved once against this device (kernel_policy.py): the model
        # is built with these kernels, the attention backend is the policy's.
        self.kernels = kernels_for(device, config.runner.kernels, self.arch, config.parallel,
                                   compiled=config.runner.compilation.enabled,
                                   custom_ops=config.runner.compilation.custom_ops)
        self.kernel_policy = self.kernels.policy
        self.attn_impl = attention_impl(self.kernel_policy.attention)
        check_fp8_kv_device(self.kv_dtype, self.kernel_policy.attention, device)
        max_reqs = config.scheduler.max_num_seqs
        self.max_num_reqs = max_reqs
        # Which layers share which cache tensor and block table (engine_core.kv_groups).
        self.kv_layout = config.kv_layout()
        self.num_kv_groups = self.kv_layout.num_groups
        self.batch = InputBatch(max_reqs, config.model.max_model_len, config.max_blocks_per_seq,
                                config.model.eos_token_ids, self.num_kv_groups)
        # A step holds at most the token budget, but never fewer rows than a padded graph batch.
        self.max_num_tokens = max(config.scheduler.max_num_batched_tokens, max_reqs)
        self.bufs = StepBuffers(max_reqs, self.max_num_tokens, config.max_blocks_per_seq,
                                self.block_size, device, self.num_kv_groups)
        self.sampler = Sampler(self.kernels)
        self._mask_staging = MaskStaging((self.vocab_size + 31) // 32, device)
        self.sampling_builder = SamplingMetadataBuilder(
            self.vocab_size, device, seeded_generators=config.speculative is not None,
            processors=LogitsProcessors(self.vocab_size, device,
                                        config.runner.logits_processors))
        # Speculative decoding: draft inputs, verification and the next drafts (spec_decode/).
        self.spec = (SpeculativeStep(config.speculative, device, max_num_reqs=max_reqs,
                                     max_model_len=config.model.max_model_len,
                                     argmax=self.kernels.argmax)
                     if config.speculative is not None else None)
        self.model: torch.nn.Module | None = None
        # --cpu-offload-gb: the layers whose weights stream in from host memory (cpu_offload).
        self.cpu_offload: LayerOffloader | None = None
        # LoRA adapters (--enable-lora): slots, host cache, per-token slot ids (worker/lora).
        self.lora: LoRAManager | None = None
        self.kv_caches: list[torch.Tensor] = []
        # The KV connector's worker side (engine_core/kv_transfer); None: off.
        self.kv_hooks = ConnectorHooks.create(config, self.tp.ranks[self.tp.rank])
        # Expert parallelism (worker/layers/moe_ep.py), set up with the model; None: off.
        self.ep: moe_ep.ExpertParallel | None = None
        self.exchange_graph_replays = 0  # decode graphs replayed as agreed between the engines
        # Per-expert routing counts for /metrics (MoE models; layers/expert_load).
        self.expert_load: ExpertLoad | None = None
        self.graphs: CudaGraphRunner | None = None
        # The torch.compile'd forward (--compilation-config mode 3, ``compile_model``): runs
        # the steps no CUDA graph replays.
        self.compiled: CompiledForward | None = None
        # Off only while the warm-up compiles the eager launches of mixed steps.
        self.mixed_graphs_on = True
        # Hand outputs back before their tokens reach the host only when the EngineCore will
        # schedule the next step meanwhile; otherwise a step returns its output directly.
        self.defer_output = config.scheduler.async_scheduling
        # Steps whose tokens are not applied yet.
        self._inflight: deque[PendingStep | PendingSpecStep] = deque()
        self._due: PendingStep | None = None  # booked by sample_lazily, not sampled yet
        self._copy_stream = torch.cuda.Stream(device) if self.on_gpu else None
        # For the newest launched step: batch row -> index into its sampled ids (-1: none), and
        # the position that token takes.
        self._index_of_row = np.full(max_reqs, -1, dtype=np.int64)
        self._pos_of_row = np.full(max_reqs, -1, dtype=np.int64)
        self._last_sampled_rows = np.zeros(0, dtype=np.int64)
        self._arange32 = np.arange(self.max_num_tokens + 1, dtype=np.int32)
        self._arange64 = np.arange(self.max_num_tokens + 1, dtype=np.int64)
        self._ones32 = np.ones(max_reqs, dtype=np.int32)
        self._ones32.flags.writeable = False

    # --- start-up -----------------------------------------------------------------------------

    def load_model(self) -> None:
        self.ep = moe_ep.create(self.config, self.tp, self.device, self.dtype)
        if self.on_gpu:
            self._check_weights_fit()
        aux = (self.spec.aux_hidden_spec(self.config, self.max_num_tokens)
               if self.spec is not None else None)
        self._aux_hidden = aux  # (part of the compile cache's key)
        offload = self._cpu_offloader()
        # (--cpu-offload-gb: offloaded layers are built and loaded in host memory)
        with moe_ep.building(self.ep), offloading(offload):
            self.model = load_model(self.config.model, self.device, self.attn_impl, self.tp,
                                    self.pp, self.kernels, aux_hidden=aux)
        if offload is not None:
            offload.finalize()
            self.cpu_offload = offload
        if self.ep is not None:
            self.ep.bind(self.model)
        self.expert_load = self._count_expert_load()
        if self.config.lora is not None:
            # (Before the KV cache is sized: the profile counts the slot buffers.)
            self.lora = LoRAManager(self.config, self.model, self.device, self.dtype, self.tp,
                                    self.kernels, self.max_num_tokens)
        if self.spec is not None:  # a draft model / EAGLE-3 head (model methods only)
            self.spec.load_drafter(self.config, self.model, self.attn_impl,
                                   max_num_reqs=self.max_num_reqs,
                                   max_num_tokens=self.max_num_tokens,
                                   block_table=self.bufs.block_table, kernels=self.kernels)
        # (--tp-devices: the CPU ranks would never join the GPU ranks' agreement below.)
        if (self.on_gpu and self.tp.world_size > 1 and not self.config.parallel.tp_devices
                and isinstance(self.model, DecoderForCausalLM)):
            from tidal.worker.distributed.push_allreduce import make_push_all_reduce

            # Two row-parallel all-reduces per decoder layer of this stage.
            self.tp.push_all_reduce = make_push_all_reduce(
                self.tp, self.device, self.dtype, self.arch.hidden_size,
                2 * len(self.model.layers), enabled=self.kernel_policy.push_allreduce,
                kernels=self.kernels)

    def _cpu_offloader(self, plan_only: bool = False) -> LayerOffloader | None:
        """--cpu-offload-gb's offloader for this stage's decoder layers (a GPU only);
        ``plan_only``: to size a ``meta`` model before loading."""
        budget = self.config.runner.cpu_offload_bytes
        if not self.on_gpu or budget <= 0:
            return None
        from tidal.worker.models.decoder import layer_range

        start, end = layer_range(self.arch.num_layers, self.pp)
        return LayerOffloader(budget, self.device, tuple(range(start, end)),
                              plan_only=plan_only)

    def _check_weights_fit(self) -> None:
        """Fail before loading, with the shortfall, when the weights alone cannot fit."""
        from tidal.worker.layers.fp8 import quantizing
        from tidal.worker.models.registry import build_model

        # (--cpu-offload-gb: the whole layers it will offload, and its staging buffers)
        plan = self._cpu_offloader(plan_only=True)
        try:
            # (Built as it will be loaded: FP8 layers count one byte a weight.)
            with torch.device("meta"), quantizing(self.config.model.quantization), \
                    moe_ep.building(self.ep), offloading(plan):
                shell = build_model(self.arch, self.dtype, self.attn_impl, self.tp, self.pp,
                                    self.kernels)
        except Exception as exc:  # noqa: BLE001 - the estimate is a courtesy, loading decides
            logger.debug("could not size the model before loading: %s", exc)
            return
        need = device_weight_bytes(shell, plan)
        if self.spec is not None:  # a draft model / EAGLE-3 head / MTP layer loads too
            try:
                need += self.spec.draft_weight_bytes(self.config, self.attn_impl, self.kernels)
            except Exception as exc:  # noqa: BLE001 - as above: a courtesy
                logger.debug("could not size the draft before loading: %s", exc)
        free, total = torch.cuda.mem_get_info(self.device)
        util = self.config.cache.gpu_memory_utilization
        room = int(total * util) - (total - free)
        if need > room:
            raise RuntimeError(
                f"the model's weights need {need / 2**30:.2f} GiB but only {room / 2**30:.2f} "
                f"GiB of this GPU may be used (gpu_memory_utilization={util}, "
                f"{(total - free) / 2**30:.2f} GiB already in use): short by "
                f"{(need - room) / 2**30:.2f} GiB; use more GPUs (tensor parallelism), a "
                "smaller dtype, or raise --gpu-memory-utilization"
            )

    def _layer_slots(self) -> list[tuple[int, int]]:
        """(KV group, cache tensor slot) of each of this stage's attention layers."""
        assert self.model is not None
        start = getattr(self.model, "start_layer", 0)
        lay = self.kv_layout
        return [(lay.layer_group[start + i], lay.layer_slot[start + i])
                for i in range(len(self.model.attention_layers()))]

    def kv_bytes_per_block(self) -> int:
        """Bytes of one pool block on this stage: the cache tensors its layers use (one per
        layer with one KV group; one per slot shared by the groups otherwise)."""
        assert self.model is not None
        layers = self.model.attention_layers()
        if not layers:
            return 0
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        # Each layer's cache layout is its own (``cache_shape``: K/V heads, or MLA's one latent
        # row per token); layers sharing a slot share one tensor.
        per_slot = {slot: math.prod(layer.cache_shape(1, self.block_size))
                    for layer, (_, slot) in zip(layers, self._layer_slots())}
        # A draft model's / EAGLE-3 head's cache has a block for every pool block.
        draft = self.spec.kv_bytes_per_block() if self.spec is not None else 0
        return sum(per_slot.values()) * elem + draft

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: forced by the config, or from the memory budget."""
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        per_block = self.kv_bytes_per_block()
        if not self.on_gpu:
            if self.config.parallel.tp_devices and self.tp.world_size > 1:
                self._profile_run()  # the GPU ranks' profile forward all-reduces with this one
            budget = self.config.cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            if self.spec is not None:  # the draft's per-row chain scratch
                budget -= self.spec.scratch_bytes()
            return max(1, budget // per_block)
        return self._profile_gpu_blocks(per_block)

    def _profile_gpu_blocks(self, per_block: int) -> int:
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        weights = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        scratch_kv = self._profile_run()
        torch.cuda.synchronize(dev)
        # Peak of weights + activations + sampler temporaries, without the scratch KV cache.
        peak = torch.cuda.max_memory_allocated(dev) - scratch_kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = total - free - torch.cuda.memory_reserved(dev)  # context, NCCL, others
        activations = max(0, peak - weights)
        graph_reserve = self._graph_memory_estimate(activations)
        util = self.config.cache.gpu_memory_utilization
        # Expert parallelism across DP engines: the profile ran this engine alone, a served
        # step gathers every engine's rows into each MoE layer (moe_ep.exchange_headroom_bytes).
        ep_reserve = (self.ep.exchange_headroom(self.max_num_tokens)
                      if self.ep is not None else 0)
        if ep_reserve:
            logger.info("KV cache: %.2f GiB kept for the experts' exchange between the %d "
                        "data-parallel engines", ep_reserve / 2**30,
                        self.config.parallel.data_parallel_size)
        budget = int(total * util) - non_torch - peak - graph_reserve - ep_reserve
        if self.config.cache.kv_cache_memory_bytes is not None:
            budget = self.config.cache.kv_cache_memory_bytes
        if self.spec is not None:  # the draft's per-row chain scratch
            budget -= self.spec.scratch_bytes()
        blocks = budget // per_block
        sched = self.config.scheduler
        need = self.kv_layout.blocks_per_seq(
            self.config.model.max_model_len, self.block_size,
            1 if sched.enable_chunked_prefill else self.config.model.max_model_len)
        if blocks < need:
            short = (need - max(blocks, 0)) * per_block
            raise RuntimeError(
                f"the model leaves room for {max(blocks, 0)} KV blocks but one sequence of "
                f"max_model_len={self.config.model.max_model_len} needs {need}: short by "
                f"{short / 2**30:.2f} GiB; raise --gpu-memory-utilization (now "
                f"{util}), lower --max-model-len, or use more GPUs (tensor parallelism)"
            )
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB, %d tokens, %s); weights %.2f GiB, peak "
            "activations %.2f GiB, CUDA graphs reserve %.2f GiB, other %.2f GiB of %.2f GiB "
            "(gpu_memory_utilization %.2f)", blocks, self.block_size, blocks * per_block / 2**30,
            blocks * self.block_size, self.kv_dtype, weights / 2**30, activations / 2**30,
            graph_reserve / 2**30, non_torch / 2**30, total / 2**30, util)
        return int(blocks)

    def _graph_memory_estimate(self, activations: int) -> int:
        """Room to keep for the decode graphs' private pool: the activations of the largest
        captured batch (scaled from the profiled token budget), doubled, plus slack."""
        full = self._graphs_enabled()
        if not full and not self._piecewise_sizes():
            return 0
        # (The piecewise graphs' pool holds about one forward at their largest size.)
        largest = max(capture_sizes(self._max_graph_batch())[-1] if full else 0,
                      max(self._mixed_graph_sizes(), default=0) if full else 0,
                      max(self._piecewise_sizes(), default=0))
        share = activations * largest / max(1, self.config.scheduler.max_num_batched_tokens)
        # Decode graphs holding the experts' exchange keep the rows of every engine in their
        # pool (the profile saw this engine's alone).
        exchange = self.ep.exchange_headroom(largest) if self.ep is not None and full else 0
        return int(2 * share) + exchange + (64 << 20)

    @torch.inference_mode()
    def _profile_run(self) -> int:
        """One forward pass at the largest token budget on a scratch cache, then the sampler on
        the largest batch with every truncation on, to measure the peak; returns the scratch
        cache's size."""
        assert self.model is not None
        n = self.config.scheduler.max_num_batched_tokens
        n_blocks = -(-n // self.block_size)
        self._allocate_kv(n_blocks)
        scratch = sum(c.numel() * c.element_size() for c in self.kv_caches)
        meta = self._dummy_meta(n, n_blocks)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % self.config.model.max_model_len
        if self.lora is not None:
            self.lora.profile_begin(n)
        hidden, _ = self.model(ids, pos, meta)
        if self.lora is not None:
            self.lora.profile_end()
        if self.pp.is_last:
            rows = min(self.max_num_reqs, n)
            logits = self.model.compute_logits(hidden[:rows])
            dev = self.device
            sampling = SamplingMetadata(
                temperature=torch.full((rows,), 0.7, device=dev), all_greedy=False,
                all_random=True,
                top_k=torch.full((rows,), 50, dtype=torch.int64, device=dev),
                top_p=torch.full((rows,), 0.9, device=dev),
                min_p=torch.full((rows,), 0.05, device=dev),
                max_num_logprobs=self.config.runner.max_logprobs)
            self.sampler(logits, sampling)
            del logits
        del hidden
        self._release_kv()
        return scratch

    def _dummy_meta(self, n: int, n_blocks: int) -> AttentionMetadata:
        qsl = np.array([0, n], dtype=np.int32)
        seq = np.array([n], dtype=np.int32)
        dev = self.device
        return AttentionMetadata(
            num_actual_tokens=n, num_reqs=1, max_query_len=n, max_seq_len=n,
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq).to(dev),
            block_table=torch.arange(n_blocks, dtype=torch.int32, device=dev).unsqueeze(0),
            slot_mapping=torch.arange(n, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        )

    def _allocate_kv(self, num_blocks: int) -> None:
        assert self.model is not None
        self.kv_caches = []
        # One tensor per slot: the slot-j layer of every KV group shares it (a pool block
        # belongs to one group at a time). With one group every layer has its own slot.
        by_slot: dict[int, torch.Tensor] = {}
        for layer, (group, slot) in zip(self.model.attention_layers(), self._layer_slots()):
            cache = by_slot.get(slot)
            if cache is None:
                shape = layer.cache_shape(num_blocks, self.block_size)
                cache = by_slot[slot] = torch.zeros(shape, dtype=self.kv_dtype,
                                                    device=self.device)
                self.kv_caches.append(cache)
            layer.kv_cache = cache
            layer.kv_group = group
        if self.spec is not None:
            self.spec.bind_kv_cache(num_blocks)

    def _release_kv(self) -> None:
        assert self.model is not None
        for layer in self.model.attention_layers():
            layer.kv_cache = torch.empty(0)
        self.kv_caches = []
        if self.spec is not None:
            self.spec.release_kv_cache()
        if self.on_gpu:
            torch.cuda.empty_cache()

    def release(self) -> None:
        """Drop the model, KV cache, graphs and drafter, so an engine shut down inside a
        longer-lived process (``LLM(...).shutdown()`` in a notebook or a benchmark running
        engines one after another) hands its GPU memory back: captured graphs keep their
        memory pools, and their closures the model, until they go."""
        if self.model is not None:
            self._release_kv()
        self._inflight.clear()
        self._due = None
        self.graphs = None
        if self.compiled is not None:
            self.compiled.release()
        self.compiled = None
        self.spec = None
        self.model = None
        if self.cpu_offload is not None:
            self.cpu_offload.close()  # (its pinned host memory and staging buffers)
            self.cpu_offload = None
        if self.ep is not None:
            self.ep.close()  # (its layers keep the expert weights; its cross-engine groups)
            self.ep = None
        self.expert_load = None
        if self.kv_hooks is not None:
            self.kv_hooks.shutdown()  # (the host tier's pinned buffers)
        if self.on_gpu:
            torch.cuda.empty_cache()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache and capture the decode graphs (the worker times the two
        apart and warms up after them: ``tidal.worker.warmup``)."""
        self.allocate_kv_cache(num_blocks)
        self.capture_graphs_if_enabled()

    def allocate_kv_cache(self, num_blocks: int) -> int:
        """Allocate the KV cache; returns its size in bytes."""
        self._allocate_kv(num_blocks)
        if self.kv_hooks is not None:
            self.kv_hooks.register(self.kv_caches)
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

    def capture_graphs_if_enabled(self) -> bool:
        if not self._graphs_enabled() or self.graphs_wait_for_engines():
            return False
        self.capture_graphs()
        return True

    def graphs_wait_for_engines(self) -> bool:
        """Whether the decode graphs hold the experts' exchange with the other data-parallel
        engines (layers/moe_ep): those are captured once the engines meet
        (``capture_exchange_graphs``, after warm-up, which runs each engine alone)."""
        return self.ep is not None and self.ep.dp is not None and self._graphs_enabled()

    def capture_exchange_graphs(self) -> bool:
        """Capture the decode graphs with the cross-engine exchange inside; every engine's
        workers call this together after ``ExpertParallel.activate`` (the same sizes in the same
        order: each capture's collectives meet the other engines')."""
        if not self.graphs_wait_for_engines():
            return False
        assert self.ep is not None
        if not self.ep.active:
            return False
        with self.ep.static_exchange():
            self.capture_graphs()
        return True

    @torch.inference_mode()
    def compile_model(self) -> str | None:
        """torch.compile the model (--compilation-config mode 3; ``worker.compilation``) with
        a dummy step over the allocated KV cache (it writes nothing there); returns what it did
        for the start-up log, None when compilation is off. A model that cannot be compiled
        as one graph keeps running eagerly (the log line says why)."""
        cc = self.config.runner.compilation
        if not cc.enabled or self.model is None:
            return None
        compiled = CompiledForward(
            self.model, cc, rank=self.pp.rank * self.tp.world_size + self.tp.rank,
            key_inputs=dict(arch=self.arch, dtype=str(self.dtype), parallel=self.config.parallel,
                            policy=self.kernel_policy, device=self.device.type,
                            aux_hidden=getattr(self, "_aux_hidden", None)),
            graphs=PiecewiseGraphs(sizes) if (sizes := self._piecewise_sizes()) else None,
            agree=self._tp_agree if self.tp.world_size > 1 else None)
        n = min(8, self.max_num_tokens)
        meta = self._dummy_meta(n, -(-n // self.block_size))
        meta.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        # The steps' own input buffers: a tensor made here would be an inference tensor, which
        # Dynamo guards apart from the steps' (a recompile at the first step).
        ids, pos = self.bufs.input_ids[:n], self.bufs.positions[:n]
        ids.zero_()
        pos.copy_(torch.arange(n, device=self.device))
        if not compiled.compile(ids, pos, meta):
            return f"off: {compiled.failure}"
        self.compiled = compiled
        return compiled.describe()

    def _count_expert_load(self) -> ExpertLoad | None:
        """The MoE routing counter for /metrics, or None: no MoE layers, stats off
        (--disable-log-stats), or a layout whose counts would not reach the engine whole."""
        assert self.model is not None
        why = ("stats are off (--disable-log-stats)" if not self.config.log_stats
               else "the model is compiled (--compilation-config)"
               if self.config.runner.compilation.enabled
               else "pipeline parallelism (only the last stage's output reaches the engine)"
               if self.pp.world_size > 1 else None)
        if why is not None:
            if any(isinstance(m, FusedMoE) for m in self.model.modules()):
                logger.info("expert load: not counted for /metrics: %s", why)
            return None
        # (Padding rows exist only in a GPU's graph steps; a CPU's staging tensors are
        # replaced when they grow, so no view of them is kept.)
        return expert_load.attach(self.model, self.bufs.num_tokens if self.on_gpu else None,
                                  self.max_num_tokens, self.device)

    def _tp_agree(self, ok: bool) -> bool:
        """True on every tensor-parallel rank iff ``ok`` on every one (start-up only)."""
        from tidal.worker.distributed.symm_allreduce import agree

        return agree(ok, self.tp.cpu_group)

    def _piecewise_sizes(self) -> list[int]:
        """Token counts of the piecewise graphs (cudagraph_mode PIECEWISE /
        FULL_AND_PIECEWISE on a GPU; none otherwise)."""
        cc = self.config.runner.compilation
        if not (cc.piecewise and self.on_gpu and not self.config.runner.enforce_eager):
            return []
        # FULL_AND_PIECEWISE: the sizes the whole-model mixed graphs hold are theirs.
        above = (max(self._mixed_graph_sizes(), default=0)
                 if cc.cudagraph_mode == "FULL_AND_PIECEWISE" and self._graphs_enabled() else 0)
        return piecewise_sizes(cc.cudagraph_capture_sizes,
                               max_num_tokens=self.bufs.input_ids.shape[0], above=above)

    @torch.inference_mode()
    def capture_piecewise_graphs(self) -> str | None:
        """Capture the compiled pieces' CUDA graphs (``piecewise_graphs``); what it did for the
        start-up log, None without them."""
        if self.compiled is None or self.compiled.graphs is None:
            return None

        def meta_for(n: int) -> AttentionMetadata:
            meta = self._dummy_meta(n, -(-n // self.block_size))
            meta.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=self.device)
            return meta

        return self.compiled.capture_graphs(self.bufs.input_ids, self.bufs.positions, meta_for)

    def finish_inflight(self) -> None:
        """Apply every in-flight step's tokens (ranks that never reply leave the newest step
        pending until the next one)."""
        if self._inflight:
            self._resolve_through(self._inflight[-1])

    def forget_steps(self) -> None:
        """Drop the bookkeeping that links the next step to the last one, as if no step had
        run (and, with no request held, hand rows out from 0 again): for after the warm-up,
        whose requests are gone. Call with nothing in flight."""
        if self._inflight:
            raise RuntimeError("steps are still in flight")
        self._index_of_row.fill(-1)
        self._pos_of_row.fill(-1)
        self._last_sampled_rows = np.zeros(0, dtype=np.int64)
        if not len(self.batch):
            self.batch.reset_rows()

    # --- CUDA graphs ----------------------------------------------------------------------------

    def _max_graph_batch(self) -> int:
        return min(self.config.runner.max_cudagraph_batch, self.max_num_reqs)

    def _graphs_enabled(self) -> bool:
        return self.graphs_off_reason() is None

    def graphs_off_reason(self) -> str | None:
        """Why decode steps run eagerly, or None when they replay CUDA graphs."""
        # The torch backend plans on the host (per-request loops over host metadata), so its
        # launches are not replayable. NCCL all-reduces capture fine (tensor parallelism);
        # pipeline stages exchange tensors outside the graph, so they stay eager.
        if not self.on_gpu:
            return "CPU"
        if self.config.runner.enforce_eager:
            return "enforce_eager"
        if self.config.runner.compilation.cudagraph_mode == "PIECEWISE":
            return "cudagraph_mode PIECEWISE (the compiled pieces replay graphs instead)"
        if self.attn_impl.name not in ("triton", "cuda"):
            return f"{self.attn_impl.name} attention"
        if self.pp.world_size > 1:
            return "pipeline parallel"
        if self._max_graph_batch() < 1:
            return "max_cudagraph_batch < 1"
        return None

    def _mixed_graph_sizes(self) -> list[int]:
        """Token counts of the mixed-step graphs: none unless the attention backend plans a
        mixed batch from its token and request counts alone (Triton; the CUDA backend splits
        the batch on the host)."""
        if self.ep is not None and self.ep.dp is not None:
            # Experts exchanged across data-parallel engines: the engines agree on decode
            # graphs only (engine_core/dp_lockstep); mixed steps run eagerly.
            return []
        if self.attn_impl.name != "triton" or self.arch.is_mla \
                or self.config.runner.compilation.cudagraph_mode == "PIECEWISE":
            # MLA's prefill (expanded) path walks its requests on the host. Under
            # FULL_AND_PIECEWISE the mixed steps these sizes hold replay whole-model graphs
            # of the compiled forward (its attention inside), the larger ones piecewise
            # graphs: piecewise replays leave attention eager between the pieces, which took
            # Qwen3-0.6B's 528-token mixed step on an H100 to 5.49 ms against 3.46 with a
            # whole-model graph (tools/results/compile_h100_qwen3_stop26.json).
            return []
        sizes = mixed_capture_sizes(min(self.config.runner.max_mixed_graph_tokens,
                                        self.bufs.input_ids.shape[0]))
        # A step holds at most max_num_seqs requests of at most max_model_len tokens each:
        # larger sizes never occur, and their dummy batch (``prepare_mixed``) could not be laid
        # out inside the block-table rows.
        limit = self.config.model.max_model_len
        return [t for t in sizes if t <= self._mixed_graph_reqs(t) * limit]

    def _mixed_graph_reqs(self, tokens: int) -> int:
        """Request slots of the mixed graph of ``tokens`` (every request has a token)."""
        return min(tokens, self.max_num_reqs)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        # The fused ops were picked (and the extension built) when the policy was resolved.
        graphs = CudaGraphRunner(capture_sizes(self._max_graph_batch()),
                                 self._mixed_graph_sizes())
        bufs = self.bufs
        r = self.max_num_reqs
        # With --compilation-config mode 3 the graphs capture the compiled forward (its pieces
        # and the attention op between them): cudagraph_mode FULL of a compiled model.
        run = self.model if self.compiled is None else self.compiled

        def prepare(size: int) -> None:
            if self.lora is not None:  # the LoRA kernels this size replays
                self.lora.capture_layout(size)
            self._dummy_decode_batch(size)

        def forward(size: int) -> torch.Tensor:
            assert self.model is not None
            meta = self._graph_meta(size)
            hidden, _ = run(bufs.input_ids[:size], bufs.positions[:size], meta)
            return hidden

        def prepare_mixed(tokens: int) -> None:
            if self.lora is not None:
                self.lora.capture_layout(None)
            # A dummy mixed batch: long prompt chunks of at most max_model_len tokens (a longer
            # context would read past its block-table row: a second engine in one process met
            # stale memory there, an illegal address), then one-token requests; nothing
            # written to the cache (slots -1), every context read from block 0.
            reqs = self._mixed_graph_reqs(tokens)
            lens = dummy_chunk_lens(tokens, reqs, self.config.model.max_model_len)
            lens_t = torch.tensor(lens, dtype=torch.int32, device=self.device)
            bufs.meta32[0] = 0
            bufs.meta32[1: reqs + 1] = torch.cumsum(lens_t, 0, dtype=torch.int32)
            bufs.meta32[r + 1:r + 1 + reqs] = lens_t
            bufs.slot_mappings[:, :tokens] = -1
            bufs.step_block_tables[:, :reqs] = 0
            bufs.positions[:tokens] = 0

        def forward_mixed(tokens: int) -> torch.Tensor:
            assert self.model is not None
            # The longest query is taken as the whole step, so the attention plan is the one
            # for long prompts whatever the split (see ops.attention_plan).
            meta = self._graph_meta(tokens, self._mixed_graph_reqs(tokens), max_query_len=tokens)
            hidden, _ = run(bufs.input_ids[:tokens], bufs.positions[:tokens], meta)
            return hidden

        graphs.capture(prepare, forward, prepare_mixed, forward_mixed)
        if self.lora is not None:
            self.lora.capture_layout(None)
        self.graphs = graphs
        if self.spec is not None and self.attn_impl.name == "triton":
            # (A propose step's first pass is a mixed batch: the CUDA backend plans those on
            # the host, so with it proposals run eagerly.)
            self.spec.capture_graphs(self._max_graph_batch())

    def _dummy_decode_batch(self, size: int) -> None:
        """Fill the fixed buffers with a decode batch of ``size`` requests of one context token
        each (read from block 0), nothing written to the cache, no token counted as real."""
        bufs = self.bufs
        r = self.max_num_reqs
        bufs.meta32[: size + 1] = torch.arange(size + 1, dtype=torch.int32, device=self.device)
        bufs.meta32[r + 1:r + 1 + size] = 1
        bufs.num_tokens.zero_()
        bufs.slot_mappings[:, :size] = -1
        bufs.step_block_tables[:, :size] = 0

    def _replay_empty_graph(self, batch: int) -> None:
        """Replay the decode graph ``batch`` pads to on a dummy batch: this engine has no
        request in a step the data-parallel engines agreed to run as that graph (its experts'
        exchange must meet theirs). Without graphs (a CPU) or past the largest, every engine
        runs the step eagerly: this one joins with no tokens."""
        size = None if self.graphs is None else self.graphs.size_for(batch)
        if size is None:
            assert self.ep is not None
            self.ep.run_empty_step()
            return
        assert self.graphs is not None
        self.launch_due()  # (the step before, if unsampled, reads the buffers rewritten here)
        self._dummy_decode_batch(size)
        self.graphs.replay(size)

    def _graph_meta(self, size: int, num_reqs: int | None = None,
                    max_query_len: int = 1) -> AttentionMetadata:
        """Metadata over the fixed buffers for a graph of ``size`` tokens and ``num_reqs``
        requests (a decode batch by default: one token each)."""
        bufs = self.bufs
        reqs = size if num_reqs is None else num_reqs
        host = np.zeros(0, dtype=np.int32)  # graph-capable backends never read host metadata
        meta = AttentionMetadata(
            num_actual_tokens=size, num_reqs=reqs, max_query_len=max_query_len,
            max_seq_len=self.config.model.max_model_len,
            query_start_loc=bufs.query_start_loc(reqs), seq_lens=bufs.seq_lens(reqs),
            block_table=bufs.step_block_table[:reqs], slot_mapping=bufs.slot_mapping[:size],
            query_start_loc_cpu=host, seq_lens_cpu=host,
            num_decodes=reqs if max_query_len == 1 else 0,
        )
        if self.num_kv_groups > 1:
            meta.groups = (meta,) + tuple(
                dataclasses.replace(meta, block_table=bufs.step_block_tables[g, :reqs],
                                    slot_mapping=bufs.slot_mappings[g, :size])
                for g in range(1, self.num_kv_groups))
        return meta

    # --- one step -----------------------------------------------------------------------------

    def apply_diffs(self, so: SchedulerOutput) -> dict[str, str]:
        """Bring the persistent batch up to date; returns requests that could not be taken."""
        failed = self._apply_new_and_finished(so)
        cr = so.cached_reqs
        if cr.req_ids:
            self._apply_cached(so, *self.batch.rows_of(cr.req_ids))
        return failed

    def _apply_new_and_finished(self, so: SchedulerOutput) -> dict[str, str]:
        b = self.batch
        lora = self.lora
        for rid in so.finished_req_ids:
            b.remove(rid)
            if lora is not None:
                lora.remove_request(rid)
        failed: dict[str, str] = {}
        for new in so.new_reqs:
            try:
                if lora is not None:  # a LoRAAdapterError (a ValueError) fails it alone
                    lora.add_request(new.req_id, new.lora_request)
                elif new.lora_request is not None:
                    raise ValueError("LoRA adapters need the engine started with --enable-lora")
                b.add(new, self.vocab_size)
            except ValueError as exc:
                failed[new.req_id] = str(exc)
                if lora is not None:
                    lora.remove_request(new.req_id)
        return failed

    def _apply_cached(self, so: SchedulerOutput, rows: np.ndarray, all_known: bool) -> None:
        """Diffs of requests the batch holds (``rows``: their rows, -1 for unknown ids)."""
        b = self.batch
        cr = so.cached_reqs
        computed = np.array(cr.num_computed_tokens, dtype=np.int32)
        if all_known:
            b.num_computed[rows] = computed
        else:  # a request this worker refused earlier
            keep = rows >= 0
            b.num_computed[rows[keep]] = computed[keep]
        for i, blocks in zip(cr.new_block_index, cr.new_block_ids):
            row = int(rows[i])
            if row >= 0:
                b.append_blocks(row, blocks)
        if cr.new_group_block_ids:  # several KV groups: groups 1..'s new entries
            for i, per_group in zip(cr.new_block_index, cr.new_group_block_ids):
                row = int(rows[i])
                if row >= 0:
                    for g, blocks in enumerate(per_group, 1):
                        b.append_blocks(row, blocks, g)
        forwarded = cr.new_token_ids
        if forwarded:
            for i, new in enumerate(forwarded):
                row = int(rows[i])
                if not new or row < 0:
                    continue
                # Pipeline parallelism: tokens sampled on the last stage, ending at this step's
                # last scheduled position (the sampling stage already holds them). Cached
                # requests come first in ``num_scheduled_tokens``.
                end = cr.num_computed_tokens[i] + so.num_scheduled_tokens[i]
                b.token_ids[row, end - len(new):end] = new
                b.num_tokens[row] = max(int(b.num_tokens[row]), end)

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, intermediate: IntermediateTensors | None = None,
        defer_sample: bool = False,
    ) -> ModelRunnerOutput | PendingStep | IntermediateTensors | SampleLater:
        """Run one step. With pipeline parallelism, stages after the first take the previous
        stage's ``intermediate`` tensors, and stages before the last return theirs instead of
        sampling. With async scheduling the output comes back as a ``PendingStep``. With
        ``defer_sample``, a step that samples stops after its logits and returns a
        ``SampleLater`` for ``finish_sample`` (or ``sample_lazily``)."""
        try:
            return self._execute_model(so, intermediate, defer_sample)
        finally:
            # Whatever path the step took: the step before is not left unsampled behind it.
            self.launch_due()

    def _execute_model(
        self, so: SchedulerOutput, intermediate: IntermediateTensors | None,
        defer_sample: bool,
    ) -> ModelRunnerOutput | PendingStep | IntermediateTensors | SampleLater:
        # Only the newest step's tokens may stay unknown on the host: its sampled ids on the
        # device fill the inputs that need them. A speculative step is resolved whole: its
        # emitted counts place this step's inputs.
        if self._inflight and isinstance(self._inflight[-1], PendingSpecStep):
            self.finish_inflight()
        while len(self._inflight) > 1:
            self._resolve_through(self._inflight[0])
        failed = self._apply_new_and_finished(so)
        b = self.batch
        req_ids = so.req_ids
        rows, all_known = b.rows_of(req_ids)
        n_cached = len(so.cached_reqs.req_ids)
        if n_cached:  # the cached requests come first
            self._apply_cached(so, rows[:n_cached], all_known)
            if so.spec_in_flight:
                assert self.spec is not None
                kept = self.spec.step_back(b, rows[:n_cached], req_ids[:n_cached], so.step_id)
                if (kept < 0).any():  # (``rows_of``'s array is read-only: a new one)
                    rows = np.concatenate((kept, rows[n_cached:]))
                    all_known = False
        if so.total_num_scheduled_tokens == len(req_ids):  # one token each: a decode batch
            n_sched = self._ones32[:len(req_ids)]
        else:
            n_sched = np.array(so.num_scheduled_tokens, dtype=np.int32)
        total: int | None = so.total_num_scheduled_tokens
        if failed or not all_known:
            keep = rows >= 0
            req_ids = [r for r, k in zip(req_ids, keep) if k]
            rows, n_sched = rows[keep], n_sched[keep]
            total = None
        # (Before any early return: the host tier's stores of this step must happen.)
        kv_meta = self.kv_hooks.before_forward(so) if self.kv_hooks is not None else None
        # Experts exchanged across data-parallel engines: a decode graph only where the engines
        # agreed on one, of the size they agreed on (0: this step runs eagerly everywhere).
        graph_batch = (so.dp_graph_batch if self.ep is not None and self.ep.active
                       else None)
        if not req_ids:
            if graph_batch:  # the other engines replay the graph of a decode batch
                self._replay_empty_graph(graph_batch)
            elif self.ep is not None:  # the other data-parallel ranks' MoE layers wait for ours
                self.ep.run_empty_step()
            result = ModelRunnerOutput(failed=failed)
            if kv_meta is not None:  # an empty step of the connector's: finished transfers
                assert self.kv_hooks is not None
                ConnectorHooks.report(result, self.kv_hooks.after_forward(so, kv_meta))
            return result
        if self._inflight and needs_token_history(b, rows):
            self._resolve_through(self._inflight[-1])  # penalties count every output token
        n_draft = None
        if so.scheduled_spec_decode_tokens:
            assert self.spec is not None
            n_draft = self.spec.write_drafts(b, rows, req_ids, so.scheduled_spec_decode_tokens)
        elif self.spec is not None:
            self.spec.write_drafts(b, rows[:0], [], {})  # (none: forget the last step's)
        inputs = self.prepare_inputs(rows, n_sched, total, n_draft, graph_batch)
        assert self.model is not None
        if graph_batch and inputs.graph_size is None and self.graphs is not None \
                and self.graphs.size_for(graph_batch) is not None:
            # Run eagerly, this step's exchange would wait forever for the other engines'.
            raise RuntimeError("expert parallel: the data-parallel engines agreed on a decode "
                               f"graph for batch {graph_batch}, but this engine's step is not a "
                               "decode batch")
        if graph_batch and inputs.graph_size is not None:
            if not self.exchange_graph_replays:
                logger.info("expert parallel: first decode step replaying the graph agreed "
                            "with the other data-parallel engines (%d requests here, %d at "
                            "most on an engine, graph of %d)", len(req_ids), graph_batch,
                            inputs.graph_size)
            self.exchange_graph_replays += 1
        num_tokens = inputs.meta.num_actual_tokens
        if self.lora is not None:
            graph = inputs.graph_size or inputs.mixed_graph_tokens
            self.lora.prepare_step(req_ids, n_sched, graph or num_tokens, eager=graph is None,
                                   decode=inputs.mixed_graph_tokens is None
                                   and inputs.meta.max_query_len == 1)
        if inputs.graph_size is not None:
            assert self.graphs is not None
            hidden = self.graphs.replay(inputs.graph_size)[:num_tokens]
            residual = None
        elif inputs.mixed_graph_tokens is not None:
            assert self.graphs is not None
            hidden = self.graphs.replay_mixed(inputs.mixed_graph_tokens)[:num_tokens]
            residual = None
        elif self.compiled is not None and intermediate is None:
            # (Piecewise graphs pad the step within the fixed buffers; the warm-up's mixed
            # steps run the pieces without graphs, like the mixed whole-model graphs.)
            pad = self.mixed_graphs_on or inputs.meta.max_query_len == 1
            hidden, residual = self.compiled.run(
                inputs.input_ids, inputs.positions, inputs.meta,
                (self.bufs.input_ids, self.bufs.positions) if pad else None)
        else:
            hidden, residual = self.model(
                inputs.input_ids, inputs.positions, inputs.meta,
                None if intermediate is None else intermediate.hidden,
                None if intermediate is None else intermediate.residual)
        b.num_computed[rows] = inputs.seq_lens
        if kv_meta is not None:
            assert self.kv_hooks is not None
            kv_done = self.kv_hooks.after_forward(so, kv_meta)
        if not self.pp.is_last:
            return IntermediateTensors(hidden, residual)
        if self.spec is not None:  # (an EAGLE-3 head reads the step's hidden states)
            self.spec.observe(rows, inputs.cu, inputs.seq_lens, self.model)
        prompt_lp = (self._prompt_logprobs(req_ids, inputs, hidden)
                     if b.num_prompt_logprobs_rows else {})
        result = ModelRunnerOutput(failed=failed, prompt_logprobs=prompt_lp)
        if kv_meta is not None:
            ConnectorHooks.report(result, kv_done)
        if inputs.sampling is None:
            if self.spec is not None and self.spec.drafter is not None:
                self.spec.propose(b, rows[:0], [])  # prompt chunks into the draft's cache
            return result
        mask = inputs.sample_mask
        if inputs.all_sample:
            sample_rows, sampled_ids = rows, req_ids
        else:
            sample_rows = rows[mask]
            sampled_ids = [r for r, m in zip(req_ids, mask) if m]
        picked = hidden if inputs.logits_indices is None else hidden[inputs.logits_indices]
        logits = self.model.compute_logits(picked)
        later = SampleLater(so, logits, inputs.sampling, sample_rows, sampled_ids, result,
                            failed)
        if self.spec is not None and (so.scheduled_spec_decode_tokens or so.propose_drafts):
            # (The EngineCore never defers sampling with speculation.)
            return self._verify_and_propose(later)
        return later if defer_sample else self.finish_sample(later)

    def _verify_and_propose(self, later: SampleLater) -> ModelRunnerOutput | PendingSpecStep:
        """Speculative decoding's sampling: verify the step's drafts (a request without drafts
        samples its one token the same way), append what each request emitted, and propose
        its next drafts. With async scheduling and a model drafter the step comes back
        unresolved (``PendingSpecStep``): the EngineCore schedules the next step meanwhile,
        with placeholder drafts (``SchedulerOutput.spec_in_flight``)."""
        spec = self.spec
        assert spec is not None
        # Verification appends each request's tokens to its row: an older step still in flight
        # (async scheduling pipelines the steps that do not speculate) lands first.
        self.finish_inflight()
        so = later.so
        if so.grammar_req_ids:  # one mask per verify position
            self._attach_grammar(so, later.sampling, later.sampled_ids,
                                 so.scheduled_spec_decode_tokens)
        elif self.defer_output and spec.config.drafts_on_device:
            launch = spec.launch_verify(self.batch, later.logits, later.sampling,
                                        later.sample_rows, later.sampled_ids, so.step_id,
                                        propose=so.propose_drafts)
            if launch is not None:
                self._mask_staging.consumed()
                pending = PendingSpecStep(self, later, launch)
                self._inflight.append(pending)  # type: ignore[arg-type]
                return pending
        emitted, bad, logprobs = spec.verify(
            self.batch, later.logits, later.sampling, self.sampling_builder, later.sample_rows,
            later.sampled_ids, so.step_id, propose=so.propose_drafts)
        self._mask_staging.consumed()
        result, rows = self._spec_result(later, emitted, bad)
        result.logprobs = logprobs  # one row per emitted token, in order
        if so.propose_drafts:
            result.spec_token_ids = spec.propose(self.batch, rows,
                                                 result.sampled_token_ids).lists()
        else:
            spec.proposal = None  # (no step verifies an older one's)
        if self.expert_load is not None:  # (verification waited for the device already)
            result.expert_load = self.expert_load.snapshot().tolist()
        return result

    def _spec_result(self, later: SampleLater, emitted: list[list[int]],
                     bad: dict[str, str]) -> tuple[ModelRunnerOutput, np.ndarray]:
        """The step's output with what each request emitted (the requests that emitted
        nothing failed), and their rows."""
        result = later.result
        result.failed = later.failed
        for rid, why in bad.items():
            result.failed[rid] = why
        keep = [i for i, e in enumerate(emitted) if e]
        rows = later.sample_rows[keep] if len(keep) < len(emitted) else later.sample_rows
        result.req_ids = [later.sampled_ids[i] for i in keep]
        result.sampled_token_ids = [emitted[i] for i in keep]
        return result, rows

    @torch.inference_mode()  # (also when called from a result wait, outside a step)
    def _finish_spec_step(self, pending: PendingSpecStep) -> None:
        """``PendingSpecStep._resolve``: the emitted tokens into the rows, the next drafts
        proposed (or, launched early, picked up) and left on the device."""
        assert self.spec is not None
        later = pending.later
        emitted = self.spec.finish_verify(self.batch, pending.launch)
        result, rows = self._spec_result(later, emitted, {})
        if later.so.propose_drafts:
            pending.proposal = self.spec.propose(self.batch, rows, result.sampled_token_ids,
                                                 defer=True)
        else:
            self.spec.proposal = None
        if self.expert_load is not None:
            result.expert_load = self.expert_load.snapshot().tolist()

    @torch.inference_mode()
    def finish_sample(self, later: SampleLater, grammar_req_ids: list[str] | None = None,
                      grammar_bitmask: np.ndarray | None = None
                      ) -> ModelRunnerOutput | PendingStep:
        """Sample a step ``execute_model`` launched, under the grammar masks given here (or
        those its scheduler output carried)."""
        so = later.so
        if grammar_req_ids:
            so.grammar_req_ids, so.grammar_bitmask = grammar_req_ids, grammar_bitmask
        if so.grammar_req_ids:
            self._attach_grammar(so, later.sampling, later.sampled_ids)
        out, bad = self._sample(later.logits, later.sampling, later.sample_rows,
                                later.sampled_ids)
        self._mask_staging.consumed()
        if self.config.parallel.tp_devices and self.tp.world_size > 1:
            # Ranks on different devices draw different random numbers: every rank takes the
            # output rank's tokens (its next inputs must agree with the others').
            self.tp.broadcast(out.token_ids, 0)
        failed = later.failed
        for rid, why in bad.items():
            failed[rid] = why
        pending = self._launch_output(later.result, out, later.sample_rows, later.sampled_ids,
                                      bad)
        if self.defer_output:
            return pending
        self._resolve_through(pending)
        return pending.result

    def sample_lazily(self, later: SampleLater,
                      masks: Callable[[], tuple[list[str], np.ndarray | None]]) -> PendingStep:
        """``finish_sample`` later: the step is booked now (its rows' placeholders, so the next
        step's inputs can be prepared on the host) and sampled, under ``masks()``, just before
        the next step's first device work (``prepare_inputs``), or when anything needs its
        tokens first. The masks are filled meanwhile, side by side with the next step's host
        work, so the device waits for them and not for that work too. One process, one rank,
        and a step whose sampling reads no per-request host state the next step could change
        (logits processors, per-row generators): otherwise it is sampled now."""
        meta = later.sampling
        if (self.tp.world_size > 1 or not self.defer_output or meta.logits_procs is not None
                or meta.generators):
            ids, mask = masks()
            out = self.finish_sample(later, ids, mask)
            assert isinstance(out, PendingStep)
            return out
        self.launch_due()  # (one at a time)
        n = len(later.sample_rows)
        tokens = torch.empty(n, dtype=torch.int64, device=self.device)
        pending = self._book_output(later.result, later.sample_rows, later.sampled_ids, tokens)

        @torch.inference_mode()  # (also when called from a result wait, outside a step)
        def launch() -> None:
            pending.launch = None
            if self._due is pending:
                self._due = None
            ids, mask = masks()
            so = later.so
            if ids:
                so.grammar_req_ids, so.grammar_bitmask = ids, mask
                self._attach_grammar(so, meta, later.sampled_ids)
            out, bad = self._sample(later.logits, meta, later.sample_rows, later.sampled_ids)
            self._mask_staging.consumed()
            tokens.copy_(out.token_ids)
            for rid, why in bad.items():
                later.failed[rid] = why
            self._copy_output(pending, out, later.sampled_ids, bad)

        pending.launch = launch
        self._due = pending
        return pending

    def launch_due(self) -> None:
        """Sample the step ``sample_lazily`` booked, if it is not yet."""
        due = self._due
        if due is not None and due.launch is not None:
            due.launch()
        self._due = None

    def prepare_inputs(self, rows: np.ndarray, n_sched: np.ndarray,
                       total: int | None = None,
                       n_draft: np.ndarray | None = None,
                       graph_batch: int | None = None) -> StepInputs:
        """Gather this step's inputs from the persistent batch (numpy), stage them in pinned
        memory, copy them over in a few transfers, and finish on the device: block-table
        updates, slot mapping, the step's block table, placeholder fills. ``total``: the sum
        of ``n_sched``, if known. ``n_draft``: draft tokens per request (speculative
        decoding): logits and sampling rows at each verify position. ``graph_batch``: the
        batch size whose decode graph this step replays (0: none, the step runs eagerly;
        None: this step's own, if captured)."""
        b = self.batch
        bufs = self.bufs
        bs = self.block_size
        if not self.on_gpu:
            # Off a GPU the staged arrays are the step's tensors themselves: the step before,
            # if booked unsampled, samples before they are overwritten.
            self.launch_due()
        hs = bufs.begin()
        num_reqs = len(rows)
        computed = b.num_computed[rows]
        seq_lens = computed + n_sched
        if total is None:
            total = int(n_sched.sum())
        decode_only = total == num_reqs
        if decode_only:
            cu = self._arange32[:num_reqs + 1]
            token_rows = rows
            positions = computed  # int32 here; the staging buffer widens it
        else:
            cu = np.zeros(num_reqs + 1, dtype=np.int32)
            np.cumsum(n_sched, out=cu[1:])
            token_rows = np.repeat(rows, n_sched)
            positions = (np.repeat((computed - cu[:-1]).astype(np.int64), n_sched)
                         + self._arange64[:total])
        ids = b.token_ids[token_rows, positions]
        graph_size = mixed_tokens = None
        padded_reqs, padded_tokens = num_reqs, total
        if self.graphs is not None and graph_batch != 0:
            if decode_only:
                graph_size = self.graphs.size_for(num_reqs if graph_batch is None
                                                  else max(graph_batch, num_reqs))
                if graph_size is not None:
                    padded_reqs = padded_tokens = graph_size
            elif self.mixed_graphs_on:
                mixed_tokens = self.graphs.mixed_size_for(total)
                if mixed_tokens is not None:
                    padded_reqs = self._mixed_graph_reqs(mixed_tokens)
                    padded_tokens = mixed_tokens

        hs.ids_np[:total] = ids
        hs.pos_np[:total] = positions
        m = hs.meta32_np
        r = self.max_num_reqs
        m[:num_reqs + 1] = cu
        m[r + 1:r + 1 + num_reqs] = seq_lens
        m[bufs.num_tokens_index] = total
        if padded_reqs > num_reqs:
            # Padding requests: no query (empty range at the end), no context.
            m[num_reqs + 1:padded_reqs + 1] = total
            m[r + 1 + num_reqs:r + 1 + padded_reqs] = 0

        put = bufs.put
        # Slot inputs: index of the token's block-table entry, and its offset in the block; the
        # slot itself is looked up on the device. Padding tokens point at the table's trailing
        # -1 with offset bs - 1 (slot -1: nothing is written for them).
        flat = np.empty(2 * padded_tokens, dtype=np.int64)
        np.floor_divide(positions, bs, out=flat[:total])
        flat[:total] += token_rows * bufs.width
        np.remainder(positions, bs, out=flat[padded_tokens:padded_tokens + total])
        if padded_tokens > total:
            flat[total:padded_tokens] = bufs.pad_index
            flat[padded_tokens + total:] = bs - 1
        slot_in = put(flat, torch.int64)
        rows_d = put(rows, torch.int64)
        updates = b.take_block_updates()
        upd_d = None
        if updates is not None:
            upd_d = (put(updates[0], torch.int64), put(updates[1], torch.int32))

        sample_mask = seq_lens >= b.num_tokens[rows]
        all_sample = bool(sample_mask.all())
        logits_d = None
        if n_draft is not None:
            assert self.spec is not None
            logits_d = put(self.spec.logits_rows(cu, sample_mask, n_draft), torch.int64)
        elif not (decode_only and all_sample):
            logits_d = put((cu[1:][sample_mask] - 1).astype(np.int64), torch.int64)
        drafts_fill = None
        if n_draft is not None and self.spec is not None and self.spec.has_device_drafts:
            # Drafts proposed after the step before, still only on the device.
            unknown = np.flatnonzero(ids < 0)
            if unknown.size:
                rows_u, pos_u = token_rows[unknown], positions[unknown]
                src = self.spec.device_draft_sources(rows_u, pos_u)
                ids[unknown] = 0
                drafts_fill = (put(unknown.astype(np.int64), torch.int64),
                               put(src, torch.int64), rows_u, pos_u)
        fill = self._placeholder_fill(ids, token_rows, positions, put)
        sampling = None
        if self.pp.is_last and (all_sample or sample_mask.any()):
            sample_rows = rows if all_sample else rows[sample_mask]
            if n_draft is None:
                sampling = self.sampling_builder.build(b, sample_rows, put)
            else:
                assert self.spec is not None
                sampling = self.spec.verify_sampling(self.sampling_builder, b, sample_rows,
                                                     n_draft[sample_mask], put)
        # The step before, if booked unsampled, samples now (on a GPU): the copies below
        # overwrite the device staging its sampling reads, the placeholder fill reads its
        # tokens.
        self.launch_due()
        bufs.flush(total, padded_reqs)

        # On the device, in stream order after the copies.
        if upd_d is not None:
            bufs.apply_block_updates(*upd_d)
        bufs.compute_slots(slot_in[:padded_tokens], slot_in[padded_tokens:], padded_tokens)
        views = bufs.views(total, num_reqs)
        block_table = bufs.gather_block_table(rows_d, views.block_table)
        if fill is not None:
            dst, src, tokens = fill
            if dst is None:
                views.input_ids.copy_(tokens)
            else:
                bufs.input_ids.index_copy_(0, dst, tokens.index_select(0, src))
        if drafts_fill is not None:
            assert self.spec is not None
            self.spec.fill_device_drafts(bufs.input_ids, *drafts_fill)
        if decode_only:
            leading_decodes, max_query = num_reqs, 1
        else:
            ones = n_sched == 1
            leading_decodes = int(np.argmin(ones)) if not ones.all() else num_reqs
            max_query = int(n_sched.max())
        meta = AttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            max_query_len=max_query,
            max_seq_len=int(seq_lens.max()),
            query_start_loc=views.query_start_loc,
            seq_lens=views.seq_lens,
            block_table=block_table,
            slot_mapping=views.slot_mapping,
            query_start_loc_cpu=cu,
            seq_lens_cpu=seq_lens,
            num_decodes=leading_decodes,
        )
        if self.num_kv_groups > 1:
            per_group = bufs.group_tables(slot_in[:padded_tokens], slot_in[padded_tokens:],
                                          padded_tokens, rows_d, num_reqs)
            meta.groups = (meta,) + tuple(
                dataclasses.replace(meta, block_table=table, slot_mapping=slots)
                for slots, table in per_group)
        return StepInputs(
            input_ids=views.input_ids,
            positions=views.positions,
            meta=meta,
            rows=rows,
            cu=cu,
            seq_lens=seq_lens,
            sample_mask=sample_mask,
            all_sample=all_sample,
            logits_indices=logits_d,
            sampling=sampling,
            graph_size=graph_size,
            mixed_graph_tokens=mixed_tokens,
        )

    def _placeholder_fill(self, ids: np.ndarray, token_rows: np.ndarray,
                          positions: np.ndarray, put) -> tuple | None:
        """Inputs whose token the host doesn't know yet come from the newest in-flight step's
        sampled ids on the device: returns (destinations, sources, that step's ids), with
        destinations and sources None when every input is the sample of the same request in
        that step, in the same order (a steady decode batch: one plain copy)."""
        if not self._inflight:
            if ids.min(initial=0) < 0:
                raise RuntimeError("an input token is unknown but no step is in flight")
            return None
        tokens = self._inflight[-1].tokens_dev
        if token_rows is self._last_sampled_rows and ids.max() < 0:
            # Every input is unknown, and these are the very rows that step sampled, in its
            # order: each at its sampled position (only the newest step's can be unknown).
            return None, None, tokens
        unknown = np.flatnonzero(ids < 0)
        if not unknown.size:
            return None
        rows_u = token_rows[unknown]
        src = self._index_of_row[rows_u]
        if (src < 0).any() or (self._pos_of_row[rows_u] != positions[unknown]).any():
            raise RuntimeError("an input token is unknown and not sampled by the previous step")
        return put(unknown.astype(np.int64), torch.int64), put(src, torch.int64), tokens

    # --- sampling and outputs ---------------------------------------------------------------------

    def grammar_buffer(self, rows: int) -> np.ndarray:
        """Host memory (pinned on a GPU) for the EngineCore to fill the next step's masks into:
        ``finish_sample`` copies them from there without another host copy."""
        return self._mask_staging.buffer(rows)

    def grammar_uploader(self) -> Callable[[], None] | None:
        """On a GPU: copies the buffer ``grammar_buffer`` just handed out to the device on a
        side stream, for the filler to call once it is filled (``MaskStaging.uploader``)."""
        return self._mask_staging.uploader()

    def _attach_grammar(self, so: SchedulerOutput, meta: SamplingMetadata,
                        sampled_ids: list[str], drafts: dict[str, list[int]] | None = None
                        ) -> None:
        """The step's grammar bitmasks on the device (one host-to-device copy) and the
        sampling rows they belong to (with ``drafts``, each verify position's)."""
        assert so.grammar_bitmask is not None
        placed = grammar_rows(so.grammar_req_ids, sampled_ids, drafts)
        if placed is None:
            return
        src, dst = placed
        bitmask = self._mask_staging.to_device(so.grammar_bitmask)
        if len(src) < bitmask.shape[0]:  # a grammar row whose request does not sample
            bitmask = bitmask[to_device(src, self.device)]
        meta.grammar_bitmask = bitmask
        if dst is not None:
            meta.grammar_rows = to_device(dst, self.device)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata, rows: np.ndarray,
                req_ids: list[str]) -> tuple[SamplerOutput, dict[str, str]]:
        """Sample the batch; if that raises, sample row by row so only the rows that fail are
        dropped (one bad request never takes the step down)."""
        try:
            return self.sampler(logits, meta), {}
        except Exception as exc:  # noqa: BLE001 - isolated below, row by row
            logger.warning("batched sampling failed (%s); isolating the failing request(s)", exc)
        tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        bad: dict[str, str] = {}
        dev = self.device

        def direct(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(arr)).to(dev, dtype=dtype)

        for i, rid in enumerate(req_ids):
            try:
                one = self.sampling_builder.build(self.batch, rows[i:i + 1], direct)
                # (The batched call applied the grammar masks to ``logits`` in place first.)
                out = self.sampler(logits[i:i + 1], one)
                tokens[i] = out.token_ids[0]
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                bad[rid] = f"sampling failed: {exc}"
        # Logprobs are dropped for this step rather than recomputed row by row.
        return SamplerOutput(tokens, None), bad

    def _launch_output(self, result: ModelRunnerOutput, out: SamplerOutput,
                       sample_rows: np.ndarray, sampled_ids: list[str],
                       bad: dict[str, str]) -> PendingStep:
        """Record the sampled tokens as placeholders and start their copy to the host."""
        pending = self._book_output(result, sample_rows, sampled_ids, out.token_ids)
        self._copy_output(pending, out, sampled_ids, bad)
        return pending

    def _book_output(self, result: ModelRunnerOutput, sample_rows: np.ndarray,
                     sampled_ids: list[str], tokens: torch.Tensor) -> PendingStep:
        """The host's side of a sampling step, which needs no token: placeholders at the
        sampled positions, where the next step finds each row's token (``tokens``: the
        device tensor the step's tokens are, or will be copied, in), and the step in flight."""
        b = self.batch
        positions = b.append_placeholders(sample_rows)
        if sample_rows is not self._last_sampled_rows:  # else the indices stand as they are
            self._index_of_row[self._last_sampled_rows] = -1
            self._index_of_row[sample_rows] = np.arange(len(sample_rows), dtype=np.int64)
        self._pos_of_row[sample_rows] = positions
        self._last_sampled_rows = sample_rows
        pending = PendingStep(
            runner=self, result=result, req_ids=sampled_ids, rows=sample_rows,
            positions=positions, generations=b.generation[sample_rows],
            membership=b.membership, tokens_dev=tokens, tokens_host=None, logprobs_host=None,
            copied=None)
        self._inflight.append(pending)
        return pending

    def _copy_output(self, pending: PendingStep, out: SamplerOutput, sampled_ids: list[str],
                     bad: dict[str, str]) -> None:
        """Start copying a booked step's tokens (and logprobs, expert load) to the host; rows
        whose sampling failed (``bad``) are left out."""
        tokens = out.token_ids
        keep = None
        if bad:
            keep = np.array([i for i, rid in enumerate(sampled_ids) if rid not in bad],
                            dtype=np.int64)
            pending.req_ids = [sampled_ids[i] for i in keep]
            pending.rows = pending.rows[keep]
            pending.positions = pending.positions[keep]
            pending.generations = pending.generations[keep]
        lp = out.logprobs
        # (In stream order after this step's forward: what it routed, and nothing later.)
        load = self.expert_load.snapshot() if self.expert_load is not None else None
        if self.on_gpu:
            main = torch.cuda.current_stream(self.device)
            stream = self._copy_stream
            assert stream is not None
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                sel = tokens if keep is None else tokens[torch.from_numpy(keep).to(self.device)]
                pending.tokens_host = _to_pinned(sel)
                if lp is not None:
                    pending.logprobs_host = self._logprobs_to_host(lp, keep)
                if load is not None:
                    load.record_stream(stream)  # (made on the main stream, read here)
                    pending.expert_load_host = _to_pinned(load)
                pending.copied = torch.cuda.Event()
                pending.copied.record(stream)
        else:
            pending.tokens_host = tokens if keep is None else tokens[torch.from_numpy(keep)]
            if lp is not None:
                pending.logprobs_host = self._logprobs_to_host(lp, keep)
            pending.expert_load_host = load

    def _logprobs_to_host(self, lp, keep: np.ndarray | None):
        ids, vals, ranks = lp.token_ids, lp.logprobs, lp.ranks
        if keep is not None:
            idx = torch.from_numpy(keep).to(ids.device)
            ids, vals, ranks = ids[idx], vals[idx], ranks[idx]
        move = _to_pinned if self.on_gpu else (lambda t: t)
        return move(ids.to(torch.int32)), move(vals), move(ranks.to(torch.int32))

    def _resolve_through(self, step: PendingStep) -> None:
        """Apply every in-flight step's tokens up to and including ``step``, in order."""
        while self._inflight:
            head = self._inflight.popleft()
            head._resolve()
            if head is step:
                return
        if not step.done:
            step._resolve()

    # --- prompt logprobs ------------------------------------------------------------------------

    def _prompt_logprobs(self, req_ids: list[str], inputs: StepInputs,
                         hidden: torch.Tensor) -> dict[str, tuple[int, LogprobsArrays]]:
        b = self.batch
        out: dict[str, tuple[int, LogprobsArrays]] = {}
        wanted = b.num_prompt_logprobs[inputs.rows]
        if not (wanted >= 0).any():
            return out
        assert self.model is not None
        for i in np.nonzero(wanted >= 0)[0]:
            row = int(inputs.rows[i])
            extra = b.extras[row]
            assert extra is not None
            start = int(inputs.seq_lens[i]) - int(inputs.cu[i + 1] - inputs.cu[i])
            # Hidden state at position p predicts prompt token p + 1.
            first = max(start, extra.prompt_logprobs_from - 1)
            last = min(int(inputs.seq_lens[i]), int(b.num_prompt_tokens[row]) - 1)
            if first >= last:
                continue
            flat = torch.arange(first - start, last - start, device=hidden.device) + int(
                inputs.cu[i])
            logprobs = self.model.compute_logits(hidden[flat]).float().log_softmax(dim=-1)
            targets = torch.from_numpy(
                b.token_ids[row, first + 1:last + 1].astype(np.int64)).to(hidden.device)
            n = int(wanted[i])
            chosen = logprobs.gather(1, targets.unsqueeze(1))
            ranks = (logprobs > chosen).sum(dim=-1) + 1
            ids, vals = targets.unsqueeze(1), chosen
            if n > 0:
                top_v, top_i = logprobs.topk(n, dim=-1)
                ids, vals = torch.cat((ids, top_i), 1), torch.cat((vals, top_v), 1)
            out[req_ids[i]] = (first + 1, LogprobsArrays(
                ids.to(torch.int32).cpu().numpy(), vals.cpu().numpy(),
                ranks.to(torch.int32).cpu().numpy()))
        return out
