"""Prompt-lookup (n-gram) drafts: for each request, the longest suffix n-gram of its tokens
(prompt + output, ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens) that occurred
earlier in them proposes the (up to) ``k`` tokens that followed its latest earlier occurrence.

It runs on the host, a tight loop over the batch with numpy per request: the candidates are the
earlier positions holding the sequence's last token (one vectorised comparison over the
history), then they are narrowed one token further back at a time, so a request costs one pass
over its history plus work proportional to its matches.
"""

from __future__ import annotations

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int32)


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        self.k = num_speculative_tokens
        self.n_min = prompt_lookup_min
        self.n_max = prompt_lookup_max

    def propose_one(self, tokens: np.ndarray, k: int | None = None) -> np.ndarray:
        """Drafts for one sequence (``tokens``: its ids, 1-D); empty when no n-gram of at least
        ``prompt_lookup_min`` tokens recurs."""
        k = self.k if k is None else k
        length = len(tokens)
        if k <= 0 or length < self.n_min + 1:
            return _EMPTY
        # End positions of earlier occurrences of the last token (the last one excluded).
        ends = np.flatnonzero(tokens[:length - 1] == tokens[length - 1])
        if not ends.size:
            return _EMPTY
        matched = 1
        while matched < self.n_max:
            # Extend every candidate one token back; those that still match survive.
            back = ends - matched
            ok = back >= 0
            ok[ok] = tokens[back[ok]] == tokens[length - 1 - matched]
            if not ok.any():
                break
            ends = ends[ok]
            matched += 1
        if matched < self.n_min:
            return _EMPTY
        start = int(ends[-1]) + 1  # the latest occurrence of the longest match
        return tokens[start:start + k]

    def propose(self, token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
                limits: np.ndarray | None = None) -> list[list[int]]:
        """Drafts for each of ``rows`` of the batch's ``token_ids`` (2-D, row r's first
        ``lengths[i]`` entries are its tokens); ``limits``: at most this many drafts per row
        (0: none), default ``k``."""
        out: list[list[int]] = []
        k = self.k
        for i, row in enumerate(rows.tolist()):
            cap = k if limits is None else min(k, int(limits[i]))
            if cap <= 0:
                out.append([])
                continue
            out.append(self.propose_one(token_ids[row, :int(lengths[i])], cap).tolist())
        return out
