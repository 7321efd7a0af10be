"""INT4 weight-only (W4A16) linear: AWQ / GPTQ tensors converted to tidal's layout against a
float64 dequantization written here, the torch reference against a float64 matmul, the kernel
policy's choice, and the Triton GEMM / split-K GEMV against the torch reference: on a GPU
(``-m gpu``) over Llama-8B and odd shapes, or on the CPU under the Triton interpreter with tiny
shapes::

    PYTHONPATH=/work/tritoncpu TRITON_INTERPRET=1 python -m pytest -q \
        tests/worker/test_int4_linear.py -k triton
"""

from __future__ import annotations

import functools
import importlib.util
import os

import numpy as np
import pytest
import torch

from tests.worker.int4_writer import pack_awq, pack_sequential
from tidal.worker.ops import int4_torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _gpu_skip() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed (the W4A16 kernels are Triton kernels)"
    if not torch.cuda.is_available():
        return "no CUDA device (the W4A16 kernels run on a GPU)"
    return None


GPU_SKIP = _gpu_skip()
ON_GPU = GPU_SKIP is None
triton_kernel = pytest.mark.skipif(
    not (ON_GPU or (INTERPRET and HAS_TRITON)),
    reason=f"{GPU_SKIP}; or run on the CPU with TRITON_INTERPRET=1 and a CPU build of triton")
DEV = "cuda" if ON_GPU else "cpu"


def _random_int4(n: int, k: int, group: int, seed: int, act_order: bool = False):
    """Random INT4 values, zeros, scales and group map (float64 / int64, [N, K] / [N, G])."""
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(1, 16, (n, groups), generator=g)
    scales = (torch.rand(n, groups, generator=g, dtype=torch.float64) * 0.02 + 1e-3)
    scales = scales.half().double()
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return q, zeros, scales, g_idx


def _deq64(q, zeros, scales, g_idx) -> torch.Tensor:
    return (q - zeros[:, g_idx]).double() * scales[:, g_idx]


def _tidal_layout(q, zeros, scales, g_idx, dtype, dev=DEV):
    """tidal's tensors for the values, converted from a GPTQ-format (v2) checkpoint."""
    qweight = int4_torch.gptq_qweight(torch.from_numpy(pack_sequential(q.t().numpy(), 0)))
    qzeros = int4_torch.zeros_of(torch.from_numpy(pack_sequential(zeros.t().numpy(), 1)),
                                 awq=False, minus_one=False)
    return (qweight.to(dev), scales.to(dtype).to(dev), qzeros.to(dev),
            g_idx.to(torch.int32).to(dev))


def test_awq_tensors_convert_to_the_stated_weights():
    q, zeros, scales, g_idx = _random_int4(24, 96, 32, seed=0)
    qweight = int4_torch.awq_qweight(torch.from_numpy(pack_awq(q.t().numpy())))
    qzeros = int4_torch.zeros_of(torch.from_numpy(pack_awq(zeros.t().numpy())), awq=True,
                                 minus_one=False)
    assert qweight.shape == (24, 12) and qweight.dtype == torch.int32
    assert torch.equal(qzeros.long(), zeros)
    w = int4_torch.dequantize(qweight, scales.t().contiguous().t(), qzeros, 32,
                              dtype=torch.float64)
    assert torch.equal(w, _deq64(q, zeros, scales, g_idx))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_tensors_convert_to_the_stated_weights(act_order):
    q, zeros, scales, g_idx = _random_int4(16, 136, 32, seed=1, act_order=act_order)  # 5 groups
    qweight = int4_torch.gptq_qweight(torch.from_numpy(pack_sequential(q.t().numpy(), 0)))
    # The classic format stores each zero minus one (4 bits: a zero of 0 wraps to 15 and is
    # read back as 16, which is what GPTQ's own kernels compute).
    stored = (zeros.t().numpy() - 1) & 0xF
    qzeros = int4_torch.zeros_of(torch.from_numpy(pack_sequential(stored, 1)), awq=False,
                                 minus_one=True)
    assert torch.equal(qzeros.long(), zeros)
    w = int4_torch.dequantize(qweight, scales, qzeros, 32, g_idx if act_order else None,
                              torch.float64)
    assert torch.equal(w, _deq64(q, zeros, scales, g_idx))
    wrapped = int4_torch.zeros_of(torch.from_numpy(pack_sequential(np.full((1, 8), 15), 1)),
                                  awq=False, minus_one=True)
    assert wrapped.flatten().tolist() == [16] * 8


