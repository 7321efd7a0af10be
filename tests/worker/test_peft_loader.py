"""``peft_loader.pack``: an adapter's matrices moved into a few shared buffers (pinned on a GPU
host: few page-locked allocations, each not much over its contents), values unchanged."""

from __future__ import annotations

import torch

from tidal.worker.lora.peft_loader import LoadedAdapter, pack


def test_pack_into_few_buffers_keeps_every_matrix():
    gen = torch.Generator().manual_seed(0)
    adapter = LoadedAdapter((1, "/a"), "a")
    for layer in range(6):
        for proj, out_f in (("q_proj", 40), ("down_proj", 24)):
            adapter.weights[(layer, proj)] = (
                torch.randn(4, 32, generator=gen).to(torch.bfloat16),
                torch.randn(out_f, 4, generator=gen).to(torch.bfloat16))
    before = {k: (a.clone(), b.clone()) for k, (a, b) in adapter.weights.items()}
    nbytes = adapter.nbytes
    # 2 KiB buffers: 1024 bf16 values each; a layer's matrices are 128 + 160 + 128 + 96.
    buffers = pack(adapter, torch.bfloat16, pin_memory=False, buffer_bytes=2048)
    assert buffers == 3
    assert adapter.nbytes == nbytes and list(adapter.weights) == list(before)
    storages = set()
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(a, before[key][0]) and torch.equal(b, before[key][1])
        assert a.is_contiguous() and b.is_contiguous()
        storages.update({a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()})
    assert len(storages) == 3
    # No two matrices overlap in a buffer.
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for ab in adapter.weights.values() for t in ab)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))


def test_a_matrix_larger_than_a_buffer_gets_its_own():
    adapter = LoadedAdapter((1, "/a"), "a")
    adapter.weights[(0, "o_proj")] = (torch.ones(8, 64), torch.ones(64, 8))
    assert pack(adapter, torch.float32, pin_memory=False, buffer_bytes=64) == 2
    a, b = adapter.weights[(0, "o_proj")]
    assert a.eq(1).all() and b.eq(1).all()
