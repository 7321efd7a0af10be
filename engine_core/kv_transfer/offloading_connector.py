"""The host-memory KV tier (``--kv-offload-gb``): prefix blocks evicted from the KV pool are
copied to a host LRU keyed by their block hash, and a later request whose prefix misses the
pool but hits the host tier gets those blocks reloaded instead of recomputed (a prefix hit).

Scheduler side (this module): the block pool reports each cached block it reuses for other
tokens (``on_block_evicted``); the block gets a host slot (``HostTierIndex``, LRU) and a store
is queued. On admission, the request's block hashes past the local prefix hit are looked up in
the host tier; the matching run of blocks is allocated as computed and a load is queued. Each
step's stores and loads travel to the workers as ``OffloadMeta``.

Worker side: ``worker/kv_transfer/host_kv_store.py`` holds each layer's host copy (pinned on a
GPU) and copies in runs of consecutive blocks: a step's stores (before its forward overwrites
those blocks) and then its loads, on a side stream on a GPU, plain copies on a CPU.

Config: ``kv_role`` must be ``kv_both``; the tier's size is ``kv_buffer_size`` bytes
(``--kv-offload-gb``) or, with vLLM's ``kv_connector_extra_config`` keys, ``cpu_bytes_to_use``
(bytes) or ``num_cpu_blocks`` (blocks); vLLM's ``block_size`` is accepted only equal to the
engine's block size and ``spec_name`` only as ``CPUOffloadingSpec``; any other key is refused.
The size counts every layer and tensor-parallel rank together and must fit the host's available
memory at start-up. (With data parallelism each rank would allocate its own tier of that size;
a KV connector with several DP ranks is refused for now.)

Not yet: sliding-window models (several KV groups), MLA's latent cache, and speculative methods
with their own KV cache (draft model, EAGLE-3) are refused at start-up by ``check_config``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

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
_EXTRA_KEYS = ("cpu_bytes_to_use", "num_cpu_blocks", "block_size", "spec_name")
_SPEC_NAME = "CPUOffloadingSpec"
_WHAT = "the host KV tier (--kv-offload-gb / OffloadingConnector)"


class OffloadMeta(KVConnectorMetadata):
    """One step's copies: pool block ``store_block_ids[i]`` -> host slot ``store_slots[i]``
    (first), then host slot ``load_slots[i]`` -> pool block ``load_block_ids[i]``."""

    store_block_ids: list[int] = []
    store_slots: list[int] = []
    load_block_ids: list[int] = []
    load_slots: list[int] = []


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
    for key, limit in (("cpu_bytes_to_use", 2**40), ("num_cpu_blocks", 2**31)):
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
        # request id -> (its first block past the local hit, the host slots matched from there)
        self._matched: dict[str, tuple[int, list[int]]] = {}
        self._stats = KVConnectorStats()
        # Worker side: built in ``register_kv_caches``.
        self.store = None
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

    def on_block_evicted(self, block_id: int, block_hash: bytes) -> None:
        assert self.index is not None
        slot = self.index.store(block_hash)
        if slot is not None:
            self._store_blocks.append(block_id)
            self._store_slots.append(slot)
            self._store_hashes.append(block_hash)
            self._stats.stores += self.block_size

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMeta:
        if len(self._store_blocks) > 1:
            self._align_store_slots()
        meta = OffloadMeta(store_block_ids=self._store_blocks, store_slots=self._store_slots,
                           load_block_ids=self._load_blocks, load_slots=self._load_slots)
        self._store_blocks, self._store_slots, self._store_hashes = [], [], []
        self._load_blocks, self._load_slots = [], []
        self._matched.clear()
        assert self.index is not None
        self.index.end_step()
        return meta

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
        return True

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        # The tensors and copies are worker code; this half runs in the worker process.
        from tidal.worker.kv_transfer.host_kv_store import HostKVStore

        self.store = HostKVStore(kv_caches, self.num_slots)

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, OffloadMeta) and self.store is not None
        if metadata.store_block_ids:
            self.store.save(metadata.store_block_ids, metadata.store_slots)
        if metadata.load_block_ids:
            self.store.load(metadata.load_block_ids, metadata.load_slots)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if self.store is not None:
            self.store.wait_layer(layer_idx)

    def shutdown(self) -> None:
        self.store = None