def test_unpack_pack_round_trip_and_sign_bit():
    values = torch.tensor([[15, 0, 7, 8, 1, 2, 3, 15, 9, 9, 9, 9, 9, 9, 9, 9]])
    words = int4_torch.pack_rows(values)
    assert words.dtype == torch.int32 and int(words[0, 0]) < 0  # top nibble 15: negative
    assert torch.equal(int4_torch.unpack(words, 1), values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act_order", [False, True])
def test_torch_linear_matches_float64_matmul(dtype, act_order):
    q, zeros, scales, g_idx = _random_int4(40, 72, 16, seed=2, act_order=act_order)
    qweight, s, qzeros, gi = _tidal_layout(q, zeros, scales, g_idx, dtype, "cpu")
    x = torch.randn(5, 3, 72, generator=torch.Generator().manual_seed(3)).to(dtype)
    bias = torch.randn(40).to(dtype)
    y = int4_torch.w4a16_linear(x, qweight, s, qzeros, 16, gi if act_order else None, bias)
    assert y.shape == (5, 3, 40) and y.dtype == dtype
    ref = x.double() @ _deq64(q, zeros, scales, g_idx).t() + bias.double()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)


def test_round_to_nearest_dummy_weights_are_close():
    w = torch.randn(8, 200, generator=torch.Generator().manual_seed(4))
    qweight, scales, zeros = int4_torch.quantize_rtn(w, 64)  # 4 groups, the last of 8
    assert scales.shape == (8, 4) and zeros.dtype == torch.uint8
    back = int4_torch.dequantize(qweight, scales, zeros, 64, dtype=torch.float32)
    # Round to nearest: within half a step (plus the zero point's rounding) of each value.
    step = scales.repeat_interleave(64, 1)[:, :200]
    assert ((back - w).abs() <= step * 1.0 + 1e-6).all()


def test_kernel_policy_picks_triton_on_a_gpu_only():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, describe, resolve

    cpu = resolve(KernelConfig(), DeviceInfo("cpu"))
    gpu = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, cuda_ext=False))
    bare = resolve(KernelConfig(), DeviceInfo("cuda", triton=False, cuda_ext=False))
    assert (cpu.triton_w4a16, gpu.triton_w4a16, bare.triton_w4a16) == (False, True, False)
    assert any(line.startswith("w4a16_linear: triton") for line in describe(gpu))
    assert "w4a16_linear: torch reference" in describe(cpu)
    # 2-8 rows on the CUDA extension's few-row product: only where the extension built, on
    # tensor-core mma (compute capability 8.0 on).
    ext = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, cuda_ext=True,
                                             capability=(9, 0)))
    old = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, cuda_ext=True,
                                             capability=(7, 5)))
    assert (cpu.skinny_w4a16, gpu.skinny_w4a16, ext.skinny_w4a16, old.skinny_w4a16) == (
        False, False, True, False)
    assert any("CUDA tensor-core product for 2-8 rows" in line for line in describe(ext))
    assert not any("CUDA tensor-core" in line for line in describe(gpu))
    # Block-wise FP8 on the same product: on by default where the extension built, e4m3 from
    # 8.9; off when asked.
    off = resolve(KernelConfig(skinny_fp8_block=False),
                  DeviceInfo("cuda", triton=True, cuda_ext=True, capability=(9, 0)))
    ampere = resolve(KernelConfig(), DeviceInfo("cuda", triton=True, cuda_ext=True,
                                                capability=(8, 0)))
    assert ext.skinny_fp8_block and not off.skinny_fp8_block and not ampere.skinny_fp8_block
    assert not gpu.skinny_fp8_block and not cpu.skinny_fp8_block
    assert any("1-8 rows, weight-only" in line for line in describe(ext))
    assert not any("1-8 rows, weight-only" in line for line in describe(off))


@functools.lru_cache(maxsize=2)
def _kernel_weights(n: int, k: int, group: int, act_order: bool):
    """tidal's tensors of a random INT4 weight (float32 scales), kept for the next test of the
    same shape: packing an 8B-sized weight takes seconds."""
    q, zeros, scales, g_idx = _random_int4(n, k, group, n + k, act_order)
    return _tidal_layout(q, zeros, scales, g_idx, torch.float32)


