"""FP8 (e4m3) mixture-of-experts weights (``--quantization fp8`` on Mixtral / Qwen3-MoE):
the experts quantized per expert and output row as they load (one tensor at a time, stacked
GGUF-style, and under tensor parallelism as on one rank), computed weight-only. The torch
reference against float64, the Triton grouped GEMMs against their stated rounding points in
float64, and the reference within the same bound (a GPU of compute capability >= 8.9, or the
Triton interpreter on the CPU::

    PYTHONPATH=/work/tritoncpu TRITON_INTERPRET=1 python -m pytest -q tests/worker/test_fp8_moe.py

), and a tiny Qwen3-MoE end to end against HF transformers with the same fake quantization.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from torch import nn

import moe_harness as mh
from tidal.engine_core.quantization_config import QuantConfig
from tidal.worker.layers import fp8
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig, select_experts
from tidal.worker.ops import fp8_torch, moe_torch

F8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
if not HAS_TRITON:
    GPU_SKIP: str | None = "triton is not installed (the grouped GEMMs are Triton kernels)"
elif not torch.cuda.is_available():
    GPU_SKIP = "no CUDA device (e4m3 in Triton needs compute capability >= 8.9)"
elif torch.cuda.get_device_capability() < (8, 9):
    GPU_SKIP = f"compute capability {torch.cuda.get_device_capability()} < (8, 9)"
else:
    GPU_SKIP = None
ON_GPU = GPU_SKIP is None and not INTERPRET
kernel = pytest.mark.skipif(
    not (ON_GPU or (INTERPRET and HAS_TRITON)),
    reason=f"{GPU_SKIP}; or run on the CPU with TRITON_INTERPRET=1 and a CPU build of triton")
DEV = "cuda" if ON_GPU else "cpu"


def _experts(e: int, h: int, i: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(e, 2 * i, h, generator=g) * torch.rand(e, 2 * i, 1, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    w13[0, 1] = 0  # an all-zero row
    q13, s13 = fp8_torch.quantize_rows(w13.reshape(-1, h))
    q2, s2 = fp8_torch.quantize_rows(w2.reshape(-1, i))
    return (w13, w2, q13.view(e, 2 * i, h), s13.view(e, 2 * i), q2.view(e, h, i),
            s2.view(e, h))


def _route(t: int, e: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    return select_experts(logits, RoutingConfig(top_k=k))


def _float64_moe(x, q13, s13, q2, s2, weights, ids):
    """The stated semantics in float64: dequantized weights, activations as they are."""
    x = x.double()
    d13 = q13.double() * s13.double().unsqueeze(-1)
    d2 = q2.double() * s2.double().unsqueeze(-1)
    i = d13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = d13[e] @ x[t]
            out[t] += float(weights[t, j]) * (d2[e] @ (torch.nn.functional.silu(gu[:i]) * gu[i:]))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_float64(dtype):
    _, _, q13, s13, q2, s2 = _experts(6, 32, 24, 0)
    weights, ids = _route(9, 6, 2, 1)
    x = (torch.randn(9, 32, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    y = moe_torch.fused_moe(x, q13, q2, weights, ids, s13, s2)
    ref = _float64_moe(x, q13, s13, q2, s2, weights, ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, rtol=tol, atol=tol)
    # The dense (CUDA-graph) form computes the same.
    dense = moe_torch.fused_moe_dense(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(dense.double(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="w13_scale and w2_scale"):
        moe_torch.fused_moe(x, q13, q2, weights, ids)
    with pytest.raises(ValueError, match="must be"):
        moe_torch.fused_moe(x, q13, q2, weights, ids, s13[:, :4], s2)


def _layer(e: int, h: int, i: int, tp=None) -> FusedMoE:
    with fp8.quantizing(QuantConfig()):
        return FusedMoE(e, h, i, RoutingConfig(top_k=2), torch.float32, tp)


def test_layer_quantizes_each_expert_as_it_loads():
    e, h, i = 4, 32, 16
    w13, w2, q13, s13, q2, s2 = _experts(e, h, i, 3)
    layer = _layer(e, h, i)
    assert layer.w13.dtype == F8 and layer.w2.dtype == F8
    assert layer.w13_weight_scale.shape == (e, 2 * i) and layer.w2_weight_scale.shape == (e, h)
    for x in range(e):
        layer.load_expert_weight("gate", x, w13[x, :i])
        layer.load_expert_weight("up", x, w13[x, i:])
        layer.load_expert_weight("down", x, w2[x])
    assert not layer.missing_weights()
    assert torch.equal(layer.w13.float(), q13.float()) and torch.equal(layer.w2.float(), q2.float())
    assert torch.equal(layer.w13_weight_scale, s13) and torch.equal(layer.w2_weight_scale, s2)
    # GGUF-style stacked tensors load to the same bits.
    stacked = _layer(e, h, i)
    stacked.load_stacked_weight("gate", w13[:, :i])
    stacked.load_stacked_weight("up", w13[:, i:])
    stacked.load_stacked_weight("down", w2)
    for a, b in zip(stacked.parameters(), layer.parameters()):
        assert torch.equal(a.float(), b.float())
    # The forward is the reference's.
    hidden = torch.randn(5, h)
    logits = torch.randn(5, e)
    weights, ids = select_experts(logits, RoutingConfig(top_k=2))
    torch.testing.assert_close(layer(hidden, logits),
                               moe_torch.fused_moe(hidden, q13, q2, weights, ids, s13, s2))
    with pytest.raises(ValueError, match="intermediate size"):
        layer.load_expert_weight("down", 0, torch.zeros(h, i + 1))


def test_tensor_parallel_ranks_shard_quantized_rows_like_one_rank():
    from types import SimpleNamespace

    e, h, i = 2, 32, 16
    w13, w2, q13, s13, q2, s2 = _experts(e, h, i, 4)
    for rank in range(2):
        tp = SimpleNamespace(world_size=2, rank=rank)
        layer = _layer(e, h, i, tp)
        for x in range(e):
            layer.load_expert_weight("gate", x, w13[x, :i])
            layer.load_expert_weight("up", x, w13[x, i:])
            layer.load_expert_weight("down", x, w2[x])
        half = slice(rank * i // 2, (rank + 1) * i // 2)
        gate = q13[:, :i][:, half]
        assert torch.equal(layer.w13[:, :i // 2].float(), gate.float())
        assert torch.equal(layer.w13_weight_scale[:, :i // 2], s13[:, :i][:, half])
        # Down splits its columns: every rank keeps the whole row's scale.
        assert torch.equal(layer.w2.float(), q2[:, :, half].float())
        assert torch.equal(layer.w2_weight_scale, s2)


def test_moe_families_accept_fp8_but_not_their_fp8_checkpoints():
    from tidal.engine_core.quantization_config import QuantConfigError, build_quant_config

    for family in ("mixtral", "qwen3_moe"):
        assert build_quant_config("fp8", {}, family) == QuantConfig()
    with pytest.raises(ValueError, match="not yet implemented"):
        with fp8.quantizing(QuantConfig(prequantized=True)):
            FusedMoE(2, 32, 16, RoutingConfig(top_k=1), torch.float32)
    with pytest.raises(QuantConfigError, match="'deepseek_v2'"):
        build_quant_config("fp8", {}, "deepseek_v2")


# --- the Triton grouped GEMMs: interpreter or GPU ---------------------------------------------

def _to_16(v: torch.Tensor, dtype: torch.dtype, truncate: bool) -> torch.Tensor:
    """``v`` (float64) rounded to ``dtype`` and back: to nearest, or toward zero where the Triton
    interpreter converts float32 to bfloat16 by dropping the low bits."""
    if dtype == torch.float32:
        return v
    if truncate:
        bits = v.float().view(torch.int32) & ~0xFFFF
        return bits.view(torch.float32).double()
    return v.to(dtype).double()


def _kernel_rounding_moe(x, q13, s13, q2, s2, weights, ids, truncate=False):
    """The kernel's stated rounding points in float64 (``triton_moe``): each projection's sum
    times its row scale, gate and up rounded to the activations' dtype, silu(gate) rounded,
    the product rounded; the down projection times its scale and the router weight summed over
    the slots unrounded. Returns that, and the magnitude ``sum |terms|`` of the down sums (what
    a rounding flip of one intermediate can move an output by, relative)."""
    dt = x.dtype
    i = q13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    mag = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = (q13[e].double() @ x[t].double()) * s13[e].double()
            g, u = _to_16(gu[:i], dt, truncate), _to_16(gu[i:], dt, truncate)
            act = _to_16(_to_16(g * torch.sigmoid(g), dt, truncate) * u, dt, truncate)
            w = float(weights[t, j]) * s2[e].double()
            out[t] += (q2[e].double() @ act) * w
            mag[t] += (q2[e].double().abs() @ act.abs()) * w.abs()
    return out, mag


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each ``|v|`` (the output's final rounding)."""
    fin = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(fin.tiny)))) * fin.eps


