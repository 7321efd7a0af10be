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


def test_scattered_blocks_are_gathered_into_one_copy_per_slot_run(monkeypatch):
    """Blocks the pool hands out in any order, slots in a run (a prefix stored in position
    order): on a GPU they go through a device buffer, one copy per slot run and layer, not one
    per block. The same path on the CPU, against plain indexing; a small buffer forces
    several batches."""
    from tidal.worker.kv_transfer import host_kv_store

    caches = _caches(blocks=12, seed=2)
    originals = [c.clone() for c in caches]
    store = HostKVStore(caches, num_slots=8, gather=True)
    blocks, slots = [9, 2, 7, 4, 11], [3, 4, 5, 6, 7]
    plan = store._plan(blocks, slots)
    assert len(plan) == 1 and plan[0].runs == [(3, 0, 5)]  # one batch, one slot run
    store.save(blocks, slots)
    for host, ref in zip(store.host, originals):
        torch.testing.assert_close(host[:, slots], ref[:, blocks], rtol=0, atol=0)
    # Back into other scattered blocks, through a buffer of two blocks: three batches.
    monkeypatch.setattr(host_kv_store, "_STAGING_BYTES", 2 * store._block_bytes)
    targets = [10, 0, 5, 3, 8]
    assert len(store._plan(targets, slots)) == 3
    for c in caches:
        c.zero_()
    store.load(targets, slots)
    for cache, ref in zip(caches, originals):
        torch.testing.assert_close(cache[:, targets], ref[:, blocks], rtol=0, atol=0)
        assert not cache[:, [b for b in range(12) if b not in targets]].any()
    # Slots out of order too: the pairs are sorted by slot, so it still holds.
    for c in caches:
        c.zero_()
    store.load([1, 6], [6, 3])
    for cache, ref in zip(caches, originals):
        torch.testing.assert_close(cache[:, [1, 6]], ref[:, [4, 9]], rtol=0, atol=0)


def test_gathered_copies_move_fp8_caches_bit_for_bit():
    caches = [c.to(torch.float8_e4m3fn) for c in _caches(num_layers=2, blocks=10, seed=4)]
    raw = [c.view(torch.uint8).clone() for c in caches]
    store = HostKVStore(caches, num_slots=6, gather=True)
    store.save([7, 2, 9], [0, 1, 2])
    for c in caches:
        c.view(torch.uint8).zero_()
    store.load([1, 5, 3], [0, 1, 2])
    for cache, ref in zip(caches, raw):
        assert torch.equal(cache.view(torch.uint8)[:, [1, 5, 3]], ref[:, [7, 2, 9]])


def test_write_through_saves_copy_the_blocks_as_the_forward_left_them(tiny_models):
    """The worker half saves a step's ``save_*`` blocks after its forward (the K/V that
    forward wrote), its eviction stores before it, and waits only on reused blocks."""
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
    caches = _caches(blocks=10, seed=3)
    before = [c.clone() for c in caches]
    worker.register_kv_caches(caches)
    meta = OffloadMeta(store_block_ids=[1], store_slots=[1], save_block_ids=[4, 5],
                       save_slots=[2, 3], reused_block_ids=[1])
    worker.start_load_kv(meta)
    for c in caches:  # the step's forward writes blocks 1 (reused), 4 and 5
        c[:, [1, 4, 5]] += 1.0
    for i, c in enumerate(caches):
        worker.save_kv_layer(i, c, meta)
    worker.wait_for_save()
    for host, old, new in zip(worker.store.host, before, caches):
        torch.testing.assert_close(host[:, 1], old[:, 1], rtol=0, atol=0)  # before the forward
        torch.testing.assert_close(host[:, [2, 3]], new[:, [4, 5]], rtol=0, atol=0)  # after
    worker.shutdown()


def _big_caches(mib_per_layer: int, layers: int = 4) -> list[torch.Tensor]:
    blocks = mib_per_layer * 2**20 // (2 * 16 * 8 * 128 * 2)
    return [torch.randn(2, blocks, 16, 8, 128, device="cuda").to(torch.bfloat16)
            for _ in range(layers)]


@pytest.mark.gpu
def test_write_through_stores_do_not_hold_up_the_forward():
    """Write-through stores run on their own stream: work issued on the forward's stream after
    them finishes while they are still copying; a step that reuses a stored block waits for
    that store's event only, and an unrelated block waits for nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: side-stream stores and their events (unrun on CPU)")
    caches = _big_caches(256)  # 1 GiB in all: ~20 ms of device -> host copy
    n = caches[0].shape[1]
    store = HostKVStore(caches, num_slots=n)
    assert store.host[0].is_pinned() and store.gather
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    ids = list(range(n - 1))  # every block but the last
    store.save_async(ids, ids)
    assert store.forward_waits == 0 and store.stores_in_flight() == 1
    x.add_(1.0)  # "the next step's forward"
    step_done = torch.cuda.Event()
    step_done.record()
    step_done.synchronize()
    assert store.stores_in_flight() == 1, "the forward's stream waited for the stores"
    store.wait_blocks([n - 1])  # not stored: no wait
    assert store.forward_waits == 0
    store.wait_blocks([3, 5])  # one batch's event, once
    assert store.forward_waits == 1
    reused = torch.cuda.Event()
    reused.record()
    reused.synchronize()
    assert store.stores_in_flight() == 0  # the wait really ordered it after the stores
    for cache, host in zip(caches, store.host):
        assert torch.equal(host[:, :n - 1], cache[:, :n - 1].cpu())
    store.close()


@pytest.mark.gpu
def test_gpu_loads_wait_for_a_store_into_their_slots_still_in_flight():
    """A host hit on a block whose write-through store is still copying: the load is ordered
    after that store (its slot's event), and lands scattered blocks through the gather
    buffer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: side-stream ordering of loads after stores (unrun on CPU)")
    caches = _big_caches(128)
    n = caches[0].shape[1]
    originals = [c.clone() for c in caches]
    store = HostKVStore(caches, num_slots=n)
    src = list(range(n // 2))
    store.save_async(src, src)
    # At once (no sync, nothing on the forward's stream to order them): the first 64 slots
    # come back into other, scattered blocks; only the slots' store events order the load.
    targets = [n - 1 - 2 * i for i in range(64)]
    store.load(targets, list(range(64)))
    for i in range(len(caches)):
        store.wait_layer(i)
    torch.cuda.synchronize()
    for cache, ref in zip(caches, originals):
        assert torch.equal(cache[:, targets], ref[:, :64])
    store.close()
