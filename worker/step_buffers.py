"""Persistent per-step buffers: pinned host staging and the device tensors the model reads.

Per step the model runner writes its numpy-prepared inputs into pinned host memory and ships each
kind in one ``non_blocking`` copy; nothing is allocated or pinned per step. Host buffers come in
two sets used on alternate steps: a set is rewritten only after the copies that last read it have
finished (an event per set), so the CPU can prepare step N+1 while the copies of step N are still
queued behind the GPU's work.

Device tensors that CUDA graphs read (token ids, positions, slot mapping, query start locations,
sequence lengths, the step's block table) have fixed addresses for the life of the runner; a
captured graph is replayed after these are refreshed in place (the slot mapping and the step's
block table computed on the device, the rest copied from the host set). Everything else travels through
a device staging buffer per dtype and is used through views.

On a CPU device the same code runs with the host buffers standing in for the device ones (no
copies at all).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

logger = logging.getLogger(__name__)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device``, queued behind the work already launched: a copy from
    pageable memory would block the host until the GPU had caught up with all of it."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start copying a small device tensor to the host, in stream order after the work that
    made it (pinned, with an event to wait on: nothing later on the stream is waited for);
    off a GPU a copy at once (``t`` may be overwritten by later work)."""
    if not t.is_cuda:
        return t.clone(), None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied

_DTYPES = (torch.int64, torch.int32, torch.float32)
_MAX_CACHED_VIEWS = 256


def _meta32_len(max_num_reqs: int) -> int:
    # query_start_loc (max_num_reqs + 1), seq_lens (max_num_reqs), the real token count (1)
    return 2 * max_num_reqs + 2


@dataclass(slots=True)
class HostSet:
    """One set of pinned host buffers (and their numpy views)."""

    ids: torch.Tensor
    pos: torch.Tensor
    meta32: torch.Tensor
    stage: dict[torch.dtype, torch.Tensor]
    ids_np: np.ndarray
    pos_np: np.ndarray
    meta32_np: np.ndarray
    stage_np: dict[torch.dtype, np.ndarray]
    done: torch.cuda.Event | None  # recorded after the copies that read this set (GPU only)
    armed: bool = False  # ``done`` was recorded and not yet waited for