def _check_kernel(m: int, n: int, k: int, group: int, dtype: torch.dtype, act_order: bool,
                  bias: bool, seed: int) -> None:
    from tidal.worker.ops import triton_w4a16

    qweight, s32, qzeros, gi = _kernel_weights(n, k, group, act_order)
    s = s32.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    b = torch.randn(n, generator=gen).to(dtype).to(DEV) if bias else None
    g_arg = gi if act_order else None
    y = triton_w4a16.w4a16_linear(x, qweight, s, qzeros, group, g_arg, b)
    # The reference in float32 from the same dequantized (rounded to ``dtype``) weights.
    ref_w = int4_torch.dequantize(qweight, s, qzeros, group, g_arg, dtype).float()
    ref = x.float() @ ref_w.t() + (0 if b is None else b.float())
    assert y.shape == (m, n) and y.dtype == dtype
    scale = ref.abs().amax().clamp_min(1.0)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    err = float(((y.float() - ref).abs() / scale).max())
    assert err < tol, (m, n, k, group, dtype, act_order, err)


@triton_kernel
@pytest.mark.parametrize("m", [1, 3, 7, 21])  # GEMV, split-K dot, GEMM
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_w4a16_matches_torch_reference(m, act_order, dtype):
    _check_kernel(m, 72, 200, 32, dtype, act_order, bias=m % 2 == 1, seed=m)


@triton_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k,group,config", [
    (40, 2120, 128, (16, 1024, 4)),  # three K chunks, the last group partial; 40 = 2.5 blocks
    (8, 256, 256, None),  # one group a row (per-channel scales)
    (32, 64, 8, (4, 64, 2)),  # one packed word a group, eight groups a chunk
    (16, 96, 24, (8, 64, 4)),  # a group of three words, straddling the chunks
])  # fmt: skip
def test_triton_whole_row_gemv(monkeypatch, bias, n, k, group, config):
    """The batch-1 decode GEMV that streams whole weight rows (``_w4a16_gemv_rows``): several
    K chunks with a last partial group, a ragged last block of rows, per-channel, one-word and
    three-word groups."""
    from tidal.worker.ops import triton_w4a16

    assert triton_w4a16.rows_kernel_takes(group)
    monkeypatch.setattr(triton_w4a16, "GROUPS_MAX_GROUP", 0)  # (else the group-tiled one)
    if config is not None:
        monkeypatch.setitem(triton_w4a16.GEMV_ROWS_CONFIGS, (n, k, group), config)
    m = 1
    _check_kernel(m, n, k, group, torch.float32, act_order=False, bias=bias, seed=n + bias)


