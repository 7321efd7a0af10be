"""The one-row (batch-1 decode) GEMV on FP8 e4m3 weights (``triton_decode.gemv`` with
``weight_scale``): weight-only dequantization in registers against the torch reference
``fp8_torch.fp8_weight_only_linear`` (itself checked against float64), with the norm prologue,
the residual add, bias and the SiLU-and-mul epilogue; the kernel choice (``Kernels``,
``NormLinear``); Llama-3.1-8B shapes and a CUDA-graph decode of a tiny FP8 model on a GPU.

The kernel tests run on a GPU of compute capability >= 8.9, or on the CPU under the Triton
interpreter with tiny shapes::

    PYTHONPATH=/work/tritoncpu TRITON_INTERPRET=1 python -m pytest -q tests/worker/test_fp8_gemv.py
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from tidal.worker.ops import fp8_torch, torch_ops

F8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _gpu_skip() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed (the FP8 GEMV is a Triton kernel)"
    if not torch.cuda.is_available():
        return "no CUDA device (the FP8 GEMV runs on compute capability >= 8.9)"
    if torch.cuda.get_device_capability() < (8, 9):
        return f"compute capability {torch.cuda.get_device_capability()} < (8, 9): no e4m3"
    return None


GPU_SKIP = _gpu_skip()
ON_GPU = GPU_SKIP is None
gpu = pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
kernel = pytest.mark.skipif(
    not (ON_GPU or (INTERPRET and HAS_TRITON)),
    reason=f"{GPU_SKIP}; or run on the CPU with TRITON_INTERPRET=1 and a CPU build of triton")
DEV = "cuda" if ON_GPU else "cpu"


def _weights(n: int, k: int, seed: int, dev: str = DEV) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 0.1
    w[min(3, n - 1)] = 0  # an all-zero row: the smallest scale, a zero output
    q, s = fp8_torch.quantize_rows(w)
    return q.to(dev), s.to(dev)


def _row(k: int, seed: int, dtype: torch.dtype, dev: str = DEV, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, k, generator=g) * scale).to(dtype).to(dev)


def _reference(x, w_q, w_s, bias, norm_w, residual, eps, silu):
    """The unfused semantics on the CPU: norm (with the residual add), weight-only FP8
    product, SiLU-and-mul; and the new residual."""
    x = x.cpu()
    res = None
    if norm_w is not None:
        if residual is None:
            h, res = torch_ops.rms_norm(x, norm_w.cpu(), eps), x
        else:
            h, res = torch_ops.fused_add_rms_norm(x, residual.cpu(), norm_w.cpu(), eps)
    else:
        h = x
    y = fp8_torch.fp8_weight_only_linear(h, w_q.cpu(), w_s.cpu(),
                                         None if bias is None else bias.cpu())
    return (torch_ops.silu_and_mul(y) if silu else y), res


# --- the reference (CPU, always runs) ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_only_reference_matches_float64(dtype):
    torch.manual_seed(0)
    x = (torch.randn(3, 48) * 4).to(dtype)
    w_q, w_s = _weights(40, 48, 1, "cpu")
    bias = torch.randn(40).to(dtype)
    y = fp8_torch.fp8_weight_only_linear(x, w_q, w_s, bias)
    assert y.dtype == dtype and y.shape == (3, 40)
    ref = x.double() @ (w_q.double() * w_s.double()).t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=tol, atol=tol)
    # Weight-only: the activation is not quantized, unlike the W8A8 product.
    w8a8 = fp8_torch.fp8_linear(x.float(), w_q, w_s, bias.float())
    assert (w8a8.double() - ref).abs().max() > 10 * (y.double() - ref).abs().max()


def test_policy_describes_the_fp8_paths():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, describe, resolve

    hopper = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, capability=(9, 0)))
    ampere = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, capability=(8, 0)))
    no_triton = resolve(KernelConfig(), DeviceInfo("cuda", triton=False, capability=(9, 0)))
    cpu = resolve(KernelConfig(), DeviceInfo("cpu"))
    assert hopper.fp8_norm_quant and not ampere.fp8_norm_quant
    assert not no_triton.fp8_norm_quant and not cpu.fp8_norm_quant
    line = next(x for x in describe(hopper) if x.startswith("fp8_linear:"))
    assert "norm + activation quantization fused" in line and "GEMV on FP8 weights" in line
    line = next(x for x in describe(no_triton) if x.startswith("fp8_linear:"))
    assert "fused" not in line and "GEMV" not in line


def test_cpu_kernels_keep_w8a8_for_one_row():
    """Off the GPU nothing changes: one row is quantized like any other (the W8A8 reference),
    through ``rms_norm_linear`` and ``rms_norm_fp8_linear`` alike."""
    from tidal.worker.kernel_policy import reference_kernels

    kernels = reference_kernels()
    torch.manual_seed(2)
    x, res, nw = torch.randn(1, 32), torch.randn(1, 32), torch.rand(32) + 0.5
    w_q, w_s = _weights(24, 32, 3, "cpu")
    assert not kernels.gemv_applies(x, w_q)
    h, r = torch_ops.fused_add_rms_norm(x, res, nw, 1e-6)
    ref = torch_ops.silu_and_mul(fp8_torch.fp8_linear(h, w_q, w_s))
    y, r2 = kernels.rms_norm_fp8_linear(x, res, nw, 1e-6, w_q, w_s, silu=True)
    assert torch.equal(y, ref) and torch.equal(r2, r)
    y, r2 = kernels.rms_norm_linear(x, res, nw, 1e-6, w_q, silu=True, weight_scale=w_s)
    assert torch.equal(y, ref) and torch.equal(r2, r)


# --- the kernel: interpreter (tiny shapes, float32) or GPU ------------------------------------

VARIANTS = {  # name -> (bias, norm, residual, silu)
    "plain": (False, False, False, False),
    "bias": (True, False, False, False),
    "norm": (False, True, False, False),
    "norm_residual": (False, True, True, False),
    "norm_residual_silu": (False, True, True, True),
}


@kernel
@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("n,k,config", [(24, 40, (4, 16, 1, 1)), (10, 64, (4, 32, 1, 2)),
                                        (16, 32, (8, 32, 1, 1))])
def test_fp8_gemv_matches_weight_only_reference(variant, n, k, config):
    from tidal.worker.ops import triton_decode as td

    has_bias, norm, add, silu = VARIANTS[variant]
    dtype = torch.float32  # the interpreter rounds to 16 bits by truncation: keep it exact
    x = _row(k, 5, dtype, scale=3.0)
    w_q, w_s = _weights(n, k, 6)
    bias = torch.randn(n // 2 if silu else n).to(dtype).to(DEV) if has_bias else None
    nw = (torch.rand(k) + 0.5).to(dtype).to(DEV) if norm else None
    residual = _row(k, 7, dtype) if add else None
    y, res = td.gemv(x, w_q, bias, norm_weight=nw, residual=residual, eps=1e-6, silu=silu,
                     config=config, weight_scale=w_s)
    ref, ref_res = _reference(x, w_q, w_s, bias, nw, residual, 1e-6, silu)
    assert y.shape == ref.shape and y.dtype == dtype
    torch.testing.assert_close(y.cpu(), ref, rtol=1e-5, atol=1e-5)
    if add:
        assert torch.equal(res.cpu(), ref_res)
    zero_row = 3 % ref.shape[-1]
    if not (has_bias or silu):
        assert float(y.reshape(-1)[zero_row]) == 0.0


@kernel
def test_fp8_gemv_checks_its_scale():
    from tidal.worker.ops import triton_decode as td

    x = _row(32, 1, torch.float32)
    w_q, w_s = _weights(16, 32, 2)
    with pytest.raises(ValueError, match="weight_scale"):
        td.gemv(x, w_q, config=(4, 16, 1, 1))
    with pytest.raises(ValueError, match="weight_scale"):
        td.gemv(x, w_q.float(), config=(4, 16, 1, 1), weight_scale=w_s)
    with pytest.raises(ValueError, match="8 values for 16 rows"):
        td.gemv(x, w_q, config=(4, 16, 1, 1), weight_scale=w_s[:8])


# --- GPU: Llama-3.1-8B shapes through the kernel choice ---------------------------------------

LLAMA8B = [  # (N, K, silu): q/k/v, o, gate/up, down; then odd shapes
    (6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False),
    (1000, 1000, False), (4098, 3000, True), (33, 4100, False),
]


def _gpu_kernels():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for

    return kernels_for(torch.device("cuda"), KernelConfig(ops="triton"))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,silu", LLAMA8B)
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fp8_gemv_llama_shapes(n, k, silu, norm, dtype):
    kernels = _gpu_kernels()
    x = _row(k, 11, dtype, "cuda")
    w_q, w_s = _weights(n, k, 12, "cuda")
    assert kernels.gemv_applies(x, w_q)
    nw = (torch.rand(k) + 0.5).to(dtype).cuda() if norm else None
    residual = _row(k, 13, dtype, "cuda") if norm else None
    if norm:
        # The policy's path: the norm as the GEMV's prologue, or apart before large weights.
        y, res = kernels.rms_norm_linear(x, residual, nw, 1e-6, w_q, silu=silu,
                                         weight_scale=w_s)
    else:
        y = kernels.fp8_linear(x, w_q, w_s) if not silu else \
            torch_ops.silu_and_mul(kernels.fp8_linear(x, w_q, w_s))
        res = None
    ref, ref_res = _reference(x, w_q, w_s, None, nw, residual, 1e-6, silu)
    assert torch.isfinite(y).all(), "non-finite output (unwritten rows?)"
    err = float((y.cpu().double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2, f"relative error {err}"
    if norm:
        torch.testing.assert_close(res.cpu(), ref_res, rtol=0, atol=0)


@gpu
@pytest.mark.gpu
def test_gpu_one_row_is_weight_only():
    """Sixteen rows take cuBLASLt (W8A8; 2-8 rows run the few-row kernels, weight-only too);
    one row the GEMV (W8A16): the one-row result is the weight-only product, closer to the
    exact one than the W8A8 product."""
    kernels = _gpu_kernels()
    x = _row(4096, 21, torch.bfloat16, "cuda", scale=2.0)
    w_q, w_s = _weights(4096, 4096, 22, "cuda")
    one = kernels.fp8_linear(x, w_q, w_s).cpu().double()
    many = kernels.fp8_linear(x.expand(16, -1).contiguous(), w_q, w_s)[:1].cpu().double()
    exact = x.cpu().double() @ (w_q.cpu().double() * w_s.cpu().double()).t()
    assert (one - exact).norm() < (many - exact).norm()


def _fake_quant_input(module, args):
    x = args[0]
    q, s = fp8_torch.quantize_rows(x.reshape(-1, x.shape[-1]))
    return ((q.float() * s).reshape(x.shape).to(x.dtype),)


@gpu
@pytest.mark.gpu
def test_gpu_fp8_decode_with_cuda_graphs_matches_weight_only_hf(tiny_models):
    """A tiny FP8 Llama decoded one request at a time on the GPU with CUDA graphs: every step
    is one row (single-token prompts), so every linear is the FP8 GEMV. The reference is HF in
    float32 with the weights fake-quantized and the activations left as they are."""
    import copy

    from torch import nn

    from tests.reference import hf_greedy
    from tidal.frontend import LLM, SamplingParams

    folder, hf = tiny_models["llama"]
    ref = copy.deepcopy(hf)
    w8a8 = copy.deepcopy(hf)
    for model, acts in ((ref, False), (w8a8, True)):
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and ".layers." in name:
                q, s = fp8_torch.quantize_rows(mod.weight.data)
                with torch.no_grad():
                    mod.weight.copy_(q.float() * s)
                if acts:
                    mod.register_forward_pre_hook(_fake_quant_input)
    prompts = [[5], [17], [99]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", device="cuda",
              quantization="fp8", num_kv_blocks=64)
    try:
        outs = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    finally:
        llm.shutdown()
    for p, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(ref, p, 8)
        assert list(out.token_ids) == tokens
        got = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
        assert max(abs(a - b) for a, b in zip(got, logprobs)) < 2e-3
        # The activations were not quantized: W8A8 logprobs differ.
        _, w8a8_lp = hf_greedy(w8a8, p, 8)
        assert max(abs(a - b) for a, b in zip(got, w8a8_lp)) > 1e-4
