"""The one-row LoRA path (batch-1 decode): the shrink that stores its inputs' slices' partial
sums (``triton_lora.lora_shrink_partials``, which can norm the row itself) and the GEMV that
adds the adapter's expand before its epilogue (``triton_decode.gemv(lora=...)``), against
torch; and the layers' wiring (``NormLinear``, row-parallel linears, ``GatedActivation``),
which takes it for one row on the GPU only and otherwise runs the shrink / expand kernels
after the linear as before.

- the GEMV's LoRA term: one, two (gate/up, with SiLU or GeGLU after it: the term goes in before
  the activation) and three output slices (q/k/v of unequal sizes, blocks of rows straddling
  them), ranks below the slot rank, the norm prologue too, and a base-model token (slot -1):
  exactly the plain GEMV's bits;
- the layers, one decoder layer's four LoRA'd linears: the new path against the old one, only
  for one row, not while torch.compile traces, not under tensor parallelism or FP8 weights;
- on a GPU: Llama-3.1-8B shapes in bfloat16 against the old path, the kernel count, and a
  CUDA graph replaying slot ids written after capture.

Runs on a CUDA GPU, or on CPU under the Triton interpreter with tiny shapes (the layers' GPU
check replaced by a patch)::

    PYTHONPATH=<cpu triton> TRITON_INTERPRET=1 python -m pytest -q tests/worker/test_lora_gemv.py

and skips, saying why, where Triton cannot run.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("triton", reason="needs triton: the LoRA and GEMV kernels are written in it")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on CPU",
                allow_module_level=True)

from tidal.engine_core.kernel_config import KernelConfig  # noqa: E402
from tidal.worker.kernel_policy import building, kernels_for, reference_policy  # noqa: E402
from tidal.worker.layers.activation import SiluAndMul  # noqa: E402
from tidal.worker.layers.linear import (  # noqa: E402
    LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
from tidal.worker.layers.norm import RMSNorm  # noqa: E402
from tidal.worker.lora.layers import LoRAContext, LoRALayer  # noqa: E402
from tidal.worker.models.decoder import NormLinear  # noqa: E402
from tidal.worker.ops import lora_torch, torch_ops  # noqa: E402
from tidal.worker.ops import triton_decode as td  # noqa: E402
from tidal.worker.ops import triton_lora  # noqa: E402
from tidal.worker.ops.kernels import Kernels  # noqa: E402

ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = dict(rtol=2e-2, atol=5e-2) if ON_GPU else dict(rtol=1e-4, atol=1e-4)
EPS = 1e-6


@pytest.fixture(autouse=True)
def _gemv_on_cpu(monkeypatch):
    """Under the interpreter: the GEMV's launch-shape chooser asks for the GPU's SM count."""
    if INTERPRET:
        monkeypatch.setattr(td, "num_sms", lambda index: 8)
        monkeypatch.setattr(td, "device_index", lambda device: 0)


def _adapters(num_slots, rank, in_f, sizes, gen, low_rank=None, b_scale=0.3):
    """Slot buffers ``a`` [L, S*R, in], ``b`` [L, out, R] (slot 0 of rank ``low_rank``,
    zero-padded) and the slices' offsets."""
    s = len(sizes)
    a = torch.randn(num_slots, s * rank, in_f, generator=gen) / in_f ** 0.5
    b = torch.randn(num_slots, sum(sizes), rank, generator=gen) * b_scale
    if low_rank is not None:
        for k in range(s):
            a[0, k * rank + low_rank:(k + 1) * rank] = 0
        b[0, :, low_rank:] = 0
    offsets = tuple(sum(sizes[:i]) for i in range(s))
    return a.to(DEVICE, DTYPE), b.to(DEVICE, DTYPE), offsets


def _slots(slot: int) -> torch.Tensor:
    # (More entries than the one token, as the context's buffer has: only the first counts.)
    return torch.tensor([slot, 1, 0, 1], dtype=torch.int32, device=DEVICE)


