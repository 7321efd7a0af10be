"""The drafts proposed after a speculative step, for the next one: host lists, or (async
scheduling) the proposer's device output, for a next step scheduled before this one's output
reached the host, its copy to the host on its way."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.worker.input_batch import InputBatch
from tidal.worker.step_buffers import to_host


@dataclass(slots=True, eq=False)
class Proposal:
    """The drafts proposed after a step, for the next: host lists, or (a uniform proposal
    under async scheduling) the drafter's device output, its copy to the host on its way.
    The next step, scheduled before this one came back, takes its drafts from the device."""

    rows: np.ndarray  # batch rows, parallel to the drafts
    generations: np.ndarray  # the rows' generations then (a reused row is another request)
    host: list[list[int]] | None = None
    dev: torch.Tensor | None = None  # int64 [n, k]: the drafter's output
    src: np.ndarray | None = None  # int64 per row: its row of ``dev`` (-1: no drafts)
    limits: np.ndarray | None = None  # int64 per row: how many of its drafts count
    # ``dev`` on the host (pinned), once ``copied``; with ``counts``, one more column: them.
    copy: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    counts: bool = False  # a count per output row on the device (n-gram): drafts past it pad
    _where: dict[int, int] | None = None

    @classmethod
    def on_device(cls, b: InputBatch, rows: np.ndarray, dev: torch.Tensor, src: np.ndarray,
                  limits: np.ndarray, counts: torch.Tensor | None = None) -> Proposal:
        """Starts the host copy, in stream order right after the drafter: the drafter's next
        run overwrites ``dev``. ``counts``: how many of each output row's drafts are real
        (the rest pad: a placeholder takes them all, verification stays exact)."""
        copy, copied = to_host(dev if counts is None
                               else torch.cat((dev, counts.unsqueeze(1)), dim=1))
        return cls(rows, b.generation[rows].copy(), dev=dev, src=src, limits=limits,
                   copy=copy, copied=copied, counts=counts is not None)

    def lists(self) -> list[list[int]]:
        """The drafts on the host (waits for their copy), parallel to ``rows``."""
        if self.host is None:
            assert self.copy is not None and self.src is not None and self.limits is not None
            if self.copied is not None:
                self.copied.synchronize()
            tokens = self.copy.numpy()
            limits = self.limits
            if self.counts:
                tokens, found = tokens[:, :-1], tokens[:, -1]
                limits = np.where(self.src >= 0,
                                  np.minimum(limits, found[np.maximum(self.src, 0)]), 0)
            self.host = [tokens[s, :n].tolist() if s >= 0 else []
                         for s, n in zip(self.src.tolist(), limits.tolist())]
        return self.host

    def find(self, b: InputBatch, row: int) -> int | None:
        """Where ``row``'s drafts are (its index in ``rows``), if they are its request's."""
        if self._where is None:
            self._where = {int(r): i for i, r in enumerate(self.rows.tolist())}
        i = self._where.get(row)
        if i is None or self.generations[i] != b.generation[row]:
            return None
        return i
