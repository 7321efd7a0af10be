"""The few-row GEMV (``ops.triton_gemv_rows``: 2 to 8 rows on the tensor cores) against a
float64 reference, and the ops' dispatch to it (``Kernels.linear``, ``gated_linear``,
``rms_norm_linear``, the LM head): rows 2-16 over random shapes (ragged N and K, bias, SiLU and
tanh-GELU epilogues, bf16 and fp16), every launch shape of the table, inside a CUDA graph; and
which calls take it (measured shapes, 2-8 rows, the policy on) and which stay on cuBLAS.

Outputs are poisoned (NaN in the memory the allocator hands back) so unwritten elements fail.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: the few-row GEMV is a Triton kernel that runs only on one",
                allow_module_level=True)
pytest.importorskip("triton", reason="needs triton: the few-row GEMV is written in it")

from tidal.engine_core.kernel_config import KernelConfig  # noqa: E402
from tidal.worker.kernel_policy import kernels_for  # noqa: E402
from tidal.worker.ops import torch_ops  # noqa: E402
from tidal.worker.ops import triton_gemv_rows as tr  # noqa: E402

DEVICE = torch.device("cuda")
HOPPER = (9, 0) <= torch.cuda.get_device_capability() < (10, 0)
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3}
ACTS = {None: None, "silu": torch_ops.silu_and_mul, "gelu_tanh": torch_ops.gelu_tanh_and_mul}


def _poison(nbytes: int) -> None:
    junk = torch.full((nbytes // 4 + 4096,), float("nan"), device=DEVICE)
    del junk


def _reference(x, w, bias, act):
    """float64 reference, and torch's own result in the dtype (its rounding error)."""
    y64 = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    y = F.linear(x, w, bias)
    fn = ACTS[act]
    return (y64, y) if fn is None else (fn(y64), fn(y))


def _check(out, ref64, torch_out, dtype, label) -> None:
    assert torch.isfinite(out).all(), f"{label}: non-finite output (unwritten elements?)"
    err = float((out.double() - ref64).norm() / ref64.norm())
    base = float((torch_out.double() - ref64).norm() / ref64.norm())
    assert err < TOL[dtype] and err <= 2 * base + 1e-6, \
        f"{label}: error {err:.3g}, torch {base:.3g}"


def _operands(gen, m, n, k, act, bias, dtype):
    """Random weight ([2n, k] for a gated ``act``), input [m, k] and bias (or None), and the
    output's memory poisoned."""
    w = (torch.randn((2 * n if act else n, k), device=DEVICE, generator=gen) / k ** 0.5
         ).to(dtype)
    x = torch.randn((m, k), device=DEVICE, generator=gen).to(dtype)
    b = torch.randn(n, device=DEVICE, generator=gen).to(dtype) if bias else None
    _poison(m * n * 2)
    return w, x, b


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("act", list(ACTS), ids=str)
@pytest.mark.parametrize("pdl_dot", [False, True], ids=["plain", "pdl"])
def test_random_shapes(dtype, act, pdl_dot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tr, "PDL_DOT", pdl_dot)
    rng = random.Random(hash((str(dtype), act)) & 0xFFFF)
    gen = torch.Generator(device=DEVICE).manual_seed(rng.randrange(1 << 30))
    for case in range(6):
        m = rng.choice([2, 3, 4, 5, 8, 16])
        n, k = rng.randrange(1, 700), rng.randrange(1, 1500)
        bias = act is None and case % 2 == 1
        w, x, b = _operands(gen, m, n, k, act, bias, dtype)
        out = tr.gemv_rows(x, w, b, act=act)
        assert out.shape == (m, n)
        _check(out, *_reference(x, w, b, act), dtype, f"{m}x{k} @ {n}x{k} {act} bias={bias}")


@pytest.mark.parametrize("config", [tr.FmaLaunch(2, 512, 4, 1), tr.FmaLaunch(4, 512, 4, 2),
                                    tr.FmaLaunch(8, 1024, 8, 2)], ids=str)
