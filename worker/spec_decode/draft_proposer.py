"""Model-based draft proposers: a chain of ``k`` draft tokens per request from a small draft
model (``DraftModelProposer``) or an EAGLE-3 head over the target's hidden states
(``Eagle3Proposer``), each with its own KV cache addressed by the target's block tables.

Independent of the scheduler: a proposer takes tensors in tidal's attention-metadata form
(``DraftBatch``) and returns tensors (``DraftOutput``).

One ``propose`` call: a first pass over the batch's rows (writing their K/V into the draft's
cache), whose output at each request's ``last_rows`` entry gives draft 1; then ``k - 1``
one-token steps, each feeding the previous draft at the next position (its K/V written at
``block_table[r, pos // block_size]``: the blocks the target needs for its verify step anyway).
Greedy requests take the argmax; with ``temperature > 0`` a draft is drawn from
``q = softmax(logits / T)`` and ``q`` is returned (over the target's vocabulary), what
rejection sampling needs to keep the target's distribution exactly.

What the rows hold differs by method:

- draft model: the tokens the draft has not seen yet at their own positions, ending (at
  ``last_rows``) with the newest token, the target's sample;
- EAGLE-3: the target step's rows, each with the *next* token (``shift_in_next_tokens``: row t
  holds token t + 1, the target's sample at each request's last row) and, in ``hidden``, the
  target's auxiliary hidden states of row t (``AuxHiddenSpec`` on the target);
- MTP (``mtp_proposer``): as EAGLE-3's, with the target's final hidden state of row t.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from tidal.engine_core.config import ModelConfig
from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionMetadata, kv_cache_shape
from tidal.worker.layers.attention import Attention
from tidal.worker.models.eagle3 import Eagle3ForCausalLM
from tidal.worker.ops import torch_ops
from tidal.worker.spec_decode.uniform_propose import UniformBuffers, UniformHost
from tidal.worker.step_buffers import to_device

logger = logging.getLogger(__name__)


_NO_ROWS = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class DraftBatch:
    """One step's input of a proposer: ``T`` rows over ``R`` requests."""

    input_ids: torch.Tensor  # int64 [T] (target vocabulary ids)
    positions: torch.Tensor  # int64 [T]
    # The T rows over the draft's cache: query_start_loc [R + 1], seq_lens [R], block_table
    # [R, max_blocks] (the target's), slot_mapping [T], and their host copies.
    meta: AttentionMetadata
    # Host int64 [R]: each request's row whose output starts its chain (normally its last;
    # rows after it, e.g. rejected drafts, are written but never read).
    last_rows: np.ndarray
    hidden: torch.Tensor | None = None  # EAGLE-3: [T, 3 * target hidden], the aux states
    # The fields below are of the chain requests (``chain``), in that order.
    temperature: torch.Tensor | None = None  # float32 [C]; rows <= 0 draft greedily
    all_greedy: bool = True  # no row has temperature > 0 (no probabilities returned)
    generator: torch.Generator | None = None  # draws of the random rows
    # Host int64 [C]: the requests that draft (the others only write their rows' K/V, e.g.
    # an EAGLE-3 head over a prompt chunk); None: every request.
    chain: np.ndarray | None = None
    # Chain index -> the generator of that request's draws (a seeded request: its drafts
    # do not depend on the batch it runs in).
    row_generators: dict[int, torch.Generator] | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.last_rows)

    @property
    def chain_reqs(self) -> np.ndarray:
        if self.chain is None:
            return np.arange(self.num_reqs, dtype=np.int64)
        return self.chain


@dataclass(slots=True)
class DraftOutput:
    token_ids: torch.Tensor  # int64 [R, k], target vocabulary ids
    # float32 [R, k, target vocab]: the distribution each draft was drawn from (one-hot for a
    # greedy row); None when the batch was all greedy.
    probs: torch.Tensor | None


class DraftProposer(Protocol):
    num_speculative_tokens: int

    def propose(self, batch: DraftBatch) -> DraftOutput: ...

    def attention_layers(self) -> list[Attention]: ...

    def kv_bytes_per_block(self, block_size: int) -> int: ...

    def bind_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]: ...


