"""Per-step sampling inputs, one row per request that samples this step, already on the device,
and the builder that gathers them from the persistent batch with vectorised numpy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tidal.worker.sample.logits_processors import BatchState, LogitsProcessors
from tidal.worker.sample.seeded_random import position_keys, position_seed  # noqa: F401

if TYPE_CHECKING:
    from tidal.worker.input_batch import InputBatch

# Copies a host array to the device (through the runner's pinned staging); the dtype is the
# device tensor's.
Stage = Callable[[np.ndarray, torch.dtype], torch.Tensor]


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # float32 [B]; 0 = greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # int64 [B]; vocab size = disabled
    top_p: torch.Tensor | None = None  # float32 [B]; 1 = disabled
    min_p: torch.Tensor | None = None  # float32 [B]; 0 = disabled
    # Seeded rows (int64 [R], indices into this step's rows) and their position keys
    # (seeded_random.position_keys): their noise comes from the keys. None: no seeded row.
    seeded_rows: torch.Tensor | None = None
    seeded_keys: torch.Tensor | None = None
    # row -> generator seeded for this very position (seeded requests only); what the
    # speculative rejection sampler still draws its uniforms from.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None
    # Penalties: None when no row uses them.
    presence_penalty: torch.Tensor | None = None  # float32 [B]
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None  # float32 [B, V]: times each token was generated
    prompt_mask: torch.Tensor | None = None  # bool [B, V]: token occurs in the prompt
    # Sparse additions / masks as (row, token) index pairs.
    bias_rows: torch.Tensor | None = None
    bias_cols: torch.Tensor | None = None
    bias_vals: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None  # min_tokens: stop tokens banned until reached
    ban_cols: torch.Tensor | None = None
    # allowed_token_ids: the (row, token) pairs a restricted row may sample; every row with a
    # pair is restricted to its pairs (an allowed list is never empty).
    allowed_rows: torch.Tensor | None = None
    allowed_cols: torch.Tensor | None = None
    # Structured outputs: int32 [G, ceil(V / 32)] next-token bitmasks (grammar_mask.py) of the
    # rows ``grammar_rows`` (int64 [G]; None: rows 0 .. G - 1). None when no row has a grammar.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None
    # Logits processors (logits_processors.py) with the rows each acts on; None: none this step.
    logits_procs: list[tuple[Any, BatchState]] | None = None


def needs_token_history(b: InputBatch, rows: np.ndarray) -> bool:
    """Whether sampling these rows reads their generated tokens (penalties)."""
    if not b.num_penalized:
        return False
    return bool(((b.presence[rows] != 0) | (b.frequency[rows] != 0)
                 | (b.repetition[rows] != 1)).any())


class SamplingMetadataBuilder:
    """Gathers the sampling rows' parameters from the persistent batch. Requests with nothing
    but a temperature (the common case) cost three numpy operations and one staged array."""

    def __init__(self, vocab_size: int, device: torch.device,
                 seeded_generators: bool = False,
                 processors: LogitsProcessors | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.processors = processors
        # Seeded rows: their position keys always; with ``seeded_generators`` (what the
        # speculative verify path draws from) also one generator per batch row, reseeded for
        # every position (about 1 us of host time a row).
        self._seeded_generators = seeded_generators
        self._generators: dict[int, torch.Generator] = {}
        # What the rows of the last call gave (a decode batch samples the same rows step after
        # step; their parameters change only when the batch's membership does):
        # (rows, membership, temperatures, all greedy, all random, any special row).
        self._last: tuple | None = None

    def build(self, b: InputBatch, rows: np.ndarray, stage: Stage) -> SamplingMetadata:
        last = self._last
        if last is not None and last[0] is rows and last[1] == b.membership:
            _, _, temp, all_greedy, all_random, special = last
        else:
            temp = b.temperature[rows]
            all_greedy, all_random = bool((temp == 0).all()), bool((temp > 0).all())
            special = bool(b.special[rows].any())
            self._last = (rows, b.membership, temp, all_greedy, all_random, special)
        meta = SamplingMetadata(
            temperature=stage(temp, torch.float32),
            all_greedy=all_greedy,
            all_random=all_random,
        )
        if self.processors is not None and self.processors.global_names:
            self._global_processors(b, rows, meta)
        if not special:
            return meta
        vocab = self.vocab_size
        if not meta.all_greedy:
            top_k = b.top_k[rows]
            top_k = np.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
            if (top_k < vocab).any():
                meta.top_k = stage(top_k, torch.int64)
            top_p = b.top_p[rows]
            if (top_p < 1.0).any():
                meta.top_p = stage(top_p, torch.float32)
            min_p = b.min_p[rows]
            if (min_p > 0).any():
                meta.min_p = stage(min_p, torch.float32)
            seeded = np.nonzero((b.seed[rows] >= 0) & (temp > 0))[0]
            if len(seeded):
                srows = rows[seeded]
                n_out = b.num_tokens[srows] - b.num_prompt_tokens[srows]
                keys = position_keys(b.seed[srows], n_out)
                meta.seeded_rows = stage(seeded.astype(np.int64), torch.int64)
                meta.seeded_keys = stage(keys, torch.int64)
                if self._seeded_generators:
                    self._seed_generators(meta, seeded, srows, keys)
        n_lp = b.num_logprobs[rows]
        if (n_lp >= 0).any():
            meta.max_num_logprobs = int(n_lp.max())
        self._penalties(b, rows, meta, stage)
        self._sparse(b, rows, meta, stage)
        return meta

    def _seed_generators(self, meta: SamplingMetadata, seeded: np.ndarray, rows: np.ndarray,
                         keys: np.ndarray) -> None:
        for i, row, key in zip(seeded.tolist(), rows.tolist(), keys.tolist()):
            gen = self._generators.get(row)
            if gen is None:
                gen = self._generators[row] = torch.Generator(device=self.device)
            gen.manual_seed(key)
            meta.generators[i] = gen

    def _processor_state(self, b: InputBatch, rows: np.ndarray,
                         idx: list[int]) -> BatchState:
        req_ids, outs = [], []
        for i in idx:
            row = int(rows[i])
            extra = b.extras[row]
            req_ids.append(extra.req_id if extra is not None else "")
            outs.append(b.token_ids[row, b.num_prompt_tokens[row]:b.num_tokens[row]].tolist())
        return BatchState(torch.tensor(idx, dtype=torch.int64, device=self.device), req_ids,
                          outs)

    def _global_processors(self, b: InputBatch, rows: np.ndarray,
                           meta: SamplingMetadata) -> None:
        assert self.processors is not None
        state = self._processor_state(b, rows, list(range(len(rows))))
        meta.logits_procs = [(self.processors.get(name), state)
                             for name in self.processors.global_names]

    def _penalties(self, b: InputBatch, rows: np.ndarray, meta: SamplingMetadata,
                   stage: Stage) -> None:
        pres, freq, rep = b.presence[rows], b.frequency[rows], b.repetition[rows]
        if not ((pres != 0).any() or (freq != 0).any() or (rep != 1).any()):
            return
        dev, vocab = self.device, self.vocab_size
        n_tok = b.num_tokens[rows]
        n_prompt = b.num_prompt_tokens[rows]
        width = int(n_tok.max())
        # Rare and large ([B, longest sequence]): a plain copy rather than the staging. The
        # lengths too: the counts below are computed now, and a staged array reaches the device
        # only when the step's inputs are flushed, after this (the kernels would read the
        # previous step's values: out-of-range indices, a device-side assert).
        toks = torch.from_numpy(b.token_ids[rows, :width].astype(np.int64)).to(dev)
        pos = torch.arange(width, device=dev).unsqueeze(0)
        n_prompt_t = torch.from_numpy(n_prompt.astype(np.int64)).to(dev).unsqueeze(1)
        n_tok_t = torch.from_numpy(n_tok.astype(np.int64)).to(dev).unsqueeze(1)
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
            meta.presence_penalty = stage(pres, torch.float32)
        if (freq != 0).any():
            meta.frequency_penalty = stage(freq, torch.float32)
        if (rep != 1).any():
            meta.repetition_penalty = stage(rep, torch.float32)

    def _sparse(self, b: InputBatch, rows: np.ndarray, meta: SamplingMetadata,
                stage: Stage) -> None:
        bias_r, bias_c, bias_v, ban_r, ban_c = [], [], [], [], []
        allow_r: list[np.ndarray] = []
        allow_c: list[np.ndarray] = []
        n_out = b.num_tokens[rows] - b.num_prompt_tokens[rows]
        named: dict[str, list[int]] = {}  # per-request logits processor -> its batch rows
        for i in np.nonzero(b.special[rows])[0]:
            row = int(rows[i])
            extra = b.extras[row]
            assert extra is not None
            for name in extra.params.logits_processors or ():
                named.setdefault(name, []).append(int(i))
            if extra.logit_bias is not None:
                ids, vals = extra.logit_bias
                bias_r.append(np.full(len(ids), i, dtype=np.int64))
                bias_c.append(ids)
                bias_v.append(vals)
            if extra.allowed_ids is not None:
                allow_r.append(np.full(len(extra.allowed_ids), i, dtype=np.int64))
                allow_c.append(extra.allowed_ids)
            if n_out[i] < b.min_tokens[row]:
                stops = extra.stop_ids
                if extra.params.ignore_eos:
                    stops = np.asarray(extra.params.stop_token_ids, dtype=np.int64)
                ban_r.append(np.full(len(stops), i, dtype=np.int64))
                ban_c.append(stops)
        if bias_r:
            meta.bias_rows = stage(np.concatenate(bias_r), torch.int64)
            meta.bias_cols = stage(np.concatenate(bias_c), torch.int64)
            meta.bias_vals = stage(np.concatenate(bias_v), torch.float32)
        if allow_r:
            meta.allowed_rows = stage(np.concatenate(allow_r), torch.int64)
            meta.allowed_cols = stage(np.concatenate(allow_c), torch.int64)
        if ban_r and sum(len(r) for r in ban_r):
            meta.ban_rows = stage(np.concatenate(ban_r), torch.int64)
            meta.ban_cols = stage(np.concatenate(ban_c), torch.int64)
        if named:
            if self.processors is None:
                raise ValueError("this worker runs no logits processors")
            work = meta.logits_procs or []
            for name, idx in named.items():
                work.append((self.processors.get(name), self._processor_state(b, rows, idx)))
            meta.logits_procs = work
