"""The Triton fused MoE kernels against the torch reference (``moe_torch``) for every routing
mode, several batch sizes (one token, fewer (token, slot) pairs than experts, many), in float32,
float16 and bfloat16; the expert alignment's invariants; unrouted experts never read; the direct
small-batch path (``triton_moe_gemv``) against the reference and the grouped path, with FP8
weights and other ranks' experts, and the rule that picks it; and, on a GPU, the policy's
dispatch and CUDA-graph captures of the layer and of the direct path.

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
from tidal.worker.ops import moe_configs, moe_torch, triton_moe  # noqa: E402
from tidal.worker.ops.moe_configs import (DirectConfig, GemmConfig, GemvShape,  # noqa: E402
                                          MoeConfig, get_config)

ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# The interpreter converts float32 to bfloat16 by truncation (toward zero), and the direct path
# rounds its output in the kernel where the grouped path leaves that to torch: one more biased
# rounding (measured 1.4e-2 to 2.0e-2 against moe_torch; 4e-3 to 5e-3 against the grouped path).
DIRECT_TOL = {**TOL, torch.bfloat16: 3e-2 if INTERPRET else TOL[torch.bfloat16]}
# The interpreter runs each program in numpy: small tiles keep it quick.
SMALL = MoeConfig(16, GemmConfig(16, 16, 2, 4, 1), GemmConfig(16, 16, 2, 4, 1))
# The direct path's: H and I below are not multiples of these (the masks are exercised).
SMALL_DIRECT = DirectConfig(GemvShape(4, 16, 4), GemvShape(4, 16, 2))

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


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype,
           tol: dict[torch.dtype, float] = TOL) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.isfinite(got).all()
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < tol[dtype], f"relative error {err:.2e} >= {tol[dtype]:.0e}"


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
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=SMALL, path="grouped"), want,
           dtype)
    # Whichever path the rule picks for this T (direct at 1 and 3 tokens), with its defaults.
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=SMALL), want, dtype,
           DIRECT_TOL)
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


@pytest.mark.parametrize("path", triton_moe.PATHS)
def test_unrouted_experts_are_never_read(path):
    e, h, i = 16, 32, 48
    w13, w2 = _weights(e, h, i, torch.float32, 3)
    x = torch.randn(1, h).to(DEVICE)
    ids = torch.tensor([[4, 11]], dtype=torch.int32, device=DEVICE)
    weights = torch.tensor([[0.7, 0.3]], device=DEVICE)
    want = moe_torch.fused_moe(x, w13, w2, weights, ids)
    for other in set(range(e)) - {4, 11}:
        w13[other] = float("nan")
        w2[other] = float("nan")
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, config=SMALL, path=path,
                                direct_config=SMALL_DIRECT), want, torch.float32)


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


# --- the direct small-batch path (triton_moe_gemv) --------------------------------------------

# H and I not multiples of any block size of SMALL_DIRECT or of the defaults.
DIRECT_SHAPE = (16, 38, 42)


def _routed(name: str, tokens: int, e: int, h: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h, generator=gen).to(DEVICE, dtype)
    logits = torch.randn(tokens, e, generator=gen).to(DEVICE)
    bias = torch.randn(e, generator=gen).to(DEVICE) if "bias" in name else None
    weights, ids = select_experts(logits, ROUTINGS[name], bias)
    return x, weights, ids


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_direct_matches_torch(name, tokens, dtype):
    e, h, i = DIRECT_SHAPE
    w13, w2 = _weights(e, h, i, dtype, 10 + tokens)
    x, weights, ids = _routed(name, tokens, e, h, dtype, 200 + tokens)
    want = moe_torch.fused_moe(x, w13, w2, weights, ids)
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, path="direct",
                                direct_config=SMALL_DIRECT), want, dtype, DIRECT_TOL)
    if tokens == 1:  # the default launch shapes (whole K in one masked chunk here)
        _check(triton_moe.fused_moe(x, w13, w2, weights, ids, path="direct"), want, dtype,
               DIRECT_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_even_shapes(dtype):
    """H, I multiples of the blocks: the unmasked loads and stores."""
    e, h, i = 8, 64, 32
    w13, w2 = _weights(e, h, i, dtype, 5)
    x = torch.randn(2, h).to(DEVICE, dtype)
    weights, ids = select_experts(torch.randn(2, e).to(DEVICE), RoutingConfig(top_k=3))
    want = moe_torch.fused_moe(x, w13, w2, weights, ids)
    for cfg in (SMALL_DIRECT, DirectConfig(GemvShape(8, 32, 4), GemvShape(2, 32, 4))):
        _check(triton_moe.fused_moe(x, w13, w2, weights, ids, path="direct",
                                    direct_config=cfg), want, dtype, DIRECT_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_long_k_loops(dtype, monkeypatch):
    """K chunks past ``UNROLL_MAX_CHUNKS`` loop rather than unroll (long rows, e.g. Mixtral's
    down projection): the same sums, masked last chunk included."""
    from tidal.worker.ops import triton_moe_gemv

    monkeypatch.setattr(triton_moe_gemv, "UNROLL_MAX_CHUNKS", 1)
    e, h, i = DIRECT_SHAPE
    w13, w2 = _weights(e, h, i, dtype, 15)
    x, weights, ids = _routed("softmax_plain", 2, e, h, dtype, 16)
    ids[0, 1] = e  # another rank's expert
    want = moe_torch.fused_moe(x, w13, w2, weights, ids)
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, path="direct", partial=True,
                                direct_config=SMALL_DIRECT), want, dtype, DIRECT_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_equals_grouped(dtype):
    e, h, i = DIRECT_SHAPE
    w13, w2 = _weights(e, h, i, dtype, 21)
    for tokens in (1, 3):
        x, weights, ids = _routed("softmax_plain", tokens, e, h, dtype, 22 + tokens)
        direct = triton_moe.fused_moe(x, w13, w2, weights, ids, path="direct",
                                      direct_config=SMALL_DIRECT)
        grouped = triton_moe.fused_moe(x, w13, w2, weights, ids, path="grouped", config=SMALL)
        assert direct.dtype == grouped.dtype == dtype
        if dtype == torch.float32:
            # Same float32 products, summed in another order.
            torch.testing.assert_close(direct, grouped, rtol=1e-5, atol=1e-6)
        else:
            # The same rounding points: apart by at most an output ulp here and there.
            _check(direct, grouped, dtype)


@pytest.mark.parametrize("path", triton_moe.PATHS)
def test_other_ranks_experts_add_nothing(path):
    """``partial``: ids of E (or beyond) name another expert-parallel rank's experts; their
    pairs add nothing, are never an address (an id of 2**30 would be far out of bounds), and
    their router weights (NaN here) never reach the sum. A token with no local expert gets 0."""
    e, h, i = DIRECT_SHAPE
    w13, w2 = _weights(e, h, i, torch.float32, 31)
    x = torch.randn(3, h).to(DEVICE)
    ids = torch.tensor([[3, e, 9], [e, e, e], [2**30, 5, e]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(3, 3).to(DEVICE)
    remote = (ids >= e)
    weights = weights.masked_fill(remote, float("nan"))
    want = moe_torch.fused_moe(x, w13, w2, weights.masked_fill(remote, 0.0),
                               ids.clamp(max=e))
    got = triton_moe.fused_moe(x, w13, w2, weights, ids.clamp(max=e) if path == "grouped"
                               else ids, config=SMALL, partial=True, path=path,
                               direct_config=SMALL_DIRECT)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    _check(got, want, torch.float32)


def _fp8_experts(e: int, h: int, i: int, seed: int):
    from tidal.worker.ops import fp8_torch

    # (Drawn where they will live: a model-sized draw on the CPU takes seconds.)
    gen = torch.Generator(DEVICE).manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=gen, device=DEVICE) * \
        torch.rand(e, 2 * i, 1, generator=gen, device=DEVICE) * 0.2
    w2 = torch.randn(e, h, i, generator=gen, device=DEVICE) * 0.2
    q13, s13 = fp8_torch.quantize_rows(w13.reshape(-1, h))
    q2, s2 = fp8_torch.quantize_rows(w2.reshape(-1, i))
    return (q13.view(e, 2 * i, h).to(DEVICE), s13.view(e, 2 * i).to(DEVICE),
            q2.view(e, h, i).to(DEVICE), s2.view(e, h).to(DEVICE))


fp8_ok = pytest.mark.skipif(
    ON_GPU and torch.cuda.get_device_capability() < (8, 9),
    reason="Triton converts e4m3 from compute capability 8.9 on")


@fp8_ok
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_fp8_weights(tokens, dtype):
    """FP8 (e4m3) experts with per-row float32 scales (weight-only), as ``test_fp8_moe``
    checks the grouped kernels: against ``moe_torch`` (which rounds each slot's down
    projection once more: a looser bound in 16 bits) and against the grouped path, whose
    rounding points are the direct path's."""
    e, h, i = DIRECT_SHAPE
    q13, s13, q2, s2 = _fp8_experts(e, h, i, 40 + tokens)
    x, weights, ids = _routed("softmax_renorm", tokens, e, h, dtype, 41 + tokens)
    x = x * 2
    want = moe_torch.fused_moe(x, q13, q2, weights, ids, s13, s2)
    got = triton_moe.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2,
                               path="direct", direct_config=SMALL_DIRECT)
    _check(got, want, dtype, DIRECT_TOL)
    grouped = triton_moe.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2,
                                   path="grouped", config=SMALL)
    if dtype == torch.float32:
        torch.testing.assert_close(got, grouped, rtol=1e-5, atol=1e-6)
    else:
        _check(got, grouped, dtype)
    # Other ranks' experts with FP8 weights: skipped, scales included.
    ids_p = ids.clone()
    ids_p[:, 0] = e
    want_p = moe_torch.fused_moe(x, q13, q2, weights, ids_p, s13, s2)
    got_p = triton_moe.fused_moe(x, q13, q2, weights, ids_p, w13_scale=s13, w2_scale=s2,
                                 partial=True, path="direct", direct_config=SMALL_DIRECT)
    _check(got_p, want_p, dtype, DIRECT_TOL)