def make_batch(input_ids: torch.Tensor, counts: np.ndarray, starts: np.ndarray,
               block_table: torch.Tensor, block_size: int, *,
               hidden: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
               all_greedy: bool = True, generator: torch.Generator | None = None,
               last_rows: np.ndarray | None = None, chain: np.ndarray | None = None,
               row_generators: dict[int, torch.Generator] | None = None) -> DraftBatch:
    """A batch of ``counts[i]`` rows for request ``i`` at positions ``starts[i] ..``, its K/V
    slots looked up in ``block_table`` (``[R, max_blocks]``, on the device); each request's
    chain starts from its last row, or from ``last_rows`` (indices into the batch's rows)."""
    dev = input_ids.device
    counts = np.asarray(counts, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    qsl = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=qsl[1:])
    req = np.repeat(np.arange(len(counts)), counts)
    pos = starts[req] + (np.arange(int(qsl[-1])) - qsl[:-1][req])
    seq = (starts + counts).astype(np.int32)
    positions = to_device(pos, dev)
    rows = to_device(req, dev)
    slots = (block_table[rows, positions // block_size].long() * block_size
             + positions % block_size)
    meta = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(counts), max_query_len=int(counts.max()),
        max_seq_len=int(seq.max()), query_start_loc=to_device(qsl, dev),
        seq_lens=to_device(seq, dev), block_table=block_table, slot_mapping=slots,
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, num_decodes=_leading_decodes(counts))
    if last_rows is None:
        last_rows = qsl[1:].astype(np.int64) - 1
    return DraftBatch(input_ids, positions, meta, np.asarray(last_rows, dtype=np.int64),
                      hidden, temperature, all_greedy, generator, chain, row_generators)


def _leading_decodes(counts: np.ndarray) -> int:
    """Requests of one row before the first longer one: backends that split decodes from the
    rest read ``num_decodes`` as that leading run (the runner's batches sort them first; a
    proposer's rows come in the target step's order)."""
    longer = np.flatnonzero(counts != 1)
    return int(longer[0]) if len(longer) else len(counts)


