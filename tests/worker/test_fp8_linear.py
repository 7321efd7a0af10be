"""FP8 (e4m3) W8A8 linear: the quantizer, the torch reference against a float64 computation of
the stated semantics, the kernel policy's choice, and (on a GPU of compute capability >= 8.9)
``torch._scaled_mm`` against the reference."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.ops import fp8_torch

F8 = torch.float8_e4m3fn


def _quant64(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization computed in float64: (dequantized values, scales)."""
    t = t.double()
    s = t.abs().amax(-1, keepdim=True) / 448.0
    s = torch.where(s > 0, s, torch.ones_like(s))
    q = (t / s).clamp(-448.0, 448.0).to(F8).double()
    return q * s, s


def test_quantize_rows_scales_clamps_and_zero_rows():
    torch.manual_seed(0)
    w = torch.randn(6, 40) * torch.tensor([1e-6, 1.0, 30.0, 1.0, 0.0, 5.0]).reshape(-1, 1)
    q, s = fp8_torch.quantize_rows(w)
    assert q.dtype == F8 and s.dtype == torch.float32 and s.shape == (6, 1)
    amax = w.abs().amax(-1, keepdim=True)
    nonzero = amax.squeeze(-1) > 0
    torch.testing.assert_close(s[nonzero], (amax / 448.0)[nonzero])
    # Each row's largest magnitude lands on the top of the e4m3 range, nothing beyond it.
    qf = q.float()
    assert torch.equal(qf.abs().amax(-1)[nonzero], torch.full((5,), 448.0))
    assert qf.abs().max() <= 448.0
    # An all-zero row stays zero, with a finite positive scale.
    assert torch.equal(qf[4], torch.zeros(40)) and 0 < float(s[4]) < 1e-9
    # Relative error of e4m3 (3 mantissa bits) per element is at most 2**-4.
    deq = qf * s
    big = w.abs() > amax * 2**-6
    assert ((deq - w).abs()[big] <= w.abs()[big] * 2**-4 + 1e-12).all()
    # Static scales clamp to the range instead of overflowing to NaN.
    clamped = fp8_torch.quantize_static(torch.tensor([[1e6, -1e6, 1.0]]), torch.tensor(1.0))
    assert clamped.float().tolist() == [[448.0, -448.0, 1.0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float64_semantics(dtype):
    torch.manual_seed(1)
    x = (torch.randn(7, 64) * 3).to(dtype)
    x[3] = 0  # a zero token row
    w = torch.randn(48, 64) * 0.2
    bias = torch.randn(48).to(dtype)
    w_q, w_s = fp8_torch.quantize_rows(w)
    y = fp8_torch.fp8_linear(x, w_q, w_s, bias)
    assert y.dtype == dtype and y.shape == (7, 48)
    xd, _ = _quant64(x.float())
    ref = xd @ (w_q.double() * w_s.double()).t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=tol, atol=tol)
    # ... and it is a quantized product: close to the exact one, but not equal.
    exact = x.double() @ w.double().t() + bias.double()
    err = (y.double() - exact).abs().max() / exact.abs().max()
    assert 1e-4 < err < 0.1
    # Leading dimensions are kept.
    y3 = fp8_torch.fp8_linear(x.reshape(1, 7, 64), w_q, w_s, bias)
    assert torch.equal(y3.reshape(7, 48), y)


def test_static_input_scale():
    torch.manual_seed(2)
    x = torch.randn(5, 32)
    w_q, w_s = fp8_torch.quantize_rows(torch.randn(16, 32))
    scale = torch.tensor([0.01])  # small: large activations clamp at +-448 * 0.01
    y = fp8_torch.fp8_linear(x, w_q, w_s, input_scale=scale)
    xq = (x.double() / 0.01).clamp(-448, 448).to(F8).double() * 0.01
    ref = xq @ (w_q.double() * w_s.double()).t()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_kernels_op_on_cpu_is_the_reference():
    from tidal.worker.kernel_policy import reference_kernels

    torch.manual_seed(3)
    x = torch.randn(4, 32)
    w_q, w_s = fp8_torch.quantize_rows(torch.randn(16, 32))
    assert torch.equal(reference_kernels().fp8_linear(x, w_q, w_s),
                       fp8_torch.fp8_linear(x, w_q, w_s))


def test_policy_chooses_scaled_mm_by_compute_capability():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, describe, resolve

    hopper = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, capability=(9, 0)))
    ampere = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, capability=(8, 0)))
    cpu = resolve(KernelConfig(), DeviceInfo("cpu"))
    assert hopper.fp8_scaled_mm and not ampere.fp8_scaled_mm and not cpu.fp8_scaled_mm
    assert "fp8_linear: torch reference (compute capability < 8.9)" in describe(ampere)
    assert any(line.startswith("fp8_linear: torch._scaled_mm") for line in describe(hopper))


