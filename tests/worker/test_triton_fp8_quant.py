"""RMSNorm + residual add + FP8 activation quantization in one Triton pass
(``ops.triton_fp8_quant``) against the torch reference (``torch_ops`` norm, then
``fp8_torch.quantize_activations``), and the FP8 norm-linear the kernel choice builds from it.

Runs on a GPU of compute capability >= 8.9, or on the CPU under the Triton interpreter::

    PYTHONPATH=/work/tritoncpu TRITON_INTERPRET=1 \
        python -m pytest -q tests/worker/test_triton_fp8_quant.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tidal.worker.ops import fp8_torch, torch_ops

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
if not HAS_TRITON:
    GPU_SKIP: str | None = "triton is not installed (the fused norm + quantization is Triton)"
elif not torch.cuda.is_available():
    GPU_SKIP = "no CUDA device (e4m3 in Triton needs compute capability >= 8.9)"
elif torch.cuda.get_device_capability() < (8, 9):
    GPU_SKIP = f"compute capability {torch.cuda.get_device_capability()} < (8, 9)"
else:
    GPU_SKIP = None
ON_GPU = GPU_SKIP is None
gpu = pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
kernel = pytest.mark.skipif(
    not (ON_GPU or (INTERPRET and HAS_TRITON)),
    reason=f"{GPU_SKIP}; or run on the CPU with TRITON_INTERPRET=1 and a CPU build of triton")
DEV = "cuda" if ON_GPU else "cpu"


def _inputs(m: int, k: int, dtype: torch.dtype, add: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[min(1, m - 1)] = 0  # an all-zero row (with no residual): the smallest scale
    res = torch.randn(m, k, generator=g) if add else None
    if res is not None:
        res[min(1, m - 1)] = 0
    nw = torch.rand(k, generator=g) + 0.5
    to = lambda t: None if t is None else t.to(dtype).to(DEV)  # noqa: E731
    return to(x), to(res), to(nw)


def _reference(x, res, nw, eps, input_scale=None):
    x, nw = x.cpu(), nw.cpu()
    if res is None:
        h, new_res = torch_ops.rms_norm(x, nw, eps), x
    else:
        h, new_res = torch_ops.fused_add_rms_norm(x, res.cpu(), nw, eps)
    q, s = fp8_torch.quantize_activations(h, None if input_scale is None else input_scale.cpu())
    return q, s, new_res, h


def _check_q(q, s, q_ref, s_ref, h) -> None:
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-5 if ON_GPU else 1e-6, atol=0)
    qf, rf = q.cpu().float(), q_ref.float()
    diff = qf != rf
    if ON_GPU:
        # The norm's rsqrt may land a row one ulp away: a few values one e4m3 step apart.
        assert diff.float().mean() < 0.01
        assert ((qf - rf).abs()[diff] <= rf.abs()[diff] * 2**-3 + 2**-9).all()
    else:
        # The interpreter rounds float32 to e4m3 without carrying a mantissa overflow into the
        # exponent: a value that rounds up to a power of two comes out as half of it. Those,
        # and only those, may differ.
        assert diff.float().mean() < 0.15
        assert torch.equal(qf[diff] * 2, rf[diff])
        assert torch.equal(rf[diff].abs().log2().frac(), torch.zeros(int(diff.sum())))
    # Either way, each value inside the range dequantizes to the normed row within e4m3's
    # precision (a static scale clamps the others to +-448).
    deq, hf = qf * s.cpu(), h.float()
    ok = (deq - hf).abs() <= hf.abs() * 2**-4 + s.cpu() * 2**-9
    inside = (hf / s.cpu()).abs() <= 448
    assert ok[~diff & inside].all()
    assert torch.equal(qf[~inside].abs(), torch.full((int((~inside).sum()),), 448.0))


@kernel
@pytest.mark.gpu
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("m,k", [(5, 40), (3, 64), (1, 24)])
def test_norm_quant_matches_reference(m, k, add):
    from tidal.worker.ops import triton_fp8_quant as tq

    dtype = torch.float32  # the interpreter rounds to 16 bits by truncation: keep it exact
    x, res, nw = _inputs(m, k, dtype, add)
    assert tq.supported(x)
    q, s, new_res = tq.add_rms_norm_quant(x, res, nw, 1e-6)
    q_ref, s_ref, res_ref, h = _reference(x, res, nw, 1e-6)
    assert q.dtype == fp8_torch.FP8_DTYPE and q.shape == (m, k) and s.shape == (m, 1)
    assert torch.equal(new_res.cpu(), res_ref)
    _check_q(q, s, q_ref, s_ref, h)


@kernel
@pytest.mark.gpu
def test_norm_quant_static_scale_clamps():
    from tidal.worker.ops import triton_fp8_quant as tq

    x, res, nw = _inputs(4, 32, torch.float32, True, seed=3)
    scale = torch.tensor([0.002], device=DEV)  # small: large values clamp at +-448
    q, s, _ = tq.add_rms_norm_quant(x, res, nw, 1e-6, scale)
    q_ref, s_ref, _, h = _reference(x, res, nw, 1e-6, scale)
    assert torch.equal(s.cpu(), s_ref)
    assert q.cpu().float().abs().max() == 448.0
    _check_q(q, s, q_ref, s_ref, h)


@kernel
@pytest.mark.gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m,k", [(5, 40), (3, 64), (1, 24)])
def test_quantize_matches_reference(m, k, static):
    """The quantization alone (the inputs of the o and down projections)."""
    from tidal.worker.ops import triton_fp8_quant as tq

    x, _, _ = _inputs(m, k, torch.float32, False, seed=k)
    scale = torch.tensor([0.004], device=DEV) if static else None
    q, s = tq.quantize(x, scale)
    q_ref, s_ref = fp8_torch.quantize_activations(x.cpu(), None if scale is None
                                                  else scale.cpu())
    assert q.dtype == fp8_torch.FP8_DTYPE and q.shape == (m, k) and s.shape == (m, 1)
    _check_q(q, s, q_ref, s_ref, x.cpu())


def test_unsupported_rows():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (the module imports it)")
    from tidal.worker.ops import triton_fp8_quant as tq

    assert not tq.supported(torch.zeros(2, tq.MAX_K + 1))
    assert not tq.supported(torch.zeros(4, 8, dtype=torch.int32))
    assert not tq.supported(torch.zeros(2, 3, 8))


# --- GPU: the model's shapes, 16-bit, and the kernel choice -----------------------------------

def _gpu_kernels():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for

    return kernels_for(torch.device("cuda"), KernelConfig(ops="triton"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(17, 4096), (2048, 4096), (300, 5120), (33, 1000)])
@pytest.mark.parametrize("add", [False, True])
def test_gpu_norm_quant_16bit(m, k, add, dtype):
    from tidal.worker.ops import triton_fp8_quant as tq

    x, res, nw = _inputs(m, k, dtype, add, seed=m)
    q, s, new_res = tq.add_rms_norm_quant(x, res, nw, 1e-5)
    q_ref, s_ref, res_ref, h = _reference(x, res, nw, 1e-5)
    assert torch.equal(new_res.cpu(), res_ref)
    _check_q(q, s, q_ref, s_ref, h)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,silu", [(64, 6144, 4096, False), (300, 28672, 4096, True),
                                        (17, 48, 32, False)])
def test_gpu_rms_norm_fp8_linear_matches_reference(m, n, k, silu):
    kernels = _gpu_kernels()
    assert kernels.policy.fp8_norm_quant
    x, res, nw = _inputs(m, k, torch.bfloat16, True, seed=n)
    w_q, w_s = fp8_torch.quantize_rows(torch.randn(n, k, device="cuda") * 0.05)
    y, new_res = kernels.rms_norm_fp8_linear(x, res, nw, 1e-6, w_q, w_s, silu=silu)
    h, r = torch_ops.fused_add_rms_norm(x.cpu(), res.cpu(), nw.cpu(), 1e-6)
    ref = fp8_torch.fp8_linear(h, w_q.cpu(), w_s.cpu())
    ref = torch_ops.silu_and_mul(ref) if silu else ref
    assert torch.equal(new_res.cpu(), r) and y.shape == ref.shape
    err = float((y.cpu().double() - ref.double()).norm() / ref.double().norm())
    assert err < 2e-2, f"relative error {err}"


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k", [(17, 4096), (2048, 14336), (300, 5120), (33, 1000)])
def test_gpu_quantize_16bit(m, k, dtype):
    from tidal.worker.ops import triton_fp8_quant as tq

    x, _, _ = _inputs(m, k, dtype, False, seed=m)
    q, s = tq.quantize(x)
    q_ref, s_ref = fp8_torch.quantize_activations(x.cpu(), None)
    _check_q(q, s, q_ref, s_ref, x.cpu())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(64, 4096, 4096), (300, 4096, 14336), (2, 48, 32)])
def test_gpu_fp8_linear_quantizes_in_triton(m, n, k, monkeypatch):
    """``Kernels.fp8_linear`` for rows the GEMV does not take: the Triton quantization, then
    cuBLASLt, against the torch reference (and never the torch quantizer)."""
    kernels = _gpu_kernels()
    assert kernels.policy.fp8_norm_quant and kernels.policy.fp8_scaled_mm

    def unexpected(*args, **kwargs):
        raise AssertionError("the torch quantizer ran")

    x, _, _ = _inputs(m, k, torch.bfloat16, False, seed=n)
    w_q, w_s = fp8_torch.quantize_rows(torch.randn(n, k, device="cuda") * 0.05)
    monkeypatch.setattr(fp8_torch, "quantize_activations", unexpected)
    y = kernels.fp8_linear(x, w_q, w_s)
    monkeypatch.undo()
    ref = fp8_torch.fp8_linear(x.cpu(), w_q.cpu(), w_s.cpu())
    assert y.shape == ref.shape and y.dtype == x.dtype
    err = float((y.cpu().double() - ref.double()).norm() / ref.double().norm())
    assert err < 2e-2, f"relative error {err}"