@dataclass(slots=True, frozen=True)
class StepViews:
    """The fixed buffers the model reads, cut to one step's size."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor  # the step's block table (filled by ``gather_block_table``)


def _host(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, pin_memory=pin)


class StepBuffers:
    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_blocks_per_req: int,
                 block_size: int, device: torch.device, num_kv_groups: int = 1) -> None:
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.width = max_blocks_per_req
        self.block_size = block_size
        # Staging capacities: generous for every per-step array (tokens, requests, new blocks,
        # sampling parameters); an oversized step falls back to a plain copy and grows them.
        self._caps = {
            torch.int64: 6 * max_num_tokens + 8 * max_num_reqs + 4096,
            torch.int32: 4 * max_num_tokens + 4 * max_num_reqs + 4096,
            torch.float32: 8 * max_num_reqs + 4096,
        }
        n_sets = 2 if self.on_gpu else 1
        self._sets = [self._make_set() for _ in range(n_sets)]
        self._cur = 0
        self._used = {dt: 0 for dt in _DTYPES}
        self._want = dict(self._caps)  # high-water mark, for growing after an overflow
        # Tensor views, made once and kept: cutting a tensor costs a couple of microseconds of
        # host time, and decode steps cut the same ones step after step (``views``, ``put``).
        self._views: dict[tuple[int, int], StepViews] = {}
        self._stage_views: dict[tuple[torch.dtype, int, int], torch.Tensor] = {}

        dev = device
        if self.on_gpu:
            self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(max_num_tokens, dtype=torch.int64, device=dev)
            self.meta32 = torch.zeros(_meta32_len(max_num_reqs), dtype=torch.int32, device=dev)
            self.stage = {dt: torch.zeros(self._caps[dt], dtype=dt, device=dev) for dt in _DTYPES}
        else:
            self._use_host_set_as_device()
        # Computed on the device from the block table (``compute_slots``); one row per KV
        # group (``engine_core.kv_groups``), ``slot_mapping`` is group 0's.
        self.num_kv_groups = num_kv_groups
        self.slot_mappings = torch.full((num_kv_groups, max_num_tokens), -1, dtype=torch.int64,
                                        device=dev)
        self.slot_mapping = self.slot_mappings[0]
        # The block table, row-indexed like the InputBatch, plus one trailing -1 entry: padding
        # tokens look it up so that their slot comes out as -1 (see ``compute_slots``). Each KV
        # group has one such table, ``group_stride`` entries apart.
        self.group_stride = max_num_reqs * self.width + 1
        self.block_table_flat = torch.zeros(num_kv_groups * self.group_stride,
                                            dtype=torch.int32, device=dev)
        self.block_table_flat[self.group_stride - 1::self.group_stride] = -1
        self.group_block_tables = [
            self.block_table_flat[g * self.group_stride:(g + 1) * self.group_stride - 1].view(
                max_num_reqs, self.width) for g in range(num_kv_groups)]
        self.block_table = self.group_block_tables[0]
        # This step's block table, one row per request in batch order (per group).
        self.step_block_tables = torch.zeros(num_kv_groups, max_num_reqs, self.width,
                                             dtype=torch.int32, device=dev)
        self.step_block_table = self.step_block_tables[0]

    def _use_host_set_as_device(self) -> None:
        """CPU device: the (single) host set is what the model reads."""
        s = self._sets[0]
        self.input_ids, self.positions, self.meta32 = s.ids, s.pos, s.meta32
        self.stage = s.stage

    @property
    def pad_index(self) -> int:
        """The block table's trailing -1 entry (flat index), for padding tokens."""
        return self.max_num_reqs * self.width

    def query_start_loc(self, n: int) -> torch.Tensor:
        return self.meta32[: n + 1]

    def seq_lens(self, n: int) -> torch.Tensor:
        start = self.max_num_reqs + 1
        return self.meta32[start:start + n]

    @property
    def num_tokens(self) -> torch.Tensor:
        """The step's real token count (padding excluded), one int32 at a fixed address: what
        a replayed graph reads to tell tokens from padding rows (``layers.expert_load``)."""
        return self.meta32[-1:]

    @property
    def num_tokens_index(self) -> int:
        """Where ``num_tokens`` sits in the host set's ``meta32``."""
        return 2 * self.max_num_reqs + 1

    def views(self, num_tokens: int, num_reqs: int) -> StepViews:
        """Views of the fixed buffers for a step of ``num_tokens`` tokens (padding included
        where a graph runs) and ``num_reqs`` requests."""
        key = (num_tokens, num_reqs)
        v = self._views.get(key)
        if v is None:
            if len(self._views) >= _MAX_CACHED_VIEWS:  # prefill sizes vary without end
                self._views.clear()
            v = self._views[key] = StepViews(
                self.input_ids[:num_tokens], self.positions[:num_tokens],
                self.slot_mapping[:num_tokens], self.query_start_loc(num_reqs),
                self.seq_lens(num_reqs), self.step_block_table[:num_reqs])
        return v

    def _make_set(self) -> HostSet:
        pin = self.on_gpu
        ids = _host(self.max_num_tokens, torch.int64, pin)
        pos = _host(self.max_num_tokens, torch.int64, pin)
        meta32 = _host(_meta32_len(self.max_num_reqs), torch.int32, pin)
        stage = {dt: _host(self._caps[dt], dt, pin) for dt in _DTYPES}
        return HostSet(ids, pos, meta32, stage, ids.numpy(), pos.numpy(), meta32.numpy(), {dt: t.numpy() for dt, t in stage.items()},
                       torch.cuda.Event() if pin else None)

    # --- one step -----------------------------------------------------------------------------

    def begin(self) -> HostSet:
        """Start a step: pick the host set whose last copies are done (wait if needed)."""
        if self.on_gpu:
            self._cur ^= 1
        hs = self._sets[self._cur]
        if hs.armed:
            hs.done.synchronize()
            hs.armed = False
        if any(self._want[dt] > self._caps[dt] for dt in _DTYPES):
            self._grow()
            hs = self._sets[self._cur]
        for dt in _DTYPES:
            self._used[dt] = 0
        return hs

    def put(self, arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """Stage ``arr`` for this step's copy; returns its device view (valid once flushed)."""
        n = arr.shape[0]
        off = self._used[dtype]
        if off + n > self._caps[dtype]:
            # Rare (a huge logit_bias, say): copy directly, remember to grow before next step.
            self._want[dtype] = max(self._want[dtype], 2 * (off + n))
            t = torch.from_numpy(np.ascontiguousarray(arr, dtype=_np_dtype(dtype)))
            return t.to(self.device) if self.on_gpu else t.clone()
        self._sets[self._cur].stage_np[dtype][off:off + n] = arr
        self._used[dtype] = off + n
        key = (dtype, off, n)
        view = self._stage_views.get(key)
        if view is None:
            if len(self._stage_views) >= _MAX_CACHED_VIEWS:
                self._stage_views.clear()
            view = self._stage_views[key] = self.stage[dtype][off:off + n]
        return view

    def flush(self, num_tokens: int, num_meta_reqs: int) -> None:
        """Issue this step's host-to-device copies: ``num_tokens`` ids/positions, the query
        start locations and sequence lengths of ``num_meta_reqs`` (padded) requests, and the
        staged arrays."""
        if not self.on_gpu:
            return
        hs = self._sets[self._cur]
        if num_tokens:
            self.input_ids[:num_tokens].copy_(hs.ids[:num_tokens], non_blocking=True)
            self.positions[:num_tokens].copy_(hs.pos[:num_tokens], non_blocking=True)
        if num_meta_reqs:
            # The whole (small) region: query start locations and sequence lengths together.
            self.meta32.copy_(hs.meta32, non_blocking=True)
        for dt in _DTYPES:
            n = self._used[dt]
            if n:
                self.stage[dt][:n].copy_(hs.stage[dt][:n], non_blocking=True)
        hs.done.record()
        hs.armed = True

    def _grow(self) -> None:
        for hs in self._sets:
            if hs.armed:
                hs.done.synchronize()
        logger.info("growing the step staging buffers to %s",
                    {str(dt).removeprefix("torch."): n for dt, n in self._want.items()})
        self._caps = dict(self._want)
        self._sets = [self._make_set() for _ in self._sets]
        self._views.clear()
        self._stage_views.clear()
        if self.on_gpu:
            # The old staging may still be read by queued kernels; the caching allocator keeps
            # it alive until the stream has passed them.
            self.stage = {dt: torch.zeros(self._caps[dt], dtype=dt, device=self.device)
                          for dt in _DTYPES}
        else:
            self._use_host_set_as_device()

    # --- device-side preparation ----------------------------------------------------------------

    def apply_block_updates(self, flat: torch.Tensor, vals: torch.Tensor) -> None:
        self.block_table_flat.index_copy_(0, flat, vals)

    def compute_slots(self, flat_block_idx: torch.Tensor, offsets: torch.Tensor, n: int) -> None:
        """slot_mapping[:n] = block_table[row, pos // bs] * bs + pos % bs, looked up on the
        device (``flat_block_idx`` = row * width + pos // bs; padding tokens point at the -1
        entry with offset bs - 1, which gives slot -1)."""
        blocks = torch.take(self.block_table_flat, flat_block_idx)
        torch.add(offsets, blocks, alpha=self.block_size, out=self.slot_mapping[:n])

    def gather_block_table(self, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The step's block table (``out``: ``views(...).block_table``): the rows' entries."""
        torch.index_select(self.block_table, 0, rows, out=out)
        return out

    def group_tables(self, flat_block_idx: torch.Tensor, offsets: torch.Tensor, n: int,
                     rows: torch.Tensor, num_reqs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV groups 1..: each one's slot mapping (``n`` tokens, as ``compute_slots``) and step
        block table (``num_reqs`` rows, as ``gather_block_table``), in the fixed buffers."""
        out = []
        for g in range(1, self.num_kv_groups):
            slots = self.slot_mappings[g, :n]
            blocks = torch.take(self.block_table_flat, flat_block_idx + g * self.group_stride)
            torch.add(offsets, blocks, alpha=self.block_size, out=slots)
            table = self.step_block_tables[g, :num_reqs]
            torch.index_select(self.group_block_tables[g], 0, rows, out=table)
            out.append((slots, table))
        return out


def _np_dtype(dtype: torch.dtype) -> type:
    return {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}[dtype]