@kernel
@pytest.mark.gpu
@pytest.mark.parametrize("t,dtype", [(1, torch.float32), (7, torch.float32),
                                     (5, torch.bfloat16)] + (
    [(300, torch.bfloat16), (64, torch.float16)] if ON_GPU else [(6, torch.float16)]))
def test_triton_fp8_moe_matches_reference(t, dtype):
    from tidal.worker.ops import triton_moe
    from tidal.worker.ops.moe_configs import GemmConfig, MoeConfig

    e, h, i = (8, 64, 48) if not ON_GPU else (8, 512, 384)
    _, _, q13, s13, q2, s2 = _experts(e, h, i, 5)
    weights, ids = _route(t, e, 2, 6)
    x = (torch.randn(t, h, generator=torch.Generator().manual_seed(7)) * 2).to(dtype)
    small = MoeConfig(16, GemmConfig(16, 16, 2, 4, 1), GemmConfig(16, 16, 2, 4, 1))
    args = [a.to(DEV) for a in (x, q13, q2, weights, ids)]
    y = triton_moe.fused_moe(*args, config=None if ON_GPU else small,
                             w13_scale=s13.to(DEV), w2_scale=s2.to(DEV))
    assert y.dtype == dtype and y.shape == (t, h)
    # Against the kernel's own rounding points in float64 (the interpreter truncates to
    # bfloat16), not against moe_torch: that rounds each expert's down projection to 16 bits
    # before the router weight too, which moves outputs whose terms cancel (|terms| in the
    # hundreds, sum near 0) by a large fraction of themselves (measured on an H100).
    ref, mag = _kernel_rounding_moe(x, q13, s13, q2, s2, weights, ids,
                                    truncate=INTERPRET and dtype == torch.bfloat16)
    err = (y.cpu().double() - ref).abs()
    eps = torch.finfo(dtype).eps / 2  # unit roundoff
    # Each output: its final rounding, plus float32 accumulation order against float64 (which
    # now and then flips one 16-bit intermediate by a unit: eps relative to |terms|). Float32
    # has no intermediate rounding: the sums' float32 error alone (measured <= 4 eps * mag).
    bound = _ulp(ref, dtype) + (8 if dtype == torch.float32 else 1) * eps * mag
    assert bool((err <= bound).all()), float((err / bound).max())
    if dtype != torch.float32:
        # And almost every output is the reference's to its last unit: a kernel that skipped
        # one of the roundings (or added one, as moe_torch does) gets 60-90% here, not 99%.
        exact = float((err <= _ulp(ref, dtype)).double().mean())
        assert exact >= 0.99, exact
    # The CPU path (moe_torch, rounding to nearest) stays within the same bound.
    if INTERPRET and dtype == torch.bfloat16:
        ref, mag = _kernel_rounding_moe(x, q13, s13, q2, s2, weights, ids)
        bound = _ulp(ref, dtype) + eps * mag
    torch_path = moe_torch.fused_moe(x, q13, q2, weights, ids, s13, s2).double()
    assert bool(((torch_path - ref).abs() <= bound).all())


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason=str(GPU_SKIP))
def test_gpu_kernels_route_fp8_experts_to_triton():
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for

    kernels = kernels_for(torch.device("cuda"), KernelConfig(ops="triton"))
    _, _, q13, s13, q2, s2 = _experts(8, 256, 128, 8)
    weights, ids = _route(4, 8, 2, 9)
    x = torch.randn(4, 256).bfloat16()
    y = kernels.fused_moe(x.cuda(), q13.cuda(), q2.cuda(), weights.cuda(), ids.cuda(),
                          s13.cuda(), s2.cuda())
    ref = moe_torch.fused_moe(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(y.cpu().float(), ref.float(), rtol=3e-2, atol=3e-2)


# --- a tiny Qwen3-MoE end to end (CPU) --------------------------------------------------------

def _fake(t: torch.Tensor) -> torch.Tensor:
    q, s = fp8_torch.quantize_rows(t.reshape(-1, t.shape[-1]))
    return (q.float() * s).reshape(t.shape).to(t.dtype)


def _fake_quant_moe_hf(hf):
    """HF with tidal's FP8 semantics: linears of the decoder layers W8A8 (weights per row,
    activations per token), experts weight-only per expert row, router and head untouched."""
    model = copy.deepcopy(hf)
    with torch.no_grad():
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Linear) and ".layers." in name:
                mod.weight.copy_(_fake(mod.weight))
                mod.register_forward_pre_hook(lambda m, a: (_fake(a[0]),))
            elif name.endswith("mlp.experts"):
                for p in mod.parameters():
                    p.copy_(_fake(p))
    return model


@pytest.mark.slow  # an engine and three HF greedy runs: ~15 s on two cores
def test_qwen3_moe_fp8_matches_fake_quantized_hf(tmp_path):
    from tests.reference import hf_greedy
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**{**mh.SHAPES, "num_hidden_layers": 2, "head_dim": 32,
                            "intermediate_size": 96, "moe_intermediate_size": 48,
                            "num_experts": 8, "mlp_only_layers": [1],
                            "tie_word_embeddings": False})
    tiny = mh.make_tiny_moe(cfg, tmp_path / "qwen3-moe", (11,))
    got = mh.generate(tiny.folder, tiny.prompts, quantization="fp8")
    ref_model = _fake_quant_moe_hf(tiny.hf)
    refs = [hf_greedy(ref_model, p, mh.NEW_TOKENS) for p in tiny.prompts]
    mh.assert_matches(got, refs, tiny.prompts, tol=2e-3)
    # The quantization is real: the 16-bit model's logprobs differ.
    assert mh.departs(got, tiny.refs)
