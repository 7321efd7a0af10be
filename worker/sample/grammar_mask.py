"""Structured outputs on the device: the step's grammar bitmasks (packed by the EngineCore, one
bit per vocabulary id) placed on the sampling rows, copied once, and applied to the logits in
place (``ops/triton_sampling.py`` holds the GPU kernel)."""

from __future__ import annotations

import sys
from collections.abc import Callable

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
    would wait for the forward pass with the host blocked). Slots are used in turn, each with a
    device buffer of its own, and one is reused only once the copy out of it has completed.

    ``uploader()``: the copy, started by the fill thread as soon as the masks are filled, on a
    stream of its own, so it runs beside the forward pass instead of between the forward pass
    and the sampling (5 MB at batch 256 on a 152k vocabulary: about 0.2 ms on an H100). It
    first waits for the sampling that last read the slot's device buffer (``consumed``)."""

    def __init__(self, words: int, device: torch.device, slots: int = 2) -> None:
        self.words = words
        self.device = device
        self._pinned = device.type == "cuda"
        self._slots: list[torch.Tensor | None] = [None] * slots
        self._on_device: list[torch.Tensor | None] = [None] * slots
        self._copied: list[torch.cuda.Event | None] = [None] * slots
        self._pending: list[bool] = [False] * slots  # a copy out of the slot was queued
        self._uploaded: list[bool] = [False] * slots  # ... by the uploader, on its stream
        self._read: list[torch.cuda.Event | None] = [None] * slots  # last sampling's read
        self._next = 0
        self._current: tuple[int, np.ndarray] | None = None
        self._last: int | None = None  # the slot ``to_device`` handed out last
        self._stream: torch.cuda.Stream | None = None

    def buffer(self, rows: int) -> np.ndarray:
        """An int32 [rows, words] array to fill; valid until the next call."""
        i = self._next
        self._next = (i + 1) % len(self._slots)
        if self._pending[i]:
            event = self._copied[i]
            assert event is not None
            event.synchronize()  # long done: two steps have been collected since
            self._pending[i] = False
        self._uploaded[i] = False
        slot = self._slots[i]
        if slot is None or slot.shape[0] < rows:
            slot = torch.empty((max(rows, 1), self.words), dtype=torch.int32,
                               pin_memory=self._pinned)
            self._slots[i] = slot
            if self._pinned:  # (allocated here, on the engine's stream, not by the uploader)
                self._on_device[i] = torch.empty_like(slot, device=self.device)
        view = slot.numpy()[:rows]
        self._current = (i, view)
        return view

    def uploader(self) -> Callable[[], None] | None:
        """For a GPU: a function that copies the buffer just handed out to the device on a
        side stream; call it once the buffer is filled (from any thread) and not before."""
        if not self._pinned or self._current is None:
            return None
        i, view = self._current
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        stream = self._stream
        if self._copied[i] is None:
            self._copied[i] = torch.cuda.Event()

        def upload() -> None:
            read = self._read[i]
            dev = self._on_device[i]
            event = self._copied[i]
            assert dev is not None and event is not None
            with torch.cuda.stream(stream):
                if read is not None:
                    stream.wait_event(read)
                dev[:view.shape[0]].copy_(torch.from_numpy(view), non_blocking=True)
                event.record(stream)
            self._pending[i] = True  # (the slot's next user waits for this copy)
            self._uploaded[i] = True

        return upload

    def to_device(self, bitmask: np.ndarray) -> torch.Tensor:
        """``bitmask`` on the device: straight from its slot if it is the last buffer handed
        out (already there if its uploader ran), else through a pinned copy (a mask packed
        elsewhere, e.g. by a remote scheduler)."""
        host = torch.from_numpy(bitmask)
        if not self._pinned:
            return host
        cur = self._current
        if cur is not None and cur[1] is bitmask:
            i = cur[0]
            dev = self._on_device[i]
            assert dev is not None
            dev = dev[:host.shape[0]]
            event = self._copied[i]
            if event is None:
                event = self._copied[i] = torch.cuda.Event()
            main = torch.cuda.current_stream(self.device)
            if self._uploaded[i]:
                main.wait_event(event)
            else:
                dev.copy_(host, non_blocking=True)
                event.record(main)
            self._pending[i] = True
            self._current = None
            self._last = i
            return dev
        pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
        pinned.copy_(host)
        # The caching host allocator keeps the block until the copy has completed.
        return pinned.to(self.device, non_blocking=True)

    def consumed(self) -> None:
        """The sampling that reads the masks ``to_device`` handed out last is queued: an
        uploader of that slot waits for it before overwriting them."""
        i = self._last
        if i is None:
            return
        self._last = None
        event = self._read[i]
        if event is None:
            event = self._read[i] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
