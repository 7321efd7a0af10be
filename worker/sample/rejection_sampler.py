"""Verifies draft tokens against the target model: speculative decoding's rejection sampling.

A request with ``k`` drafts is verified at ``k + 1`` positions: the logits at verify position
``j`` are the target's distribution for the token that draft ``j`` proposes, and position ``k``
gives the bonus token when every draft is accepted. Per request the result is 1..k+1 tokens:
the accepted drafts, then one token from the target (the resampled or the bonus one).

- Greedy rows (temperature 0): a draft is accepted while it equals the target's argmax; the
  token after the accepted run is the argmax at that position. Output = greedy decoding exactly.
- Sampled rows: the standard rule (Leviathan et al., Chen et al.): draft ``d`` is accepted with
  probability ``min(1, p(d) / q(d))``; at the first rejection the token is drawn from the
  normalised residual ``max(p - q, 0)``; after k accepted drafts the bonus is drawn from ``p`` at
  position k. A deterministic drafter (n-gram) has a one-hot q: acceptance with probability
  ``p(d)``, the residual ``p`` without ``d``; a sampling drafter passes its q. Every emitted
  token is thus distributed exactly as the target's ``p``, where ``p`` is what the plain sampler
  draws from: the same logit processing (allowed tokens, bias, min_tokens bans, penalties),
  temperature, top-k, top-p and min-p, through the sampler's own functions. Seeded requests draw every random number of a position from that
  position's generator (``SamplingMetadata.generators``, one per verify position).
- Synthetic (``rejection_sample_method: synthetic``): draft ``j`` is accepted with a fixed
  conditional probability whatever the logits: the emitted tokens are the drafts, not the
  target's choice. Only for speed measurements.

Everything is batched torch on the device, without a host synchronisation: the caller copies the
padded result to the host once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tidal.worker.ops import torch_ops
from tidal.worker.sample.grammar_mask import apply_token_bitmask_
from tidal.worker.sample.metadata import SamplingMetadata
from tidal.worker.sample.sampler import (
    apply_allowed_token_ids,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)

_NEG_INF = float("-inf")


@dataclass(slots=True)
class VerifyLayout:
    """Where each request's verify positions sit among the step's logits rows (host arrays,
    built once per step by ``verify_layout``), ``B`` requests with at most ``K`` drafts."""

    num_drafts: np.ndarray  # int64 [B]
    index: np.ndarray  # int64 [B, K + 1]: logits row of verify position j (clamped to k_b)
    draft_ids: np.ndarray  # int64 [B, K + 1]: draft j, 0 past the request's drafts

    @property
    def num_rows(self) -> int:
        """Logits rows: the sum of 1 + drafts over the requests."""
        return int(self.num_drafts.sum()) + len(self.num_drafts)


def verify_layout(drafts: list[list[int]]) -> VerifyLayout:
    """The layout of requests whose drafts are ``drafts`` (an empty list: a plain sample),
    their verify positions consecutive rows in request order."""
    n = np.fromiter((len(d) for d in drafts), dtype=np.int64, count=len(drafts))
    k_max = int(n.max(initial=0))
    first = np.zeros(len(drafts), dtype=np.int64)
    if len(drafts) > 1:
        np.cumsum(n[:-1] + 1, out=first[1:])
    j = np.arange(k_max + 1, dtype=np.int64)
    index = first[:, None] + np.minimum(j[None, :], n[:, None])
    ids = np.zeros((len(drafts), k_max + 1), dtype=np.int64)
    if k_max:
        flat = np.fromiter((t for d in drafts for t in d), dtype=np.int64, count=int(n.sum()))
        ids[j[None, :] < n[:, None]] = flat
    return VerifyLayout(n, index, ids)


@dataclass(slots=True)
class RejectionOutput:
    token_ids: torch.Tensor  # int64 [B, K + 1]: emitted tokens of each request, then -1
    num_emitted: torch.Tensor  # int64 [B]: 1 + accepted drafts
    # float32 [T, V]: log-probabilities of every verify position, as ``Sampler`` reports them
    # (after the temperature, before truncation); only when a row asked for logprobs.
    logprobs: torch.Tensor | None = None


def processed_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The logits as ``Sampler`` processes them before the temperature, in its order: grammar
    masks (one row per verify position: the mask after the drafts before it), allowed tokens,
    bias, min_tokens bans, penalties."""
    logits = logits.float()  # (in place when already float32, as ``Sampler`` masks)
    if meta.grammar_bitmask is not None:
        apply_token_bitmask_(logits, meta.grammar_bitmask, meta.grammar_rows)
    if meta.allowed_rows is not None:
        assert meta.allowed_cols is not None
        logits = apply_allowed_token_ids(logits, meta.allowed_rows, meta.allowed_cols)
    if meta.bias_rows is not None:
        logits = logits.index_put((meta.bias_rows, meta.bias_cols), meta.bias_vals,
                                  accumulate=True)
    if meta.ban_rows is not None:
        logits = logits.index_put((meta.ban_rows, meta.ban_cols), logits.new_full((), _NEG_INF))
    if meta.output_counts is not None:
        logits = apply_penalties(logits, meta)
    return logits


