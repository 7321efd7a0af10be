"""The host-memory KV tier (``--kv-offload-gb``): prefix-cache blocks are copied to a host LRU
keyed by their block hash, and a later request whose prefix misses the pool but hits the host
tier gets those blocks reloaded instead of recomputed (a prefix hit).

Write-through, so stores stay off the step's critical path. Copying a block out only when the
pool reuses it put the copy in front of the forward that overwrites it (+33 % decode step time
on an H100). Instead:

- the block pool reports each block it registers in the prefix cache (``on_block_cached``: full,
  hashed, its K/V written by this step's forward); it joins a FIFO queue;
- each step's metadata takes up to ``store_blocks_per_step`` blocks from the queue's head
  (``save_*``): the workers copy them after that step's forward, on a side stream of their own
  (a GPU), so the copies overlap the next step; the queue holds at most
  ``_QUEUE_STEPS`` steps' worth, the oldest entries dropped first when it overflows;
- a block the pool reuses later costs nothing if the host has it: its id travels in
  ``reused_block_ids`` and a worker's forward waits only for a store of that block still in
  flight (that store's event, not a device sync);
- a block reused while it is still queued, or that the host LRU dropped while the pool kept it
  (a hot prefix), is stored on eviction as before (``store_*``: before the forward, which
  waits for it). Blocks already on the host (loaded from it, or stored) are not queued.

On admission, the request's block hashes past the local prefix hit are looked up in the host
tier; the matching run of blocks is allocated as computed and a load is queued (``load_*``).
A load from a slot whose store is still in flight is ordered after that store by the workers.

Worker side: ``worker/kv_transfer/host_kv_store.py`` holds each layer's host copy (pinned on a
GPU) and does the copies: in runs of consecutive blocks, or gathered through a device buffer
when the pool blocks are scattered (one copy per run of host slots); plain copies on a CPU.

Config: ``kv_role`` must be ``kv_both``; the tier's size is ``kv_buffer_size`` bytes
(``--kv-offload-gb``) or, with vLLM's ``kv_connector_extra_config`` keys, ``cpu_bytes_to_use``
(bytes) or ``num_cpu_blocks`` (blocks); vLLM's ``block_size`` is accepted only equal to the
engine's block size and ``spec_name`` only as ``CPUOffloadingSpec``; tidal's own
``store_blocks_per_step`` sets the write-through cap (default: every block one step can fill,
``store_blocks_default``); any other key is refused.
The size counts every layer and tensor-parallel rank together and must fit the host's available
memory at start-up. (With data parallelism each rank would allocate its own tier of that size;
a KV connector with several DP ranks is refused for now.)

Not yet: sliding-window models (several KV groups), MLA's latent cache, and speculative methods
with their own KV cache (draft model, EAGLE-3) are refused at start-up by ``check_config``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tidal.engine_core.kv_transfer.connector_base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorStats,
)
from tidal.engine_core.kv_transfer.host_tier_index import HostTierIndex

if TYPE_CHECKING:
    import torch

    from tidal.engine_core.config import EngineConfig
    from tidal.engine_core.protocol import SchedulerOutput
    from tidal.engine_core.request import Request

logger = logging.getLogger(__name__)

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# vLLM's OffloadingConnector keys honoured here (``block_size``/``spec_name``: one value only).
# (``store_blocks_per_step`` is tidal's own: the write-through cap.)
_EXTRA_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size", "spec_name",
               "store_blocks_per_step")
# The write-through queue holds at most this many steps' worth of blocks (at the cap).
_QUEUE_STEPS = 16
_SPEC_NAME = "CPUOffloadingSpec"
_WHAT = "the host KV tier (--kv-offload-gb / OffloadingConnector)"


class OffloadMeta(KVConnectorMetadata):
    """One step's copies, in the workers' order. Before the forward: the forward waits for any
    store still in flight out of ``reused_block_ids`` (blocks this step overwrites); pool block
    ``store_block_ids[i]`` -> host slot ``store_slots[i]`` (eviction stores; the forward waits
    for them); host slot ``load_slots[i]`` -> pool block ``load_block_ids[i]``. After the
    forward: pool block ``save_block_ids[i]`` -> host slot ``save_slots[i]`` (write-through,
    asynchronous on a GPU)."""

    store_block_ids: list[int] = []
    store_slots: list[int] = []
    load_block_ids: list[int] = []
    load_slots: list[int] = []
    save_block_ids: list[int] = []
    save_slots: list[int] = []
    reused_block_ids: list[int] = []


def kv_bytes_per_block(config: EngineConfig) -> int:
    """Bytes of one pool block over every layer and rank (what one host slot holds in all the
    workers together)."""
    arch = config.model.arch
    elem = 1 if config.cache.cache_dtype != "auto" else _DTYPE_BYTES.get(config.model.dtype, 2)
    return 2 * config.cache.block_size * arch.num_kv_heads * arch.head_dim * arch.num_layers \
        * elem


def host_tier_slots(config: EngineConfig) -> int:
    """Blocks the host tier holds: ``num_cpu_blocks``, else ``cpu_bytes_to_use`` (or
    ``kv_buffer_size``) bytes over ``kv_bytes_per_block``."""
    kv = config.kv_transfer
    assert kv is not None
    blocks = kv.extra("num_cpu_blocks")
    if blocks is not None:
        return int(blocks)
    return int(kv.extra("cpu_bytes_to_use", kv.kv_buffer_size) // kv_bytes_per_block(config))


def store_blocks_default(config: EngineConfig) -> int:
    """Blocks one step can fill (its token budget's, plus one decode block per sequence): the
    queue keeps up with any steady load, and a burst waits. Copying them costs far less than
    the step that computed them (Llama-3.1-8B on an H100: 512 blocks, ~20 ms of copy, against
    ~400 ms for the 8k-token prefill step that filled them)."""
    sched = config.scheduler
    return -(-sched.max_num_batched_tokens // config.cache.block_size) + sched.max_num_seqs


def available_host_bytes() -> int:
    """Host memory free for a new allocation now (a seam for tests)."""
    import psutil

    return int(psutil.virtual_memory().available)


def _check_extra(config: EngineConfig) -> None:
    kv = config.kv_transfer
    assert kv is not None
    extra = kv.kv_connector_extra_config
    unknown = sorted(set(extra) - set(_EXTRA_KEYS))
    if unknown:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config has unknown key(s) "
                         f"{', '.join(unknown)} for OffloadingConnector (known: "
                         f"{', '.join(_EXTRA_KEYS)})")
    if "cpu_bytes_to_use" in extra and "num_cpu_blocks" in extra:
        raise ValueError("--kv-transfer-config: give kv_connector_extra_config.cpu_bytes_to_use "
                         "or num_cpu_blocks, not both")
    for key, limit in (("cpu_bytes_to_use", 2**40), ("num_cpu_blocks", 2**31),
                       ("store_blocks_per_step", 2**20)):
        value = extra.get(key)
        if value is not None and (type(value) is not int or not 0 < value <= limit):
            raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{key} must be an "
                             f"integer in [1, {limit}], got {value!r}")
    bs = extra.get("block_size")
    if bs is not None and bs != config.cache.block_size:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.block_size {bs!r}: "
                         "not yet supported: a host block size other than the engine's "
                         f"--block-size ({config.cache.block_size})")
    spec = extra.get("spec_name")
    if spec is not None and spec != _SPEC_NAME:
        raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.spec_name {spec!r}: "
                         f"not yet supported (only {_SPEC_NAME!r}, one host tier)")


def _check_host_memory(config: EngineConfig) -> None:
    """Refuse a tier the host cannot hold now, rather than die allocating it (or swap)."""
    want = host_tier_slots(config) * kv_bytes_per_block(config)
    have = available_host_bytes()
    if want > have:
        raise ValueError(f"{_WHAT}: {want / 1e9:.2f} GB asked for (--kv-offload-gb / "
                         "--kv-transfer-config kv_buffer_size, cpu_bytes_to_use or "
                         f"num_cpu_blocks) but only {have / 1e9:.2f} GB of host memory is "
                         "available; ask for less")


class OffloadingConnector(KVConnectorBase):
    metadata_type = OffloadMeta
    wants_evictions = True
    wants_cached_blocks = True

    @classmethod
    def check_config(cls, config: EngineConfig) -> None:
        kv = config.kv_transfer
        assert kv is not None
        what = _WHAT
        if kv.kv_role != "kv_both":
            raise ValueError(f"--kv-transfer-config: kv_role must be 'kv_both' for {what} (it "
                             f"saves and loads within one engine), got {kv.kv_role!r}")
        _check_extra(config)
        if config.model.task != "generate":
            raise ValueError(f"{what} serves generation models only, not task "
                             f"{config.model.task!r}")
        if not config.cache.enable_prefix_caching:
            raise ValueError(f"{what} keeps evicted prefix-cache blocks: it needs prefix "
                             "caching on (drop --no-enable-prefix-caching)")
        if config.kv_layout().hybrid:
            raise ValueError(f"{what} with sliding-window layers (several KV cache groups) is "
                             "not yet supported; pass --disable-hybrid-kv-cache-manager to keep "
                             "every layer's KV in one group")
        if config.model.arch.is_mla:
            raise ValueError(f"{what} with MLA models (a latent KV cache) is not yet supported")
        spec = config.speculative
        if spec is not None and spec.uses_model:
            raise ValueError(f"{what} with speculative method {spec.method!r} (a draft KV cache) "
                             "is not yet supported")
        if kv.kv_buffer_device != "cpu":
            raise ValueError(f"--kv-transfer-config: kv_buffer_device must be 'cpu' for "
                             f"{what}, got {kv.kv_buffer_device!r}")
        per_block = kv_bytes_per_block(config)
        if host_tier_slots(config) < 1:
            raise ValueError(f"{what}: its size (kv_buffer_size {kv.kv_buffer_size:.0f} bytes, "
                             "or cpu_bytes_to_use) holds no KV block (one block is "
                             f"{per_block} bytes)")
        _check_host_memory(config)

    def __init__(self, config: EngineConfig, role: KVConnectorRole, rank: int = 0) -> None:
        super().__init__(config, role, rank)
        self.num_slots = host_tier_slots(config)
        # Scheduler side.
        self.index = HostTierIndex(self.num_slots) if role == KVConnectorRole.SCHEDULER else None
        self._store_blocks: list[int] = []
        self._store_slots: list[int] = []
        self._store_hashes: list[bytes] = []
        self._load_blocks: list[int] = []
        self._load_slots: list[int] = []
        self._reused: list[int] = []
        # Write-through queue, oldest first: hash -> (pool block, the step that cached it).
        self._queue: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._step = 0  # steps whose metadata was built
        self.store_per_step = int(config.kv_transfer.extra(
            "store_blocks_per_step", store_blocks_default(config)))
        self.max_queue = _QUEUE_STEPS * self.store_per_step
        self.dropped = 0  # queued blocks dropped on overflow (they may still go on eviction)
        # request id -> (its first block past the local hit, the host slots matched from there)
        self._matched: dict[str, tuple[int, list[int]]] = {}
        self._stats = KVConnectorStats()
        # Worker side: built in ``register_kv_caches``; the step's metadata between
        # ``save_kv_layer`` and ``wait_for_save``.
        # (A worker's ``HostKVStore``; engine_core does not import worker modules at the top.)
        self.store: Any = None
        self._step_meta: OffloadMeta | None = None
        if role == KVConnectorRole.SCHEDULER:
            logger.info("host KV tier: %d blocks (%.2f GB)", self.num_slots,
                        self.num_slots * kv_bytes_per_block(config) / 1e9)

    # --- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        index = self.index
        assert index is not None
        if request.sampling_params.prompt_logprobs is not None or not len(index):
            return 0, False  # prompt logprobs need every prompt position computed
        bs = self.block_size
        start = num_computed_tokens // bs
        usable = (request.num_tokens - 1) // bs  # at least one token is computed
        slots: list[int] = []
        for h in request.block_hashes[start:usable]:
            if h not in index:
                break
            slots.append(index.take(h))  # pinned: a store of this step must not reuse it
        if not slots:
            self._matched.pop(request.request_id, None)
            return 0, False
        self._matched[request.request_id] = (start, slots)
        return len(slots) * bs, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        self._stats.queries += request.num_tokens
        matched = self._matched.pop(request.request_id, None)
        if matched is None or not num_external_tokens:
            return
        start, slots = matched
        n = num_external_tokens // self.block_size
        self._load_blocks.extend(block_ids[start:start + n])
        self._load_slots.extend(slots[:n])
        self._stats.hits += num_external_tokens

    def on_block_cached(self, block_id: int, block_hash: bytes) -> None:
        assert self.index is not None
        if block_hash in self.index:
            return  # loaded from the host, or stored already: nothing to copy
        queue = self._queue
        queue[block_hash] = (block_id, self._step)
        if len(queue) > self.max_queue:
            queue.popitem(last=False)
            self.dropped += 1

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        index = self.index
        assert index is not None
        # This step overwrites the block: a store of it still in flight must end first.
        self._reused.append(block_id)
        queued = self._queue.pop(block_hash, None)
        if queued is not None and queued[1] == self._step:
            return  # cached this very step and never computed: nothing worth keeping
        if queued is None and block_hash in index:
            index.touch(block_hash)  # the host copy is now the only one
            return
        # Not on the host (still queued, or dropped by the host LRU while the pool kept it):
        # copied out before this step's forward, as the only way left to keep it.
        slot = index.store(block_hash)
        if slot is not None:
            self._store_blocks.append(block_id)
            self._store_slots.append(slot)
            self._store_hashes.append(block_hash)
            self._stats.stores += self.block_size

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMeta:
        index = self.index
        assert index is not None
        if len(self._store_blocks) > 1:
            self._align_store_slots()
        save_blocks, save_slots = self._take_saves(index)
        meta = OffloadMeta(store_block_ids=self._store_blocks, store_slots=self._store_slots,
                           load_block_ids=self._load_blocks, load_slots=self._load_slots,
                           save_block_ids=save_blocks, save_slots=save_slots,
                           reused_block_ids=self._reused)
        self._store_blocks, self._store_slots, self._store_hashes = [], [], []
        self._load_blocks, self._load_slots, self._reused = [], [], []
        self._matched.clear()
        index.end_step()
        self._step += 1
        return meta

    def _take_saves(self, index: HostTierIndex) -> tuple[list[int], list[int]]:
        """Up to ``store_per_step`` blocks off the queue's head, each with a host slot (slots
        of this step's loads are pinned, so a save never takes one)."""
        queue = self._queue
        n = min(len(queue), self.store_per_step)
        blocks: list[int] = []
        slots: list[int] = []
        for _ in range(n):
            block_hash, (block_id, _step) = queue.popitem(last=False)
            slot = index.store(block_hash)
            if slot is not None:
                blocks.append(block_id)
                slots.append(slot)
        self._stats.stores += self.block_size * len(blocks)
        return blocks, slots

    def _align_store_slots(self) -> None:
        """Blocks are evicted last-position-first, so slots handed out in eviction order run
        against the block ids and every block became its own copy (an 8k-token prefix: 32k
        small copies, slower than recomputing it on an H100). Sorted by block id, with the
        step's slots in ascending order, consecutive blocks land in consecutive slots: one
        copy per run of blocks, both when stored and when loaded again."""
        assert self.index is not None
        order = sorted(range(len(self._store_blocks)), key=self._store_blocks.__getitem__)
        hashes = [self._store_hashes[i] for i in order]
        slots = self.index.reorder(hashes)
        if slots is not None:
            self._store_blocks = [self._store_blocks[i] for i in order]
            self._store_slots = slots
            self._store_hashes = hashes

    def take_stats(self) -> KVConnectorStats | None:
        stats = self._stats
        if not (stats.queries or stats.hits or stats.stores):
            return None
        self._stats = KVConnectorStats()
        return stats

    def reset_cache(self) -> bool:
        if self.index is not None:
            self.index.clear()
        self._queue.clear()
        return True

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        # The tensors and copies are worker code; this half runs in the worker process.
        from tidal.worker.kv_transfer.host_kv_store import HostKVStore

        self.store = HostKVStore(kv_caches, self.num_slots)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadMeta) and self.store is not None
        store = self.store
        if metadata.reused_block_ids:
            store.wait_blocks(metadata.reused_block_ids)
        if metadata.store_block_ids:
            store.save(metadata.store_block_ids, metadata.store_slots)
        if metadata.load_block_ids:
            store.load(metadata.load_block_ids, metadata.load_slots)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if self.store is not None:
            self.store.wait_layer(layer_idx)

    def wait_for_save(self) -> None:
        # (Called after the forward.) Write-through stores start here and are not waited for:
        # a later step that overwrites one of these blocks waits for its store (reused ids).
        meta = self._step_meta
        self._step_meta = None
        if meta is not None and meta.save_block_ids and self.store is not None:
            self.store.save_async(meta.save_block_ids, meta.save_slots)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor,
                      metadata: KVConnectorMetadata) -> None:
        # Every layer's blocks go in one batch from ``wait_for_save``.
        if layer_idx == 0:
            assert isinstance(metadata, OffloadMeta)
            self._step_meta = metadata

    def shutdown(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store = None
