"""The worker's adapter bookkeeping: the host LRU (``adapter_cache``) and the device slots
(``gpu_slots``): a step's adapters keep their slots, new ones take a free slot or the least
recently used one no adapter of the step needs, loading clears what a larger adapter left, and
the per-token slot ids of a step (``LoRAManager.prepare_step``) follow the batch order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.worker.lora.adapter_cache import AdapterCache
from tidal.worker.lora.gpu_slots import GPUSlots
from tidal.worker.lora.layers import LoRAContext, LoRALayer
from tidal.worker.lora.peft_loader import LoadedAdapter
from tidal.worker.kernel_policy import reference_kernels


def adapter(i: int, rank: int = 4, in_f: int = 8, out_f: int = 6) -> LoadedAdapter:
    out = LoadedAdapter((i, f"/a{i}"), f"a{i}")
    out.weights[(0, "q_proj")] = (torch.full((rank, in_f), float(i)),
                                  torch.full((out_f, rank), 1.0))
    return out


def test_host_lru():
    cache = AdapterCache(2)
    assert cache.put(adapter(1)) == [] and cache.put(adapter(2)) == []
    assert cache.get((1, "/a1")) is not None  # 1 is now the most recent
    assert cache.put(adapter(3)) == [(2, "/a2")]
    assert cache.keys() == [(1, "/a1"), (3, "/a3")]
    moved = LoadedAdapter((3, "/moved"), "a3")
    assert cache.put(moved) == [(3, "/a3")]  # same id, other files: the old entry goes
    with pytest.raises(ValueError):
        AdapterCache(0)


def test_slots_reuse_and_clear():
    ctx = LoRAContext(16, torch.device("cpu"))
    layer = LoRALayer(("q_proj", "k_proj"), (6, 2), 8, 2, 8, torch.float32,
                      torch.device("cpu"), ctx, reference_kernels())
    slots = GPUSlots(2, {(0, "q_proj"): layer, (0, "k_proj"): layer})
    fetched = []

    def fetch(key):
        fetched.append(key)
        return adapter(key[0], rank=8 if key[0] == 1 else 4)

    k1, k2, k3 = (1, "/a1"), (2, "/a2"), (3, "/a3")
    first = slots.assign([k1, k2], fetch)
    assert sorted(first.values()) == [0, 1] and fetched == [k1, k2]
    assert slots.assign([k2], fetch) == {k2: first[k2]}  # resident: no load
    # k3 takes the least recently used slot (k1's), never the one k2 holds this step.
    third = slots.assign([k2, k3], fetch)
    assert third[k3] == first[k1] and third[k2] == first[k2]
    s = third[k3]
    # k1 had rank 8, k3 has rank 4: the rest of the slot was cleared, not left over.
    assert torch.equal(layer.a[s, :4], torch.full((4, 8), 3.0))
    assert not layer.a[s, 4:].any() and not layer.b[s, :, 4:].any()
    assert not layer.b[s, 6:].any()  # k_proj rows: not targeted
    # An idle adapter's slot goes before a live one's, even a more recently used one.
    k4 = (4, "/a4")
    assert slots.assign([k3], fetch) == {k3: third[k3]}
    assert slots.assign([k2], fetch) == {k2: third[k2]}  # k3 is now the least recent
    fourth = slots.assign([k4], fetch, live={k3})
    assert fourth[k4] == third[k2]  # k2 (idle) out, though k2 was used last
    with pytest.raises(RuntimeError, match="--max-loras"):
        slots.assign([k1, k2, k3], fetch)


def test_prepare_step_token_slots(tiny_models):
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.lora_request import LoRARequest
    from tidal.worker.lora.manager import LoRAManager

    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.distributed.parallel_state import single_group
    from tidal.worker.models.decoder import DecoderForCausalLM

    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), enable_lora=True, max_loras=2).create_config()
    model = DecoderForCausalLM(config.model.arch, torch.float32, TorchAttention())
    mgr = LoRAManager(config, model, torch.device("cpu"), torch.float32, single_group(),
                      reference_kernels(), 32)
    assert model.layers["0"].self_attn.qkv_proj.lora is not None
    key = (1, "/a1")
    mgr.cache.put(adapter(1, in_f=64, out_f=64))
    mgr.requests["r1"] = LoRARequest("a1", 1, "/a1")
    mgr.prepare_step(["r0", "r1", "r2"], np.array([2, 3, 1], dtype=np.int32), 8, eager=True)
    slot = mgr.slots.slot_of(key)
    assert mgr.ctx.token_slots[:8].tolist() == [-1, -1, slot, slot, slot, -1, -1, -1]
    mgr.prepare_step(["r1"], np.array([1], dtype=np.int32), 1, eager=True)
    assert mgr.ctx.token_slots[:8].tolist() == [slot] + [-1] * 7  # the old tail cleared


def test_grouped_decode_tables(tiny_models):
    """With grouping on (``lora_grouped_min_tokens``), a decode step writes the permutation
    and the tile table the grouped kernels read (fixed buffers: the rest of the graph's tiles
    length 0); below the threshold, and for other steps, the per-token layout stays."""
    import dataclasses

    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.lora_request import LoRARequest
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.distributed.parallel_state import single_group
    from tidal.worker.kernel_policy import reference_policy
    from tidal.worker.lora.grouping import TILE, group_tokens, max_tiles
    from tidal.worker.lora.manager import LoRAManager
    from tidal.worker.models.decoder import DecoderForCausalLM
    from tidal.worker.ops.kernels import Kernels

    folder, _ = tiny_models["llama"]
    config = EngineArgs(model=str(folder), enable_lora=True, max_loras=2).create_config()
    model = DecoderForCausalLM(config.model.arch, torch.float32, TorchAttention())
    policy = dataclasses.replace(reference_policy(), triton_lora=True,
                                 lora_grouped_min_tokens=4)
    mgr = LoRAManager(config, model, torch.device("cpu"), torch.float32, single_group(),
                      Kernels(policy), 32)
    for i in (1, 2):
        mgr.cache.put(adapter(i, in_f=64, out_f=64))
    mgr.requests.update({"a": LoRARequest("a1", 1, "/a1"), "b": LoRARequest("a2", 2, "/a2"),
                         "c": LoRARequest("a1", 1, "/a1"), "e": LoRARequest("a2", 2, "/a2")})
    ids = ["a", "b", "base", "c", "e", "base2"]
    one = np.ones(len(ids), dtype=np.int32)
    mgr.prepare_step(ids, one, 8, eager=False, decode=True)
    token_slots = np.array(mgr.ctx.token_slots[:len(ids)].tolist(), dtype=np.int32)
    perm, starts, lengths, slots = group_tokens(token_slots, TILE)
    seg = mgr.ctx.segments
    assert seg is not None and seg.perm is mgr.ctx.perm and seg.num == max_tiles(8, 2, TILE)
    assert mgr.ctx.perm[:len(perm)].tolist() == perm.tolist() == [0, 3, 1, 4] or \
        mgr.ctx.perm[:len(perm)].tolist() == perm.tolist() == [1, 4, 0, 3]
    k = len(starts)
    assert mgr.ctx.tiles[0, :k].tolist() == starts.tolist()
    assert mgr.ctx.tiles[1, :k].tolist() == lengths.tolist() == [2, 2]
    assert mgr.ctx.tiles[2, :k].tolist() == slots.tolist()
    assert not mgr.ctx.tiles[1, k:seg.num].any()  # the graph's other tiles: empty
    # Below the threshold, and a step that is not a decode: no grouping.
    mgr.prepare_step(ids[:3], one[:3], 3, eager=True, decode=True)
    assert mgr.ctx.segments is None
    mgr.prepare_step(ids, one + 1, 12, eager=False, decode=False)
    assert mgr.ctx.segments is None
    mgr.capture_layout(8)
    assert mgr.ctx.segments is mgr.grouped_segments(8)
    mgr.capture_layout(2)
    assert mgr.ctx.segments is None