def _lora_delta(h, a, b, slot, offsets, rank):
    """float64 [1, out]: h @ A_s^T @ B_s^T per slice (zeros for slot -1)."""
    out = torch.zeros(1, b.shape[1], dtype=torch.float64, device=h.device)
    if slot < 0:
        return out
    ends = offsets[1:] + (b.shape[1],)
    for s, (lo, hi) in enumerate(zip(offsets, ends)):
        xa = h.double() @ a[slot, s * rank:(s + 1) * rank].double().t()
        out[:, lo:hi] = xa @ b[slot, lo:hi].double().t()
    return out


# (name, in features, output slices, slot rank, adapter rank in slot 0, act, GEMV config)
GEMV_CASES = [
    ("one slice", 96, (40,), 8, 3, None, (4, 32, 4, 1)),
    ("q/k/v 32/8/8", 96, (32, 8, 8), 8, None, None, (4, 32, 4, 2)),
    ("q/k/v straddled", 80, (20, 6, 6), 16, 5, None, (8, 32, 4, 1)),
    ("gate/up + SiLU", 96, (24, 24), 16, 5, "silu", (4, 64, 4, 1)),
    ("gate/up + GeGLU", 96, (12, 12), 8, None, "gelu_tanh", (4, 32, 4, 1)),
]


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "norm_prologue"])
@pytest.mark.parametrize("slot", [1, 0, -1])
@pytest.mark.parametrize("case", GEMV_CASES, ids=[c[0] for c in GEMV_CASES])
def test_gemv_lora_term(case, slot, norm):
    """The GEMV with the LoRA term of the shrink's partial sums (three slices of the inputs)
    against the base product plus torch's LoRA delta; gated: act(gate + its delta) * (up + its
    delta). Slot -1: the plain GEMV's bits. Slot 0 holds a zero-padded lower-rank adapter."""
    _, in_f, sizes, rank, low_rank, act, config = case
    gen = torch.Generator().manual_seed(len(sizes) * 100 + in_f)
    n_total = sum(sizes)
    a, b, offsets = _adapters(3, rank, in_f, sizes, gen, low_rank)
    x = torch.randn(1, in_f, generator=gen).to(DEVICE, DTYPE)
    w = (torch.randn(n_total, in_f, generator=gen) / in_f ** 0.5).to(DEVICE, DTYPE)
    res = torch.randn(1, in_f, generator=gen).to(DEVICE, DTYPE)
    nw = (1 + 0.1 * torch.randn(in_f, generator=gen)).to(DEVICE, DTYPE)
    slots = _slots(slot)
    if norm:  # the GEMV norms x itself; the shrink norms the same row (stored h: the check)
        parts, h, _ = triton_lora.lora_shrink_partials(x, a, slots, norm_weight=nw,
                                                       residual=res, eps=EPS, split_k=3)
        kw = dict(norm_weight=nw, residual=res, eps=EPS)
    else:
        parts, h, _ = triton_lora.lora_shrink_partials(x, a, slots, split_k=3)
        kw = {}
    assert parts.shape[0] == 3
    lora = td.LoRAArgs(parts, b, slots, offsets, rank)
    gated = dict(silu=act == "silu", gelu=act == "gelu_tanh")
    y, new_res = td.gemv(x, w, config=config, lora=lora, **kw, **gated)
    base, base_res = td.gemv(x, w, config=config, **kw, **gated)
    if norm:
        assert torch.equal(new_res, base_res)
    if slot < 0:
        assert torch.equal(y, base)
        return
    pre = h.double() @ w.double().t() + _lora_delta(h, a, b, slot, offsets, rank)
    if act is None:
        ref = pre
    else:
        n = n_total // 2
        g, u = pre[:, :n], pre[:, n:]
        ref = (F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")) * u
        # (The term added after the activation instead would be far off: the check bites.)
        plain = h.double() @ w.double().t()
        actp = F.silu if act == "silu" else (lambda v: F.gelu(v, approximate="tanh"))
        wrong = actp(plain[:, :n]) * plain[:, n:] + _lora_delta(h, a, b, slot, offsets,
                                                                  rank)[:, :n]
        assert not torch.allclose(wrong, ref, **TOL)
    assert not torch.allclose(base.double(), ref, **TOL)  # the adapter changes the rows
    torch.testing.assert_close(y.double(), ref, **TOL)


def test_gemv_lora_refuses_fused_all_reduce_and_bad_buffers():
    x = torch.randn(1, 32, device=DEVICE, dtype=DTYPE)
    w = torch.randn(16, 32, device=DEVICE, dtype=DTYPE)
    a, b, offsets = _adapters(2, 4, 32, (16,), torch.Generator().manual_seed(0))
    parts, _, _ = triton_lora.lora_shrink_partials(x, a, _slots(0))
    lora = td.LoRAArgs(parts, b, _slots(0), offsets, 4)
    push = td.PushArgs(torch.zeros(2, dtype=torch.int64, device=DEVICE), 0, 2)
    with pytest.raises(ValueError, match="pushed or summed"):
        td.gemv(x, w, push=push, lora=lora)
    with pytest.raises(ValueError, match="does not fit"):
        td.gemv(x, w[:8], lora=lora)
    with pytest.raises(ValueError, match="partial sums"):
        td.gemv(x, w, lora=dataclasses.replace(lora, partials=parts.double()))


# --- the layers' wiring --------------------------------------------------------------------

# (hidden, head_dim, heads, kv_heads, intermediate, rank)
TINY_DIMS = SimpleNamespace(hidden=64, head_dim=16, heads=4, kv_heads=1, inter=48, rank=8)
LLAMA8B_DIMS = SimpleNamespace(hidden=4096, head_dim=128, heads=32, kv_heads=8, inter=14336,
                               rank=16)


def _kernels() -> Kernels:
    if ON_GPU:
        return kernels_for(DEVICE, KernelConfig(ops="triton"))
    # The GPU policy's kernels, on CPU tensors (the interpreter runs them).
    policy = dataclasses.replace(reference_policy(), decode_kernels=True, gemv=True,
                                 gemv_max_bytes=float("inf"), triton_lora=True)
    return Kernels(policy)


@pytest.fixture
def gpu_rules_on_cpu(monkeypatch):
    """On CPU: the one-row GEMV applies to CPU rows too (its GPU check patched out), so the
    layers' choices and the new path's numbers can be checked under the interpreter."""
    if INTERPRET:
        def applies(self, x, *weights):
            return self._gemv and x.dim() >= 1 and x.numel() == x.shape[-1]

        monkeypatch.setattr(Kernels, "gemv_applies", applies)


def _layer(kernels: Kernels, d: SimpleNamespace = TINY_DIMS, seed: int = 0):
    """One decoder layer's norms and LoRA'd linears, adapters in slots 0 (rank 5, padded) and
    1 of their LoRALayers."""
    gen = torch.Generator().manual_seed(seed)
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    with building(kernels):
        ln1, ln2 = RMSNorm(d.hidden, EPS, DTYPE), RMSNorm(d.hidden, EPS, DTYPE)
        qkv = QKVParallelLinear(d.hidden, d.head_dim, d.heads, d.kv_heads, False, DTYPE)
        o = RowParallelLinear(q, d.hidden, False, DTYPE)
        gate_up = MergedColumnParallelLinear(d.hidden, [d.inter, d.inter], False, DTYPE)
        down = RowParallelLinear(d.inter, d.hidden, False, DTYPE)
        act = SiluAndMul()
    ctx = LoRAContext(4, DEVICE)
    for lin, sizes in ((qkv, (q, kv, kv)), (o, (d.hidden,)), (gate_up, (d.inter, d.inter)),
                       (down, (d.hidden,))):
        lin.to(DEVICE)
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=gen)
                              / lin.in_features ** 0.5)
        lora = LoRALayer(("p",) * len(sizes), sizes, lin.in_features, 3, d.rank, DTYPE,
                         DEVICE, ctx, kernels)
        a, b, _ = _adapters(3, d.rank, lin.in_features, sizes, gen, low_rank=5)
        lora.a.copy_(a)
        lora.b.copy_(b)
        lin.lora = lora
    for ln in (ln1, ln2):
        ln.to(DEVICE)
        ln.weight.data.copy_(1 + 0.1 * torch.randn(d.hidden, generator=gen))
    return SimpleNamespace(ln1=ln1, ln2=ln2, qkv=qkv, o=o, gate_up=gate_up, down=down,
                           act=act, ctx=ctx, q=q, norm_qkv=NormLinear(ln1, qkv),
                           norm_gate_up=NormLinear(ln2, gate_up, silu=True))


