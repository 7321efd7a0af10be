"""The batch-1 decode kernels (``ops.triton_decode``) and the fused split merge of the Triton
paged attention, against plain-torch references.

- GEMV (one row times a weight), alone and with its RMSNorm prologue (with and without the
  residual add) and its SiLU-and-mul or GeGLU epilogue, over random shapes (ragged K and N
  included) and every launch configuration family, against a float64 reference; the kernel
  must be within the dtype's tolerance and no worse than twice the torch version's own error.
- q/k RMSNorm (Qwen3's and Gemma 3's) + rotary + K/V cache write against
  ``torch_ops.qk_norm_rope_write_kv``.
- the two-stage argmax: exactly ``torch.argmax`` (ties, NaN, -inf rows).
- split-context decode attention with the merge done by the last split program, repeated (the
  split counters must re-arm) and inside a CUDA graph, against the merge-kernel path and the
  float64 reference.
- the kernel time stamps (``ops.triton_probe``) of the rotary, attention and merge kernels:
  ordered, consistent with the dependent-launch waits, and changing no result.
- the all-reduce fused into the GEMVs (rows pushed to every rank, summed by the next GEMV), with
  the ranks simulated by buffers on one GPU, eagerly and in a CUDA graph: bit-exact against the
  plain GEMVs' rows summed in rank order. ``test_push_allreduce_gpu.py`` runs it across GPUs.

Outputs are poisoned (NaN in the memory the allocator hands back) so unwritten elements fail.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU: the Triton decode kernels run only on one", allow_module_level=True
    )
pytest.importorskip("triton", reason="needs triton: the decode kernels are written in it")

from tidal.engine_core.kernel_config import KernelConfig  # noqa: E402
from tidal.worker.kernel_policy import building, kernels_for  # noqa: E402
from tidal.worker.ops import kernels as kernels_module  # noqa: E402
from tidal.worker.ops import torch_ops  # noqa: E402
from tidal.worker.ops import triton_decode as td  # noqa: E402

DEVICE = torch.device("cuda")
# The fused ops of a GPU worker with the default kernel config (Triton ops: no extension build).
K = kernels_for(DEVICE, KernelConfig(ops="triton"))
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def _poison(nbytes: int) -> None:
    junk = torch.full((nbytes // 4 + 4096,), float("nan"), device=DEVICE)
    del junk


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _check(out, ref64, torch_out, dtype, label) -> None:
    assert torch.isfinite(out).all(), f"{label}: non-finite output (unwritten elements?)"
    err, base = _rel(out, ref64), _rel(torch_out, ref64)
    assert err < TOL[dtype] and err <= 2 * base + 1e-6, f"{label}: error {err:.3g}, torch {base:.3g}"


# ------------------------------------------------------------------------------------- GEMV

MODEL_SHAPES = [  # (N, K, silu): Qwen3-0.6B and Llama-3.1-8B decode projections
    (4096, 1024, False), (1024, 2048, False), (6144, 1024, True), (1024, 3072, False),
    (6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False),
]  # fmt: skip
VARIANTS = ["plain", "bias", "norm", "add_norm", "silu", "add_norm_silu", "gelu"]
# Every variant in bf16; the plain and the fully fused ones in every dtype (each case compiles
# its own kernels, so the grid stays small).
GEMV_CASES = [(v, torch.bfloat16) for v in VARIANTS] + [
    (v, dt) for v in ("plain", "add_norm_silu", "gelu") for dt in (torch.float16, torch.float32)
]


def _gemv_case(n, k, dtype, gen, norm, add, bias):
    def rnd(*shape):
        return torch.randn(shape, device=DEVICE, generator=gen)

    x = (rnd(1, k) * 2).to(dtype)
    w = (rnd(n, k) / k**0.5).to(dtype)
    b = rnd(n).to(dtype) if bias else None
    nw = rnd(k).to(dtype) if norm else None
    r = rnd(1, k).to(dtype) if add else None
    return x, w, b, nw, r


def _gemv_refs(x, w, b, nw, r, eps, silu, gelu=False):
    """(float64 reference, torch version in the dtype, expected new residual)."""
    if nw is None:
        h, res = x, None
    elif r is None:
        h, res = torch_ops.rms_norm(x, nw, eps), x
    else:
        h, res = torch_ops.fused_add_rms_norm(x, r, nw, eps)
    # The reference starts from the dtype's normed input (the kernel rounds it the same way).
    ref = F.linear(h.double(), w.double(), None if b is None else b.double())
    got_torch = F.linear(h, w, b)
    if silu:
        ref, got_torch = torch_ops.silu_and_mul(ref), torch_ops.silu_and_mul(got_torch)
    if gelu:
        ref, got_torch = torch_ops.gelu_tanh_and_mul(ref), torch_ops.gelu_tanh_and_mul(got_torch)
    return ref, got_torch, res


def _run_gemv(n, k, dtype, gen, variant, cfg) -> None:
    norm, add, silu = "norm" in variant, "add" in variant, "silu" in variant
    gelu = "gelu" in variant
    x, w, b, nw, r = _gemv_case(n, k, dtype, gen, norm, add, variant == "bias")
    ref, got_torch, res_ref = _gemv_refs(x, w, b, nw, r, 1e-6, silu, gelu)
    _poison(4 * (n + k))
    y, res = td.gemv(x, w, b, norm_weight=nw, residual=r, eps=1e-6, silu=silu, gelu=gelu,
                     config=cfg)
    label = f"gemv {variant} {n}x{k} {dtype} cfg={cfg}"
    assert y.shape == (1, n // 2 if silu or gelu else n), label
    _check(y, ref, got_torch, dtype, label)
    if add:
        assert torch.equal(res, res_ref), f"{label}: new residual differs"
    elif norm:
        assert res is x, label


@pytest.mark.parametrize("variant,dtype", GEMV_CASES, ids=lambda c: str(c).removeprefix("torch."))
def test_gemv_random_shapes(variant: str, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(VARIANTS.index(variant) * 7 + len(str(dtype)))
    rng = random.Random(f"{variant}{dtype}")
    pair = 2 if "silu" in variant or "gelu" in variant else 1
    cases = [
        # ragged N and K (masks on both), a non-default launch shape
        ((2 * rng.randint(1, 350) + 1) * pair, rng.randint(1, 1500) * 2 + 1, (4, 512, 4)),
        # aligned, the default launch shape
        (96 * pair, 4096, None),
        # smaller than one tile in both directions
        (3 * pair, 100, (16, 256, 8)),
    ]
    for n, k, cfg in cases:
        _run_gemv(n, k, dtype, gen, variant, cfg)


def test_gemv_model_shapes() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    for n, k, silu in MODEL_SHAPES:
        _run_gemv(n, k, torch.bfloat16, gen, "add_norm_silu" if silu else "plain", None)
        if not silu:
            _run_gemv(n, k, torch.bfloat16, gen, "add_norm", None)


def test_ops_dispatch_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Kernels.linear`` / ``Kernels.rms_norm_linear`` / ``Kernels.gated_linear`` take the
    kernel for one CUDA row and agree with the torch path; more rows stay on F.linear."""
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    dt = torch.bfloat16
    x = torch.randn((1, 512), device=DEVICE, generator=gen).to(dt)
    w = torch.randn((768, 512), device=DEVICE, generator=gen).to(dt)
    assert K.gemv_applies(x, w)
    assert not K.gemv_applies(torch.randn((2, 512), device=DEVICE, dtype=dt), w)
    assert not K.gemv_applies(x.cpu(), w.cpu())
    ref = F.linear(x.double(), w.double())
    _check(K.linear(x, w), ref, F.linear(x, w), dt, "Kernels.linear")
    nw = torch.randn(512, device=DEVICE, generator=gen).to(dt)
    r = torch.randn((1, 512), device=DEVICE, generator=gen).to(dt)
    y, res = K.rms_norm_linear(x, r, nw, 1e-6, w, silu=True)
    y_ref, res_ref = torch_ops.rms_norm_linear(x, r, nw, 1e-6, w, silu=True)
    assert y.shape == y_ref.shape == (1, 384)
    assert torch.equal(res, res_ref)
    _check(y, torch_ops.rms_norm_linear(x.double(), r.double(), nw.double(), 1e-6, w.double(),
                                        silu=True)[0], y_ref, dt, "Kernels.rms_norm_linear")
    # The gated projection: one GEMV with the activation as its epilogue, for one row.
    calls: list[dict] = []
    gemv = td.gemv
    monkeypatch.setattr(td, "gemv", lambda *a, **kw: calls.append(kw) or gemv(*a, **kw))
    for act, fn in (("silu", torch_ops.silu_and_mul), ("gelu_tanh", torch_ops.gelu_tanh_and_mul)):
        calls.clear()
        y = K.gated_linear(x, w, act)
        assert y.shape == (1, 384)
        assert len(calls) == 1 and calls[0]["gelu"] == (act == "gelu_tanh"), act
        _check(y, fn(F.linear(x.double(), w.double())), fn(F.linear(x, w)), dt,
               f"Kernels.gated_linear {act}")


