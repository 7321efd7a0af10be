"""Triton and CUDA versions of the fused ops (RMSNorm, residual-add RMSNorm, SiLU-and-mul,
rotary embedding, Gemma's norms and GeGLU) against float64 references and the torch versions.

Each check draws fresh random inputs, runs the kernel into memory that was just filled with NaN
and released (the caching allocator hands it straight back, so an unwritten element shows up as
NaN), and measures ||out - ref|| / ||ref|| against a float64 reference. The kernel must be within
the dtype's tolerance and no worse than twice the torch version's own error.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU: the Triton/CUDA op kernels run only on one", allow_module_level=True
    )
pytest.importorskip("triton", reason="needs triton: the Triton op kernels are written in it")

from tidal.engine_core.kernel_config import KernelConfig  # noqa: E402
from tidal.worker.kernel_policy import kernels_for  # noqa: E402
from tidal.worker.ops import torch_ops  # noqa: E402

DEVICE = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _impl(name: str):
    if name == "triton":
        from tidal.worker.ops import triton_ops

        return triton_ops
    from tidal.worker.ops import cuda_ops
    from tidal.worker.ops.cuda_ext import build_result

    result = build_result()
    assert result.module is not None, f"CUDA extension failed to build: {result.error}"
    return cuda_ops


def _poison_allocator(numel_bytes: int) -> None:
    """Leave NaN in the blocks the next allocations of about this size will reuse."""
    junk = torch.full((numel_bytes // 4 + 1024,), float("nan"), device=DEVICE)
    del junk


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def _check(
    out: torch.Tensor, ref64: torch.Tensor, torch_out: torch.Tensor, dtype, label: str
) -> None:
    assert torch.isfinite(out).all(), f"{label}: non-finite output (unwritten elements?)"
    err, base = _rel(out, ref64), _rel(torch_out, ref64)
    assert err < TOL[dtype] and err <= 2 * base + 1e-6, (
        f"{label}: error {err:.3g}, torch {base:.3g}"
    )


IMPLS = ["triton", "cuda"]
SHAPES = [(1, 1024), (37, 4096), (3, 5, 896), (64, 100)]  # 100: not a multiple of 8 -> scalar path


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm(name: str, dtype: torch.dtype) -> None:
    impl = _impl(name)
    for shape in SHAPES:
        x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3
        w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
        _poison_allocator(x.numel() * x.element_size())
        out = impl.rms_norm(x, w, 1e-6)
        ref = torch_ops.rms_norm(x.double(), w.double(), 1e-6)
        _check(out, ref, torch_ops.rms_norm(x, w, 1e-6), dtype, f"{name} rms_norm {shape}")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(name: str, dtype: torch.dtype) -> None:
    impl = _impl(name)
    for shape in SHAPES:
        x = torch.randn(shape, device=DEVICE, dtype=dtype)
        res = torch.randn(shape, device=DEVICE, dtype=dtype) * 4
        w = torch.randn(shape[-1], device=DEVICE, dtype=dtype)
        x_before, res_before = x.clone(), res.clone()
        _poison_allocator(x.numel() * x.element_size())
        out, new_res = impl.fused_add_rms_norm(x, res, w, 1e-5)
        assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs were modified"
        # The residual sum is rounded to the dtype exactly like torch's add.
        assert torch.equal(new_res, x + res), f"{name} residual differs from x + residual"
        ref = torch_ops.rms_norm((x + res).double(), w.double(), 1e-5)
        t_out, _ = torch_ops.fused_add_rms_norm(x, res, w, 1e-5)
        _check(out, ref, t_out, dtype, f"{name} fused_add_rms_norm {shape}")


def test_rms_norm_strided_rows() -> None:
    """Rows of a wider tensor (a slice, row stride != hidden) normalise in place of a copy."""
    for name in IMPLS:
        impl = _impl(name)
        big = torch.randn(16, 3072, device=DEVICE, dtype=torch.bfloat16)
        x = big[:, 1024:2048]
        w = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16)
        out = impl.rms_norm(x, w, 1e-6)
        ref = torch_ops.rms_norm(x.double(), w.double(), 1e-6)
        _check(out, ref, torch_ops.rms_norm(x, w, 1e-6), torch.bfloat16, f"{name} strided")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(name: str, dtype: torch.dtype) -> None:
    impl = _impl(name)
    for shape in [(1, 2 * 3072), (33, 2 * 1024), (2, 3, 2 * 100), (5, 2 * 14336)]:
        x = torch.randn(shape, device=DEVICE, dtype=dtype) * 2
        _poison_allocator(x.numel() * x.element_size() // 2)
        out = impl.silu_and_mul(x)
        assert out.shape == (*shape[:-1], shape[-1] // 2)
        ref = torch_ops.silu_and_mul(x.double())
        _check(out, ref, torch_ops.silu_and_mul(x), dtype, f"{name} silu_and_mul {shape}")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_and_mul(name: str, dtype: torch.dtype) -> None:
    impl = _impl(name)
    for shape in [(1, 2 * 14336), (33, 2 * 1024), (2, 3, 2 * 100)]:
        x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3  # reaches both tanh tails
        _poison_allocator(x.numel() * x.element_size() // 2)
        out = impl.gelu_tanh_and_mul(x)
        assert out.shape == (*shape[:-1], shape[-1] // 2)
        ref = torch_ops.gelu_tanh_and_mul(x.double())
        _check(out, ref, torch_ops.gelu_tanh_and_mul(x), dtype, f"{name} gelu {shape}")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemma_norms(name: str, dtype: torch.dtype) -> None:
    """Gemma's (1 + w) norm alone, and fused as post-norm + residual add + next pre-norm."""
    impl = _impl(name)
    for shape in [*SHAPES, (7, 16, 256)]:  # the last: q/k norm over heads
        x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3
        res = torch.randn(shape, device=DEVICE, dtype=dtype) * 4
        w = torch.randn(shape[-1], device=DEVICE, dtype=dtype) * 0.5
        w2 = torch.randn(shape[-1], device=DEVICE, dtype=dtype) * 0.5
        _poison_allocator(x.numel() * x.element_size())
        out = impl.gemma_rms_norm(x, w, 1e-6)
        ref = torch_ops.gemma_rms_norm(x.double(), w.double(), 1e-6)
        _check(out, ref, torch_ops.gemma_rms_norm(x, w, 1e-6), dtype, f"{name} gemma {shape}")
        x_before, res_before = x.clone(), res.clone()
        nxt, new_res = impl.gemma_add_norm_norm(x, res, w, w2, 1e-6)
        assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs modified"
        t_nxt, t_res = torch_ops.gemma_add_norm_norm(x, res, w, w2, 1e-6)
        # The residual is rounded like torch's add of the rounded norm: equal but for a norm
        # that rounds the other way (rsqrt differs in its last bit).
        assert _rel(new_res, t_res.double()) < TOL[dtype], f"{name} residual {shape}"
        ref = torch_ops.gemma_rms_norm(t_res.double(), w2.double(), 1e-6)
        _check(nxt, ref, t_nxt, dtype, f"{name} gemma add+norm {shape}")


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rot_dim", [(128, 128), (64, 64), (128, 64), (64, 36)])
def test_rotary_embedding(
    name: str, dtype: torch.dtype, is_neox: bool, head_dim: int, rot_dim: int
) -> None:
    impl = _impl(name)
    tokens, heads, kv_heads, max_pos = 45, 16, 4, 4096
    # q and k as strided views of one fused QKV output, the way the attention layer splits it.
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, device=DEVICE).float() / rot_dim))
    freqs = torch.outer(torch.arange(max_pos, device=DEVICE).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    _poison_allocator(q.numel() * q.element_size())
    q_out, k_out = impl.rotary_embedding(positions, q, k, cache, is_neox)
    q_ref, k_ref = torch_ops.rotary_embedding(
        positions, q.double(), k.double(), cache.double(), is_neox
    )
    q_t, k_t = torch_ops.rotary_embedding(positions, q, k, cache, is_neox)
    _check(q_out, q_ref, q_t, dtype, f"{name} rotary q")
    _check(k_out, k_ref, k_t, dtype, f"{name} rotary k")
    if rot_dim < head_dim:  # the channels past rot_dim pass through untouched (36: scalar path)
        assert torch.equal(q_out[..., rot_dim:], q[..., rot_dim:])


def test_dispatch_routes_cuda_tensors() -> None:
    """ops auto -> the CUDA extension here; triton; torch forced -> the reference; outputs
    agree."""
    x = torch.randn(8, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16)
    auto = kernels_for(DEVICE, KernelConfig(ops="auto"))
    assert auto.name == "cuda", "the CUDA extension should build on this machine"
    fast = auto.rms_norm(x, w, 1e-6)
    triton_k = kernels_for(DEVICE, KernelConfig(ops="triton"))
    assert triton_k.name == "triton"
    tri = triton_k.rms_norm(x, w, 1e-6)
    torch_k = kernels_for(DEVICE, KernelConfig(ops="torch"))
    assert torch_k.name == "torch"
    slow = torch_k.rms_norm(x, w, 1e-6)
    ref = torch_ops.rms_norm(x.double(), w.double(), 1e-6)
    assert _rel(fast, ref) < TOL[torch.bfloat16] and _rel(tri, ref) < TOL[torch.bfloat16]
    assert torch.equal(slow, torch_ops.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_vocab_shard_embedding(dtype: torch.dtype) -> None:
    """The tensor-parallel embedding lookup of one vocabulary shard: exactly the torch version's
    rows (zeros for the tokens other ranks hold), for the first, a middle and the last shard,
    a decode row and a ragged prefill, into NaN-filled memory."""
    from tidal.worker.ops import triton_ops

    gen = torch.Generator(device=DEVICE).manual_seed(7)
    vocab, shard, hidden = 1000, 250, 1000  # hidden: not a multiple of the kernel's block
    weight = torch.randn(shard, hidden, generator=gen, device=DEVICE).to(dtype)
    for start in (0, 500, 750):
        for shape in ((1,), (3, 37)):
            ids = torch.randint(0, vocab, shape, generator=gen, device=DEVICE)
            ids.view(-1)[0] = start  # the shard's first and last rows, and its neighbours
            ids.view(-1)[-1] = start + shard - 1
            if ids.numel() > 3:
                ids.view(-1)[1], ids.view(-1)[2] = start - 1, start + shard
            torch.empty(shape + (hidden,), dtype=dtype, device=DEVICE).fill_(float("nan"))
            got = triton_ops.vocab_shard_embedding(ids, weight, start)
            want = torch_ops.vocab_shard_embedding(ids, weight, start)
            assert got.shape == want.shape and torch.equal(got, want), (start, shape)
            assert torch.equal(kernels_for(DEVICE, KernelConfig(ops="triton"))
                               .vocab_shard_embedding(ids, weight, start), want)