@triton_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k,group,config", [
    (40, 2120, 128, (16, 4, 4, 1, False, 1)),  # 17 groups (the last partial) in chunks of 4
    (40, 2120, 128, (16, 2, 2, 2, True, 1)),  # the same with the next chunk loaded ahead
    (40, 2120, 128, (32, 2, 1, 1, True, 3)),  # K in 3 shares of 6, 6 and 5 groups
    (40, 2120, 128, (16, 4, 1, 1, False, 8)),  # 8 shares of 4 groups: the last 3 empty
    (8, 256, 256, (8, 1, 1, 1, True, 1)),  # one group a row
    (32, 64, 8, (4, 8, 2, 1, False, 1)),  # one packed word a group, eight groups a chunk
    (24, 96, 32, (16, 2, 4, 1, True, 2)),  # 3 groups in chunks of 2, split in two
])  # fmt: skip
def test_triton_group_tiled_gemv(monkeypatch, bias, n, k, group, config):
    """The batch-1 GEMV tiled by quantization groups (``_w4a16_gemv_groups``): a last partial
    group, a last chunk of fewer groups, a ragged last block of rows, the prefetching variant,
    K split over programs (shares of unequal size, empty ones), per-channel and one-word
    groups; every nibble position is exercised by the random weights (both halves of each
    two-nibble shift)."""
    from tidal.worker.ops import triton_w4a16

    assert triton_w4a16.groups_kernel_takes(group)
    monkeypatch.setitem(triton_w4a16.GEMV_GROUPS_CONFIGS, (n, k, group), config)
    called = []
    kernel = triton_w4a16._w4a16_gemv_groups
    monkeypatch.setattr(triton_w4a16, "_w4a16_gemv_groups", _Recording(kernel, called))
    _check_kernel(1, n, k, group, torch.float32, act_order=False, bias=bias, seed=n + bias)
    assert called and called[0][1] == config[5]  # (the table sent the call here, split so)
    if config[5] > 1:  # every row block's last program re-zeroed its counter
        from tidal.worker.ops import triton_gemv_rows

        counts = triton_gemv_rows._split_workspace(torch.device(DEV))[1]
        assert int(counts[: -(-n // config[0])].abs().sum()) == 0


@triton_kernel
@pytest.mark.parametrize("n,k,group,config,act,bias", [
    (72, 2120, 128, (16, 4, 1, 1, False, 1), "silu", False),  # 36 outputs: 4.5 row blocks
    (72, 2120, 128, (32, 2, 1, 1, True, 3), "silu", True),  # K split in 3, the last ragged
    (48, 256, 32, (16, 2, 2, 1, False, 2), "gelu_tanh", True),  # Gemma's GeGLU
])  # fmt: skip
def test_group_tiled_gemv_with_the_gated_activation(monkeypatch, n, k, group, config, act, bias):
    """``act(gate) * up`` as the group-tiled GEMV's epilogue over a fused ``[gate; up]`` INT4
    weight (a program's rows: half gate, half the matching up rows): what the GEMV and then
    the activation give, through a ragged last block and K splits."""
    from tidal.worker.ops import torch_ops, triton_w4a16

    monkeypatch.setitem(triton_w4a16.GEMV_GROUPS_CONFIGS, (n, k, group), config)
    qweight, s32, qzeros, _ = _kernel_weights(n, k, group, False)
    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to(DEV)
    b = torch.randn(n, generator=gen).to(DEV) if bias else None
    assert triton_w4a16.gated_gemv_applies(x, qweight, group, None)
    y = triton_w4a16.w4a16_gated_gemv(x, qweight, s32, qzeros, group, act, b)
    lin = triton_w4a16.w4a16_linear(x, qweight, s32, qzeros, group, None, b)
    ref = (torch_ops.silu_and_mul(lin) if act == "silu" else torch_ops.gelu_tanh_and_mul(lin))
    assert y.shape == (1, n // 2) and y.dtype == x.dtype
    torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5)
    odd = qweight[:-1]  # (an odd number of rows is no [gate; up] pair)
    assert not triton_w4a16.gated_gemv_applies(x, odd, group, None)
    assert not triton_w4a16.gated_gemv_applies(x.expand(2, k), qweight, group, None)


@triton_kernel
@pytest.mark.parametrize("n,k,group,split", [
    (40, 2120, 128, 4),  # 17 groups, 9 chunks of two: four shares of two or three
    (8, 2048, 128, 4),  # 8 chunks: four shares of two (1 row block; 4 SMs in the interpreter)
    (8, 384, 128, 1),  # 2 chunks: too few for two shares of two
    (24, 96, 24, None),  # three-word groups: the whole-row kernel
])  # fmt: skip
def test_group_tiled_gemv_is_the_batch1_default(monkeypatch, n, k, group, split):
    """With no measured launch shape, one row goes to the group-tiled GEMV under the rule's
    shape (K split while the grid is small and each share keeps two chunks), unless its group
    size is not a power-of-two number of words."""
    from tidal.worker.ops import triton_w4a16

    assert (n, k, group) not in triton_w4a16.GEMV_GROUPS_CONFIGS
    called = []
    kernel = triton_w4a16._w4a16_gemv_groups
    monkeypatch.setattr(triton_w4a16, "_w4a16_gemv_groups", _Recording(kernel, called))
    _check_kernel(1, n, k, group, torch.float32, act_order=False, bias=False, seed=n)
    if split is None:
        assert not called
    else:
        assert called and called[0][1] == split
        assert triton_w4a16.gemv_groups_config(n, k, group, torch.device(DEV))[5] == split


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the kernel module imports it)")
def test_group_tiled_rule_on_the_llama8b_shapes():
    """The rule's K splits for Llama-3.1-8B's projections on a 132-SM GPU: what the H200 sweeps
    found best or within 2-8 % of it (tools/results/int4_gemv_groups{2,3}_h200_llama8b.json)."""
    from tidal.worker.ops import triton_w4a16

    dev = torch.device("cuda", 7)  # (the SM count is read from the cache, never the device)
    old = triton_w4a16._SM_COUNT.get(7)
    triton_w4a16._SM_COUNT[7] = 132
    saved = dict(triton_w4a16.GEMV_GROUPS_CONFIGS)
    triton_w4a16.GEMV_GROUPS_CONFIGS.clear()
    try:
        rule = {shape: triton_w4a16.gemv_groups_config(*shape, dev)[5]
                for shape in ((6144, 4096, 128), (4096, 4096, 128), (28672, 4096, 128),
                              (4096, 14336, 128))}
    finally:
        triton_w4a16.GEMV_GROUPS_CONFIGS.update(saved)
        if old is None:
            del triton_w4a16._SM_COUNT[7]
        else:
            triton_w4a16._SM_COUNT[7] = old
    assert rule == {(6144, 4096, 128): 8, (4096, 4096, 128): 8, (28672, 4096, 128): 2,
                    (4096, 14336, 128): 8}


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the kernel module imports it)")
def test_group_tiled_gemv_takes_power_of_two_word_groups():
    from tidal.worker.ops import triton_w4a16

    takes = [g for g in range(1, 2049) if triton_w4a16.groups_kernel_takes(g)]
    assert takes == [8, 16, 32, 64, 128, 256, 512, 1024]


class _Recording:
    """A launchable (``kernel[grid](...)``) that records its launches."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 16, 17, 100, 512])
@pytest.mark.parametrize("n,k,group", [
    (6144, 4096, 128),  # Llama-3.1-8B q/k/v
    (4096, 4096, 128),  # o_proj
    (28672, 4096, 128),  # gate/up
    (4096, 14336, 128),  # down
    (200, 136, 32),  # odd: partial tiles, 5 groups (the last of 8)
    (1000, 1048, 128),  # odd: 9 groups (the last of 24)
])
def test_gpu_w4a16_matches_torch_reference(dtype, m, n, k, group):
    _check_kernel(m, n, k, group, dtype, act_order=False, bias=m == 5, seed=n + m)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
@pytest.mark.parametrize("m", [1, 9, 300])
def test_gpu_w4a16_act_order(m):
    _check_kernel(m, 4096, 4096, 128, torch.bfloat16, act_order=True, bias=False, seed=m)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
def test_gpu_kernels_dispatch_to_triton():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, resolve
    from tidal.worker.ops.kernels import Kernels

    kernels = Kernels(resolve(KernelConfig(ops="triton"), DeviceInfo("cuda", triton=True)))
    assert kernels._w4 is not None
    q, zeros, scales, g_idx = _random_int4(256, 512, 128, seed=9)
    qweight, s, qzeros, _ = _tidal_layout(q, zeros, scales, g_idx, torch.bfloat16)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    y = kernels.w4a16_linear(x, qweight, s, qzeros, 128)
    ref = int4_torch.w4a16_linear(x, qweight, s, qzeros, 128)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
@pytest.mark.parametrize("m", [1, 2, 4, 8, 9])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("group", [64, 128])
def test_gpu_kernels_take_the_cuda_few_row_product_for_1_to_8_rows(m, gated, group,
                                                                   monkeypatch):
    """With the extension built, 2-8 rows (no act-order) run ``skinny_gemm``, and one row
    where it stages the activations (groups of 128 here); one row with groups of 64 and nine
    rows stay on Triton; all equal the torch reference."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import resolve, probe_device
    from tidal.worker.ops import skinny_gemm
    from tidal.worker.ops.kernels import Kernels

    kc = KernelConfig()
    kernels = Kernels(resolve(kc, probe_device(torch.device("cuda"), kc)))
    if kernels._skinny is None:
        pytest.skip(f"no CUDA few-row product here: {kernels.policy.why('ops') or 'policy off'}")
    q, zeros, scales, g_idx = _random_int4(512, 1024, group, seed=m)
    qweight, s, qzeros, _ = _tidal_layout(q, zeros, scales, g_idx, torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = skinny_gemm.skinny_gemm
    monkeypatch.setattr(skinny_gemm, "skinny_gemm",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    if gated:
        y = kernels.w4a16_gated_linear(x, qweight, s, qzeros, group, None, None, "silu")
        g, u = int4_torch.w4a16_linear(x, qweight, s, qzeros, group).float().chunk(2, -1)
        ref = torch.nn.functional.silu(g) * u
    else:
        y = kernels.w4a16_linear(x, qweight, s, qzeros, group)
        ref = int4_torch.w4a16_linear(x, qweight, s, qzeros, group)
    assert bool(calls) == (2 <= m <= 8 or (m == 1 and group >= 128))
    # (Summed in another order, a gate or up value may round to the next bfloat16, which the
    # product carries: compare the whole output, not each element.)
    err = float((y.double() - ref.double()).norm() / ref.double().norm())
    assert err < 1e-2, f"relative error {err:.3g}"