def _run_layer(layer, x, residual, project=True):
    """The decoder layer's linears in order (attention replaced by q's rows); ``project``:
    the MLP again as ``DecoderMLP.forward`` runs it (``GatedActivation.project``)."""
    qkv, residual = layer.norm_qkv(x, residual)
    o = layer.o(qkv[..., :layer.q].contiguous(), True)
    act, residual = layer.norm_gate_up(o, residual)
    down = layer.down(act, True)
    outs = [qkv, o, act, residual, down]
    return outs + [layer.act.project(layer.gate_up, down)] if project else outs


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of the new path (``LoRALayer.gemv``)."""
    calls = []
    original = LoRALayer.gemv

    def gemv(self, *args, **kwargs):
        calls.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LoRALayer, "gemv", gemv)
    return calls


@pytest.mark.parametrize("first", [True, False], ids=["no_residual", "residual"])
@pytest.mark.parametrize("slot", [1, 0, -1])
def test_layer_new_path_matches_old(gpu_rules_on_cpu, spy, monkeypatch, slot, first):
    """One row: every LoRA'd linear takes the new path (five calls: q/k/v, o, gate/up with
    SiLU, down, gate/up projected), with the old path's results."""
    layer = _layer(_kernels())
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, TINY_DIMS.hidden, generator=gen).to(DEVICE, DTYPE)
    residual = (None if first
                else torch.randn(1, TINY_DIMS.hidden, generator=gen).to(DEVICE, DTYPE))
    layer.ctx.token_slots[0] = slot
    new = _run_layer(layer, x, residual)
    assert len(spy) == 5
    monkeypatch.setattr(LinearBase, "lora_gemv_applies", lambda self, *a, **k: False)
    old = _run_layer(layer, x, residual)
    assert len(spy) == 5
    for got, want, name in zip(new, old, ["qkv", "o", "act", "residual", "down", "project"]):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def test_layer_old_path_elsewhere(gpu_rules_on_cpu, spy, monkeypatch):
    """Two rows; a torch.compile trace; tensor parallelism; FP8 weights; no GEMV on CPU rows
    (the reference kernels): the adapters' products after the linear, as before."""
    layer = _layer(_kernels())
    layer.ctx.token_slots[:2] = 1
    two = torch.randn(2, TINY_DIMS.hidden, device=DEVICE, dtype=DTYPE)
    _run_layer(layer, two, None)
    assert spy == []
    one = two[:1].clone()
    assert layer.qkv.lora_gemv_applies(one)
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not layer.qkv.lora_gemv_applies(one)
    with monkeypatch.context() as m:
        m.setattr(layer.o, "tp", SimpleNamespace(world_size=2))
        assert not layer.o.lora_gemv_applies(one)
    with monkeypatch.context() as m:
        m.setattr(layer.down, "weight_scale", nn.Parameter(
            torch.ones(TINY_DIMS.hidden, 1, device=DEVICE), requires_grad=False))
        assert not layer.down.lora_gemv_applies(
            torch.randn(1, TINY_DIMS.inter, dtype=DTYPE, device=DEVICE))
    # A norm weight of another dtype, a residual of another shape: the old path.
    assert not layer.qkv.lora_gemv_applies(one, None, layer.ln1.weight.double())
    assert not layer.qkv.lora_gemv_applies(one, None, layer.ln1.weight, two)
    if not ON_GPU:
        cpu = _layer(Kernels(reference_policy()))
        cpu.ctx.token_slots[0] = 1
        _run_layer(cpu, one, None)
        assert spy == []


