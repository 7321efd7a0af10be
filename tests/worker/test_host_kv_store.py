"""The host KV tier's copies in a worker, against plain torch indexing: pool blocks out to host
slots and back, in runs, for every layer; and the connector's worker half driving them from the
step metadata."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.kv_transfer.host_kv_store import HostKVStore, block_runs


def test_block_runs_merge_consecutive_pairs_only():
    assert block_runs([], []) == []
    assert block_runs([4, 5, 6, 9, 10, 2, 3], [0, 1, 2, 3, 5, 6, 7]) == \
        [(4, 0, 3), (9, 3, 1), (10, 5, 1), (2, 6, 2)]


def _caches(num_layers: int = 3, blocks: int = 10, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, blocks, 4, 2, 8, generator=g) for _ in range(num_layers)]


def test_save_then_load_round_trips_blocks_through_host_slots():
    caches = _caches()
    originals = [c.clone() for c in caches]
    store = HostKVStore(caches, num_slots=6)
    blocks, slots = [7, 8, 2, 5], [0, 1, 4, 2]
    store.save(blocks, slots)
    for host, ref in zip(store.host, originals):
        torch.testing.assert_close(host[:, slots], ref[:, blocks], rtol=0, atol=0)
    # The pool blocks get other tokens, then the host copy comes back into other blocks.
    for c in caches:
        c.zero_()
    targets = [0, 1, 9, 3]
    store.load(targets, slots)
    for i in range(len(caches)):
        store.wait_layer(i)  # no-op on a CPU: copies are done when load returns
    for cache, ref in zip(caches, originals):
        torch.testing.assert_close(cache[:, targets], ref[:, blocks], rtol=0, atol=0)
        untouched = [b for b in range(10) if b not in targets]
        assert not cache[:, untouched].any()


def test_offloading_connector_worker_half_follows_the_metadata(tiny_models):
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.kv_transfer.connector_base import KVConnectorRole
    from tidal.engine_core.kv_transfer.offloading_connector import (
        OffloadingConnector,
        OffloadMeta,
    )

    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), max_model_len=64, num_kv_blocks=10,
                        kv_offload_gb=1e-3).create_config()
    worker = OffloadingConnector(config, KVConnectorRole.WORKER)
    caches = _caches(blocks=10, seed=1)
    originals = [c.clone() for c in caches]
    worker.register_kv_caches(caches)
    assert worker.store is not None and worker.store.num_slots == worker.num_slots
    # One step: block 3 goes to slot 0 and, in the same step, slot 0 comes back into block 6
    # (stores run before loads, so a block evicted and reloaded in one step is never lost).
    worker.start_load_kv(OffloadMeta(store_block_ids=[3], store_slots=[0],
                                     load_block_ids=[6], load_slots=[0]))
    for cache, ref in zip(caches, originals):
        torch.testing.assert_close(cache[:, 6], ref[:, 3], rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_copies_use_pinned_memory_and_a_side_stream():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: pinned host memory and side-stream copies (unrun on CPU)")
    caches = [c.cuda() for c in _caches()]
    originals = [c.clone() for c in caches]
    store = HostKVStore(caches, num_slots=6)
    assert store.host[0].is_pinned()
    store.save([7, 8], [0, 1])
    for c in caches:
        c.zero_()
    store.load([1, 2], [0, 1])
    for i in range(len(caches)):
        store.wait_layer(i)
    torch.cuda.synchronize()
    for cache, ref in zip(caches, originals):
        torch.testing.assert_close(cache[:, [1, 2]], ref[:, [7, 8]], rtol=0, atol=0)