# ----------------------------------------------------- q/k norm + rotary + K/V cache write


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim,norm",
                         [(16, 8, 128, True), (32, 8, 128, False), (14, 2, 64, True),
                          (4, 4, 64, False), (12, 3, 16, True), (16, 8, 256, "gemma"),
                          (8, 4, 128, "gemma")])  # fmt: skip
def test_qk_norm_rope_write_kv(dtype, heads, kv_heads, head_dim, norm) -> None:
    """``norm``: Qwen3's q/k norms (True), none, or Gemma 3's (1 + w) ones."""
    from tidal.worker.layers.rotary import build_cos_sin_cache

    gemma = norm == "gemma"
    norm = bool(norm)
    gen = torch.Generator().manual_seed(heads * head_dim + norm + gemma)
    page, blocks = 16, 64
    cs = build_cos_sin_cache(head_dim, 8192, 1e6, None).to(DEVICE)
    for t in (1, 3, 257):
        qkv = torch.randn((t, (heads + 2 * kv_heads) * head_dim), generator=gen) * 2
        qkv = qkv.to(DEVICE, dtype)
        pos = torch.randint(0, 8192, (t,), generator=gen).to(DEVICE)
        qw = torch.randn(head_dim, generator=gen).to(DEVICE, dtype) if norm else None
        kw = torch.randn(head_dim, generator=gen).to(DEVICE, dtype) if norm else None
        slots = torch.randperm(blocks * page, generator=gen)[:t]
        if t > 1:
            slots[torch.randperm(t, generator=gen)[: t // 3]] = -1  # padding tokens
        slots = slots.to(DEVICE)
        n_slots = t if t < 257 else t - 5  # a slot mapping shorter than the rows: rest skipped
        cache = torch.randn((2, blocks, page, kv_heads, head_dim), generator=gen).to(DEVICE, dtype)
        expected = cache.clone()
        args = (pos, heads, kv_heads, head_dim, qw, kw, 1e-6, cs)
        q_ref = torch_ops.qk_norm_rope_write_kv(qkv, *args, expected, slots[:n_slots],
                                                gemma_norm=gemma)
        q64 = torch_ops.qk_norm_rope_write_kv(
            qkv.double(), pos, heads, kv_heads, head_dim,
            None if qw is None else qw.double(), None if kw is None else kw.double(), 1e-6,
            cs.double(), torch.zeros((2, blocks, page, kv_heads, head_dim), dtype=torch.float64,
                                     device=DEVICE), slots[:n_slots], gemma_norm=gemma)  # fmt: skip
        _poison(qkv.numel() * 4)
        assert K.qk_norm_rope_applies(qkv, head_dim, cs, True, cache)
        q = td.qk_norm_rope_write_kv(qkv, *args, cache, slots[:n_slots], gemma_norm=gemma)
        label = f"qk_norm_rope {dtype} t={t} {heads}/{kv_heads}x{head_dim} norm={norm} " \
                f"gemma={gemma}"
        _check(q, q64, q_ref, dtype, label)
        # The cache: untouched slots bit-equal, written K within the dtype's rounding of the
        # reference, written V bit-equal.
        diff = (cache.double() - expected.double()).abs()
        tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 8e-2}[dtype]
        assert float(diff[0].max()) <= tol * max(1.0, float(expected[0].abs().max())), label
        assert torch.equal(cache[1], expected[1]), f"{label}: V cache differs"
        keep = torch.ones(blocks * page, dtype=torch.bool, device=DEVICE)
        s = slots[:n_slots]
        keep[s[s >= 0]] = False
        assert torch.equal(cache[0].reshape(blocks * page, -1)[keep],
                           expected[0].reshape(blocks * page, -1)[keep]), label


# ------------------------------------------------------------------------------------ argmax


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_argmax_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    for rows, cols in ((1, 151936), (1, 128256), (3, 5000), (16, 2049), (2, 7), (5, 32000)):
        x = torch.randn((rows, cols), generator=gen).to(DEVICE, dtype)
        if cols > 100:
            x[0, cols // 3] = x[0, cols - 1] = x[0].max() + 1  # a tie: the first wins
        if rows > 2:
            x[1, cols // 2] = float("nan")
            x[1, cols // 4] = float("nan")  # the first NaN wins
            x[2] = float("-inf")
        got = td.argmax(x)
        assert got.dtype == torch.int64
        assert torch.equal(got, x.argmax(dim=-1)), f"argmax {rows}x{cols} {dtype}"
        assert torch.equal(K.argmax(x), x.argmax(dim=-1))
    # A strided view (a slice of a wider logits buffer).
    wide = torch.randn((4, 1000), generator=gen).to(DEVICE, dtype)
    assert torch.equal(td.argmax(wide[:, :900]), wide[:, :900].argmax(dim=-1))


# ----------------------------------------------------------- attention: fused split merge


def test_fused_merge_matches_merge_kernel() -> None:
    import dataclasses

    from test_kernels_attention import TOL as ATOL
    from test_kernels_attention import make_batch, reference_out, request_errors

    from tidal.worker.ops import triton_attention_kernels as tk
    from tidal.worker.ops.attention_plan import plan_triton_attention

    rng = random.Random(4)
    # (dtype, head_dim, kv_heads, [(splits, early_v), ...]); the merge kernel path runs too.
    cases = [
        (torch.bfloat16, 128, 8, [(5, True), (16, True), (5, False)]),
        (torch.float16, 64, 2, [(5, True)]),
        (torch.float32, 128, 4, [(5, True)]),
    ]
    for dtype, head_dim, kv_heads, plans in cases:
        ctx = [rng.randint(1, 5000) for _ in range(3)] + [1, 64, 1057]
        batch = make_batch([1] * len(ctx), ctx, kv_heads, head_dim, dtype, pad_reqs=2,
                           pad_tokens=1, seed=rng.randrange(1000))  # fmt: skip
        q, kv, m = batch.query, batch.kv_cache, batch.meta
        scale = head_dim**-0.5
        ref = reference_out(batch, scale)
        base = plan_triton_attention(q.shape[0], m.num_reqs, 1, q.shape[1], kv_heads, head_dim,
                                     dtype, DEVICE)  # fmt: skip
        n = sum(batch.q_lens)
        for splits, early_v in plans:
            plan = dataclasses.replace(base, num_splits=splits, early_v=early_v)
            outs = []
            for fused in (True, False, True):  # fused twice: the counters must re-arm
                out = torch.full_like(q, float("nan"))
                tk.paged_attention(q, kv[0], kv[1], m.block_table, m.seq_lens,
                                   m.query_start_loc, m.num_reqs, scale, out, plan,
                                   fused_merge=fused)  # fmt: skip
                torch.cuda.synchronize()
                label = (f"{dtype} d{head_dim} kv{kv_heads} splits={splits} early_v={early_v} "
                         f"fused={fused}")  # fmt: skip
                worst = max(request_errors(out, ref, batch))
                assert worst < ATOL[dtype], f"{label}: worst error {worst:.3g}"
                outs.append(out)
            assert torch.equal(outs[0][:n], outs[2][:n]), "fused merge not repeatable"
            counters = tk._COUNTERS.get(q.device)
            assert counters is not None and int(counters.abs().sum()) == 0, "counters left armed"


def test_time_stamps_are_ordered_and_change_no_result() -> None:
    """The kernel time stamps of tools/bench_decode_chain.py (rotary + K/V write, split
    attention, merge): every program's stamps in program order, each kernel past its wait
    only after the kernel before it issued its last store (the dependent-launch wait holds),
    and the same outputs, bit for bit, as the kernels built without stamps."""
    from test_kernels_attention import NUM_HEADS, make_batch

    from tidal.worker.layers.rotary import build_cos_sin_cache
    from tidal.worker.ops import triton_attention_kernels as tk
    from tidal.worker.ops.attention_plan import plan_triton_attention
    from tidal.worker.ops.triton_probe import STAMPS

    kv_heads, d, ctx = 4, 128, 300
    batch = make_batch([1], [ctx], kv_heads, d, torch.bfloat16, seed=9)
    m = batch.meta
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    qkv = torch.randn((1, (NUM_HEADS + 2 * kv_heads) * d), device=DEVICE,
                      generator=gen).to(torch.bfloat16)
    cs = build_cos_sin_cache(d, 4096, 5e5, None).to(DEVICE)
    pos = torch.tensor([ctx - 1], device=DEVICE)
    plan = plan_triton_attention(1, 1, 1, NUM_HEADS, kv_heads, d, torch.bfloat16, DEVICE)
    assert plan.num_splits > 1, "the split path (preload, merge kernel) is what is stamped"
    programs = kv_heads * plan.num_splits
    outs = []
    for stamped in (False, True):
        cache = batch.kv_cache.clone()
        rope_t = torch.zeros((1, STAMPS), dtype=torch.int64, device=DEVICE)
        attn_t = torch.zeros((programs, STAMPS), dtype=torch.int64, device=DEVICE)
        merge_t = torch.zeros((NUM_HEADS, STAMPS), dtype=torch.int64, device=DEVICE)
        q = td.qk_norm_rope_write_kv(qkv, pos, NUM_HEADS, kv_heads, d, None, None, 1e-6, cs,
                                     cache, m.slot_mapping, times=rope_t if stamped else None)
        out = torch.full_like(q, float("nan"))
        tk.paged_attention(q, cache[0], cache[1], m.block_table, m.seq_lens, m.query_start_loc,
                           1, d**-0.5, out, plan,
                           times=(attn_t, merge_t) if stamped else None)  # fmt: skip
        torch.cuda.synchronize()
        outs.append((q, out, cache))
    for a, b in zip(*outs):  # (the cache holds NaN outside the contexts)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                   msg="the stamped kernels computed something else")
    assert torch.isfinite(outs[1][1]).all()
    r, a, g = rope_t.cpu(), attn_t.cpu(), merge_t.cpu()
    assert (r[0, 0] <= r[0, 1] <= r[0, 4]) and int(r[0, 0]) > 0
    # entry, past the wait, query loaded, preloaded tile landed, newest reloaded, math done,
    # stores issued: in program order in every attention program.
    order = a[:, [0, 1, 2, 5, 6, 3, 4]]
    assert (order[:, 1:] >= order[:, :-1]).all() and (order > 0).all(), order
    assert (g[:, 1] >= g[:, 0]).all() and (g[:, 4] >= g[:, 1]).all()
    # Programmatic dependent launch: resident early, but past the wait only once the kernel
    # before has completed.
    assert int(a[:, 1].min()) >= int(r[0, 4])
    assert int(g[:, 1].min()) >= int(a[:, 4].max())


def test_lm_head_takes_the_gemv_only_for_tuned_shapes(monkeypatch) -> None:
    """The LM head of a one-row decode step runs the GEMV kernel where its weight's shape has a
    measured launch shape (matching the float64 product as well as cuBLAS does), and cuBLAS
    (``F.linear``, bit for bit) for untuned shapes and for several rows."""
    from tidal.worker.layers.embedding import ParallelLMHead

    gen = torch.Generator(device=DEVICE).manual_seed(5)
    vocab, hidden = 1000, 256
    with building(K):  # the head takes its ops from the model build's kernels
        head = ParallelLMHead(vocab, hidden, torch.bfloat16).to(DEVICE)
    head.weight.data.copy_(torch.randn(vocab, hidden, generator=gen, device=DEVICE) * 0.05)
    x = torch.randn(1, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    ref64 = x.double() @ head.weight.double().T
    assert not K.gemv_tuned(x, head.weight)
    assert torch.equal(head.compute_logits(x), F.linear(x, head.weight))
    calls = []
    real_gemv = td.gemv
    monkeypatch.setattr(td, "gemv", lambda *a, **k: calls.append(1) or real_gemv(*a, **k))
    monkeypatch.setitem(td.GEMV_CONFIGS, (vocab, hidden, False, 2), (4, 256, 4, 1))
    assert K.gemv_tuned(x, head.weight)
    got = head.compute_logits(x)
    assert calls, "the tuned shape did not run the GEMV"
    _check(got, ref64, F.linear(x, head.weight), torch.bfloat16, "LM head GEMV")
    rows = torch.randn(2, hidden, generator=gen, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(head.compute_logits(rows), F.linear(rows, head.weight))


# ------------------------------------------- programmatic dependent launch: kernel chains


def test_decode_chain_in_cuda_graph() -> None:
    """A batch-1 decode layer stack built from the kernels above (norm+GEMV, q/k norm + rotary +
    K/V write, split attention and its merge, GEMV, norm+gate/up+SiLU GEMV, GEMV), run
    eagerly and replayed from a CUDA graph: both must match the torch ops. With programmatic
    dependent launch on (Hopper), each kernel starts while its predecessor runs and prefetches
    its weights, so a misplaced wait shows up here as a wrong or unstable result."""
    from test_kernels_attention import make_batch

    from tidal.worker.attention.torch_backend import paged_attention_reference
    from tidal.worker.attention.triton_attn import TritonAttention
    from tidal.worker.layers.rotary import build_cos_sin_cache

    gen = torch.Generator(device=DEVICE).manual_seed(21)
    dt, hidden, heads, kv_heads, d, ffn, layers = torch.bfloat16, 512, 16, 4, 64, 1024, 6

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, device=DEVICE, generator=gen) * scale).to(dt)

    w = [dict(ln1=rnd(hidden) + 1, qkv=rnd((heads + 2 * kv_heads) * d, hidden, scale=0.05),
              qn=rnd(d) + 1, kn=rnd(d) + 1, o=rnd(hidden, heads * d, scale=0.05),
              ln2=rnd(hidden) + 1, gu=rnd(2 * ffn, hidden, scale=0.05),
              down=rnd(hidden, ffn, scale=0.03)) for _ in range(layers)]  # fmt: skip
    cs = build_cos_sin_cache(d, 4096, 1e6, None).to(DEVICE)
    batch = make_batch([1], [700], kv_heads, d, dt, seed=2)
    caches = [batch.kv_cache.clone() for _ in range(layers)]
    meta = batch.meta
    attn = TritonAttention()
    pos = torch.tensor([699], device=DEVICE)
    x0 = rnd(1, hidden)

    def forward(fused: bool, kv: list[torch.Tensor], f64: bool = False) -> torch.Tensor:
        h, res = (x0.double() if f64 else x0 * 1), None
        for lw, cache in zip(w, kv):
            if f64:
                lw = {k: v.double() for k, v in lw.items()}
            if fused:
                qkv, res = td.gemv(h, lw["qkv"], norm_weight=lw["ln1"], residual=res, eps=1e-6)
                res = h if res is None else res
                q = td.qk_norm_rope_write_kv(qkv, pos, heads, kv_heads, d, lw["qn"], lw["kn"],
                                             1e-6, cs, cache, meta.slot_mapping)  # fmt: skip
            else:
                qkv, res = torch_ops.rms_norm_linear(h, res, lw["ln1"], 1e-6, lw["qkv"])
                q = torch_ops.qk_norm_rope_write_kv(qkv, pos, heads, kv_heads, d, lw["qn"],
                                                    lw["kn"], 1e-6, cs, cache, meta.slot_mapping)
            out = torch.empty_like(q)
            if fused:
                attn.forward(q, cache, meta, d**-0.5, out)
            else:
                paged_attention_reference(q, cache, meta, d**-0.5, out)
            o = out.view(1, -1)
            if fused:
                a, _ = td.gemv(o, lw["o"])
                g, res = td.gemv(a, lw["gu"], norm_weight=lw["ln2"], residual=res, eps=1e-6,
                                 silu=True)  # fmt: skip
                h, _ = td.gemv(g, lw["down"])
            else:
                a = F.linear(o, lw["o"])
                g, res = torch_ops.rms_norm_linear(a, res, lw["ln2"], 1e-6, lw["gu"], silu=True)
                h = F.linear(g, lw["down"])
        return torch.cat([h, res], dim=-1)

    ref64 = forward(False, [c.double() for c in caches], f64=True)
    ref = forward(False, [c.clone() for c in caches])
    slot = int(meta.slot_mapping[0])

    def poison_new_slot(kv: list[torch.Tensor]) -> None:
        # The newest position's K/V as NaN until the rotary kernel writes it: attention, which
        # loads its first tile before the dependent-launch wait, must take that position
        # from after the write (a stale read would turn the output into NaN).
        for cache in kv:
            cache.view(2, -1, kv_heads, d)[:, slot] = float("nan")

    eager_kv = [c.clone() for c in caches]
    poison_new_slot(eager_kv)
    eager = forward(True, eager_kv)
    # Six layers of bf16 activations: torch's own error grows too; judge against it.
    err, base = _rel(eager, ref64), _rel(ref, ref64)
    assert torch.isfinite(eager).all() and err < 5e-2 and err <= 2 * base + 1e-3, (
        f"eager chain: error {err:.3g}, torch {base:.3g}")
    graph_kv = [c.clone() for c in caches]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(True, graph_kv)
    results = []
    for _ in range(5):
        poison_new_slot(graph_kv)
        graph.replay()
        torch.cuda.synchronize()
        results.append(out.clone())
    for i, r in enumerate(results):
        assert torch.equal(r, eager), f"graph replay {i} differs from the eager run"
    for a, b in zip(graph_kv, eager_kv):  # (NaN marks the cache slots outside the context)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True,
                                   msg="K/V written differently in the graph")


# ------------------------------------- all-reduce fused into the GEMVs (push / partial sums)


def _simulated_ranks(world: int, slots: int, hidden: int, dtype: torch.dtype):
    """Every rank's partial-sum slots, armed with the sentinel, on one GPU: the kernels only
    see addresses, so ``world`` ranks can share a device (and one stream)."""
    data = torch.full((world, slots, world, hidden), td.SENTINEL, dtype=torch.int16,
                      device=DEVICE)
    data_ptrs = torch.tensor([data[r].data_ptr() for r in range(world)], device=DEVICE)

    def push(rank: int, slot: int) -> td.PushArgs:
        return td.PushArgs(data_ptrs, (slot * world + rank) * hidden, world)

    def parts(rank: int, slot: int) -> td.PartsArgs:
        return td.PartsArgs(data[rank, slot].view(dtype),
                            data[rank, (slot - 1) % slots].view(dtype).view(-1))

    return data, push, parts


def _as_pushed(rows: torch.Tensor) -> torch.Tensor:
    """The bits a producer sends for ``rows``: negative zero goes as positive zero."""
    bits = rows.view(torch.int16).clone()
    bits[bits == td.SENTINEL] = 0
    return bits


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_pushed_rows_summed_by_the_next_gemv(world: int, dtype: torch.dtype) -> None:
    """Each simulated rank's row-parallel GEMV pushes its rows to every rank; then each rank's
    consumers (``sum_parts``, alone and with the residual add and the norm's sums of squares,
    and the norm + residual GEMV with ``parts``) see exactly the sum of
    the plain GEMVs' rows, summed in rank order, and put the sentinel back into the slot before.
    Three rounds over three slots; one call's rows are all zeros (a zero input), and any
    negative zero must arrive as +0 (the sentinel is negative zero's bit pattern)."""
    gen = torch.Generator(device=DEVICE).manual_seed(world)
    hidden, k_in, n_next, slots = 1000, 384, 768, 3  # ragged against every block size

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, device=DEVICE, generator=gen) * scale).to(dtype)

    data, push, parts = _simulated_ranks(world, slots, hidden, dtype)
    w_next, nw = rnd(n_next, hidden, scale=0.05), rnd(hidden) + 1
    for rnd_no in range(3):
        for slot in range(slots):
            xs = [rnd(1, k_in) for _ in range(world)]
            ws = [rnd(hidden, k_in, scale=0.05) for _ in range(world)]
            if rnd_no == 1 and slot == 1:
                xs[0] = torch.zeros_like(xs[0])
            for r in range(world):
                td.gemv(xs[r], ws[r], push=push(r, slot))
            torch.cuda.synchronize()
            rows = torch.cat([td.gemv(xs[r], ws[r])[0] for r in range(world)])
            label = f"round {rnd_no} slot {slot}"
            total = rows.float().sum(0, keepdim=True).to(dtype)
            residual = rnd(1, hidden)
            ref_y, ref_res = td.gemv(total, w_next, norm_weight=nw, residual=residual, eps=1e-6)
            for r in range(world):
                assert torch.equal(data[r, slot], _as_pushed(rows)), f"{label}: rank {r}'s rows"
            ss = torch.full((4,), float("nan"), device=DEVICE)
            for r in range(world):
                got = td.sum_parts(parts(r, slot))
                assert torch.equal(got, total), f"{label}: sum, rank {r}"
                got = td.sum_parts(parts(r, slot), residual, ss)
                assert torch.equal(got, ref_res), f"{label}: sum + residual, rank {r}"
                want_ss = F.pad(ref_res.float().pow(2), (0, 24)).view(2, 512).sum(1)
                torch.testing.assert_close(ss[:2], want_ss, rtol=1e-5, atol=1e-3)
                assert bool(ss[2:].isnan().all()), f"{label}: statistics past the blocks"
                y, res = td.gemv(total, w_next, norm_weight=nw, residual=residual, eps=1e-6,
                                 parts=parts(r, slot))
                assert torch.equal(res, ref_res) and torch.equal(y, ref_y), f"{label}: rank {r}"
            torch.cuda.synchronize()
            before = (slot - 1) % slots
            assert bool((data[:, before] == td.SENTINEL).all()), f"{label}: slot before not armed"
            assert not bool((data[:, slot] == td.SENTINEL).any()), f"{label}: own slot erased"


def test_pushed_rows_in_cuda_graph() -> None:
    """A cycle of three slots (push, then the norm GEMV consumer) captured once and replayed:
    each replay's consumers wait for that replay's rows, and the slots re-arm in turn."""
    world, hidden, k_in, n_next, slots, dtype = 2, 512, 256, 384, 3, torch.bfloat16
    gen = torch.Generator(device=DEVICE).manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(shape, device=DEVICE, generator=gen) * scale).to(dtype)

    xs = [[rnd(1, k_in) for _ in range(world)] for _ in range(slots)]
    ws = [[rnd(hidden, k_in, scale=0.05) for _ in range(world)] for _ in range(slots)]
    w_next, nw, residual = rnd(n_next, hidden, scale=0.05), rnd(hidden) + 1, rnd(1, hidden)
    data, push, parts = _simulated_ranks(world, slots, hidden, dtype)

    def cycle():
        outs = []
        for s in range(slots):
            for r in range(world):
                td.gemv(xs[s][r], ws[s][r], push=push(r, s))
            outs.append([td.gemv(residual, w_next, norm_weight=nw, residual=residual, eps=1e-6,
                                 parts=parts(r, s))[0] for r in range(world)])
        return outs

    cycle()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = cycle()
    for i in range(4):
        for per_slot in xs:
            for x in per_slot:
                x.copy_(rnd(1, k_in))
        graph.replay()
        torch.cuda.synchronize()
        for s in range(slots):
            total = sum(td.gemv(xs[s][r], ws[s][r])[0].float() for r in range(world)).to(dtype)
            want = td.gemv(total, w_next, norm_weight=nw, residual=residual, eps=1e-6)[0]
            for r in range(world):
                assert torch.equal(outs[s][r], want), f"replay {i}, slot {s}, rank {r}"
        assert bool((data[:, :slots - 1] == td.SENTINEL).all()), f"replay {i}: not re-armed"