def test_elementwise_kernel_random_shapes(config) -> None:
    """The elementwise kernel (``FmaLaunch``) over 2-8 rows, ragged N and K (masked tiles, a
    K shorter than two chunks), bias and both gated epilogues; 16 rows fall back to the
    tensor-core kernel."""
    rng = random.Random(config.block_n)
    gen = torch.Generator(device=DEVICE).manual_seed(rng.randrange(1 << 30))
    dt = torch.bfloat16
    for case, act in enumerate((None, "silu", "gelu_tanh", None, None, "silu")):
        m = (2, 3, 4, 8, 16, 5)[case]
        n, k = rng.randrange(1, 700), rng.choice([rng.randrange(1, 1500), 2048])
        bias = case == 3
        w, x, b = _operands(gen, m, n, k, act, bias, dt)
        out = tr.gemv_rows(x, w, b, act=act, config=config)
        assert out.shape == (m, n)
        _check(out, *_reference(x, w, b, act), dt, f"{config} {m}x{k} @ {n}x{k} {act}")


@pytest.mark.parametrize("split", [2, 3, 8])
@pytest.mark.parametrize("pdl_dot", [False, True], ids=["plain", "pdl"])
def test_split_k(split, pdl_dot, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tensor-core kernel with K split over several programs per tile (partial sums in the
    workspace, the tile's last program adding them in order): right for ragged shapes (slices
    of K that end mid-chunk or hold nothing), bitwise the same run after run, back to back in a
    CUDA graph (each tile's counter back at zero after every call)."""
    monkeypatch.setattr(tr, "PDL_DOT", pdl_dot)
    rng = random.Random(split)
    gen = torch.Generator(device=DEVICE).manual_seed(rng.randrange(1 << 30))
    dt = torch.bfloat16
    for case, act in enumerate((None, "silu", None, "gelu_tanh")):
        m = (4, 2, 8, 3)[case]
        n, k = rng.randrange(1, 700), rng.choice([rng.randrange(1, 1500), 4096])
        bias = case == 2
        cfg = (32, 128, 4, 3, split)
        w, x, b = _operands(gen, m, n, k, act, bias, dt)
        out = tr.gemv_rows(x, w, b, act=act, config=cfg)
        _check(out, *_reference(x, w, b, act), dt, f"split {split} {m}x{k} @ {n}x{k} {act}")
        assert torch.equal(out, tr.gemv_rows(x, w, b, act=act, config=cfg)), "not repeatable"
    w = (torch.randn((1024, 2048), device=DEVICE, generator=gen) / 45).to(dt)
    w2 = (torch.randn((512, 1024), device=DEVICE, generator=gen) / 32).to(dt)
    x = torch.randn((4, 2048), device=DEVICE, generator=gen).to(dt)
    cfg = (32, 128, 4, 3, split)
    tr.gemv_rows(tr.gemv_rows(x, w, config=cfg), w2, config=cfg)  # compiled outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = tr.gemv_rows(x, w, config=cfg)
        out = tr.gemv_rows(h, w2, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn((4, 2048), device=DEVICE, generator=gen).to(dt))
        graph.replay()
        torch.cuda.synchronize()
        _check(h, *_reference(x, w, None, None), dt, "graph replay, first")
        assert torch.equal(out, tr.gemv_rows(h, w2, config=cfg)), "second in the graph"
    assert not tr._split_ws[(DEVICE.type, torch.cuda.current_device())][1].any()


# Each launch shape of the table with the kind of weight it serves (a gated one reads two tiles
# per pipeline stage: the plain weights' deepest shapes would not fit the shared memory), and
# the default with both.
LAUNCH_CASES = sorted({(cfg, gated) for (_, _, gated), cfg in tr.ROWS_CONFIGS.items()}
                      | {(tr.DEFAULT_CONFIG, False), (tr.DEFAULT_CONFIG, True)})


@pytest.mark.skipif(not HOPPER, reason="the launch shapes were chosen for (and fit) a Hopper "
                                       "SM's shared memory; the policy runs them there only")
@pytest.mark.parametrize("config,gated", LAUNCH_CASES)
def test_every_launch_shape(config, gated) -> None:
    """Each launch shape on a ragged shape (partial tiles in N and K) and a tuned-size one, as
    a [batch, seq, K] input too."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    dt = torch.bfloat16
    act = "silu" if gated else None
    for n, k in ((1000, 777), (300, 4096)):
        w = (torch.randn((2 * n if act else n, k), device=DEVICE, generator=gen) / k ** 0.5
             ).to(dt)
        x = torch.randn((2, 2, k), device=DEVICE, generator=gen).to(dt)
        out = tr.gemv_rows(x, w, act=act, config=config)
        assert out.shape == (2, 2, n)
        _check(out, *_reference(x, w, None, act), dt, f"{config} {n}x{k} {act}")


@pytest.mark.parametrize("config,pdl_dot", [(None, False), (None, True),
                                            (tr.FmaLaunch(4, 256, 4, 2), False)], ids=str)
def test_in_a_cuda_graph(config, pdl_dot, monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured and replayed, back to back with itself (the first weight chunk prefetched
    under programmatic dependent launch, where the device has it: the elementwise kernel's
    always, the tensor-core one's with ``PDL_DOT``)."""
    monkeypatch.setattr(tr, "PDL_DOT", pdl_dot)
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    dt = torch.bfloat16
    w = (torch.randn((768, 512), device=DEVICE, generator=gen) / 512 ** 0.5).to(dt)
    w2 = (torch.randn((256, 384), device=DEVICE, generator=gen) / 384 ** 0.5).to(dt)
    x = torch.randn((4, 512), device=DEVICE, generator=gen).to(dt)
    tr.gemv_rows(tr.gemv_rows(x, w, act="silu", config=config), w2, config=config)  # compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        h = tr.gemv_rows(x, w, act="silu", config=config)
        out = tr.gemv_rows(h, w2, config=config)
    for _ in range(2):
        x.copy_(torch.randn((4, 512), device=DEVICE, generator=gen).to(dt))
        graph.replay()
        torch.cuda.synchronize()
        h_ref = tr.gemv_rows(x, w, act="silu", config=config)
        _check(h, *_reference(x, w, None, "silu"), dt, "graph replay, first")
        assert torch.equal(out, tr.gemv_rows(h_ref, w2, config=config)), "second in the graph"


def test_bad_arguments_raise() -> None:
    w = torch.zeros((64, 32), device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="at most 16 rows"):
        tr.gemv_rows(torch.zeros((17, 32), device=DEVICE, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="unknown gated activation"):
        tr.gemv_rows(torch.zeros((2, 32), device=DEVICE, dtype=torch.bfloat16), w, act="relu")


@pytest.mark.skipif(not HOPPER, reason="the policy runs the few-row GEMV on Hopper only "
                                       "(where its launch shapes were measured)")
@pytest.mark.parametrize("pdl_dot", [False, True], ids=["plain", "pdl"])
def test_dispatch(pdl_dot, monkeypatch: pytest.MonkeyPatch) -> None:
    """2-8 rows of a measured shape take the kernel in every op that can; 1 row takes the
    one-row GEMV, 9 rows, an unmeasured shape or the policy off stay on cuBLAS. With
    ``PDL_DOT`` the norm before it is the Triton one (rounded the same: the residual exact)."""
    # (``kernels_for`` sets the module's PDL_DOT from the policy: restored after the test.)
    monkeypatch.setattr(tr, "PDL_DOT", tr.PDL_DOT)
    K = kernels_for(DEVICE, KernelConfig(ops="triton", gemv_rows_pdl=pdl_dot))
    off = kernels_for(DEVICE, KernelConfig(ops="triton", gemv_rows=False))
    assert K.policy.gemv_rows and not off.policy.gemv_rows
    assert K.policy.gemv_rows_pdl == pdl_dot and tr.PDL_DOT == pdl_dot
    calls: list[str | None] = []
    real = tr.gemv_rows
    monkeypatch.setattr(tr, "gemv_rows",
                        lambda *a, **kw: calls.append(kw.get("act")) or real(*a, **kw))
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    dt = torch.bfloat16
    w = (torch.randn((4096, 4096), device=DEVICE, generator=gen) / 64).to(dt)  # measured
    wg = (torch.randn((2 * 14336, 4096), device=DEVICE, generator=gen) / 64).to(dt)
    odd = (torch.randn((4000, 4096), device=DEVICE, generator=gen) / 64).to(dt)  # not
    nw = torch.randn(4096, device=DEVICE, generator=gen).to(dt)
    for rows in (2, 4, 8):
        x = torch.randn((rows, 4096), device=DEVICE, generator=gen).to(dt)
        calls.clear()
        _check(K.linear(x, w), *_reference(x, w, None, None), dt, f"linear {rows}")
        _check(K.gated_linear(x, wg, "silu"), *_reference(x, wg, None, "silu"), dt,
               f"gated_linear {rows}")
        r = torch.randn_like(x)
        y, res = K.rms_norm_linear(x, r, nw, 1e-6, wg, silu=True)
        y_ref, res_ref = torch_ops.rms_norm_linear(x, r, nw, 1e-6, wg, silu=True)
        assert torch.equal(res, res_ref)
        _check(y, torch_ops.rms_norm_linear(x.double(), r.double(), nw.double(), 1e-6,
                                            wg.double(), silu=True)[0], y_ref, dt,
               f"rms_norm_linear {rows}")
        assert calls == [None, "silu", "silu"], (rows, calls)
        calls.clear()
        K.linear(x, odd)
        off.linear(x, w)
        off.gated_linear(x, wg, "silu")
        assert calls == [], (rows, calls)
    K.linear(torch.randn((9, 4096), device=DEVICE, dtype=dt), w)
    K.linear(torch.randn((1, 4096), device=DEVICE, dtype=dt), w)
    assert calls == []
    # A weight whose launch shape is the elementwise kernel's, measured at four rows: takes it
    # up to four rows, stays on cuBLAS past them.
    sq = (torch.randn((2048, 2048), device=DEVICE, generator=gen) / 45).to(dt)
    assert isinstance(tr.ROWS_CONFIGS[(2048, 2048, False)], tr.FmaLaunch)
    for rows, taken in ((2, True), (4, True), (5, False), (8, False)):
        calls.clear()
        x = torch.randn((rows, 2048), device=DEVICE, generator=gen).to(dt)
        _check(K.linear(x, sq), *_reference(x, sq, None, None), dt, f"square {rows}")
        assert calls == ([None] if taken else []), (rows, calls)


# --- FP8 (e4m3) weights on the tensor-core kernel -------------------------------------------

FP8_OK = torch.cuda.get_device_capability() >= (8, 9)
fp8_gpu = pytest.mark.skipif(not FP8_OK, reason="e4m3 conversion needs compute capability >= 8.9")


def _fp8_operands(gen, m, n, k, act, bias, x_scale=1.0):
    from tidal.worker.ops import fp8_torch

    w = torch.randn((2 * n if act else n, k), device=DEVICE, generator=gen) / k ** 0.5
    if w.shape[0] >= 8:  # (not the only row of a gate or an up half: a zero reference)
        w[3] = 0  # an all-zero row: the smallest scale, a zero output
    w_q, w_s = fp8_torch.quantize_rows(w)
    x = (torch.randn((m, k), device=DEVICE, generator=gen) * x_scale).to(torch.bfloat16)
    b = torch.randn(n, device=DEVICE, generator=gen).to(torch.bfloat16) if bias else None
    _poison(m * n * 2)
    return w_q, w_s, x, b


def _fp8_reference(x, w_q, w_s, b, act):
    """float64 and the torch reference (``fp8_weight_only_linear``, in the dtype)."""
    from tidal.worker.ops import fp8_torch

    w64 = w_q.double() * w_s.double().reshape(-1, 1)
    y64 = F.linear(x.double(), w64, None if b is None else b.double())
    y = fp8_torch.fp8_weight_only_linear(x, w_q, w_s, b)
    fn = ACTS[act]
    return (y64, y) if fn is None else (fn(y64), fn(y))


@fp8_gpu
@pytest.mark.parametrize("act", [None, "silu"], ids=str)
@pytest.mark.parametrize("split", [1, 4])
def test_fp8_weights_random_shapes(act, split) -> None:
    """FP8 weights from one row up: ragged shapes, bias, SiLU, K split, against the weight-only
    reference; x far from 1 in magnitude (the kernel takes it times 2^-4 in float16)."""
    rng = random.Random(hash((act, split)) & 0xFFFF)
    gen = torch.Generator(device=DEVICE).manual_seed(rng.randrange(1 << 30))
    for case in range(6):
        m = rng.choice([1, 1, 2, 4, 8])
        n, k = rng.randrange(1, 700), rng.randrange(16, 1500)
        bias = act is None and case % 2 == 1
        x_scale = rng.choice([1e-3, 1.0, 3000.0])
        w_q, w_s, x, b = _fp8_operands(gen, m, n, k, act, bias, x_scale)
        out = tr.gemv_rows(x, w_q, b, act=act, config=(32, 128, 4, 3, split), weight_scale=w_s)
        assert out.shape == (m, n)
        _check(out, *_fp8_reference(x, w_q, w_s, b, act), torch.bfloat16,
               f"fp8 m={m} n={n} k={k} act={act} split={split} x~{x_scale}")


@fp8_gpu
def test_fp8_checks_its_scale() -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    w_q, w_s, x, _ = _fp8_operands(gen, 1, 64, 128, None, False)
    with pytest.raises(ValueError, match="takes a weight_scale"):
        tr.gemv_rows(x, w_q)
    with pytest.raises(ValueError, match="one float32 scale per weight row"):
        tr.gemv_rows(x, w_q, weight_scale=w_s[:10])
    assert tr.gemv_rows_supported(x, w_q) and not tr.gemv_rows_supported(
        x, w_q.to(torch.float16))  # (a 16-bit weight takes two rows or more)


@fp8_gpu
@pytest.mark.skipif(not HOPPER, reason="the policy runs the few-row GEMV on Hopper only "
                                       "(where its launch shapes were measured)")
def test_fp8_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """2-8 rows take the tensor-core kernel in ``fp8_linear`` and ``rms_norm_fp8_linear`` (the
    Triton norm first: the residual exact), with a shape's launch shape or the default, and
    match the weight-only reference; one row stays on the elementwise GEMV, nine rows on the
    FP8 GEMM (rows quantized)."""
    assert {(6144, 4096, False), (4096, 4096, False), (14336, 4096, True),
            (4096, 14336, False)} <= set(tr.FP8_ROWS_CONFIGS)  # Llama-3.1-8B's, measured
    monkeypatch.setitem(tr.FP8_ROWS_CONFIGS, (512, 1024, True), (32, 128, 4, 3))
    monkeypatch.setitem(tr.FP8_ROWS_CONFIGS, (512, 1024, False), (32, 128, 4, 3, 2))
    K = kernels_for(DEVICE, KernelConfig(ops="triton"))
    calls: list[str | None] = []
    real = tr.gemv_rows
    monkeypatch.setattr(tr, "gemv_rows",
                        lambda *a, **kw: calls.append(kw.get("act")) or real(*a, **kw))
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    w_q, w_s, _, _ = _fp8_operands(gen, 1, 512, 1024, None, False)
    wg_q, wg_s, _, _ = _fp8_operands(gen, 1, 512, 1024, "silu", False)
    odd_q, odd_s, _, _ = _fp8_operands(gen, 1, 500, 1024, None, False)
    nw = torch.randn(1024, device=DEVICE, generator=gen).to(torch.bfloat16)
    for rows in (2, 4, 8):
        x = torch.randn((rows, 1024), device=DEVICE, generator=gen).to(torch.bfloat16)
        r = torch.randn_like(x)
        calls.clear()
        _check(K.fp8_linear(x, w_q, w_s), *_fp8_reference(x, w_q, w_s, None, None),
               torch.bfloat16, f"fp8_linear {rows}")
        y, res = K.rms_norm_fp8_linear(x, r, nw, 1e-6, wg_q, wg_s, silu=True)
        h_ref, res_ref = torch_ops.fused_add_rms_norm(x, r, nw, 1e-6)
        assert torch.equal(res, res_ref)
        _check(y, *_fp8_reference(h_ref, wg_q, wg_s, None, "silu"), torch.bfloat16,
               f"rms_norm_fp8_linear {rows}")
        assert calls == [None, "silu"], (rows, calls)
        calls.clear()
        _check(K.fp8_linear(x, odd_q, odd_s), *_fp8_reference(x, odd_q, odd_s, None, None),
               torch.bfloat16, f"fp8_linear, default launch shape, {rows}")
        assert calls == [None], (rows, calls)
        calls.clear()
    for rows in (1, 9):
        K.fp8_linear(torch.randn((rows, 1024), device=DEVICE).to(torch.bfloat16), w_q, w_s)
    assert calls == [], calls
