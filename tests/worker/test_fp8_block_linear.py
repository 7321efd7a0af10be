"""Block-wise FP8 W8A8 linear: the torch reference (``fp8_block_torch``) against a float64
computation written here from the definition, and the Triton kernels (``triton_fp8_block``)
against the reference: the group quantizer bit for bit, the GEMM to float32 rounding, over
ragged shapes, block sizes, bias and dtypes.

The kernel tests run on a GPU of compute capability >= 8.9, or on the CPU under the Triton
interpreter::

    PYTHONPATH=<cpu triton> TRITON_INTERPRET=1 python -m pytest -q tests/worker/test_fp8_block_linear.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tidal.worker.ops import fp8_block_torch as fbt

F8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _gpu_skip() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed (the block-wise FP8 GEMM is a Triton kernel)"
    if not torch.cuda.is_available():
        return "no CUDA device (the block-wise FP8 GEMM runs on compute capability >= 8.9)"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability()} < (8, 9): no e4m3"
    return None


GPU_SKIP = _gpu_skip()
ON_GPU = GPU_SKIP is None
kernel = pytest.mark.skipif(
    not (ON_GPU or (INTERPRET and HAS_TRITON)),
    reason=f"{GPU_SKIP}; or run on the CPU with TRITON_INTERPRET=1 and a CPU build of triton")
DEV = "cuda" if ON_GPU else "cpu"


def _weight(n: int, k: int, bn: int, bk: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    # Blocks of very different magnitudes: one scale per row would lose the small ones.
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)[None, :].flip(1)
    w[0, :bk] = 0  # an all-zero block: the smallest scale, zeros back
    q, s = fbt.quantize_weight_blocks(w, bn, bk)
    return w, q, fbt.expand_block_scale(s, n, bn)


def _activations(m: int, k: int, group: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Activations spanning many magnitudes. Under the interpreter, whose float32 -> e4m3
    conversion drops the carry when rounding up crosses a power of two (31.7 became 16 on
    triton 3.6), each group is e4m3 values times a power of two with an amax of exactly 448
    times it, so quantizing needs no rounding; the GPU rounds random values."""
    g = torch.Generator().manual_seed(seed)
    if not INTERPRET or ON_GPU:
        x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, k)[None, :]
        return x.to(dtype)
    x = (torch.randn(m, k, generator=g) * 60).clamp(-448, 448).to(F8).float()
    groups = -(-k // group)
    for b in range(groups):
        x[:, b * group] = 448.0
        x[:, b * group:(b + 1) * group] *= 2.0 ** (b % 9 - 4)
    return x.to(dtype)


def test_reference_matches_the_definition_in_float64():
    n, k, bn, bk = 70, 200, 32, 64  # ragged: the last row and column blocks are partial
    w, q, s = _weight(n, k, bn, bk, 0)
    assert q.dtype == F8 and s.shape == (n, 4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, k, generator=g) * torch.logspace(2, -2, k)[None, :]
    x[1] = 0  # an all-zero row
    want = torch.zeros(5, n, dtype=torch.float64)
    for b in range(4):
        cols = slice(b * bk, min(k, (b + 1) * bk))
        xs = x[:, cols].double()
        sx = (xs.abs().amax(1, keepdim=True) / 448).clamp_min(1e-12)
        xq = (xs / sx).clamp(-448, 448).float().to(F8).double() * sx
        for r in range(n):
            blk = q[r, cols].double() * s[r, b].double()
            want[:, r] += xq @ blk
    got = fbt.fp8_block_linear(x, q, s, bk)
    # (float32 sums in BLAS order against float64: 1.2e-5 relative measured on one CPU)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    # The weight really is blocked: a per-block scale equals the block's amax / 448.
    blk = w[bn:2 * bn, bk:2 * bk]
    assert s[bn, 1] == pytest.approx(float(blk.abs().amax()) / 448, rel=1e-6)
    # Quantized, close to the exact product (two e4m3 roundings: a few percent).
    exact = x.double() @ w.double().t()
    rel = (got.double() - exact).norm() / exact.norm()
    assert 0 < rel < 0.05


def test_expand_block_scale_refuses_a_wrong_height():
    with pytest.raises(ValueError, match="has 3 rows"):
        fbt.expand_block_scale(torch.ones(2, 4), 70, 32)


@kernel
@pytest.mark.parametrize("m,k,group", [(1, 256, 128), (5, 192, 64), (33, 96, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_quantizer_is_bit_exact(m, k, group, dtype):
    from tidal.worker.ops import triton_fp8_block as tfb

    x = _activations(m, k, group, dtype, m + k)
    x[0, :group] = 0
    q, s = tfb.quantize_groups(x.to(DEV), group)
    q_ref, s_ref = fbt.quantize_groups(x, group)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.view(torch.uint8))


@kernel
@pytest.mark.parametrize("m,n,k,bn,bk", [
    (1, 96, 256, 128, 128),   # one row (decode), fewer rows than one block
    (7, 130, 384, 64, 128),   # ragged N
    (40, 64, 160, 32, 32),    # K not a multiple of 128; small blocks
    (70, 200, 512, 128, 256),  # a scale block of two K steps
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_matches_the_reference(m, n, k, bn, bk, dtype):
    from tidal.worker.ops import triton_fp8_block as tfb

    _, q, s = _weight(n, k, bn, bk, m)
    x = _activations(m, k, bk, dtype, n)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
    assert tfb.supported(x, q, bk)
    got = tfb.fp8_block_linear(x.to(DEV), q.to(DEV), s.to(DEV), bk, bias.to(DEV)).cpu()
    want = fbt.fp8_block_linear(x, q, s, bk, bias)
    assert got.dtype == dtype
    # float32: the kernel sums each K block's products, then scales; the reference scales,
    # then sums: orders differ, with cancellation across magnitudes. On a GPU the e4m3
    # tensor-core products also accumulate with fewer bits than float32 inside each K step
    # (measured on an H200: 9e-4 relative, 5 of 14,000 outputs past 1e-4).
    tol = (2e-3 if ON_GPU else 1e-4) if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol,
                               atol=tol * float(want.float().abs().max()))


@kernel
def test_kernel_refuses_a_mismatched_scale():
    from tidal.worker.ops import triton_fp8_block as tfb

    _, q, s = _weight(64, 256, 128, 128, 0)
    with pytest.raises(ValueError, match="block scale"):
        tfb.fp8_block_linear(torch.randn(2, 256).to(DEV), q.to(DEV), s[:, :1].to(DEV), 128)


def test_unsupported_shapes_are_declined():
    if not HAS_TRITON:
        pytest.skip("triton is not installed (supported() lives in the Triton module)")
    from tidal.worker.ops import triton_fp8_block as tfb

    q = torch.zeros(8, 64, dtype=F8)
    assert not tfb.supported(torch.zeros(2, 64), q, 16)  # block below the e4m3 dot's K step
    assert not tfb.supported(torch.zeros(2, 64, dtype=torch.float64), q, 64)
    assert tfb.supported(torch.zeros(2, 64), q, 64)



@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
@pytest.mark.parametrize("m", [1, 4, 8, 9])
def test_default_kernels_take_the_cuda_few_row_product_weight_only(m, monkeypatch):
    """``skinny_fp8_block`` (the default): 1-8 rows of a block-wise FP8 linear run the CUDA
    few-row product weight-only (the activations stay 16-bit: equal to the dequantized
    weight's product); nine rows keep the Triton block GEMM (activations quantized per
    group)."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import probe_device, resolve
    from tidal.worker.ops import skinny_gemm
    from tidal.worker.ops.kernels import Kernels

    kc = KernelConfig()
    kernels = Kernels(resolve(kc, probe_device(torch.device("cuda"), kc)))
    if not kernels.policy.skinny_fp8_block:
        pytest.skip(f"no CUDA few-row product here: {kernels.policy.why('ops') or 'off'}")
    w, q, s = _weight(256, 512, 128, 128, 4)
    q, s = q.cuda(), s.cuda()
    x = (torch.randn(m, 512) * torch.logspace(-2, 1, 512)).to(torch.bfloat16).cuda()
    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    y = kernels.fp8_block_linear(x, q, s, 128)
    assert bool(calls) == (m <= 8)
    dense = fbt.dequantize_weight(q, s, 128)
    weight_only = (x.double() @ dense.double().t())
    ref = weight_only if m <= 8 else fbt.fp8_block_linear(x, q, s, 128).double()
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < 1e-2, f"relative error {err:.3g}"


def _gated_reference(y: torch.Tensor) -> torch.Tensor:
    n = y.shape[-1] // 2
    return torch.nn.functional.silu(y[..., :n]) * y[..., n:]


def test_a_gated_linear_is_the_activation_of_the_linear_on_the_cpu():
    """``fp8_block_gated_linear`` off the GPU (and for rows the few-row product does not
    take): the block-wise linear, then SiLU-and-mul, exactly as the two ops."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, resolve
    from tidal.worker.ops.kernels import Kernels

    kernels = Kernels(resolve(KernelConfig(), DeviceInfo("cpu")))
    _, q, s = _weight(64, 256, 1, 128, 5)  # [gate; up] of 32 outputs each
    x = torch.randn(3, 256).to(torch.bfloat16)
    got = kernels.fp8_block_gated_linear(x, q, s, 128, None, "silu")
    want = kernels.silu_and_mul(kernels.fp8_block_linear(x, q, s, 128))
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        kernels.fp8_block_gated_linear(x, q, s, 128, None, "relu")


def test_the_mlp_projects_a_block_fp8_gate_up_through_the_gated_op(monkeypatch):
    """``SiluAndMul.project`` on a block-wise FP8 ``[gate; up]`` layer goes through
    ``fp8_block_gated_linear`` (where 1-8 rows on the GPU fuse the activation) and gives
    silu-and-mul of the layer's output."""
    from tidal.engine_core.quantization_config import QuantConfig
    from tidal.worker.layers import fp8
    from tidal.worker.layers.activation import SiluAndMul
    from tidal.worker.layers.linear import MergedColumnParallelLinear

    with fp8.quantizing(QuantConfig(method="fp8", weight_block=(1, 128))):
        layer = MergedColumnParallelLinear(256, [32, 32], bias=False, dtype=torch.bfloat16)
    assert layer.fp8_block is not None
    _, q, s = _weight(64, 256, 1, 128, 6)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    from tidal.worker.ops.kernels import Kernels

    act = SiluAndMul()
    calls = []
    real = Kernels.fp8_block_gated_linear
    monkeypatch.setattr(Kernels, "fp8_block_gated_linear",
                        lambda self, *a, **kw: calls.append(a[-1]) or real(self, *a, **kw))
    x = torch.randn(2, 256).to(torch.bfloat16)
    got = act.project(layer, x)
    assert calls == ["silu"]
    assert torch.equal(got, act(layer(x)))


@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
@pytest.mark.parametrize("m", [1, 4, 8, 9])
def test_gated_rows_take_the_few_row_product_with_the_activation_fused(m, monkeypatch):
    """1-8 rows of a block-wise FP8 ``[gate; up]`` weight: the CUDA few-row product with
    SiLU-and-mul as its epilogue (weight-only); nine rows: the block GEMM, then the op."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import probe_device, resolve
    from tidal.worker.ops import skinny_gemm
    from tidal.worker.ops.kernels import Kernels

    kc = KernelConfig()
    kernels = Kernels(resolve(kc, probe_device(torch.device("cuda"), kc)))
    if not kernels.policy.skinny_fp8_block:
        pytest.skip(f"no CUDA few-row product here: {kernels.policy.why('ops') or 'off'}")
    w, q, s = _weight(512, 512, 128, 128, 7)  # [gate; up] of 256 outputs each
    q, s = q.cuda(), s.cuda()
    x = (torch.randn(m, 512) * torch.logspace(-2, 1, 512)).to(torch.bfloat16).cuda()
    acts = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm",
                        lambda *a, **kw: acts.append(kw.get("act")) or real(*a, **kw))
    y = kernels.fp8_block_gated_linear(x, q, s, 128, None, "silu")
    assert acts == (["silu"] if m <= 8 else [])
    dense = fbt.dequantize_weight(q, s, 128)
    if m <= 8:
        ref = _gated_reference(x.double() @ dense.double().t())
    else:
        ref = _gated_reference(fbt.fp8_block_linear(x, q, s, 128).double())
    err = float((y.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"relative error {err:.3g}"


def _norm_gate_up(kernels=None):
    """An RMSNorm and a block-wise FP8 ``[gate; up]`` layer (2 x 256 outputs, 512 inputs)
    built with ``kernels`` (default: the torch ones), fused as the decoder fuses them."""
    from tidal.engine_core.quantization_config import QuantConfig
    from tidal.worker.kernel_policy import building, reference_kernels
    from tidal.worker.layers import fp8
    from tidal.worker.layers.linear import MergedColumnParallelLinear
    from tidal.worker.layers.norm import RMSNorm
    from tidal.worker.models.decoder import NormLinear

    with building(kernels or reference_kernels()), \
            fp8.quantizing(QuantConfig(method="fp8", weight_block=(1, 128))):
        norm = RMSNorm(512, 1e-6, torch.bfloat16)
        layer = MergedColumnParallelLinear(512, [256, 256], bias=False, dtype=torch.bfloat16)
    _, q, s = _weight(512, 512, 1, 128, 11)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    norm.weight.data.copy_((torch.rand(512) + 0.5).to(torch.bfloat16))
    return norm, layer, NormLinear(norm, layer, silu=True)


def test_the_decoder_norm_gate_up_of_block_fp8_takes_the_gated_op(monkeypatch):
    """The decoder's fused norm + gate/up over a block-wise FP8 layer: the norm, then
    ``fp8_block_gated_linear`` (whose 1-8 GPU rows fuse SiLU-and-mul), equal to the ops
    composed."""
    from tidal.worker.ops import torch_ops
    from tidal.worker.ops.kernels import Kernels

    norm, layer, fused = _norm_gate_up()
    calls = []
    real = Kernels.fp8_block_gated_linear
    monkeypatch.setattr(Kernels, "fp8_block_gated_linear",
                        lambda self, *a, **kw: calls.append(a[-1]) or real(self, *a, **kw))
    x = torch.randn(3, 512).to(torch.bfloat16)
    residual = torch.randn(3, 512).to(torch.bfloat16)
    y, res = fused(x, residual)
    assert calls == ["silu"]
    h, want_res = torch_ops.fused_add_rms_norm(x, residual, norm.weight, 1e-6)
    assert torch.equal(res, want_res)
    assert torch.equal(y, torch_ops.silu_and_mul(layer(h)))


@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
def test_one_and_two_rows_of_the_decoder_norm_gate_up_fuse_silu_on_the_gpu(monkeypatch):
    """On the GPU, the decoder's norm + gate/up over block-wise FP8 weights at one and two rows:
    the norm, then the few-row product with SiLU-and-mul as its epilogue, matching the ops
    composed in float64."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for
    from tidal.worker.ops import skinny_gemm, torch_ops

    kernels = kernels_for(torch.device("cuda"), KernelConfig())
    if not kernels.policy.skinny_fp8_block:
        pytest.skip(f"no CUDA few-row product here: {kernels.policy.why('ops') or 'off'}")
    norm, layer, fused = _norm_gate_up(kernels)
    norm.cuda()
    layer.cuda()
    acts = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm",
                        lambda *a, **kw: acts.append(kw.get("act")) or real(*a, **kw))
    for m in (1, 2):
        x = torch.randn(m, 512).to(torch.bfloat16).cuda()
        residual = torch.randn(m, 512).to(torch.bfloat16).cuda()
        y, res = fused(x, residual)
        h, want_res = torch_ops.fused_add_rms_norm(x.cpu().float(), residual.cpu().float(),
                                                   norm.weight.cpu().float(), 1e-6)
        dense = fbt.dequantize_weight(layer.weight.cpu(), layer.weight_scale_inv.cpu(), 128)
        ref = torch_ops.silu_and_mul(h.double() @ dense.double().t())
        err = float((y.double().cpu() - ref).norm() / ref.norm())
        assert err < 2e-2, f"{m} rows: relative error {err:.3g}"
        torch.testing.assert_close(res.float().cpu(), want_res, rtol=1e-2, atol=1e-2)
    assert acts == ["silu", "silu"]
