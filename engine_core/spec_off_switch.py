"""Speculative decoding's automatic off-switch: per step, draft only where it pays.

Verifying drafts is not free: a step that verifies ``d`` drafts per request computes ``1 + d``
tokens per request instead of one. On a memory-bound decode that costs about ``1 + c * d`` plain
steps (``c`` = ``verify_token_cost``, small while the weights dominate the memory traffic) and
emits ``1 + accepted`` tokens. So drafting pays only while ``accepted > c * d`` on average, and
not at all once the batch is large enough that decode is compute bound (extra verify tokens then
cost as much as the tokens they might save): above ``disable_by_batch_size`` running requests.

The acceptance side is one exponential moving average over recent verifies (every request's
verify one sample) of accepted tokens and of draft tokens. Until ``acceptance_window`` verifies
were seen, drafting stays on (the warm-up). Switched off for low acceptance, nothing is measured
any more, so every ``acceptance_probe_interval`` such steps one step drafts again (a probe)
and its verifies update the average: a workload whose acceptance recovers resumes drafting.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tidal.engine_core.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SpecOffSwitch:
    # Above this many running requests, no drafts (None: no batch-size limit).
    disable_by_batch_size: int | None
    # Whether low measured acceptance switches drafting off.
    by_acceptance: bool
    # c: one verified draft token costs this share of a plain decode step.
    verify_token_cost: float
    # Verifies in the moving average's span, and before the first acceptance decision.
    window: int
    # Steps off for acceptance between two probe steps.
    probe_interval: int
    # Moving averages of accepted and of draft tokens per verify, over ``samples`` verifies.
    mean_accepted: float = 0.0
    mean_drafted: float = 0.0
    samples: int = 0
    # Steps off for acceptance since the last probe.
    off_streak: int = 0
    # Steps with drafts at hand that scheduled none, by reason, since the last ``take_counts``.
    off_batch_size: int = 0
    off_acceptance: int = 0

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> SpecOffSwitch:
        return cls(disable_by_batch_size=config.disable_by_batch_size,
                   by_acceptance=config.disable_by_acceptance,
                   verify_token_cost=config.verify_token_cost,
                   window=config.acceptance_window,
                   probe_interval=config.acceptance_probe_interval)

    def describe(self) -> str:
        batch = (f"more than {self.disable_by_batch_size} running requests"
                 if self.disable_by_batch_size is not None else "never by batch size")
        if not self.by_acceptance:
            return f"drafting off with {batch}; never by acceptance"
        c = self.verify_token_cost
        return (f"drafting off with {batch}, or while mean accepted tokens per verify <= "
                f"{c:g} x draft tokens (a verify step of 1 + d tokens costs ~1 + {c:g}·d plain "
                f"steps; moving average over {self.window} verifies, decided after as many; a "
                f"probe step every {self.probe_interval} steps off)")

    def pays(self) -> bool:
        """Whether drafting pays by the measured acceptance (always during the warm-up):
        ``1 + accepted`` tokens out of a verify step costing ``1 + c * drafted`` steps."""
        if not self.by_acceptance or self.samples < self.window:
            return True
        return self.mean_accepted > self.verify_token_cost * self.mean_drafted

    def decide(self, batch_size: int) -> bool:
        """Whether this step schedules the drafts it has at hand (called only when it has
        some); counts the steps that do not, by reason."""
        limit = self.disable_by_batch_size
        if limit is not None and batch_size > limit:
            self.off_batch_size += 1
            return False
        if self.pays():
            self.off_streak = 0
            return True
        self.off_streak += 1
        if self.off_streak > self.probe_interval:
            self.off_streak = 0
            return True  # a probe: its verifies measure the acceptance again
        self.off_acceptance += 1
        return False

    def wants_drafts(self, batch_size: int) -> bool:
        """Whether the next step would schedule drafts, were ``batch_size`` requests running
        then (as ``decide`` would, without counting): if not, proposing them is pure cost."""
        limit = self.disable_by_batch_size
        if limit is not None and batch_size > limit:
            return False
        return self.pays() or self.off_streak + 1 > self.probe_interval

    def observe(self, drafted: int, accepted: int) -> None:
        """One request's verify: ``accepted`` of its ``drafted`` draft tokens."""
        was_paying = self.pays()
        self.samples += 1
        # The plain mean until the window fills (no bias towards the zero start), then a
        # fixed weight.
        weight = 1.0 / min(self.samples, self.window)
        self.mean_accepted += weight * (accepted - self.mean_accepted)
        self.mean_drafted += weight * (drafted - self.mean_drafted)
        if was_paying != self.pays():
            # (Debug: near the break-even point this may flip often; /metrics counts it.)
            logger.debug("speculative decoding %s: mean %.2f accepted of %.2f draft tokens "
                         "per verify over the last ~%d verifies",
                         "switched off (acceptance)" if was_paying else "resumes",
                         self.mean_accepted, self.mean_drafted, self.window)

    def take_counts(self) -> tuple[int, int]:
        """Steps off (batch size, acceptance) since the previous call."""
        counts = (self.off_batch_size, self.off_acceptance)
        self.off_batch_size = self.off_acceptance = 0
        return counts