@pytest.mark.parametrize("variant", ["plain", "add_norm_silu", "norm"])
def test_gemv_two_chunks_prefetched_is_bit_exact(variant: str) -> None:
    """Fetching the second weight chunk before the dependent-launch wait changes when it is
    loaded, not the arithmetic: the same bits as the one-chunk kernel."""
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    norm, add, silu = "norm" in variant, "add" in variant, "silu" in variant
    for n, k, cfg in ((96 * (2 if silu else 1), 4096, (4, 1024, 4)),
                      (2 * 77, 2 * 1000 + 3, (2, 512, 4)), (8, 300, (8, 256, 4))):
        x, w, b, nw, r = _gemv_case(n, k, torch.bfloat16, gen, norm, add, False)
        one, res1 = td.gemv(x, w, norm_weight=nw, residual=r, eps=1e-6, silu=silu, config=cfg)
        two, res2 = td.gemv(x, w, norm_weight=nw, residual=r, eps=1e-6, silu=silu, config=cfg,
                            prefetch=2)
        assert torch.equal(one, two), f"{variant} {n}x{k} {cfg}"
        if add:
            assert torch.equal(res1, res2)


@pytest.mark.parametrize("silu", [False, True])
def test_gemv_norm_from_sums_of_squares(silu: bool) -> None:
    """``norm_ss``: the RMSNorm statistics come in as partial sums of squares (zero-padded to
    a power of two) instead of from the row; the result is the prologue norm's, up to the order
    in which the squares were summed."""
    gen = torch.Generator(device=DEVICE).manual_seed(13)
    for n, k, parts in ((96 * (2 if silu else 1), 4096, 8), (2 * 50, 1000, 2), (6, 3000, 8)):
        x, w, _, nw, _ = _gemv_case(n, k, torch.bfloat16, gen, True, False, False)
        sq = x.float().pow(2).view(-1)
        bounds = torch.linspace(0, k, 4).long().tolist()  # three uneven partial sums
        ss = torch.zeros(parts, device=DEVICE)
        for i in range(3 if parts > 2 else 1):
            ss[i] = sq[bounds[i]: bounds[i + 1]].sum() if parts > 2 else sq.sum()
        ref, got_torch, _ = _gemv_refs(x, w, None, nw, None, 1e-6, silu)
        y, same = td.gemv(x, w, norm_weight=nw, eps=1e-6, silu=silu, norm_ss=ss, prefetch=2)
        _check(y, ref, got_torch, torch.bfloat16, f"norm_ss {n}x{k}")
        assert same is x
    with pytest.raises(ValueError, match="norm_ss"):
        td.gemv(x, w, norm_weight=nw, residual=x, norm_ss=ss)


