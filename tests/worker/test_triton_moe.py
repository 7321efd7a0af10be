"""The Triton fused MoE kernels against the torch reference (``moe_torch``) for every routing
mode, several batch sizes (one token, fewer (token, slot) pairs than experts, many), in float32,
float16 and bfloat16; the expert alignment's invariants; unrouted experts never read; and, on a
GPU, the policy's dispatch and a CUDA-graph capture of the layer.

Runs on a CUDA GPU, or on CPU under the Triton interpreter with tiny shapes::

    PYTHONPATH=<cpu triton> TRITON_INTERPRET=1 python -m pytest -q tests/worker/test_triton_moe.py

and skips, saying why, where Triton cannot run.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton", reason="needs triton: the fused MoE kernels are written in it")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on CPU",
                allow_module_level=True)

from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig, select_experts  # noqa: E402
from tidal.worker.ops import moe_torch, triton_moe  # noqa: E402
from tidal.worker.ops.moe_configs import GemmConfig, MoeConfig, get_config  # noqa: E402

ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# The interpreter runs each program in numpy: small tiles keep it quick.
SMALL = MoeConfig(16, GemmConfig(16, 16, 2, 4, 1), GemmConfig(16, 16, 2, 4, 1))

ROUTINGS = {
    "softmax_renorm": RoutingConfig(top_k=2),
    "softmax_plain": RoutingConfig(top_k=3, renormalize=False),
    "sigmoid_scaled": RoutingConfig(top_k=2, scoring="sigmoid", renormalize=False,
                                    routed_scaling_factor=2.5),
    "grouped": RoutingConfig(top_k=3, renormalize=False, num_groups=4, topk_groups=2,
                             routed_scaling_factor=16.0),
    "grouped_sigmoid_bias": RoutingConfig(top_k=4, scoring="sigmoid", num_groups=4,
                                          topk_groups=2),
}


def _weights(e: int, h: int, i: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen) / math.sqrt(h)
    w2 = torch.randn(e, h, i, generator=gen) / math.sqrt(i)
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e} >= {TOL[dtype]:.0e}"


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_matches_torch(name, tokens, dtype):
    routing = ROUTINGS[name]
    e, h, i = 16, 32, 48  # i not a multiple of the tile: the masks are exercised
    w13, w2 = _weights(e, h, i, dtype, tokens)
    gen = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, h, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, e, generator=gen).to(DEVICE)
    bias = torch.randn(e, generator=gen).to(DEVICE) if "bias" in name else None
    weights, ids = select_experts(logits, routing, bias)
    want = moe_torch.fused_moe(x, w13, w2, weights, ids)
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=SMALL), want, dtype)
    if ON_GPU:  # the table's launch config too (its tiles are too large for the interpreter)
        _check(triton_moe.fused_moe(x, w13, w2, weights, ids), want, dtype)


@pytest.mark.parametrize("name", list(ROUTINGS) + ["grouped_64", "odd_experts"])
@pytest.mark.parametrize("tokens", [1, 37])
def test_routing_kernel_matches_torch(name, tokens):
    routing, e = {"grouped_64": (RoutingConfig(top_k=6, num_groups=8, topk_groups=3), 64),
                  "odd_experts": (RoutingConfig(top_k=2), 6)}.get(name, (ROUTINGS.get(name), 16))
    gen = torch.Generator().manual_seed(tokens)
    logits = (torch.randn(tokens, e, generator=gen) * 2).to(DEVICE)
    bias = torch.randn(e, generator=gen).to(DEVICE) if "bias" in name or name == "grouped_64" \
        else None
    want_w, want_i = moe_torch.select_experts(logits, routing, bias)
    got_w, got_i = triton_moe.select_experts(logits, routing, bias)
    assert got_w.dtype == torch.float32 and got_i.dtype == torch.int32
    assert got_i.shape == want_i.shape == (tokens, routing.top_k)
    # Best first in both (random float32 logits have no ties).
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)
    # bfloat16 logits (as a bf16 router gate gives them) read the same way.
    w16, i16 = triton_moe.select_experts(logits.to(torch.bfloat16), routing, bias)
    r16 = moe_torch.select_experts(logits.to(torch.bfloat16), routing, bias)
    assert i16.shape == r16[1].shape
    for t in range(tokens):  # bf16 values can tie: compare as sets of (expert, weight)
        got = dict(zip(i16[t].tolist(), w16[t].tolist()))
        want = dict(zip(r16[1][t].tolist(), r16[0][t].tolist()))
        assert got.keys() == want.keys()
        assert all(abs(got[k] - want[k]) < 1e-5 for k in got)


def test_float16_and_wider_blocks():
    e, h, i = 8, 64, 40
    w13, w2 = _weights(e, h, i, torch.float16, 7)
    x = torch.randn(20, h).to(DEVICE, torch.float16)
    weights, ids = select_experts(torch.randn(20, e).to(DEVICE), RoutingConfig(top_k=2))
    config = MoeConfig(32, GemmConfig(32, 32, 1, 4, 1), GemmConfig(16, 32, 4, 4, 1))
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=config),
           moe_torch.fused_moe(x, w13, w2, weights, ids), torch.float16)


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [(1, 2, 8, 16), (5, 2, 16, 16),
                                                           (40, 3, 8, 32), (300, 4, 24, 16)])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_align_invariants(tokens, top_k, experts, block_m, impl):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[: tokens // 2, 0] = 1  # one crowded expert: runs of several blocks
    ids = ids.to(DEVICE, torch.int32)
    align = triton_moe.align if impl == "triton" else triton_moe.align_torch
    sorted_ids, expert_ids, post = align(ids, experts, block_m)
    pairs = tokens * top_k
    # Fixed sizes for a given T (what a CUDA graph needs), from the worst-case bound.
    assert sorted_ids.numel() == triton_moe.padded_bound(pairs, experts, block_m)
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    flat = ids.reshape(-1).cpu()
    counts = torch.bincount(flat.long(), minlength=experts)
    post = post.item()
    assert post == int(((counts + block_m - 1) // block_m * block_m).sum())
    s, ex = sorted_ids.cpu(), expert_ids.cpu()
    used = s[:post]
    assert (used <= pairs).all()
    real = used[used < pairs]
    assert sorted(real.tolist()) == list(range(pairs))  # every pair exactly once
    if impl == "torch":
        assert (s[post:] == pairs).all()  # the reference also fills the unused tail
    for b in range(post // block_m):
        block = s[b * block_m:(b + 1) * block_m]
        block = block[block < pairs]
        assert len(block) > 0  # no expert gets a block of padding only
        assert (flat[block.long()] == ex[b]).all()


def test_unrouted_experts_are_never_read():
    e, h, i = 16, 32, 48
    w13, w2 = _weights(e, h, i, torch.float32, 3)
    x = torch.randn(1, h).to(DEVICE)
    ids = torch.tensor([[4, 11]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.7, 0.3]], device=DEVICE)
    want = moe_torch.fused_moe(x, w13, w2, weights, ids)
    for other in set(range(e)) - {4, 11}:
        w13[other] = float("nan")
        w2[other] = float("nan")
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=SMALL), want, torch.float32)


def test_bad_arguments_are_refused():
    w13, w2 = _weights(4, 32, 16, torch.float32, 0)
    x = torch.randn(2, 32).to(DEVICE)
    ids = torch.zeros(2, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="one of"):
        triton_moe.fused_moe(x.double(), w13.double(), w2.double(),
                             torch.ones(2, 2, device=DEVICE), ids)
    with pytest.raises(ValueError, match="w13"):
        triton_moe.fused_moe(x, w13[:, :, :16], w2, torch.ones(2, 2, device=DEVICE), ids)


def test_config_table_defaults():
    for m in (1, 8, 64, 256, 2048, 10000):
        cfg = get_config(m, 128, 2048, 768, 8)
        assert cfg.block_m in (16, 32, 64, 128)
        assert MoeConfig.from_dict(cfg.as_dict()) == cfg


# --- on a GPU only ----------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (not the interpreter)")


@gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_gpu_larger_shapes(tokens):
    e, h, i = 64, 512, 384
    w13, w2 = _weights(e, h, i, torch.bfloat16, tokens)
    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, e, device=DEVICE), RoutingConfig(top_k=6))
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids),
           moe_torch.fused_moe(x, w13, w2, weights, ids), torch.bfloat16)


@gpu
def test_gpu_policy_dispatch_and_cuda_graph():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import building, kernels_for

    kernels = kernels_for(DEVICE, KernelConfig(ops="triton"))  # no CUDA extension build
    assert kernels._moe is not None, "a GPU with triton should get the Triton MoE kernels"
    e, h, i, t = 32, 256, 128, 16
    with building(kernels):
        layer = FusedMoE(e, h, i, RoutingConfig(top_k=4), torch.bfloat16).to(DEVICE)
    w13, w2 = _weights(e, h, i, torch.bfloat16, 1)
    layer.w13.data.copy_(w13)
    layer.w2.data.copy_(w2)
    x = torch.randn(t, h, device=DEVICE, dtype=torch.bfloat16)
    logits = torch.randn(t, e, device=DEVICE)
    eager = layer(x, logits)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(x, logits)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x, logits)
    # New inputs in the captured buffers: the routing changes, the graph follows.
    x.copy_(torch.randn_like(x))
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    torch.cuda.synchronize()
    want = layer(x, logits)
    assert not torch.equal(want, eager)
    torch.testing.assert_close(out, want)
    weights, ids = select_experts(logits, layer.routing)
    _check(out, moe_torch.fused_moe(x, w13, w2, weights, ids), torch.bfloat16)


def test_routing_kernel_counts_real_tokens_only():
    """The /metrics routing counter inside the Triton routing kernel (layers/expert_load):
    each real token's top-k picks added once; rows from ``valid`` on (CUDA-graph padding)
    nothing; without ``valid`` every row."""
    dev = DEVICE
    torch.manual_seed(0)
    logits = torch.randn(37, 16, device=dev)
    cfg = RoutingConfig(top_k=3)
    counts = torch.zeros(16, dtype=torch.int32, device=dev)
    valid = torch.tensor([30], dtype=torch.int32, device=dev)
    weights, ids = triton_moe.select_experts(logits, cfg, count=(counts, valid))
    want_w, want_ids = moe_torch.select_experts(logits, cfg)
    assert torch.equal(ids.long(), want_ids.long())  # (routing unchanged by counting)
    torch.testing.assert_close(weights, want_w)
    assert counts.tolist() == torch.bincount(ids[:30].reshape(-1).long(), minlength=16).tolist()
    counts.zero_()
    triton_moe.select_experts(logits, cfg, count=(counts, None))
    assert counts.tolist() == torch.bincount(ids.reshape(-1).long(), minlength=16).tolist()