def shift_in_next_tokens(input_ids: torch.Tensor, last_rows: np.ndarray,
                         next_token_ids: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's inputs from a target step's: row t takes row t + 1's token, and each
    request's last row the token the target sampled after it (``next_token_ids`` [R])."""
    shifted = torch.roll(input_ids, -1)
    shifted[to_device(last_rows, input_ids.device)] = next_token_ids
    return shifted


class _ChainProposer:
    """The chain shared by the proposers: ``_first`` and ``_step`` give logits over the
    draft vocabulary and the state the next step needs."""

    model: nn.Module

    def __init__(self, model: nn.Module, num_speculative_tokens: int, target_vocab_size: int,
                 max_model_len: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got "
                             f"{num_speculative_tokens}")
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.target_vocab_size = target_vocab_size
        self.max_model_len = max_model_len
        self.kv_caches: list[torch.Tensor] = []
        # The row argmax of draft logits: torch's, or the worker's ``Kernels.argmax`` (set by
        # ``SpeculativeStep.load_drafter``; the same first maximum, NaN counted largest).
        self.argmax: Callable[[torch.Tensor], torch.Tensor] = torch_ops.argmax

    # --- the draft's KV cache -----------------------------------------------------------------

    def attention_layers(self) -> list[Attention]:
        return self.model.attention_layers()

    def _cache_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def kv_bytes_per_block(self, block_size: int) -> int:
        """What one pool block costs in the draft's layers: the KV manager adds it to the
        target's per-block bytes when it sizes the pool (the draft uses the same block ids)."""
        elem = torch.tensor([], dtype=self._cache_dtype()).element_size()
        return sum(2 * block_size * a.num_kv_heads * a.head_dim * elem
                   for a in self.attention_layers())

    def bind_kv_cache(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """Allocate one cache tensor per draft layer (as many blocks as the target's pool)."""
        dev = next(self.model.parameters()).device
        self.kv_caches = []
        for layer in self.attention_layers():
            layer.kv_cache = torch.zeros(
                kv_cache_shape(num_blocks, block_size, layer.num_kv_heads, layer.head_dim),
                dtype=self._cache_dtype(), device=dev)
            layer.kv_group = 0
            self.kv_caches.append(layer.kv_cache)
        return self.kv_caches

    # --- drafting -------------------------------------------------------------------------------

    def _first(self, batch: DraftBatch, last: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def _target_index(self, n: int, device: torch.device) -> torch.Tensor:
        """The target id of each of the ``n`` draft vocabulary entries."""
        return torch.arange(n, device=device)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> DraftOutput:
        """Write the batch's rows into the draft's cache and draft ``k`` tokens for each
        request of ``batch.chain`` (every request by default), in that order."""
        k = self.num_speculative_tokens
        meta = batch.meta
        dev = batch.input_ids.device
        chain = batch.chain_reqs
        last_rows = batch.last_rows[chain]
        last = to_device(last_rows, dev)
        # Host positions of the chain: each request's last row sits this far before its end.
        qsl, seq = meta.query_start_loc_cpu, meta.seq_lens_cpu
        last_pos = (seq[chain].astype(np.int64) - 1
                    - (qsl[chain + 1].astype(np.int64) - 1 - last_rows))
        logits, state = self._first(batch, last)
        if not len(chain):
            return DraftOutput(torch.zeros(0, k, dtype=torch.int64, device=dev), None)
        table = meta.block_table
        if batch.chain is not None:
            table = table[to_device(chain, dev)]
        ids, probs = self._pick(logits, batch)
        all_ids, all_probs = [ids], [probs]
        for s in range(1, k):
            positions, step_meta = self._decode_meta(table, last_pos + s, dev)
            logits, state = self._step(ids, positions, step_meta, state)
            ids, probs = self._pick(logits, batch)
            all_ids.append(ids)
            all_probs.append(probs)
        return DraftOutput(torch.stack(all_ids, dim=1),
                           None if batch.all_greedy else torch.stack(all_probs, dim=1))

    @torch.inference_mode()
    def propose_uniform(self, u: UniformBuffers, n: int, host: UniformHost | None = None
                        ) -> None:
        """Greedy drafts of ``n`` requests of ``u.q`` rows each into ``u.out[:n]``, from the
        buffers alone (what a CUDA graph captures: see ``uniform_propose``). ``host``: the
        inputs' host copies, for a backend that plans on the host (None under a graph)."""
        q, k = u.q, self.num_speculative_tokens
        t = n * q
        bs = self._block_size()
        table, valid = u.table[:n], u.valid[:n]
        width = table.shape[1]
        cap = min(self.max_model_len, width * bs)
        pos2 = u.pos_start[:n, None] + u.offsets[None, :]
        ok2 = valid[:, None] & (pos2 < cap)
        u.slots[:t].copy_(self._slots(table, pos2, ok2).reshape(t))
        u.seq[:n].copy_(u.pos_start[:n] + q)
        empty = np.zeros(0, dtype=np.int32)
        qsl_h = seq_h = chain_h = empty
        max_seq = cap
        if host is not None:
            qsl_h = np.arange(n + 1, dtype=np.int32) * q
            seq_h = (host.pos_start + q).astype(np.int32)
            max_seq = int(seq_h.max())
        meta = AttentionMetadata(
            num_actual_tokens=t, num_reqs=n, max_query_len=q, max_seq_len=max_seq,
            query_start_loc=u.qsl[:n + 1], seq_lens=u.seq[:n], block_table=table,
            slot_mapping=u.slots[:t], query_start_loc_cpu=qsl_h, seq_lens_cpu=seq_h,
            num_decodes=n if q == 1 else 0)
        hidden = u.hidden[:t] if u.hidden is not None else None
        batch = DraftBatch(u.ids[:t], pos2.reshape(t), meta, _NO_ROWS, hidden)
        logits, state = self._first(batch, u.qsl[:n].long() + u.last[:n])
        ids = self._to_target(self.argmax(logits))
        u.out[:n, 0].copy_(ids)
        last_pos = u.pos_start[:n] + u.last[:n]
        for s in range(1, k):
            p = last_pos + s
            ok = valid & (p < cap)
            # A position past the context attends a clamped one (its draft is never verified);
            # a padding request attends one token.
            c = torch.where(valid, p.clamp(max=cap - 1), torch.zeros_like(p))
            u.chain_slots[:n].copy_(self._slots(table, c[:, None], ok[:, None]).squeeze(1))
            u.chain_seq[:n].copy_(c + 1)
            if host is not None:
                ph = host.pos_start + host.last + s
                chain_h = np.minimum(ph, cap - 1).astype(np.int32) + 1
                max_seq = int(chain_h.max())
            step_meta = AttentionMetadata(
                num_actual_tokens=n, num_reqs=n, max_query_len=1, max_seq_len=max_seq,
                query_start_loc=u.qsl1[:n + 1], seq_lens=u.chain_seq[:n], block_table=table,
                slot_mapping=u.chain_slots[:n],
                query_start_loc_cpu=empty if host is None else np.arange(n + 1, dtype=np.int32),
                seq_lens_cpu=chain_h, num_decodes=n)
            logits, state = self._step(ids, c, step_meta, state)
            ids = self._to_target(self.argmax(logits))
            u.out[:n, s].copy_(ids)

    def _slots(self, table: torch.Tensor, pos: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """KV slots of positions ``pos`` [n, m] in the rows' block tables ``[n, width]``; -1
        where not ``ok`` (nothing is written there)."""
        bs = self._block_size()
        safe = torch.where(ok, pos, torch.zeros_like(pos))
        blocks = table.gather(1, safe // bs).long()
        return torch.where(ok, blocks * bs + safe % bs, torch.full_like(safe, -1))

    def _decode_meta(self, block_table: torch.Tensor, pos: np.ndarray, dev: torch.device
                     ) -> tuple[torch.Tensor, AttentionMetadata]:
        """One token per request at host positions ``pos``. A position past the context or
        the block table is not written (slot -1) and attends a clamped context: its draft is
        beyond what the target can verify."""
        n = len(pos)
        block_size = self._block_size()
        width = block_table.shape[1]
        ok = (pos < self.max_model_len) & (pos // block_size < width)
        clamped = np.minimum(pos, min(self.max_model_len, width * block_size) - 1)
        positions = to_device(clamped, dev)
        rows = torch.arange(n, device=dev)
        slots = (block_table[rows, positions // block_size].long() * block_size
                 + positions % block_size)
        slots = torch.where(to_device(ok, dev), slots, torch.full_like(slots, -1))
        qsl = np.arange(n + 1, dtype=np.int32)
        seq = (clamped + 1).astype(np.int32)
        meta = AttentionMetadata(
            num_actual_tokens=n, num_reqs=n, max_query_len=1, max_seq_len=int(seq.max()),
            query_start_loc=to_device(qsl, dev), seq_lens=to_device(seq, dev),
            block_table=block_table, slot_mapping=slots, query_start_loc_cpu=qsl,
            seq_lens_cpu=seq, num_decodes=n)
        return positions, meta

    def _block_size(self) -> int:
        caches = self.attention_layers()
        if not caches or caches[0].kv_cache.dim() != 5:
            raise RuntimeError("the draft's KV cache is not bound (bind_kv_cache)")
        return caches[0].kv_cache.shape[2]

    def _pick(self, logits: torch.Tensor, batch: DraftBatch
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft ids (target vocabulary) from draft-vocabulary logits ``[R, Vd]``, and with
        random rows in the batch their distributions over the target's vocabulary."""
        greedy = self.argmax(logits)
        logits = logits.float()
        if batch.all_greedy:
            return self._to_target(greedy), None
        temp = batch.temperature
        if temp is None:
            raise ValueError("a batch with random rows (all_greedy=False) needs temperature")
        random = temp > 0
        scaled = logits / torch.where(random, temp, torch.ones_like(temp)).unsqueeze(1)
        q = torch.softmax(scaled, dim=-1)
        drawn = torch.multinomial(q, 1, generator=batch.generator).squeeze(1)
        for i, gen in (batch.row_generators or {}).items():
            drawn[i] = torch.multinomial(q[i], 1, generator=gen)[0]
        q = torch.where(random.unsqueeze(1), q,
                        torch.nn.functional.one_hot(greedy, q.shape[1]).to(q.dtype))
        draft = torch.where(random, drawn, greedy)
        full = q.new_zeros(q.shape[0], self.target_vocab_size)
        index = self._target_index(q.shape[1], q.device)
        keep = index < self.target_vocab_size  # a draft vocabulary padded past the target's
        full[:, index[keep]] = q[:, keep]
        return self._to_target(draft), full


class DraftModelProposer(_ChainProposer):
    """A small model of any supported decoder family with the target's tokenizer."""

    def __init__(self, model: nn.Module, num_speculative_tokens: int, target: ArchSpec,
                 max_model_len: int) -> None:
        draft = model.arch
        if draft.is_embedding or isinstance(model, Eagle3ForCausalLM):
            raise ValueError(f"{draft.architecture} cannot be a draft model")
        super().__init__(model, num_speculative_tokens, target.vocab_size, max_model_len)
        self.draft_vocab_size = min(draft.vocab_size, target.vocab_size)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Tokens past the target's vocabulary (a padded draft embedding) are never drafted.
        return self.model.compute_logits(hidden)[:, :self.draft_vocab_size]

    def _first(self, batch: DraftBatch, last: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, _ = self.model(batch.input_ids, batch.positions, batch.meta)
        return self._logits(hidden[last]), None

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, _ = self.model(ids, positions, meta)
        return self._logits(hidden), None


class Eagle3Proposer(_ChainProposer):
    """An EAGLE-3 head (``models.eagle3``) drafting from the target's auxiliary hidden
    states; the target's embedding / LM head are shared where the checkpoint has none."""

    model: Eagle3ForCausalLM

    def __init__(self, model: Eagle3ForCausalLM, num_speculative_tokens: int,
                 target_model: nn.Module, max_model_len: int) -> None:
        target = target_model.arch
        head = model.arch
        if head.vocab_size != target.vocab_size:
            raise ValueError(f"the EAGLE-3 head's vocabulary ({head.vocab_size}) is not the "
                             f"target's ({target.vocab_size})")
        if (head.target_hidden_size or head.hidden_size) != target.hidden_size:
            raise ValueError(f"the EAGLE-3 head was trained on hidden states of size "
                             f"{head.target_hidden_size}, the target's are {target.hidden_size}")
        model.share_target_weights(target_model)
        super().__init__(model, num_speculative_tokens, target.vocab_size, max_model_len)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.model.to_target_ids(draft_ids)

    def _target_index(self, n: int, device: torch.device) -> torch.Tensor:
        return self.model.to_target_ids(torch.arange(n, device=device))

    def _first(self, batch: DraftBatch, last: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if batch.hidden is None:
            raise ValueError("an EAGLE-3 batch needs the target's auxiliary hidden states")
        fused = self.model.combine_hidden_states(batch.hidden)
        normed, prenorm = self.model(batch.input_ids, batch.positions, batch.meta, fused)
        return self.model.compute_logits(normed[last]), prenorm[last]

    def _step(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
              state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        normed, prenorm = self.model(ids, positions, meta, state)
        return self.model.compute_logits(normed), prenorm


def draft_model_config(model: str, target: ModelConfig, *, load_format: str = "auto"
                       ) -> ModelConfig:
    """The ``ModelConfig`` of a draft (a model folder / hub id / GGUF, or an EAGLE-3 head) for
    ``target``: its own architecture, the target's dtype, context and tokenizer. Never the
    target's quantization: a quantized target (FP8, INT4) verifies drafts from a 16-bit draft,
    whose checkpoint holds no quantized tensors."""
    import msgspec

    from tidal.engine_core.model_arch import arch_from_hf_dict
    from tidal.engine_core.model_source import load_hf_config, resolve_model

    src = resolve_model(model)
    arch = arch_from_hf_dict(load_hf_config(src), src.path, draft=True)
    if load_format == "auto":
        load_format = "gguf" if src.format == "gguf" else "safetensors"
    if arch.vocab_size < target.arch.vocab_size and arch.family != "eagle3":
        logger.info("draft %s has a vocabulary of %d tokens, the target %d: tokens past it "
                    "are never drafted", src.path, arch.vocab_size, target.arch.vocab_size)
    return msgspec.structs.replace(target, path=src.path, format=src.format,
                                   load_format=load_format, served_model_name=src.name,
                                   arch=arch, quantization=None)
