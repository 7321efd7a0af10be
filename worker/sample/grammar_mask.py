"""Structured outputs on the device: the step's grammar bitmasks (packed by the EngineCore, one
bit per vocabulary id) placed on the sampling rows, copied once, and applied to the logits in
place (``ops/triton_sampling.py`` holds the GPU kernel)."""

from __future__ import annotations

import sys

import numpy as np
import torch

_NEG_INF = float("-inf")


def grammar_rows(grammar_req_ids: list[str], sampled_ids: list[str],
                 drafts: dict[str, list[int]] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Where each grammar row goes: (the bitmask rows to keep, int64 indices into the sampling
    rows, or None when the kept rows are the sampling rows in order). None when no sampling
    row has a grammar. With speculative ``drafts``, a request has one sampling row per verify
    position (1 + its drafts) and as many consecutive bitmask rows, in the same order."""
    if not drafts:
        if grammar_req_ids == sampled_ids:
            return np.arange(len(sampled_ids)), None
        width = {}
    else:
        width = {rid: len(d) for rid, d in drafts.items()}
    where: dict[str, int] = {}
    row = 0
    for rid in sampled_ids:
        where[rid] = row
        row += 1 + width.get(rid, 0)
    num_sampling = row
    src: list[int] = []
    dst: list[int] = []
    row = 0
    for rid in grammar_req_ids:
        n = 1 + width.get(rid, 0)
        j = where.get(rid)
        if j is not None:
            src.extend(range(row, row + n))
            dst.extend(range(j, j + n))
        row += n
    if not src:
        return None
    src_a = np.array(src, dtype=np.int64)
    dst_a = np.array(dst, dtype=np.int64)
    if len(dst) == num_sampling and np.array_equal(src_a, dst_a):
        return src_a, None
    return src_a, dst_a


def grammar_slice(bitmask: torch.Tensor | None, rows: torch.Tensor | None, start: int,
                  count: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The masks (and their rows, renumbered from 0) of sampling rows ``start`` ..
    ``start + count - 1``, for one request sampled on its own."""
    if bitmask is None:
        return None, None
    if rows is None:
        rows = torch.arange(bitmask.shape[0], device=bitmask.device)
    pick = ((rows >= start) & (rows < start + count)).nonzero().flatten()
    if not pick.numel():
        return None, None
    return bitmask[pick], rows[pick] - start


def unpack_allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [G, vocab]: bit t of word w of a row allows token 32 w + t."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        # A word's bytes in memory are its bits 0-7, 8-15, ...: numpy unpacks them in order,
        # about 5 times faster than the shifts below on a CPU.
        words = bitmask.contiguous().numpy().view(np.uint8)
        bits = np.unpackbits(words, axis=1, count=vocab, bitorder="little")
        return torch.from_numpy(bits.view(np.bool_))
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab] != 0


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor,
                         rows: torch.Tensor | None = None) -> None:
    """Set to -inf, in place, every token of row ``rows[g]`` (row g when ``rows`` is None)
    whose bit is clear in ``bitmask[g]`` (int32 [G, words], words * 32 >= vocabulary). The
    torch implementation: the CPU path and the reference of the Triton kernel."""
    if not bitmask.shape[0]:
        return
    banned = ~unpack_allowed(bitmask, logits.shape[1])
    if rows is None:
        logits[:bitmask.shape[0]].masked_fill_(banned, _NEG_INF)
    else:
        logits[rows] = logits[rows].masked_fill(banned, _NEG_INF)


class MaskStaging:
    """Host memory the EngineCore fills a step's masks straight into, so they cross to the
    device in one copy with no host-side copy first. On a GPU the slots are pinned: the copy
    queues behind the step's forward pass without holding the host (from pageable memory it
    would wait for the forward pass with the host blocked). Slots are used in turn, and one is
    reused only once the copy out of it has completed."""

    def __init__(self, words: int, device: torch.device, slots: int = 2) -> None:
        self.words = words
        self.device = device
        self._pinned = device.type == "cuda"
        self._slots: list[torch.Tensor | None] = [None] * slots
        self._copied: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self._current: tuple[int, np.ndarray] | None = None

    def buffer(self, rows: int) -> np.ndarray:
        """An int32 [rows, words] array to fill; valid until the next call."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        event = self._copied[i]
        if event is not None:
            event.synchronize()  # long done: two steps have been collected since
            self._copied[i] = None
        slot = self._slots[i]
        if slot is None or slot.shape[0] < rows:
            slot = torch.empty((max(rows, 1), self.words), dtype=torch.int32,
                               pin_memory=self._pinned)
            self._slots[i] = slot
        view = slot.numpy()[:rows]
        self._current = (i, view)
        return view

    def to_device(self, bitmask: np.ndarray) -> torch.Tensor:
        """``bitmask`` on the device: straight from its slot if it is the last buffer handed
        out, else through a pinned copy (a mask packed elsewhere, e.g. by a remote scheduler)."""
        host = torch.from_numpy(bitmask)
        if not self._pinned:
            return host
        cur = self._current
        if cur is not None and cur[1] is bitmask:
            dev = host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._copied[cur[0]] = event
            self._current = None
            return dev
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        # The caching host allocator keeps the block until the copy has completed.
        return pinned.to(self.device, non_blocking=True)