def _close(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """The sum of squares is reduced in another order than torch's ``mean``, so the 1/RMS can
    differ in its last float32 bit: the normed value rounds one unit in the last place off,
    which the weight scales and the product rounds again (at most two units of the result). In
    float32 nothing rounds in between: there the sums of 4096 squares may differ by more than
    a unit, and so may most elements."""
    ulp = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(1e-3)
    if want.dtype == torch.float32:
        ulp = ulp * 64
    bad = (got.float() - want.float()).abs() > 2 * ulp
    assert not bool(bad.any()), f"{label}: {int(bad.sum())} elements off by more than allowed"
    if want.dtype != torch.float32:
        assert float((got == want).float().mean()) > 0.98, f"{label}: many rounding differences"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_row(dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    for n in (4096, 1536, 3, 16384):
        x, r = (torch.randn(2, 1, n, generator=gen, device=DEVICE) * 3).to(dtype)
        w = torch.randn(n, generator=gen, device=DEVICE).to(dtype)
        _poison(16 * n)
        y, new_res = td.add_rms_norm_row(x, r, w, 1e-5)
        want_y, want_res = torch_ops.fused_add_rms_norm(x, r, w, 1e-5)
        assert torch.equal(new_res, want_res), n
        _close(y, want_y, f"{n} with residual")
        y, same = td.add_rms_norm_row(x, None, w, 1e-5)
        assert same is x, n
        _close(y, torch_ops.rms_norm(x, w, 1e-5), f"{n} without residual")
    with pytest.raises(ValueError, match="one row"):
        td.add_rms_norm_row(torch.ones(2, 8, device=DEVICE, dtype=dtype), None, w[:8], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_rows(dtype: torch.dtype) -> None:
    """The same kernel over a few rows (one program each), strided inputs included."""
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    for rows, n in ((4, 4096), (3, 1000), (8, 16384)):
        x, r = (torch.randn(2, rows, n, generator=gen, device=DEVICE) * 3).to(dtype)
        w = torch.randn(n, generator=gen, device=DEVICE).to(dtype)
        _poison(16 * rows * n)
        y, new_res = td.add_rms_norm_rows(x, r, w, 1e-5)
        want_y, want_res = torch_ops.fused_add_rms_norm(x, r, w, 1e-5)
        assert y.shape == x.shape and torch.equal(new_res, want_res), (rows, n)
        _close(y, want_y, f"{rows}x{n} with residual")
        wide = torch.randn(rows, 2 * n, generator=gen, device=DEVICE).to(dtype)[:, :n]
        y, same = td.add_rms_norm_rows(wide, None, w, 1e-5)  # rows 2n apart
        assert same is wide
        _close(y, torch_ops.rms_norm(wide, w, 1e-5), f"{rows}x{n} strided, no residual")


def test_kernels_add_rms_norm_row_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Kernels.add_rms_norm_row`` (a MoE layer's norm before its router): one 16-bit row in
    the one-row kernel (new tensors, the inputs untouched), anything else the fused add + norm,
    both ``torch_ops.fused_add_rms_norm``'s result."""
    taken = []
    one_row = td.add_rms_norm_row
    monkeypatch.setattr(td, "add_rms_norm_row",
                        lambda *a: taken.append(a[0].dtype) or one_row(*a))
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    for rows, dtype in ((1, torch.bfloat16), (1, torch.float32), (3, torch.bfloat16)):
        x, r = (torch.randn(2, rows, 2048, generator=gen, device=DEVICE) * 3).to(dtype)
        w = torch.randn(2048, generator=gen, device=DEVICE).to(dtype)
        want_y, want_res = torch_ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
        x0, r0 = x.clone(), r.clone()
        y, res = K.add_rms_norm_row(x, r, w, 1e-6)
        assert torch.equal(res, want_res), (rows, dtype)
        _close(y, want_y, f"{rows} rows of {dtype}")
        if rows == 1 and dtype == torch.bfloat16:
            assert torch.equal(x, x0) and torch.equal(r, r0)
    assert taken == [torch.bfloat16]  # the one-row kernel for the one 16-bit row only


@pytest.mark.parametrize("silu", [False, True])
def test_norm_apart_from_large_gemvs(monkeypatch: pytest.MonkeyPatch, silu: bool) -> None:
    """``Kernels.rms_norm_linear`` before a weight of ``NORM_APART_MIN_WEIGHTS`` or more: the
    one-row norm kernel, then the plain GEMV; the same result as the prologue path up to the norm's
    summation order, and the same new residual."""
    gen = torch.Generator(device=DEVICE).manual_seed(17)
    x, w, _, nw, r = _gemv_case(256 * (2 if silu else 1), 2048, torch.bfloat16, gen, True, True,
                                False)
    monkeypatch.setattr(kernels_module, "NORM_APART_MIN_WEIGHTS", 1 << 40)
    y0, res0 = K.rms_norm_linear(x, r, nw, 1e-6, w, silu=silu)
    monkeypatch.setattr(kernels_module, "NORM_APART_MIN_WEIGHTS", 0)
    y1, res1 = K.rms_norm_linear(x, r, nw, 1e-6, w, silu=silu)
    assert torch.equal(res0, res1)
    ref, got_torch, _ = _gemv_refs(x, w, None, nw, r, 1e-6, silu)
    _check(y1, ref, got_torch, torch.bfloat16, "norm apart")
    _check(y0, ref, got_torch, torch.bfloat16, "norm in the prologue")
