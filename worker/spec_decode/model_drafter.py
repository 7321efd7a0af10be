"""Drafts from a model inside the worker's step: the glue between the persistent batch and a
``DraftProposer`` (``draft_proposer.py``) for ``draft_model`` and ``eagle3``.

The draft's KV cache uses the target's block ids (the pool is sized for both). Two things the
target's tables do not give it:

- Room for the chain. A chain writes K/V up to ``k`` positions past the tokens the scheduler
  allocated blocks for, so each batch row has a few scratch blocks past the pool, private to
  it; a proposer's block table maps every entry past the row's own blocks to them. What lands
  there is a draft's chain state only, never read again: a position counts as seen by the
  draft only once it lies in one of the request's own blocks.
- What the draft has seen. A draft model catches up at each proposal on the tokens it has
  not seen (``_seen``: a count per batch row, reset when the row takes a new or resumed
  request; the accepted drafts are fed again, so rejected positions are overwritten), in
  passes of at most the step's token budget. A request starts from token 0, even on a prefix
  cache hit: the draft's K/V in a cached block may never have been computed.
  An EAGLE-3 head needs the target's hidden states of each position, so it runs over every
  target step's rows right after the step (``observe``, then ``propose``), prompt chunks
  included; row ``t`` holds token ``t + 1`` (known once the step's tokens are appended).

Sampling requests with ``temperature > 0`` draw their drafts at their temperature and keep the
distribution ``q`` they were drawn from for the next step's verification (``draft_probs``);
a seeded request draws from its own generator, keyed by its seed and output count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from tidal.engine_core.speculative_config import SpeculativeConfig
from tidal.worker.input_batch import InputBatch
from tidal.worker.sample.metadata import position_seed
from tidal.worker.spec_decode.draft_proposer import DraftProposer, make_batch

logger = logging.getLogger(__name__)

# Mixed into a request's seed for its draft draws (the verify step's draws use the seed as is).
_DRAFT_SALT = 0x5D3A_F7C1


@dataclass(slots=True)
class StepRows:
    """The target step an EAGLE-3 head reads after verification."""

    rows: np.ndarray  # batch rows, in step order
    cu: np.ndarray  # int32 [R + 1]: each request's rows among the step's tokens
    seq_lens: np.ndarray  # int32 [R]: tokens computed through the step
    aux: torch.Tensor  # [T, 3 * target hidden]: the target's auxiliary hidden states


class ModelDrafter:
    def __init__(self, config: SpeculativeConfig, proposer: DraftProposer, *,
                 max_num_reqs: int, max_num_tokens: int, block_size: int,
                 block_table: torch.Tensor, device: torch.device) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.eagle = config.method == "eagle3"
        self.proposer = proposer
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.block_size = block_size
        # The runner's device block tables ([max_num_reqs, width], by batch row).
        self.block_table = block_table
        self.device = device
        # Scratch blocks per row: the chain's furthest position lies k past the allocation.
        self.scratch_per_row = -(-self.k // block_size) + 1
        self._scratch_base = 0
        self._seen = np.zeros(max_num_reqs, dtype=np.int64)
        self._seen_generation = np.full(max_num_reqs, -1, dtype=np.int64)
        # Request id -> (its drafts, q [len(drafts), V]) for the next verification.
        self._q: dict[str, tuple[list[int], torch.Tensor]] = {}
        self._step: StepRows | None = None

    # --- the draft's KV cache ------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return self.proposer.kv_bytes_per_block(self.block_size)

    def scratch_bytes(self) -> int:
        return self.max_num_reqs * self.scratch_per_row * self.kv_bytes_per_block()

    def bind_kv_cache(self, num_blocks: int) -> None:
        self._scratch_base = num_blocks
        extra = self.max_num_reqs * self.scratch_per_row
        self.proposer.bind_kv_cache(num_blocks + extra, self.block_size)
        logger.debug("draft KV cache: %d pool blocks + %d scratch blocks, %d bytes each",
                     num_blocks, extra, self.kv_bytes_per_block())
        self._seen_generation.fill(-1)

    def release_kv_cache(self) -> None:
        for layer in self.proposer.attention_layers():
            layer.kv_cache = torch.empty(0)
        self._seen_generation.fill(-1)

    def _tables(self, b: InputBatch, rows: np.ndarray) -> torch.Tensor:
        """The rows' block tables with every entry past a row's own blocks in its scratch."""
        dev = self.device
        rows_d = torch.from_numpy(rows.astype(np.int64)).to(dev)
        table = self.block_table.index_select(0, rows_d)
        own = torch.from_numpy(b.num_blocks[rows].astype(np.int64)).to(dev).unsqueeze(1)
        j = torch.arange(table.shape[1], device=dev).unsqueeze(0)
        scratch = (self._scratch_base + rows_d.unsqueeze(1) * self.scratch_per_row
                   + (j - own).clamp(0, self.scratch_per_row - 1))
        return torch.where(j < own, table, scratch.to(table.dtype))

    # --- one step ------------------------------------------------------------------------------

    def observe(self, rows: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
                aux: torch.Tensor | None) -> None:
        """The target step just run (EAGLE-3 drafts from its hidden states)."""
        if self.eagle:
            assert aux is not None
            self._step = StepRows(rows, cu, seq_lens, aux[:int(cu[-1])])

    def propose(self, b: InputBatch, rows: np.ndarray, limits: np.ndarray) -> list[list[int]]:
        """Drafts of the requests of ``rows`` (after their emitted tokens were appended),
        at most ``limits[i]`` each (0: none)."""
        drafting = limits > 0
        out: list[list[int]] = [[] for _ in range(len(rows))]
        if self.eagle:
            step, self._step = self._step, None
            if step is not None:
                self._propose_eagle(b, step, rows, limits, out)
        elif drafting.any():
            self._propose_draft_model(b, rows[drafting], limits[drafting],
                                      np.flatnonzero(drafting), out)
        for i, rid in enumerate(self._req_ids(b, rows)):
            if not out[i]:
                self._q.pop(rid, None)
        if len(self._q) > len(b):
            for rid in [r for r in self._q if r not in b]:
                del self._q[rid]
        return out

    def _propose_draft_model(self, b: InputBatch, rows: np.ndarray, limits: np.ndarray,
                             where: np.ndarray, out: list[list[int]]) -> None:
        fresh = self._seen_generation[rows] != b.generation[rows]
        self._seen[rows[fresh]] = 0
        self._seen_generation[rows] = b.generation[rows]
        n_tokens = b.num_tokens[rows].astype(np.int64)
        seen = self._seen[rows].copy()
        table = self._tables(b, rows)
        # Catch up in passes of at most the token budget; the last pass ends each request
        # with its newest token (the chain starts there).
        budget = self.max_num_tokens
        while int((n_tokens - seen).sum()) > budget:
            take = np.zeros(len(rows), dtype=np.int64)
            left = budget
            for i in range(len(rows)):
                t = min(int(n_tokens[i] - seen[i]) - 1, left)
                if t > 0:
                    take[i] = t
                    left -= t
                if not left:
                    break
            part = take > 0
            self._run(b, rows, seen, take, table, part, chain=np.zeros(0, np.int64))
            seen += take
        counts = n_tokens - seen
        batch_rows = np.ones(len(rows), dtype=bool)
        drafts = self._run(b, rows, seen, counts, table, batch_rows,
                           chain=np.arange(len(rows), dtype=np.int64), limits=limits)
        own = b.num_blocks[rows].astype(np.int64) * self.block_size
        self._seen[rows] = np.minimum(n_tokens, own)
        for j, i in enumerate(where.tolist()):
            out[i] = drafts[j]

    def _run(self, b: InputBatch, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
             table: torch.Tensor, part: np.ndarray, chain: np.ndarray,
             limits: np.ndarray | None = None) -> list[list[int]]:
        """One draft-model pass over tokens ``starts[i] .. + counts[i]`` of the ``part``
        requests (of ``rows``); drafts of the ``chain`` ones (indices into ``rows``)."""
        sel = np.flatnonzero(part)
        rows_p, starts_p, counts_p = rows[sel], starts[sel], counts[sel]
        token_rows = np.repeat(rows_p, counts_p)
        pos = np.repeat(starts_p, counts_p) + (
            np.arange(int(counts_p.sum()), dtype=np.int64)
            - np.repeat(np.cumsum(counts_p) - counts_p, counts_p))
        ids = torch.from_numpy(b.token_ids[token_rows, pos].astype(np.int64)).to(self.device)
        if len(sel) < len(rows):
            table = table[torch.from_numpy(sel).to(self.device)]
        # (A pass with a chain holds every row: ``chain`` indexes the pass as it does ``rows``.)
        return self._draft(b, rows_p, ids, counts_p, starts_p, table, None, None, chain, limits)

    def _propose_eagle(self, b: InputBatch, step: StepRows, rows: np.ndarray,
                       limits: np.ndarray, out: list[list[int]]) -> None:
        counts = np.diff(step.cu).astype(np.int64)
        starts = step.seq_lens.astype(np.int64) - counts
        token_rows = np.repeat(step.rows, counts)
        pos = np.repeat(starts, counts) + (np.arange(int(counts.sum()), dtype=np.int64)
                                           - np.repeat(step.cu[:-1].astype(np.int64), counts))
        # Row t holds token t + 1: a prompt's next token, an accepted draft, the target's
        # sample; past a request's tokens (rejected drafts) whatever its row holds, unread.
        width = b.token_ids.shape[1]
        ids = torch.from_numpy(
            b.token_ids[token_rows, np.minimum(pos + 1, width - 1)].astype(np.int64)
        ).to(self.device)
        index_of = {int(r): i for i, r in enumerate(step.rows.tolist())}
        chain_step, chain_out, chain_limits = [], [], []
        last_rows = step.cu[1:].astype(np.int64) - 1
        for j, row in enumerate(rows.tolist()):
            i = index_of.get(int(row))
            if i is None or limits[j] <= 0:
                continue
            # The chain starts at the row whose next token is the newest one.
            at = int(b.num_tokens[row]) - 2 - int(starts[i])
            if not 0 <= at < counts[i]:
                continue
            last_rows[i] = int(step.cu[i]) + at
            chain_step.append(i)
            chain_out.append(j)
            chain_limits.append(int(limits[j]))
        table = self._tables(b, step.rows)
        drafts = self._draft(b, step.rows, ids, counts, starts, table, step.aux, last_rows,
                             np.array(chain_step, dtype=np.int64),
                             np.array(chain_limits, dtype=np.int64))
        for j, d in zip(chain_out, drafts):
            out[j] = d

    def _draft(self, b: InputBatch, rows: np.ndarray, ids: torch.Tensor, counts: np.ndarray,
               starts: np.ndarray, table: torch.Tensor, hidden: torch.Tensor | None,
               last_rows: np.ndarray | None, chain: np.ndarray,
               limits: np.ndarray | None) -> list[list[int]]:
        chain_rows = rows[chain]
        temp = b.temperature[chain_rows].astype(np.float32)
        random = temp > 0
        all_greedy = not random.any()
        temperature = gens = None
        if not all_greedy:
            temperature = torch.from_numpy(temp).to(self.device)
            gens = {}
            for i in np.flatnonzero(random & (b.seed[chain_rows] >= 0)).tolist():
                row = int(chain_rows[i])
                n_out = int(b.num_tokens[row]) - int(b.num_prompt_tokens[row])
                gen = torch.Generator(device=self.device)
                gen.manual_seed(position_seed(int(b.seed[row]) ^ _DRAFT_SALT, n_out))
                gens[i] = gen
        batch = make_batch(ids, counts, starts, table, self.block_size, hidden=hidden,
                           temperature=temperature, all_greedy=all_greedy,
                           last_rows=last_rows, chain=chain, row_generators=gens or None)
        result = self.proposer.propose(batch)
        if not len(chain):
            return []
        assert limits is not None
        tokens = result.token_ids.cpu().numpy()
        drafts = [tokens[i, :int(limits[i])].tolist() for i in range(len(chain))]
        if result.probs is not None:
            req_ids = self._req_ids(b, chain_rows)
            for i in np.flatnonzero(random).tolist():
                self._q[req_ids[i]] = (drafts[i], result.probs[i, :len(drafts[i])])
        return drafts

    @staticmethod
    def _req_ids(b: InputBatch, rows: np.ndarray) -> list[str]:
        extras = b.extras
        return [extras[int(r)].req_id for r in rows.tolist()]  # type: ignore[union-attr]

    # --- verification --------------------------------------------------------------------------

    def draft_probs(self, req_ids: list[str], drafts: list[list[int]], vocab_size: int
                    ) -> torch.Tensor | None:
        """``[B, K, V]`` for the rejection sampler: each sampled request's q over its drafts
        (one-hot where its drafts were not drawn at random); None when no request's were."""
        found = [self._q.get(rid) for rid in req_ids]
        if not any(f is not None for f in found):
            return None
        k = max((len(d) for d in drafts), default=0)
        if not k:
            return None
        out = torch.zeros(len(req_ids), k, vocab_size, device=self.device)
        for i, (d, f) in enumerate(zip(drafts, found)):
            if not d:
                continue
            if f is not None and f[0][:len(d)] == d:
                # (q covers the target's vocabulary; logits may carry padding columns.)
                out[i, :len(d), :f[1].shape[1]] = f[1][:len(d)]
            else:
                out[i, torch.arange(len(d), device=self.device),
                    torch.tensor(d, device=self.device)] = 1.0
        return out