def test_linear_layers_never_hand_fp8_weights_to_the_gemv():
    from tidal.engine_core.quantization_config import QuantConfig
    from tidal.worker.layers import fp8
    from tidal.worker.layers.linear import RowParallelLinear
    from tidal.worker.layers.norm import RMSNorm
    from tidal.worker.models.decoder import NormLinear

    with fp8.quantizing(QuantConfig()):
        layer = RowParallelLinear(32, 16, False, torch.float32)
    assert layer.weight.dtype == F8 and layer.weight_scale.shape == (16, 1)
    w = torch.randn(16, 32)
    layer.weight.weight_loader(layer.weight, w)
    q, s = fp8_torch.quantize_rows(w)
    assert torch.equal(layer.weight.float(), q.float()) and torch.equal(layer.weight_scale, s)
    norm = RMSNorm(32, 1e-6, torch.float32)
    x, res = torch.randn(3, 32), torch.randn(3, 32)
    y, r = NormLinear(norm, layer)(x, res)
    torch.testing.assert_close(r, x + res)
    torch.testing.assert_close(y, fp8_torch.fp8_linear(norm(x + res), q, s))


# --- GPU: cuBLASLt against the reference (skipped off Ada/Hopper) -----------------------------

def _fp8_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (the torch._scaled_mm path needs compute capability >= 8.9)"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability()} < (8, 9)"
    return None


_SKIP_GPU = _fp8_gpu()
gpu = pytest.mark.skipif(_SKIP_GPU is not None, reason=str(_SKIP_GPU))


@gpu
@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (7, 1024, 512), (256, 6144, 4096),
                                   (3, 40, 48), (5, 48, 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_matches_reference(m, n, k, dtype):
    from tidal.worker.ops import fp8_scaled_mm

    torch.manual_seed(4)
    x = torch.randn(m, k, device="cuda").to(dtype)
    w_q, w_s = fp8_torch.quantize_rows(torch.randn(n, k, device="cuda") * 0.05)
    bias = torch.randn(n, device="cuda").to(dtype)
    y = fp8_scaled_mm.fp8_linear(x, w_q, w_s, bias)
    ref = fp8_torch.fp8_linear(x.cpu(), w_q.cpu(), w_s.cpu(), bias.cpu())
    assert y.dtype == dtype and y.shape == (m, n)
    # Same quantized inputs; what differs is the GEMM's accumulation (Hopper's FP8 tensor
    # cores accumulate in reduced precision) and the output rounded before the bias is added:
    # over K = 4096, 0.1 % of the elements landed up to 0.16 away (H100), so the bound is on
    # the error's norm and on its largest element relative to the output's scale.
    diff = (y.cpu().double() - ref.double())
    assert float(diff.norm() / ref.double().norm()) < 1e-2
    assert float(diff.abs().max()) <= 0.03 * float(ref.abs().max())


@gpu
def test_gpu_kernels_take_scaled_mm():
    from tidal.worker.kernel_policy import kernels_for

    kernels = kernels_for(torch.device("cuda"))
    assert kernels.policy.fp8_scaled_mm
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    w_q, w_s = fp8_torch.quantize_rows(torch.randn(128, 256, device="cuda"))
    # One row takes the FP8 GEMV (tests/worker/test_fp8_gemv.py); two take cuBLASLt.
    assert kernels.gemv_applies(x[:1], w_q) and not kernels.gemv_applies(x, w_q)
    y = kernels.fp8_linear(x, w_q, w_s)
    ref = fp8_torch.fp8_linear(x, w_q, w_s)
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
