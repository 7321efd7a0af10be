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
  An EAGLE-3 head (or an MTP layer: the target's final hidden states instead of the aux
  ones) needs the target's hidden states of each position, so it runs over every
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
from tidal.worker.spec_decode.proposal import Proposal
from tidal.worker.spec_decode.uniform_propose import ProposeGraphs, UniformBuffers, UniformHost
from tidal.worker.step_buffers import to_device

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
                 block_table: torch.Tensor, device: torch.device,
                 aux_buffer: torch.Tensor | None = None) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        # EAGLE-3 and MTP draft from the target's hidden states of each step's rows (the aux
        # states / the final state): the same rows, chain and uniform steps.
        self.eagle = config.method in ("eagle3", "mtp")
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
        # Uniform steps (``uniform_propose``): k + 1 rows per request, as many requests as
        # the buffers (and an EAGLE-3 head's share of the target's aux buffer) hold.
        q = self.k + 1
        uniform_reqs = max_num_reqs
        if self.eagle:
            uniform_reqs = 0 if aux_buffer is None else min(max_num_reqs,
                                                             aux_buffer.shape[0] // q)
        self._uniform = (UniformBuffers.allocate(uniform_reqs, q, self.k, block_table.shape[1],
                                                 device, aux_buffer if self.eagle else None)
                         if uniform_reqs and hasattr(proposer, "propose_uniform") else None)
        self.graphs: ProposeGraphs | None = None
        self.uniform_steps = 0  # (counted for tests and benchmarks)
        self.early_steps = 0  # of which launched by ``propose_early``
        self._early: StepRows | None = None  # the step ``propose_early`` launched for
        # A draft model's: the batch rows ``propose_early`` launched for.
        self._early_rows: np.ndarray | None = None
        # ``propose(defer=True)``: a uniform proposal left on the device, (the rows' indices
        # into the output, their limits, the output).
        self._defer = False
        self._on_device: tuple[np.ndarray, np.ndarray, torch.Tensor] | None = None

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
        self.graphs = None  # (they address the cache being released)
        for layer in self.proposer.attention_layers():
            layer.kv_cache = torch.empty(0)
        self._seen_generation.fill(-1)

    def _tables(self, b: InputBatch, rows: np.ndarray) -> torch.Tensor:
        """The rows' block tables with every entry past a row's own blocks in its scratch."""
        both = to_device(np.stack((rows.astype(np.int64),
                                   b.num_blocks[rows].astype(np.int64))), self.device)
        return self._tables_from(both[0], both[1])

    def _tables_from(self, rows_d: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        dev = self.device
        table = self.block_table.index_select(0, rows_d)
        own = own.unsqueeze(1)
        j = torch.arange(table.shape[1], device=dev).unsqueeze(0)
        scratch = (self._scratch_base + rows_d.unsqueeze(1) * self.scratch_per_row
                   + (j - own).clamp(0, self.scratch_per_row - 1))
        return torch.where(j < own, table, scratch.to(table.dtype))

    # --- one step ------------------------------------------------------------------------------

    def observe(self, rows: np.ndarray, cu: np.ndarray, seq_lens: np.ndarray,
                aux: torch.Tensor | None) -> None:
        """The target step just run (EAGLE-3 drafts from its hidden states)."""
        self._early = None
        self._early_rows = None
        if self.eagle:
            assert aux is not None
            self._step = StepRows(rows, cu, seq_lens, aux[:int(cu[-1])])

    def propose(self, b: InputBatch, rows: np.ndarray, limits: np.ndarray,
                defer: bool = False) -> Proposal:
        """Drafts of the requests of ``rows`` (after their emitted tokens were appended),
        at most ``limits[i]`` each (0: none). ``defer``: a uniform proposal stays on the
        device (its host copy on its way), for a next step scheduled before this one's
        output is collected."""
        drafting = limits > 0
        out: list[list[int]] = [[] for _ in range(len(rows))]
        self._defer, self._on_device = defer, None
        try:
            if self.eagle:
                step, self._step = self._step, None
                if step is not None:
                    self._propose_eagle(b, step, rows, limits, out)
            elif drafting.any():
                self._propose_draft_model(b, rows[drafting], limits[drafting],
                                          np.flatnonzero(drafting), out)
        finally:
            self._defer = False
        for i, rid in enumerate(self._req_ids(b, rows)):
            if not out[i]:  # (a proposal on the device is greedy: no q either)
                self._q.pop(rid, None)
        if len(self._q) > len(b):
            for rid in [r for r in self._q if r not in b]:
                del self._q[rid]
        found, self._on_device = self._on_device, None
        if found is not None:
            src, lim, dev = found
            return Proposal.on_device(b, rows, dev, src, lim)
        return Proposal(rows, b.generation[rows].copy(), host=out)

    def _keep_on_device(self, n_rows: int, where: list[int] | np.ndarray,
                        src: list[int] | np.ndarray, limits: list[int] | np.ndarray,
                        n_out: int) -> None:
        """A deferred uniform proposal: rows ``where`` (of the proposal's ``n_rows``) take
        output rows ``src``, ``limits`` drafts each."""
        assert self._uniform is not None
        s = np.full(n_rows, -1, dtype=np.int64)
        lim = np.zeros(n_rows, dtype=np.int64)
        s[np.asarray(where, dtype=np.int64)] = np.asarray(src, dtype=np.int64)
        lim[np.asarray(where, dtype=np.int64)] = np.asarray(limits, dtype=np.int64)
        self._on_device = (s, lim, self._uniform.out[:n_out])

    def _propose_draft_model(self, b: InputBatch, rows: np.ndarray, limits: np.ndarray,
                             where: np.ndarray, out: list[list[int]]) -> None:
        early, self._early_rows = self._early_rows, None
        if early is not None and self._pick_up_early(b, rows, limits, where, out, early):
            return
        fresh = self._seen_generation[rows] != b.generation[rows]
        self._seen[rows[fresh]] = 0
        self._seen_generation[rows] = b.generation[rows]
        n_tokens = b.num_tokens[rows].astype(np.int64)
        seen = self._seen[rows].copy()
        own = b.num_blocks[rows].astype(np.int64) * self.block_size
        q = self.k + 1
        u = self._uniform
        if (u is not None and len(rows) <= u.max_reqs and not fresh.any()
                and bool((n_tokens >= q).all()) and bool((n_tokens - seen <= q).all())
                and bool((b.temperature[rows] <= 0).all())):
            # Each request's newest q tokens: those it has not seen, then older ones again
            # (their K/V rewritten as they were), so every request has q rows.
            starts = n_tokens - q
            ids_h = b.token_ids[np.repeat(rows, q),
                                (starts[:, None] + np.arange(q)).ravel()].astype(np.int64)
            last = np.full(len(rows), q - 1, dtype=np.int64)
            self._seen[rows] = np.minimum(n_tokens, own)
            if self._defer:
                self._launch_uniform(b, rows, ids_h, starts, last)
                self._keep_on_device(len(out), where, np.arange(len(rows)), limits, len(rows))
                return
            tokens = self._run_uniform(b, rows, ids_h, starts, last)
            for j, i in enumerate(where.tolist()):
                out[i] = tokens[j, :int(limits[j])].tolist()
            return
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
        self._seen[rows] = np.minimum(n_tokens, own)
        for j, i in enumerate(where.tolist()):
            out[i] = drafts[j]

    def _pick_up_early(self, b: InputBatch, rows: np.ndarray, limits: np.ndarray,
                       where: np.ndarray, out: list[list[int]], early: np.ndarray) -> bool:
        """A draft model's proposal launched by ``propose_early`` (for the batch rows
        ``early``): the drafts of ``rows`` from it, or False where it does not cover them."""
        index = {int(r): i for i, r in enumerate(early.tolist())}
        src = [index.get(int(r)) for r in rows.tolist()]
        if any(i is None for i in src) or bool(
                (self._seen_generation[rows] != b.generation[rows]).any()):
            return False
        own = b.num_blocks[rows].astype(np.int64) * self.block_size
        self._seen[rows] = np.minimum(b.num_tokens[rows].astype(np.int64), own)
        if self._defer:
            self._keep_on_device(len(out), where, src, limits, len(early))
            return True
        tokens = self._uniform_out(len(early))
        for j, i in enumerate(where.tolist()):
            out[i] = tokens[src[j], :int(limits[j])].tolist()
        return True

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
        ids = to_device(b.token_ids[token_rows, pos].astype(np.int64), self.device)
        if len(sel) < len(rows):
            table = table[to_device(sel, self.device)]
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
        ids_h = b.token_ids[token_rows, np.minimum(pos + 1, width - 1)].astype(np.int64)
        # (Past the tokens: a draft the step before took from the device is -1 on the host.)
        np.maximum(ids_h, 0, out=ids_h)
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
        q = self.k + 1
        u = self._uniform
        early, self._early = self._early is step, None
        if early:  # launched from the verify step's outputs (``propose_early``)
            if self._defer:
                self._keep_on_device(len(out), chain_out, chain_step, chain_limits,
                                     len(step.rows))
                return
            tokens = self._uniform_out(len(step.rows))
            for i, j, limit in zip(chain_step, chain_out, chain_limits):
                out[j] = tokens[i, :limit].tolist()
            return
        if (u is not None and chain_step and len(step.rows) <= u.max_reqs
                and bool((counts == q).all())
                and bool((b.temperature[step.rows[chain_step]] <= 0).all())):
            last = np.full(len(step.rows), q - 1, dtype=np.int64)
            last[chain_step] = last_rows[chain_step] - step.cu[chain_step].astype(np.int64)
            if self._defer:
                self._launch_uniform(b, step.rows, ids_h, starts, last)
                self._keep_on_device(len(out), chain_out, chain_step, chain_limits,
                                     len(step.rows))
                return
            tokens = self._run_uniform(b, step.rows, ids_h, starts, last)
            for i, j, limit in zip(chain_step, chain_out, chain_limits):
                out[j] = tokens[i, :limit].tolist()
            return
        ids = to_device(ids_h, self.device)
        table = self._tables(b, step.rows)
        drafts = self._draft(b, step.rows, ids, counts, starts, table, step.aux, last_rows,
                             np.array(chain_step, dtype=np.int64),
                             np.array(chain_limits, dtype=np.int64))
        for j, d in zip(chain_out, drafts):
            out[j] = d

    def _run_uniform(self, b: InputBatch, rows: np.ndarray, ids: np.ndarray,
                     starts: np.ndarray, last: np.ndarray) -> np.ndarray:
        """Greedy drafts ``[len(rows), k]`` of a uniform step (``uniform_propose``): its
        captured graph where there is one, else the same step eagerly."""
        self._launch_uniform(b, rows, ids, starts, last)
        return self._uniform_out(len(rows))

    def _launch_uniform(self, b: InputBatch, rows: np.ndarray, ids: np.ndarray | torch.Tensor,
                        starts: np.ndarray | torch.Tensor, last: np.ndarray | torch.Tensor
                        ) -> None:
        """Fill the uniform buffers and run the step; ``ids``, ``starts`` and ``last`` may
        already be on the device (``propose_early``: only where a graph replays, which needs
        no host copies of them)."""
        u = self._uniform
        assert u is not None
        n_req, q = len(rows), u.q
        t = n_req * q
        on_host = isinstance(ids, np.ndarray)
        starts_on_host = isinstance(starts, np.ndarray)
        host_starts, host_last = starts, last
        parts = [rows.astype(np.int64), b.num_blocks[rows].astype(np.int64)]
        if starts_on_host:
            parts.append(starts)  # type: ignore[arg-type]
        if on_host:
            parts += [last, ids]  # type: ignore[list-item]
        packed = to_device(np.concatenate(parts), self.device)
        rows_d, blocks_d = packed[:n_req], packed[n_req:2 * n_req]
        at = 2 * n_req
        if starts_on_host:
            starts, at = packed[at:at + n_req], at + n_req
        if on_host:
            last, ids = packed[at:at + n_req], packed[at + n_req:]
        u.ids[:t].copy_(ids.reshape(t))  # type: ignore[union-attr]
        u.last[:n_req].copy_(last)  # type: ignore[arg-type]
        size = self.graphs.size_for(n_req) if self.graphs is not None else None
        n = size or n_req
        u.pos_start[:n_req].copy_(starts)  # type: ignore[arg-type]
        u.table[:n_req].copy_(self._tables_from(rows_d, blocks_d))
        u.valid[:n] = u.qsl1[:n] < n_req
        if n > n_req:  # padding requests: one short query each, nothing written
            u.pos_start[n_req:n].zero_()
            u.last[n_req:n].fill_(q - 1)
        if size is not None:
            self.graphs.replay(size)  # type: ignore[union-attr]
        else:
            assert on_host and starts_on_host, "an early launch needs its graph"
            self.proposer.propose_uniform(  # type: ignore[attr-defined]
                u, n_req, UniformHost(host_starts, host_last))  # type: ignore[arg-type]
        self.uniform_steps += 1

    def _uniform_out(self, n_req: int) -> np.ndarray:
        assert self._uniform is not None
        return self._uniform.out[:n_req].cpu().numpy()

    def propose_early(self, b: InputBatch, sample_rows: np.ndarray, token_ids: torch.Tensor,
                      num_emitted: torch.Tensor) -> bool:
        """An EAGLE-3 head's uniform step launched from the verify step's device outputs,
        before the host has them (one wait for both): row j of a request holds token j of
        what it emitted (its accepted drafts, then the target's token), the chain starts at
        its last emitted one. Only for a step whose graph is captured; ``propose`` then
        picks the drafts up. Returns whether it launched. A draft model's: see
        ``_propose_early_draft_model``."""
        if not self.eagle:
            return self._propose_early_draft_model(b, sample_rows, token_ids, num_emitted)
        step, u = self._step, self._uniform
        if step is None or u is None or self.graphs is None:
            return False
        q = self.k + 1
        n_req = len(step.rows)
        counts = np.diff(step.cu)
        if (n_req > u.max_reqs or self.graphs.size_for(n_req) is None
                or tuple(token_ids.shape) != (n_req, q) or not bool((counts == q).all())
                or not np.array_equal(sample_rows, step.rows)
                or bool((b.temperature[step.rows] > 0).any())):
            return False
        starts = step.seq_lens.astype(np.int64) - counts
        self._launch_uniform(b, step.rows, token_ids.clamp(min=0), starts,
                             (num_emitted - 1).clamp(min=0))
        self._early = step
        self.early_steps += 1
        return True

    def forget_early(self) -> None:
        """The step's early launch is not to be picked up (its verification was redone)."""
        self._early = None
        self._early_rows = None

    def _propose_early_draft_model(self, b: InputBatch, rows: np.ndarray,
                                   token_ids: torch.Tensor, num_emitted: torch.Tensor) -> bool:
        """A draft model's uniform step launched from the verify step's device outputs: each
        request's newest k + 1 tokens, once its ``e`` emitted ones are appended, are the last
        k + 1 of [its k + 1 newest tokens before the step (on the host), the emitted ones],
        i.e. that window from ``e`` on; they start at position (tokens before) - (k + 1) + e.
        For requests whose draft has seen every token before the step (as a uniform step
        needs), greedy ones. Under a captured graph nothing waits for the device; on a CPU
        (no graphs, the wait free) the same step runs eagerly from the tensors' values."""
        u = self._uniform
        q = self.k + 1
        n_req = len(rows)
        cpu = self.device.type == "cpu"
        if (u is None or not n_req or n_req > u.max_reqs
                or tuple(token_ids.shape) != (n_req, q)):
            return False
        if not cpu and (self.graphs is None or self.graphs.size_for(n_req) is None):
            return False
        before = b.num_tokens[rows].astype(np.int64)
        if (bool((before < q).any()) or bool((b.temperature[rows] > 0).any())
                or bool((self._seen_generation[rows] != b.generation[rows]).any())
                or bool((self._seen[rows] != before).any())):
            return False
        older = b.token_ids[np.repeat(rows, q),
                            ((before - q)[:, None] + np.arange(q)).ravel()].astype(np.int64)
        packed = to_device(np.concatenate((older, before - q)), self.device)
        window = torch.cat((packed[:n_req * q].view(n_req, q), token_ids.to(torch.int64)), 1)
        emitted = num_emitted.to(torch.int64)
        ids = window.gather(1, emitted.unsqueeze(1)
                            + torch.arange(q, device=window.device).unsqueeze(0))
        starts = packed[n_req * q:] + emitted
        if cpu:
            self._launch_uniform(b, rows, ids.reshape(-1).numpy(), starts.numpy(),
                                 np.full(n_req, q - 1, dtype=np.int64))
        else:
            self._launch_uniform(b, rows, ids.reshape(-1), starts,
                                 torch.full((n_req,), q - 1, dtype=torch.int64,
                                            device=self.device))
        self._early_rows = rows.copy()
        self.early_steps += 1
        return True

    def capture_graphs(self, max_reqs: int) -> None:
        """Capture the uniform propose step for padded request counts up to ``max_reqs`` (the
        target's decode graph sizes); call with the draft's KV cache bound."""
        from tidal.worker.cuda_graphs import capture_sizes

        if self._uniform is None or not getattr(self.proposer, "capturable", True):
            return
        sizes = capture_sizes(min(max_reqs, self._uniform.max_reqs))
        if not sizes:
            return
        graphs = ProposeGraphs(sizes)
        graphs.capture(self.proposer, self._uniform)  # type: ignore[arg-type]
        self.graphs = graphs

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
            temperature = to_device(temp, self.device)
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

    def draft_probs(self, req_ids: list[str], drafts: list[list[int]], vocab_size: int,
                    draft_ids: torch.Tensor) -> torch.Tensor | None:
        """``[B, K, V]`` for the rejection sampler: each sampled request's q over its drafts
        (one-hot where its drafts were not drawn at random); None when no request's were.
        ``draft_ids``: the drafts on the device (``[B, >= K]``; ``drafts`` holds -1 for
        those only the device knows, greedy ones)."""
        found = [self._q.get(rid) for rid in req_ids]
        if not any(f is not None for f in found):
            return None
        k = max((len(d) for d in drafts), default=0)
        if not k:
            return None
        dev = self.device
        out = torch.zeros(len(req_ids), k, vocab_size, device=dev)
        n = torch.tensor([len(d) for d in drafts], device=dev)
        valid = (torch.arange(k, device=dev).unsqueeze(0) < n.unsqueeze(1)).float()
        out.scatter_(2, draft_ids[:, :k].clamp(min=0).unsqueeze(2), valid.unsqueeze(2))
        for i, (d, f) in enumerate(zip(drafts, found)):
            if d and f is not None and f[0][:len(d)] == d:
                # (q covers the target's vocabulary; logits may carry padding columns.)
                out[i, :len(d)] = 0.0
                out[i, :len(d), :f[1].shape[1]] = f[1][:len(d)]
        return out