class _Spy:
    """Records which path ``triton_moe.fused_moe`` took, then runs it."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        direct, align = triton_moe.triton_moe_gemv.fused_moe_direct, triton_moe.align

        def spy_direct(*args, **kwargs):
            self.calls.append("direct")
            return direct(*args, **kwargs)

        def spy_align(*args, **kwargs):
            self.calls.append("grouped")
            return align(*args, **kwargs)

        monkeypatch.setattr(triton_moe.triton_moe_gemv, "fused_moe_direct", spy_direct)
        monkeypatch.setattr(triton_moe, "align", spy_align)

    def took(self, fn) -> str:
        self.calls.clear()
        fn()
        assert len(self.calls) == 1, self.calls
        return self.calls[0]


def test_direct_selection_rule(monkeypatch):
    spy = _Spy(monkeypatch)
    e, h, i = DIRECT_SHAPE
    w13, w2 = _weights(e, h, i, torch.float32, 50)

    def run(tokens: int, **kw):
        x, weights, ids = _routed("softmax_renorm", tokens, e, h, torch.float32, tokens)
        return lambda: triton_moe.fused_moe(x, w13, w2, weights, ids, config=SMALL,
                                            direct_config=SMALL_DIRECT, **kw)

    # top-2 of 16 experts: 1 token (2 pairs) direct; 9 tokens (18 pairs, over a third of them
    # expected to share an expert with another) grouped.
    assert moe_configs.use_direct(1, e, 2) and not moe_configs.use_direct(9, e, 2)
    assert spy.took(run(1)) == "direct"
    assert spy.took(run(9)) == "grouped"
    # Forced either way.
    assert spy.took(run(1, path="grouped")) == "grouped"
    assert spy.took(run(9, path="direct")) == "direct"
    with pytest.raises(ValueError, match="path"):
        run(1, path="gemv")()
    # The hook: never direct, then back to the shipped rule.
    try:
        moe_configs.configure_direct(max_pairs=0)
        assert spy.took(run(1)) == "grouped"
    finally:
        moe_configs.configure_direct(reset=True)
    assert spy.took(run(1)) == "direct"


def test_direct_rule_and_shapes_for_released_models():
    use = moe_configs.use_direct
    # Qwen3-30B-A3B (128 experts, top-8): up to 4 tokens direct (32 pairs, 9% of them expected
    # to share an expert), 5 grouped (40 pairs).
    assert [use(t, 128, 8) for t in (1, 2, 4, 5, 64)] == [True, True, True, False, False]
    # Mixtral (8 experts, top-2): one token direct; at two, 12.5% of the pairs would read an
    # expert twice (at 352 MB an expert).
    assert [use(t, 8, 2) for t in (1, 2, 8)] == [True, False, False]
    assert moe_configs.expected_duplicate(1, 8, 2) == 0.0
    assert moe_configs.expected_duplicate(2, 8, 2) == pytest.approx(0.125)
    # Default shapes: gate/up 4 rows x all 2048 of H (4 KiB of each row, both halves: 32 KiB
    # a chunk); down 4 rows of the 8 slots x 256 of I = 768 (three whole chunks).
    cfg = moe_configs.direct_config(1, 2048, 768, 8, 2)
    assert cfg.as_tuple() == ((4, 2048, 4), (4, 256, 4))
    assert DirectConfig.from_tuple(cfg.as_tuple()) == cfg
    fp8 = moe_configs.default_direct_config(1, 2048, 768, 8, 1)
    assert fp8.w13.block_k == 2048 and fp8.w2.block_k == 256  # (not one 1024 chunk of 768)
    # ... but FP8 at one token has a measured entry.
    assert moe_configs.direct_config(1, 2048, 768, 8, 1) == DirectConfig.from_tuple(
        moe_configs.TUNED_DIRECT[(2048, 768, 8, 1, 1)])
    assert moe_configs.direct_config(1, 2048, 768, 8, 4).w13.block_k == 1024  # float32: 4 KiB
    # Mixtral: gate/up chunks of 2048 (the accumulators' cap), down 2 slots x 4 rows x 1024.
    assert moe_configs.direct_config(1, 4096, 14336, 2, 1).as_tuple() == \
        ((4, 2048, 4), (4, 1024, 4))
    # A tuned entry takes over for its (H, I, k, T, element size), and only there.
    try:
        moe_configs.configure_direct(configs={(2048, 768, 8, 1, 2): ((2, 2048, 8), (2, 256, 4))})
        assert moe_configs.direct_config(1, 2048, 768, 8, 2).as_tuple() == \
            ((2, 2048, 8), (2, 256, 4))
        assert moe_configs.direct_config(2, 2048, 768, 8, 2) == cfg
        with pytest.raises(TypeError):
            moe_configs.configure_direct(configs={(1, 1, 1, 1, 2): ((2,), ())})
    finally:
        moe_configs.configure_direct(reset=True)
    assert moe_configs.direct_config(1, 2048, 768, 8, 2) == cfg
    with pytest.raises(ValueError, match="powers of two"):
        e, h, i = DIRECT_SHAPE
        w13, w2 = _weights(e, h, i, torch.float32, 1)
        x, weights, ids = _routed("softmax_renorm", 1, e, h, torch.float32, 1)
        triton_moe.fused_moe(x, w13, w2, weights, ids, path="direct",
                             direct_config=DirectConfig(GemvShape(3, 16), GemvShape(4, 16)))


# --- on a GPU only ----------------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (not the interpreter)")


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 8, 64, 300])
@pytest.mark.parametrize("path", [None, *triton_moe.PATHS])
def test_gpu_larger_shapes(tokens, path):
    if path == "direct" and tokens > 8:
        pytest.skip("the direct path is for a few tokens")
    e, h, i = 64, 512, 384
    w13, w2 = _weights(e, h, i, torch.bfloat16, tokens)
    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = select_experts(torch.randn(tokens, e, device=DEVICE), RoutingConfig(top_k=6))
    _check(triton_moe.fused_moe(x, w13, w2, weights, ids, path=path),
           moe_torch.fused_moe(x, w13, w2, weights, ids), torch.bfloat16)


@gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_direct_qwen3_shape_and_graph(pdl, dtype):
    """Qwen3-30B-A3B's layer shape (128 experts, top-8, H 2048, I 768) down the direct path with
    the default launch shapes, with and without programmatic dependent launch; captured in a
    CUDA graph, replayed on new routing (with another rank's experts among it) and inputs."""
    from tidal.worker.ops import triton_moe_gemv

    e, h, i, k = 128, 2048, 768, 8
    gen = torch.Generator(DEVICE).manual_seed(3)
    w13 = (torch.randn(e, 2 * i, h, generator=gen, device=DEVICE) / math.sqrt(h)).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen, device=DEVICE) / math.sqrt(i)).to(dtype)
    for t in (1, 2):
        x = torch.randn(t, h, device=DEVICE, dtype=dtype)
        logits = torch.randn(t, e, device=DEVICE)
        weights, ids = triton_moe.select_experts(logits, RoutingConfig(top_k=k))

        def run():
            return triton_moe_gemv.fused_moe_direct(x, w13, w2, weights, ids, pdl=pdl)

        _check(run(), moe_torch.fused_moe(x, w13, w2, weights, ids), dtype)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        x.copy_(torch.randn_like(x))
        new_w, new_ids = triton_moe.select_experts(torch.randn_like(logits),
                                                   RoutingConfig(top_k=k))
        new_ids[:, -1] = e  # another expert-parallel rank's
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        _check(out, moe_torch.fused_moe(x, w13, w2, weights, ids), dtype)
        assert torch.equal(out, run())


@gpu
@fp8_ok
@pytest.mark.parametrize("tokens", [1, 2])
def test_gpu_direct_fp8_qwen3_shape(tokens):
    e, h, i, k = 128, 2048, 768, 8
    q13, s13, q2, s2 = _fp8_experts(e, h, i, 9)
    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = triton_moe.select_experts(torch.randn(tokens, e, device=DEVICE),
                                             RoutingConfig(top_k=k))
    got = triton_moe.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2,
                               path="direct")
    grouped = triton_moe.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2,
                                   path="grouped")
    _check(got, moe_torch.fused_moe(x, q13, q2, weights, ids, s13, s2), torch.bfloat16)
    _check(got, grouped, torch.bfloat16)


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
