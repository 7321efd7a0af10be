"""Prompt-lookup (n-gram) drafts on the device: what ``ngram_proposer.NgramProposer`` finds on
the host (for each request, the longest suffix n-gram of its tokens, ``prompt_lookup_max`` down
to ``prompt_lookup_min`` tokens, that occurred earlier; the ``k`` tokens after its latest earlier
occurrence), for the whole batch at once.

The device keeps a copy of every batch row's tokens (``[max_num_reqs, max_model_len]`` int32),
brought up to date at each proposal with the tokens appended since the last one (at steady
decode 1 to k + 1 per request: one small copy for the batch). The lookup compares each row's
history with its last token, then narrows the matches one token further back at a time,
``prompt_lookup_max`` passes over ``[rows, longest row]`` elementwise: no per-request loop,
where the host version walks the batch in Python.
"""

from __future__ import annotations

import numpy as np
import torch

from tidal.worker.input_batch import InputBatch
from tidal.worker.spec_decode.proposal import Proposal
from tidal.worker.step_buffers import to_device


# Rows x positions a lookup compares at once (its temporaries: about 10 bytes each).
LOOKUP_ELEMENTS = 16 << 20


class NgramDeviceProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int, max_num_reqs: int, max_model_len: int,
                 device: torch.device) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max
        self.device = device
        self.history = torch.zeros(max_num_reqs, max_model_len, dtype=torch.int32,
                                   device=device)
        # Per batch row: tokens already on the device, and the row's generation then.
        self._synced = np.zeros(max_num_reqs, dtype=np.int64)
        self._generation = np.full(max_num_reqs, -1, dtype=np.int64)

    def _sync(self, b: InputBatch, rows: np.ndarray, lengths: np.ndarray) -> None:
        """Copy the tokens of ``rows`` the device does not hold yet (those below ``lengths``:
        a request's tokens never change once appended; a reused row starts again)."""
        fresh = self._generation[rows] != b.generation[rows]
        self._synced[rows[fresh]] = 0
        self._generation[rows] = b.generation[rows]
        start = np.minimum(self._synced[rows], lengths)
        counts = lengths - start
        total = int(counts.sum())
        if total:
            row_of = np.repeat(rows.astype(np.int64), counts)
            pos = np.repeat(start, counts) + (np.arange(total, dtype=np.int64)
                                              - np.repeat(np.cumsum(counts) - counts, counts))
            vals = b.token_ids[row_of, pos].astype(np.int64)
            packed = to_device(np.concatenate((row_of, pos, vals)), self.device)
            self.history.index_put_((packed[:total], packed[total:2 * total]),
                                    packed[2 * total:].to(torch.int32))
        self._synced[rows] = lengths

    def lookup(self, rows: torch.Tensor, lengths: torch.Tensor, width: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts ``[R, k]`` and their counts ``[R]`` (0 .. k) of batch ``rows`` whose tokens
        are their first ``lengths`` (all <= ``width``), from the device's copy; in chunks of
        rows, so the temporaries (a few bytes per row and position) stay bounded."""
        step = max(1, LOOKUP_ELEMENTS // max(width, 1))
        if len(rows) <= step:
            return self._lookup(rows, lengths, width)
        parts = [self._lookup(rows[i:i + step], lengths[i:i + step], width)
                 for i in range(0, len(rows), step)]
        return torch.cat([d for d, _ in parts]), torch.cat([c for _, c in parts])

    def _lookup(self, rows: torch.Tensor, lengths: torch.Tensor, width: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hist = self.history[:, :width].index_select(0, rows)  # int32 [R, W]
        n_rows = hist.shape[0]
        dev = hist.device
        pos = torch.arange(width, dtype=torch.int32, device=dev)
        lengths = lengths.to(torch.int64)
        last = lengths - 1
        # Candidate end positions of an earlier occurrence: before the last token.
        ok = pos.unsqueeze(0) < last.unsqueeze(1)
        best_end = torch.full((n_rows,), -1, dtype=torch.int64, device=dev)
        best_n = torch.zeros(n_rows, dtype=torch.int64, device=dev)
        for i in range(self.n_max):
            # The suffix's i-th token from the end against each candidate's i-th one back
            # (none whose n-gram would start before token 0).
            want = hist.gather(1, (last - i).clamp(min=0).unsqueeze(1))
            if i:
                ok[:, i:] &= hist[:, :width - i] == want
                ok[:, :i] = False
            else:
                ok &= hist == want
            ok &= (last - i >= 0).unsqueeze(1)
            end = torch.where(ok, pos.unsqueeze(0), -1).amax(dim=1).to(torch.int64)
            found = end >= 0
            best_end = torch.where(found, end, best_end)
            best_n = torch.where(found, i + 1, best_n)
        hit = (best_n >= self.n_min) & (lengths >= self.n_min + 1)
        start = best_end + 1
        counts = torch.where(hit, (lengths - start).clamp(0, self.k), 0)
        cols = (start.unsqueeze(1) + torch.arange(self.k, device=dev)).clamp(max=width - 1)
        drafts = hist.gather(1, cols).to(torch.int64)
        return drafts, counts

    def propose(self, b: InputBatch, rows: np.ndarray, lengths: np.ndarray,
                limits: np.ndarray | None = None, defer: bool = False) -> Proposal:
        """``NgramProposer.propose`` for the batch ``b``: drafts of each of ``rows`` (their
        first ``lengths[i]`` tokens), at most ``limits[i]`` (0: none), default ``k``.
        ``defer``: left on the device (``Proposal.on_device``), for a next step scheduled
        before this one's output is collected."""
        lengths = np.asarray(lengths, dtype=np.int64)
        cap = np.full(len(rows), self.k, dtype=np.int64)
        if limits is not None:
            cap = np.minimum(cap, np.asarray(limits, dtype=np.int64))
        live = cap > 0
        generations = b.generation[rows].copy()
        if not live.any():
            return Proposal(rows, generations, host=[[] for _ in range(len(rows))])
        sel = rows[live].astype(np.int64)
        lens = lengths[live]
        self._sync(b, sel, lens)
        both = to_device(np.concatenate((sel, lens)), self.device)
        drafts, counts = self.lookup(both[:len(sel)], both[len(sel):], int(lens.max()))
        src = np.full(len(rows), -1, dtype=np.int64)
        src[live] = np.arange(len(sel), dtype=np.int64)
        proposal = Proposal.on_device(b, rows, drafts, src, cap, counts)
        if not defer:
            proposal.lists()
        return proposal