def target_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution ``Sampler`` draws from (rows with temperature 0 get temperature 1;
    they take the argmax instead)."""
    temp = meta.temperature
    if not meta.all_random:
        temp = torch.where(temp == 0.0, torch.ones_like(temp), temp)
    truncated = apply_top_k_top_p(logits / temp.unsqueeze(1), meta.top_k, meta.top_p)
    if meta.min_p is not None:
        truncated = apply_min_p(truncated, meta.min_p)
    return truncated.softmax(dim=-1)


def _plain(meta: SamplingMetadata) -> bool:
    return (meta.bias_rows is None and meta.ban_rows is None and meta.output_counts is None
            and meta.allowed_rows is None and meta.grammar_bitmask is None)


class RejectionSampler:
    def __init__(self, synthetic_rates: tuple[float, ...] | None = None,
                 argmax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        # Conditional acceptance rate of each draft position (synthetic mode), else None.
        self.synthetic_rates = synthetic_rates
        # The row argmax of the verify logits (``Kernels.argmax`` on a GPU), else torch's.
        self.argmax = argmax or torch_ops.argmax
        self._rates_dev: dict[torch.device, torch.Tensor] = {}

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata, index: torch.Tensor,
                 draft_ids: torch.Tensor, num_drafts: torch.Tensor,
                 draft_probs: torch.Tensor | None = None) -> RejectionOutput:
        """``logits``: [T, V] at the verify positions; ``meta``: T rows (each verify position
        its request's parameters, seeded positions their own generator); ``index``,
        ``draft_ids``, ``num_drafts``: the ``VerifyLayout`` on the device. ``draft_probs``:
        float32 [B, K, V], the distributions a sampling drafter drew its drafts from (a draft
        model with temperature > 0); None: deterministic drafts (one-hot q)."""
        dev = logits.device
        b, width = index.shape
        k = width - 1
        j = torch.arange(width, device=dev)
        valid = j[:k].unsqueeze(0) < num_drafts.unsqueeze(1)  # [B, K]
        drafts = draft_ids[:, :k]
        greedy_fast = meta.all_greedy and _plain(meta)
        processed = logits if greedy_fast else processed_logits(logits, meta)
        argmax = self.argmax(processed)  # [T]
        probs = uniform = noise = None
        if not meta.all_greedy or self.synthetic_rates is not None:
            uniform, noise = self._randoms(processed, meta, need_noise=not meta.all_greedy)
        if not meta.all_greedy:
            probs = target_probs(processed, meta)

        # Which drafts pass.
        if self.synthetic_rates is not None:
            assert uniform is not None
            accepted = uniform[index[:, :k]] < self._rates(dev)[:k].unsqueeze(0)
        else:
            accepted = argmax[index[:, :k]] == drafts
            if probs is not None:
                assert uniform is not None
                p_draft = probs[index[:, :k], drafts]
                if draft_probs is None:
                    by_rule = uniform[index[:, :k]] < p_draft
                else:  # u < p / q, without dividing by a q of 0
                    q_draft = draft_probs[:, :k].gather(2, drafts.unsqueeze(2)).squeeze(2)
                    by_rule = uniform[index[:, :k]] * q_draft < p_draft
                greedy_row = meta.temperature[index[:, 0]] == 0.0
                accepted = torch.where(greedy_row.unsqueeze(1), accepted, by_rule)
        accepted &= valid
        num_accepted = accepted.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B]

        # The target's token after the accepted run: argmax, or a draw from the residual (a
        # rejection: p without the rejected draft) or from p itself (the bonus position).
        at = index.gather(1, num_accepted.unsqueeze(1)).squeeze(1)  # [B] logits rows
        final = argmax[at]
        if probs is not None:
            assert noise is not None
            p = probs[at]
            rejected = num_accepted < num_drafts
            if k and draft_probs is None:
                draft_at = drafts.gather(1, num_accepted.clamp(max=k - 1).unsqueeze(1))
                kept = p.gather(1, draft_at)
                # (Synthetic acceptance can reject a draft that holds all of p, e.g. the one
                # token a grammar allows: p itself then, never an empty residual.)
                drop = rejected.unsqueeze(1) & (kept < 1.0)
                p = p.scatter(1, draft_at, torch.where(drop, torch.zeros_like(kept), kept))
            elif k:
                q = draft_probs[torch.arange(b, device=dev), num_accepted.clamp(max=k - 1)]
                residual = (p - q).clamp_min(0.0)
                # (An all-zero residual means p == q, where a rejection cannot happen but for
                # rounding: p itself then.)
                use = rejected & (residual.sum(dim=1) > 0)
                p = torch.where(use.unsqueeze(1), residual, p)
            drawn = (p / noise[at]).argmax(dim=-1)
            greedy_row = meta.temperature[at] == 0.0
            final = torch.where(greedy_row, final, drawn)
        tokens = torch.where(j.unsqueeze(0) < num_accepted.unsqueeze(1), draft_ids,
                             torch.full_like(draft_ids, -1))
        tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
        logprobs = None
        if meta.max_num_logprobs is not None:
            scaled = processed.float()
            if not meta.all_greedy:
                temp = meta.temperature
                scaled = scaled / torch.where(temp == 0.0, torch.ones_like(temp),
                                              temp).unsqueeze(1)
            logprobs = scaled.log_softmax(dim=-1)
        return RejectionOutput(tokens, num_accepted + 1, logprobs)

    def _rates(self, dev: torch.device) -> torch.Tensor:
        rates = self._rates_dev.get(dev)
        if rates is None:
            assert self.synthetic_rates is not None
            rates = torch.tensor(self.synthetic_rates, dtype=torch.float32, device=dev)
            self._rates_dev[dev] = rates
        return rates

    @staticmethod
    def _randoms(logits: torch.Tensor, meta: SamplingMetadata, need_noise: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One uniform per verify position (the acceptance test) and, for sampling, Exp(1)
        noise per vocabulary entry (the exponential race draws argmax p / noise ~ p). A seeded
        position draws both from its own generator, the noise first: a position without a
        draft then draws the very token ``Sampler`` would from the same generator."""
        t = logits.shape[0]
        uniform = torch.rand(t, device=logits.device)
        noise = None
        if need_noise:
            noise = torch.empty_like(logits)
            if len(meta.generators) < t:
                noise.exponential_()
        for row, gen in meta.generators.items():
            if noise is not None:
                noise[row].exponential_(generator=gen)
            uniform[row:row + 1] = torch.rand(1, generator=gen, device=logits.device)
        return uniform, noise