def test_shrink_partials_store_the_normed_row_once():
    """Several blocks of outputs and slices of the inputs: every element of h and of the new
    residual written (the outputs start as NaN), equal to torch's."""
    gen = torch.Generator().manual_seed(3)
    a, _, _ = _adapters(2, 48, 200, (8, 8, 8), gen)  # S*R = 144: three blocks of 64
    x = torch.randn(1, 200, generator=gen).to(DEVICE, DTYPE)
    res = torch.randn(1, 200, generator=gen).to(DEVICE, DTYPE)
    nw = torch.randn(200, generator=gen).to(DEVICE, DTYPE)
    junk = torch.full((4096,), float("nan"), device=DEVICE)
    del junk
    parts, h, new_res = triton_lora.lora_shrink_partials(x, a, _slots(1), norm_weight=nw,
                                                         residual=res, eps=EPS, split_k=4)
    ref_h, ref_res = torch_ops.fused_add_rms_norm(x, res, nw, EPS)
    assert parts.shape == (4, 1, 144)
    torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
    torch.testing.assert_close(h, ref_h, rtol=8e-3 if ON_GPU else 1e-5, atol=1e-5)
    torch.testing.assert_close(parts.sum(0).double(),
                               lora_torch.lora_shrink(h.double(), a.double(), _slots(1)[:1]),
                               **TOL)


