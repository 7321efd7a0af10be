"""The sampler: logits of a batch → one token per row (and log-probabilities when asked).

Order of processing: the grammar masks (in place), logits processors
(``logits_processors.py``), the allowed-token mask, logit bias,
min_tokens bans, penalties, temperature; log-probabilities are taken here (the "processed"
distribution); then top-k, top-p and min-p truncate, and tokens are drawn with the
exponential-race trick (argmax of p / q, q ~ Exp(1)), which needs one random number per
vocabulary entry; a seeded row's numbers are a hash of its seed, position and the column
(``seeded_random.py``), so all seeded rows draw in one launch. A batch that only scales the
distribution by a temperature (no truncation, penalty, bias or log-probabilities) draws the
same race in one pass over the logits, grammar masks included (``gumbel_sample.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tidal.worker.ops.kernels import Kernels
from tidal.worker.sample import gumbel_sample, seeded_random
from tidal.worker.sample.logits_processors import apply_processors
from tidal.worker.sample.metadata import SamplingMetadata

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # int64 [B, 1 + N]: sampled token, then the top-N
    logprobs: torch.Tensor  # float32 [B, 1 + N]
    ranks: torch.Tensor  # int64 [B]: 1-based rank of the sampled token


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    logprobs: LogprobsTensors | None


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    counts = meta.output_counts
    assert counts is not None and meta.prompt_mask is not None
    rep = meta.repetition_penalty
    if rep is not None:
        seen = meta.prompt_mask | (counts > 0)
        factor = torch.where(logits > 0, 1.0 / rep.unsqueeze(1), rep.unsqueeze(1))
        logits = torch.where(seen, logits * factor, logits)
    if meta.frequency_penalty is not None:
        logits = logits - meta.frequency_penalty.unsqueeze(1) * counts
    if meta.presence_penalty is not None:
        logits = logits - meta.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_allowed_token_ids(logits: torch.Tensor, rows: torch.Tensor,
                            cols: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) every token of a restricted row but its allowed ones; a row is restricted
    when it has at least one (row, token) pair. One scatter and one fill for the whole batch."""
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.index_put_((rows, cols), keep.new_ones(()))
    return logits.masked_fill(keep.any(dim=1, keepdim=True) & ~keep, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and its top-p nucleus."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # The k-th largest value is at ascending position vocab - k; ties with it survive.
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        tail_mass = probs.cumsum(dim=-1)
        drop = tail_mass <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False  # the most likely token always stays
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def exponential_noise(probs: torch.Tensor, meta: SamplingMetadata,
                      kernels: Kernels | None = None) -> torch.Tensor:
    """Exp(1) noise [B, V]: the seeded rows' from their position keys, the others' from the
    global generator."""
    q = torch.empty_like(probs)
    rows = meta.seeded_rows
    n_seeded = 0 if rows is None else rows.shape[0]
    if n_seeded < probs.shape[0]:
        if q.device.type == "cpu":
            # -log(1 - U): the same Exp(1), about 4 times faster than exponential_ on a CPU;
            # never 0 (U = 0 happens: 2^-24 a value), which would make p / q inf or nan.
            torch.rand(q.shape, out=q).neg_().log1p_().neg_().clamp_min_(_TINY)
        else:
            q.exponential_()
    if rows is not None:
        assert meta.seeded_keys is not None
        if kernels is None:
            seeded_random.seeded_exponential_(q, rows, meta.seeded_keys)
        else:
            kernels.seeded_exponential_(q, rows, meta.seeded_keys)
    return q


def compute_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num: int
) -> LogprobsTensors:
    chosen = logprobs.gather(1, sampled.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num > 0:
        top_vals, top_ids = logprobs.topk(num, dim=-1)
        ids = torch.cat((sampled.unsqueeze(1), top_ids), dim=1)
        vals = torch.cat((chosen, top_vals), dim=1)
    else:
        ids, vals = sampled.unsqueeze(1), chosen
    return LogprobsTensors(ids, vals, ranks)


def _plain_random(meta: SamplingMetadata) -> bool:
    """Some rows random, and nothing but a temperature between the logits and the draw."""
    return (not meta.all_greedy and meta.top_k is None and meta.top_p is None
            and meta.min_p is None and meta.max_num_logprobs is None
            and meta.bias_rows is None and meta.ban_rows is None
            and meta.output_counts is None and meta.allowed_rows is None
            and meta.logits_procs is None)


def _plain_greedy(meta: SamplingMetadata) -> bool:
    """Every row greedy, and nothing that changes or reports the distribution."""
    return (meta.all_greedy and meta.max_num_logprobs is None and meta.bias_rows is None
            and meta.ban_rows is None and meta.output_counts is None
            and meta.allowed_rows is None and meta.logits_procs is None)


class Sampler:
    def __init__(self, kernels: Kernels | None = None) -> None:
        if kernels is None:  # outside a worker: the torch ops
            from tidal.worker.kernel_policy import reference_kernels

            kernels = reference_kernels()
        self._argmax = kernels.argmax
        self._kernels = kernels

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row. The grammar masks are applied to ``logits`` in place,
        except by the one-pass draw, which reads them as it goes (and applies them when it
        raises: a caller sampling the rows apart afterwards finds them)."""
        if logits.is_cuda and _plain_random(meta):
            return self._gumbel(logits, meta)
        if meta.grammar_bitmask is not None:
            self._kernels.apply_token_bitmask_(logits, meta.grammar_bitmask, meta.grammar_rows)
        if _plain_greedy(meta):
            # Converting bf16/fp16 to float32 is exact, so the argmax (first maximum) is the
            # same without the [B, V] float copy. A few rows on the GPU take a two-stage
            # kernel (torch reduces each row in a single block: 37 us for a 128k vocabulary).
            return SamplerOutput(self._argmax(logits), None)
        logits = logits.float()
        if meta.logits_procs is not None:
            logits = apply_processors(logits, meta.logits_procs)
        if meta.allowed_rows is not None:
            assert meta.allowed_cols is not None
            logits = apply_allowed_token_ids(logits, meta.allowed_rows, meta.allowed_cols)
        if meta.bias_rows is not None:
            logits = logits.index_put(
                (meta.bias_rows, meta.bias_cols), meta.bias_vals, accumulate=True
            )
        if meta.ban_rows is not None:
            # A device-side fill value: a host scalar tensor would cost a synchronous copy.
            logits = logits.index_put(
                (meta.ban_rows, meta.ban_cols), logits.new_full((), _NEG_INF)
            )
        if meta.output_counts is not None:
            logits = apply_penalties(logits, meta)
        if not meta.all_greedy:
            temp = meta.temperature
            if not meta.all_random:
                temp = torch.where(temp == 0.0, torch.ones_like(temp), temp)
            logits = logits / temp.unsqueeze(1)
        logprobs = None
        if meta.max_num_logprobs is not None:
            logprobs = logits.log_softmax(dim=-1)

        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            sampled = greedy
        else:
            truncated = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
            if meta.min_p is not None:
                truncated = apply_min_p(truncated, meta.min_p)
            probs = truncated.softmax(dim=-1)
            drawn = (probs / exponential_noise(probs, meta, self._kernels)).argmax(dim=-1)
            sampled = drawn if greedy is None else torch.where(
                meta.temperature == 0.0, greedy, drawn
            )
        lp = None
        if logprobs is not None:
            lp = compute_logprobs(logprobs, sampled, meta.max_num_logprobs or 0)
        return SamplerOutput(sampled, lp)

    def _gumbel(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The one-pass draw (``gumbel_sample.py``); the masks reach ``logits`` only here."""
        try:
            keys = gumbel_sample.row_keys(logits.shape[0], meta.seeded_rows, meta.seeded_keys,
                                          logits.device)
            tokens = self._kernels.gumbel_sample(logits, meta.temperature, keys,
                                                 meta.grammar_bitmask, meta.grammar_rows)
        except Exception:
            if meta.grammar_bitmask is not None:
                self._kernels.apply_token_bitmask_(logits, meta.grammar_bitmask,
                                                   meta.grammar_rows)
            raise
        return SamplerOutput(tokens, None)
