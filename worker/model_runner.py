"""Runs one scheduler step on one worker: applies the step's diffs to the persistent batch,
prepares inputs with vectorised numpy, runs the model, samples, and reports the new tokens."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.protocol import LogprobsArrays, ModelRunnerOutput, SchedulerOutput
from tidal.worker.attention.backend import AttentionMetadata, kv_cache_shape
from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.input_batch import InputBatch
from tidal.worker.loader.model_loader import load_model, torch_dtype
from tidal.worker.sample.metadata import SamplingMetadata
from tidal.worker.sample.sampler import Sampler, SamplerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_BYTES = 2 << 30
_SEED_MIX = 0x9E3779B97F4A7C15
_INT63 = (1 << 63) - 1


def position_seed(seed: int, position: int) -> int:
    """Seed of one sampled position: a pure function of the request's seed and how many tokens it
    has generated, so a seeded request draws the same numbers whatever the batch around it and
    after a preemption."""
    return ((seed ^ ((position + 1) * _SEED_MIX)) & _INT63) or 1


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
    logits_indices: torch.Tensor


def _select_attention(name: str | None, device: torch.device):
    try:
        from tidal.worker.attention.selector import get_attention_impl
    except ImportError:
        from tidal.worker.attention.torch_backend import TorchAttention

        if name not in (None, "torch"):
            raise ValueError(f"attention backend {name!r} is not available in this build")
        return TorchAttention()
    return get_attention_impl(name, device)


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device,
                 tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> None:
        self.config = config
        self.device = device
        self.tp = tp or single_group()
        self.pp = pp or single_group()
        self.arch = config.model.arch
        self.vocab_size = self.arch.vocab_size
        self.block_size = config.cache.block_size
        self.dtype = torch_dtype(config.model.dtype)
        self.attn_impl = _select_attention(config.runner.attention_backend, device)
        self.batch = InputBatch(config.scheduler.max_num_seqs, config.model.max_model_len,
                                config.max_blocks_per_seq, config.model.eos_token_ids)
        self.sampler = Sampler()
        self.model: torch.nn.Module | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._generators: dict[int, torch.Generator] = {}

    # --- start-up -----------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.config.model, self.device, self.attn_impl, self.tp, self.pp)

    def kv_bytes_per_block(self) -> int:
        assert self.model is not None
        layers = self.model.attention_layers()
        if not layers:
            return 0
        a = layers[0]
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(layers) * self.block_size * a.num_kv_heads * a.head_dim * elem

    def determine_num_blocks(self) -> int:
        """How many KV blocks fit: forced by the config, or from the memory budget."""
        if self.config.cache.num_blocks is not None:
            return self.config.cache.num_blocks
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cpu":
            budget = self.config.cache.kv_cache_memory_bytes or DEFAULT_CPU_KV_BYTES
            return max(1, budget // per_block)
        return self._profile_gpu_blocks(per_block)

    def _profile_gpu_blocks(self, per_block: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - used_by_others
        if self.config.cache.kv_cache_memory_bytes is not None:
            budget = self.config.cache.kv_cache_memory_bytes
        blocks = budget // per_block
        need = -(-self.config.model.max_model_len // self.block_size)
        if blocks < need:
            short = (need - max(blocks, 0)) * per_block
            raise RuntimeError(
                f"the model leaves room for {max(blocks, 0)} KV blocks but one sequence of "
                f"max_model_len={self.config.model.max_model_len} needs {need}: short by "
                f"{short / 2**30:.2f} GiB; raise --gpu-memory-utilization (now "
                f"{self.config.cache.gpu_memory_utilization}), lower --max-model-len, or use "
                "more GPUs (tensor parallelism)"
            )
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB); peak activations %.2f GiB",
                    blocks, self.block_size, blocks * per_block / 2**30, peak / 2**30)
        return int(blocks)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        """One forward pass at the largest token budget, on a throwaway cache, to measure the
        activation peak."""
        assert self.model is not None
        n = self.config.scheduler.max_num_batched_tokens
        n_blocks = -(-n // self.block_size)
        self.init_kv_cache(n_blocks)
        meta = self._dummy_meta(n, n_blocks)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device) % self.config.model.max_model_len
        hidden, _ = self.model(ids, pos, meta)
        if self.pp.is_last:
            rows = min(self.config.scheduler.max_num_seqs, n)
            self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        self.kv_caches = []
        del hidden
        torch.cuda.empty_cache()

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

    def init_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None
        self.kv_caches = []
        for layer in self.model.attention_layers():
            shape = kv_cache_shape(num_blocks, self.block_size, layer.num_kv_heads,
                                   layer.head_dim)
            cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            layer.kv_cache = cache
            self.kv_caches.append(cache)

    # --- one step -----------------------------------------------------------------------------

    def apply_diffs(self, so: SchedulerOutput) -> dict[str, str]:
        """Bring the persistent batch up to date; returns requests that could not be taken."""
        b = self.batch
        for rid in so.finished_req_ids:
            b.remove(rid)
        failed: dict[str, str] = {}
        for new in so.new_reqs:
            try:
                b.add(new, self.vocab_size)
            except ValueError as exc:
                failed[new.req_id] = str(exc)
        cr = so.cached_reqs
        for i, (rid, blocks, computed) in enumerate(
                zip(cr.req_ids, cr.new_block_ids, cr.num_computed_tokens)):
            row = b.row_of.get(rid)
            if row is None:
                continue
            b.append_blocks(row, blocks)
            b.num_computed[row] = computed
            if cr.new_token_ids and cr.new_token_ids[i]:
                # Pipeline parallelism: tokens sampled on the last stage, ending at this step's
                # last scheduled position (the sampling stage already holds them).
                new = cr.new_token_ids[i]
                end = computed + so.num_scheduled_tokens.get(rid, 0)
                b.token_ids[row, end - len(new):end] = new
                b.num_tokens[row] = max(int(b.num_tokens[row]), end)
        return failed

    @torch.inference_mode()
    def execute_model(
        self, so: SchedulerOutput, intermediate: IntermediateTensors | None = None
    ) -> ModelRunnerOutput | IntermediateTensors:
        """Run one step. With pipeline parallelism, stages after the first take the previous
        stage's ``intermediate`` tensors, and stages before the last return theirs instead of
        sampling."""
        failed = self.apply_diffs(so)
        b = self.batch
        req_ids = [rid for rid in so.num_scheduled_tokens if rid in b.row_of]
        if not req_ids:
            return ModelRunnerOutput(failed=failed)
        rows = np.fromiter((b.row_of[r] for r in req_ids), np.int64, len(req_ids))
        n_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), np.int32,
                              len(req_ids))
        inputs = self.prepare_inputs(rows, n_sched)
        assert self.model is not None
        hidden, residual = self.model(
            inputs.input_ids, inputs.positions, inputs.meta,
            None if intermediate is None else intermediate.hidden,
            None if intermediate is None else intermediate.residual)
        if not self.pp.is_last:
            b.num_computed[rows] = inputs.seq_lens
            return IntermediateTensors(hidden, residual)
        prompt_lp = self._prompt_logprobs(req_ids, inputs, hidden)
        sample_rows = rows[inputs.sample_mask]
        sampled_ids = [rid for rid, m in zip(req_ids, inputs.sample_mask) if m]
        result = ModelRunnerOutput(failed=failed, prompt_logprobs=prompt_lp)
        b.num_computed[rows] = inputs.seq_lens
        if len(sample_rows):
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
            out, bad = self._sample(logits, sample_rows, sampled_ids)
            for rid, why in bad.items():
                failed[rid] = why
            tokens = out.token_ids.tolist()
            keep = [i for i, rid in enumerate(sampled_ids) if rid not in bad]
            for i in keep:
                b.append_token(int(sample_rows[i]), tokens[i])
            result.req_ids = [sampled_ids[i] for i in keep]
            result.sampled_token_ids = [[tokens[i]] for i in keep]
            if out.logprobs is not None:
                lp = out.logprobs
                idx = torch.tensor(keep, dtype=torch.long, device=lp.token_ids.device)
                result.logprobs = LogprobsArrays(
                    lp.token_ids.index_select(0, idx).to(torch.int32).cpu().numpy(),
                    lp.logprobs.index_select(0, idx).cpu().numpy(),
                    lp.ranks.index_select(0, idx).to(torch.int32).cpu().numpy(),
                )
        return result

    def prepare_inputs(self, rows: np.ndarray, n_sched: np.ndarray) -> StepInputs:
        b = self.batch
        bs = self.block_size
        num_reqs = len(rows)
        computed = b.num_computed[rows]
        cu = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(n_sched, out=cu[1:])
        total = int(cu[-1])
        token_rows = np.repeat(rows, n_sched)
        positions = np.repeat(computed - cu[:-1], n_sched) + np.arange(total, dtype=np.int32)
        input_ids = b.token_ids[token_rows, positions]
        slots = (b.block_table[token_rows, positions // bs].astype(np.int64) * bs
                 + positions % bs)
        seq_lens = computed + n_sched
        max_seq = int(seq_lens.max())
        block_table = b.block_table[rows, : -(-max_seq // bs)]
        sample_mask = seq_lens >= b.num_tokens[rows]
        logits_indices = cu[1:][sample_mask] - 1
        leading_decodes = int(np.argmin(n_sched == 1)) if (n_sched != 1).any() else num_reqs

        dev = self.device
        meta = AttentionMetadata(
            num_actual_tokens=total,
            num_reqs=num_reqs,
            max_query_len=int(n_sched.max()),
            max_seq_len=max_seq,
            query_start_loc=_to(cu, dev),
            seq_lens=_to(seq_lens.astype(np.int32), dev),
            block_table=_to(np.ascontiguousarray(block_table), dev),
            slot_mapping=_to(slots, dev),
            query_start_loc_cpu=cu,
            seq_lens_cpu=seq_lens,
            num_decodes=leading_decodes,
        )
        return StepInputs(
            input_ids=_to(input_ids.astype(np.int64), dev),
            positions=_to(positions.astype(np.int64), dev),
            meta=meta,
            rows=rows,
            cu=cu,
            seq_lens=seq_lens,
            sample_mask=sample_mask,
            logits_indices=_to(logits_indices.astype(np.int64), dev),
        )

    # --- sampling -----------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, rows: np.ndarray,
                req_ids: list[str]) -> tuple[SamplerOutput, dict[str, str]]:
        """Sample the batch; if that raises, sample row by row so only the rows that fail are
        dropped (one bad request never takes the step down)."""
        try:
            return self.sampler(logits, self.sampling_metadata(rows)), {}
        except Exception as exc:  # noqa: BLE001 - isolated below, row by row
            logger.warning("batched sampling failed (%s); isolating the failing request(s)", exc)
        tokens = torch.zeros(len(rows), dtype=torch.long, device=logits.device)
        bad: dict[str, str] = {}
        for i, rid in enumerate(req_ids):
            try:
                out = self.sampler(logits[i:i + 1], self.sampling_metadata(rows[i:i + 1]))
                tokens[i] = out.token_ids[0]
            except Exception as exc:  # noqa: BLE001 - reported to that request only
                bad[rid] = f"sampling failed: {exc}"
        # Logprobs are dropped for this step rather than recomputed row by row.
        return SamplerOutput(tokens, None), bad

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        b = self.batch
        dev = self.device
        vocab = self.vocab_size
        temp = b.temperature[rows]
        meta = SamplingMetadata(
            temperature=_to(temp, dev),
            all_greedy=bool((temp == 0).all()),
            all_random=bool((temp > 0).all()),
        )
        if not meta.all_greedy:
            top_k = b.top_k[rows]
            top_k = np.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
            if (top_k < vocab).any():
                meta.top_k = _to(top_k, dev)
            top_p = b.top_p[rows]
            if (top_p < 1.0).any():
                meta.top_p = _to(top_p, dev)
            min_p = b.min_p[rows]
            if (min_p > 0).any():
                meta.min_p = _to(min_p, dev)
            n_out = b.num_tokens[rows] - b.num_prompt_tokens[rows]
            for i in np.nonzero((b.seed[rows] >= 0) & (temp > 0))[0]:
                row = int(rows[i])
                gen = self._generators.get(row)
                if gen is None:
                    gen = self._generators[row] = torch.Generator(device=dev)
                gen.manual_seed(position_seed(int(b.seed[row]), int(n_out[i])))
                meta.generators[int(i)] = gen
        n_lp = b.num_logprobs[rows]
        if (n_lp >= 0).any():
            meta.max_num_logprobs = int(n_lp.max())
        self._penalty_metadata(rows, meta)
        self._sparse_metadata(rows, meta)
        return meta

    def _penalty_metadata(self, rows: np.ndarray, meta: SamplingMetadata) -> None:
        b = self.batch
        pres, freq, rep = b.presence[rows], b.frequency[rows], b.repetition[rows]
        if not ((pres != 0).any() or (freq != 0).any() or (rep != 1).any()):
            return
        dev, vocab = self.device, self.vocab_size
        n_tok = b.num_tokens[rows]
        n_prompt = b.num_prompt_tokens[rows]
        width = int(n_tok.max())
        toks = torch.from_numpy(b.token_ids[rows, :width].astype(np.int64)).to(dev)
        pos = torch.arange(width, device=dev).unsqueeze(0)
        n_prompt_t = _to(n_prompt.astype(np.int64), dev).unsqueeze(1)
        n_tok_t = _to(n_tok.astype(np.int64), dev).unsqueeze(1)
        is_out = (pos >= n_prompt_t) & (pos < n_tok_t)
        out_idx = torch.where(is_out, toks, vocab)
        counts = torch.zeros(len(rows), vocab + 1, device=dev)
        counts.scatter_add_(1, out_idx, torch.ones_like(out_idx, dtype=counts.dtype))
        prompt_idx = torch.where(pos < n_prompt_t, toks, vocab)
        mask = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev)
        mask.scatter_(1, prompt_idx, True)
        meta.output_counts = counts[:, :vocab]
        meta.prompt_mask = mask[:, :vocab]
        if (pres != 0).any():
            meta.presence_penalty = _to(pres, dev)
        if (freq != 0).any():
            meta.frequency_penalty = _to(freq, dev)
        if (rep != 1).any():
            meta.repetition_penalty = _to(rep, dev)

    def _sparse_metadata(self, rows: np.ndarray, meta: SamplingMetadata) -> None:
        b = self.batch
        bias_r, bias_c, bias_v, ban_r, ban_c = [], [], [], [], []
        n_out = b.num_tokens[rows] - b.num_prompt_tokens[rows]
        for i, row in enumerate(rows):
            extra = b.extras[int(row)]
            assert extra is not None
            if extra.logit_bias is not None:
                ids, vals = extra.logit_bias
                bias_r.append(np.full(len(ids), i, dtype=np.int64))
                bias_c.append(ids)
                bias_v.append(vals)
            if n_out[i] < b.min_tokens[row]:
                stops = extra.stop_ids
                if extra.params.ignore_eos:
                    stops = np.asarray(extra.params.stop_token_ids, dtype=np.int64)
                ban_r.append(np.full(len(stops), i, dtype=np.int64))
                ban_c.append(stops)
        dev = self.device
        if bias_r:
            meta.bias_rows = _to(np.concatenate(bias_r), dev)
            meta.bias_cols = _to(np.concatenate(bias_c), dev)
            meta.bias_vals = _to(np.concatenate(bias_v), dev)
        if ban_r and sum(len(r) for r in ban_r):
            meta.ban_rows = _to(np.concatenate(ban_r), dev)
            meta.ban_cols = _to(np.concatenate(ban_c), dev)

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


def _to(arr: np.ndarray, device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(arr)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
