"""The worker's LoRA state: which request runs which adapter, the host LRU, the device slots,
and each step's per-token slot ids.

Built by the model runner when the engine runs with ``--enable-lora``: it hangs a
``LoRALayer`` on every attention and MLP linear of the model (buffers allocated here, before
the KV cache is sized, so the profile counts them), loads a new request's adapter into the host
cache when the request arrives (a bad adapter fails that request alone), and before each
forward pass puts the step's adapters into slots and writes each token's slot into the
persistent buffer the layers (and captured CUDA graphs) read.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from tidal.engine_core.config import EngineConfig
from tidal.engine_core.lora_request import LoRARequest
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.lora.adapter_cache import AdapterCache
from tidal.worker.lora.gpu_slots import GPUSlots
from tidal.worker.lora.grouping import TILE, group_tokens, max_tiles
from tidal.worker.lora.layers import LoRAContext, LoRALayer, LoRASegments
from tidal.worker.lora.peft_loader import AdapterKey, LoadedAdapter, adapter_key, load_adapter
from tidal.worker.ops.kernels import Kernels

logger = logging.getLogger(__name__)

# Passes of up to this many tokens take their shrink outputs from one scratch buffer zeroed
# once, in at most this many bytes (Llama-8B, rank 16: 256 rows are 3.5 MiB); a larger pass
# zeroes each output apart, a cost its GEMMs dwarf.
_SCRATCH_ROWS = 256
_SCRATCH_BYTES = 64 << 20


def attach_lora_layers(model: nn.Module, num_slots: int, rank: int, dtype: torch.dtype,
                       device: torch.device, ctx: LoRAContext, kernels: Kernels
                       ) -> dict[tuple[int, str], LoRALayer]:
    """Give each decoder layer's q/k/v, o, gate/up and down linears a ``LoRALayer``; returns
    (layer index, projection) -> its layer. Raises for a model built otherwise."""
    from tidal.worker.models.decoder import DecoderLayer

    layers = getattr(model, "layers", None)
    if layers is None or not all(type(layer) is DecoderLayer for layer in layers.values()):
        raise ValueError(f"LoRA needs the plain decoder layers; {type(model).__name__} is not "
                         "yet supported")
    out: dict[tuple[int, str], LoRALayer] = {}

    def hang(linear: nn.Module, idx: int, projs: tuple[str, ...], sizes: tuple[int, ...]
             ) -> None:
        lora = LoRALayer(projs, sizes, linear.in_features, num_slots, rank, dtype, device, ctx,
                         kernels)
        linear.lora = lora
        for p in projs:
            out[(idx, p)] = lora

    for name, layer in layers.items():
        idx = int(name)
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        q, kv = qkv.num_heads * qkv.head_dim, qkv.num_kv_heads * qkv.head_dim
        hang(qkv, idx, ("q_proj", "k_proj", "v_proj"), (q, kv, kv))
        hang(attn.o_proj, idx, ("o_proj",), (attn.o_proj.out_features,))
        half = mlp.gate_up_proj.out_features // 2
        hang(mlp.gate_up_proj, idx, ("gate_proj", "up_proj"), (half, half))
        hang(mlp.down_proj, idx, ("down_proj",), (mlp.down_proj.out_features,))
    return out


class LoRAManager:
    def __init__(self, config: EngineConfig, model: nn.Module, device: torch.device,
                 dtype: torch.dtype, tp: ParallelGroup, kernels: Kernels,
                 max_num_tokens: int) -> None:
        lora = config.lora
        assert lora is not None
        self.arch = config.model.arch
        self.rank = lora.max_lora_rank
        self.dtype, self.device, self.tp = dtype, device, tp
        self.on_gpu = device.type == "cuda"
        self.ctx = LoRAContext(max_num_tokens, device)
        by_proj = attach_lora_layers(model, lora.max_loras, lora.max_lora_rank, dtype, device,
                                     self.ctx, kernels)
        self.slots = GPUSlots(lora.max_loras, by_proj)
        self.cache = AdapterCache(lora.max_cpu_loras)
        # The segmented kernels pay off only on the GPU (the torch path ignores runs).
        self.segmented = kernels.policy.triton_lora
        # Decode steps of at least this many tokens grouped by adapter (0: never). A compiled
        # model's trace holds the per-token ops (no per-step metadata), so not with it.
        self.grouped_min = (kernels.policy.lora_grouped_min_tokens
                            if self.segmented and not config.runner.compilation.enabled
                            else 0)
        self._tiles_cap = max_tiles(max_num_tokens, lora.max_loras, TILE)
        self._grouped: dict[int, LoRASegments] = {}
        if self.grouped_min:
            # The permutation and the tile table (starts, lengths, slots) the grouped kernels
            # read: fixed buffers, so a captured graph replays what each step writes.
            self.ctx.perm = torch.zeros(max_num_tokens, dtype=torch.int32, device=device)
            self.ctx.tiles = torch.zeros(3, self._tiles_cap, dtype=torch.int32, device=device)
        if self.segmented and not config.runner.compilation.enabled:
            # One scratch buffer for the small passes' shrink outputs (``LoRAContext``), each
            # layer a block in model order; the model's hooks open and close each pass.
            ctx = self.ctx
            ctx.use_scratch(self.slots.layers, min(max_num_tokens, _SCRATCH_ROWS),
                            _SCRATCH_BYTES)
            model.register_forward_pre_hook(lambda _module, _args: ctx.begin_forward())
            model.register_forward_hook(lambda _module, _args, _out: ctx.end_forward())
        self.requests: dict[str, LoRARequest] = {}
        # Two pinned staging buffers, used in turn; an event says when the device has read
        # one (async scheduling writes step N+1's while step N may not have copied yet).
        self.max_num_tokens = max_num_tokens
        # (Slot ids; with grouping, then the permutation and the tile table.)
        staged = max_num_tokens + (max_num_tokens + 3 * self._tiles_cap if self.grouped_min
                                   else 0)
        self._staging = [torch.empty(staged, dtype=torch.int32, pin_memory=self.on_gpu)
                         for _ in range(2)]
        self._events = [torch.cuda.Event() if self.on_gpu else None for _ in range(2)]
        self._turn = 0
        self._padded_last = max_num_tokens  # the buffer starts all -1
        nbytes = sum(layer.nbytes for layer in self.slots.layers)
        logger.info("LoRA: %d slots of rank %d on %d linears (%.1f MiB), host cache of %d",
                    lora.max_loras, lora.max_lora_rank, len(self.slots.layers), nbytes / 2**20,
                    lora.max_cpu_loras)

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, req_id: str, lora: LoRARequest | None) -> None:
        """Note a new request's adapter and have it in host memory (loaded now if neither
        cached nor in a slot). Raises ``LoRAAdapterError`` (the request then fails alone)."""
        if lora is None:
            self.requests.pop(req_id, None)
            return
        key = adapter_key(lora)
        if key not in self.cache and self.slots.slot_of(key) is None:
            self._load(lora)
        self.requests[req_id] = lora

    def remove_request(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def _load(self, lora: LoRARequest) -> LoadedAdapter:
        adapter = load_adapter(lora, self.arch, self.rank, self.dtype, self.tp.rank,
                               self.tp.world_size, pin=self.on_gpu)
        self.cache.put(adapter)
        return adapter

    def _fetch(self, key: AdapterKey) -> LoadedAdapter:
        adapter = self.cache.get(key)
        if adapter is not None:
            return adapter
        lora = next(r for r in self.requests.values() if adapter_key(r) == key)
        return self._load(lora)  # evicted meanwhile: read again

    # --- one step ------------------------------------------------------------------------------

    def grouped_segments(self, tokens: int) -> LoRASegments | None:
        """The grouped kernels' view of the fixed tables for a decode step of ``tokens``
        (padded) tokens, or None where it runs the per-token kernels."""
        if not self.grouped_min or tokens < self.grouped_min:
            return None
        view = self._grouped.get(tokens)
        if view is None:
            tiles = self.ctx.tiles
            view = self._grouped[tokens] = LoRASegments(
                tiles[0], tiles[1], tiles[2], max_tiles(tokens, self.slots.num_slots, TILE),
                TILE, perm=self.ctx.perm)
        return view

    def capture_layout(self, tokens: int | None) -> None:
        """Before capturing a decode graph of ``tokens`` (None: a mixed step's, or done
        capturing): the kernels its replays will need."""
        self.ctx.segments = None if tokens is None else self.grouped_segments(tokens)

    def prepare_step(self, req_ids: list[str], n_sched: np.ndarray, padded: int,
                     eager: bool, decode: bool = False) -> None:
        """Slots for this step's adapters, and each token's slot in ``ctx.token_slots``
        (tokens in batch order, ``n_sched`` per request; rows up to ``padded``, a CUDA
        graph's size, are the base model's). ``decode``: one token per request, replayed
        from a decode graph (``padded``: its size) or eager; grouped by adapter from
        ``grouped_min`` tokens on."""
        requests = self.requests
        per_req = np.full(len(req_ids), -1, dtype=np.int32)
        if requests:
            wanted: dict[AdapterKey, list[int]] = {}
            for i, rid in enumerate(req_ids):
                lora = requests.get(rid)
                if lora is not None:
                    wanted.setdefault(adapter_key(lora), []).append(i)
            if wanted:
                live = {adapter_key(r) for r in requests.values()}
                slots = self.slots.assign(list(wanted), self._fetch, live)
                for key, rows in wanted.items():
                    per_req[rows] = slots[key]
        total = int(n_sched.sum())
        token_slots = per_req if total == len(req_ids) else np.repeat(per_req, n_sched)
        grouped = self.grouped_segments(max(padded, total)) if decode else None
        self._write_slots(token_slots, max(padded, total), grouped)
        self.ctx.segments = grouped
        if eager and self.segmented and total > len(req_ids) and (per_req >= 0).any():
            self.ctx.segments = self._segments(per_req, n_sched)

    def _write_slots(self, token_slots: np.ndarray, padded: int,
                     grouped: LoRASegments | None = None) -> None:
        n = len(token_slots)
        turn = self._turn
        self._turn ^= 1
        event = self._events[turn]
        if event is not None:
            event.synchronize()  # the device has read this buffer's previous contents
        staging = self._staging[turn]
        # Clear what the previous step wrote past this one's tokens (its padding, or more
        # tokens): the rows up to ``padded`` read as the base model.
        end = max(padded, self._padded_last)
        host = staging.numpy()
        host[:n] = token_slots
        host[n:end] = -1
        self.ctx.token_slots[:end].copy_(staging[:end], non_blocking=True)
        if grouped is not None:
            # This step's tiles over the fixed table's first ``grouped.num`` entries (the
            # rest length 0: their programs do nothing), and the permutation they index.
            perm, starts, lengths, slots = group_tokens(token_slots, TILE)
            cap, num, at = self._tiles_cap, grouped.num, self.max_num_tokens
            host[at:at + len(perm)] = perm
            table = host[2 * at:2 * at + 3 * cap].reshape(3, cap)
            k = len(starts)
            table[0, :k], table[1, :k], table[2, :k] = starts, lengths, slots
            table[1, k:num] = 0
            if len(perm):
                self.ctx.perm[:len(perm)].copy_(staging[at:at + len(perm)], non_blocking=True)
            tiles = staging[2 * at:2 * at + 3 * cap].view(3, cap)
            for row in range(3):  # (contiguous rows: each one asynchronous copy)
                self.ctx.tiles[row, :num].copy_(tiles[row, :num], non_blocking=True)
        if event is not None:
            event.record()
        self._padded_last = padded

    def _segments(self, per_req: np.ndarray, n_sched: np.ndarray) -> LoRASegments:
        """Runs of consecutive requests with the same adapter (base-model runs left out)."""
        starts = np.zeros(len(per_req), dtype=np.int64)
        np.cumsum(n_sched[:-1], out=starts[1:])
        change = np.ones(len(per_req), dtype=bool)
        change[1:] = per_req[1:] != per_req[:-1]
        run_ids = np.cumsum(change) - 1
        run_start = starts[change]
        run_len = np.bincount(run_ids, weights=n_sched).astype(np.int64)
        run_slot = per_req[change]
        keep = run_slot >= 0
        arr = np.stack([run_start[keep], run_len[keep], run_slot[keep]]).astype(np.int32)
        dev = torch.from_numpy(arr).to(self.device, non_blocking=False)
        return LoRASegments(dev[0], dev[1], dev[2], int(keep.sum()),
                            int(run_len[keep].max()))

    # --- start-up ------------------------------------------------------------------------------

    def profile_begin(self, num_tokens: int) -> None:
        """The memory profile runs every token through slot 0 (zeros: the base model's
        outputs), so the LoRA kernels' temporaries are measured and their kernels compiled."""
        self.ctx.token_slots[:num_tokens].fill_(0)
        if self.segmented:
            dev = torch.tensor([[0], [num_tokens], [0]], dtype=torch.int32, device=self.device)
            self.ctx.segments = LoRASegments(dev[0], dev[1], dev[2], 1, num_tokens)

    def profile_end(self) -> None:
        self.ctx.token_slots.fill_(-1)
        self.ctx.segments = None
        self._padded_last = self.max_num_tokens
        if self.segmented:
            # The per-token kernels of every layer shape too (graph capture compiles them, but
            # an engine without graphs would first meet them serving).
            for layer in self.slots.layers:
                x = torch.zeros(1, layer.a.shape[2], dtype=self.dtype, device=self.device)
                layer.add(x, torch.zeros(1, layer.b.shape[1], dtype=self.dtype,
                                         device=self.device))