# --- GPU: Llama-3.1-8B shapes -------------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (8B shapes are too slow to "
                                            "interpret)")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("slot", [1, 0, -1])
def test_gpu_llama8b_new_path_matches_old(spy, monkeypatch, slot):
    """Llama-3.1-8B's q/k/v, o, gate/up and down with rank-16 adapters in bfloat16: the new
    path against the old (shrink / expand after the linear) on the same inputs, on the
    default GPU policy (norm apart from the large GEMVs on the old path)."""
    d = LLAMA8B_DIMS
    layer = _layer(kernels_for(DEVICE, KernelConfig(ops="triton")), d, seed=1)
    gen = torch.Generator().manual_seed(7)

    def row(n):
        return torch.randn(1, n, generator=gen).to(DEVICE, DTYPE)

    x, residual, attn, act = row(d.hidden), row(d.hidden), row(layer.q), row(d.inter)
    layer.ctx.token_slots[0] = slot

    def run():
        qkv, res = layer.norm_qkv(x, residual)
        gated, res2 = layer.norm_gate_up(x, residual)
        return [qkv, res, layer.o(attn, True), gated, res2, layer.down(act, True)]

    new = run()
    assert len(spy) == 4
    monkeypatch.setattr(LinearBase, "lora_gemv_applies", lambda self, *a, **k: False)
    old = run()
    for got, want, name in zip(new, old, ["qkv", "residual", "o", "gate/up", "residual",
                                          "down"]):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=5e-2,
                                   msg=lambda m: f"{name}: {m}")
    if slot >= 0:  # (the adapters' terms are large enough to fail a path that drops them)
        base = layer.down.base_matmul(act, None)
        assert not torch.allclose(base.float(), new[-1].float(), rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@gpu
def test_gpu_kernel_count_and_graph_replay(monkeypatch):
    """Two kernels per LoRA'd linear (the old path ran up to six), and a CUDA graph captured
    with slot -1 replays the adapter of the slot written after capture."""
    layer = _layer(kernels_for(DEVICE, KernelConfig(ops="triton")))
    x = torch.randn(1, TINY_DIMS.hidden, device=DEVICE, dtype=DTYPE)
    residual = torch.randn(1, TINY_DIMS.hidden, device=DEVICE, dtype=DTYPE)
    layer.ctx.token_slots[0] = 1
    layer.norm_gate_up(x, residual)  # compile outside the profile and the capture
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        layer.norm_gate_up(x, residual)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 2, [e.name for e in kernels]
    eager = layer.norm_gate_up(x, residual)[0].clone()

    layer.ctx.token_slots[0] = -1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = layer.norm_gate_up(x, residual)
    layer.ctx.token_slots[0] = 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
