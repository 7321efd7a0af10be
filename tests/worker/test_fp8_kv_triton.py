"""The Triton kernels with an FP8 KV cache against the torch reference
(``attention.torch_backend``, whose semantics ``test_fp8_kv_cache.py`` checks in float64): the
quantizing K/V write, mixed prefill / decode attention, decode-only attention unsplit and split
(flash-decoding, with the preloaded first tile), the fused norm / rotary / K-V write against
its float32 semantics, and on a GPU a whole tiny model with CUDA graphs against the torch
attention path (log-probabilities, teacher-forced).

Runs on a CUDA GPU (bfloat16 queries), or on the CPU under the Triton interpreter
(``PYTHONPATH=/work/tritoncpu TRITON_INTERPRET=1``, float32 queries, tiny shapes); skips
otherwise."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not _INTERPRET:
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1 (the Triton interpreter) to run the "
                "FP8 KV cache kernels", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton: the attention kernels are written in it")

from tidal.worker.attention.backend import AttentionMetadata  # noqa: E402
from tidal.worker.attention.fp8_kv import FP8_KV_DTYPE  # noqa: E402
from tidal.worker.attention.torch_backend import (  # noqa: E402
    paged_attention_reference,
    write_kv_reference,
)
from tidal.worker.ops import triton_attention_kernels as tk  # noqa: E402
from tidal.worker.ops.attention_plan import (  # noqa: E402
    TritonAttentionPlan,
    next_pow2,
    plan_triton_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
DTYPE = torch.bfloat16 if GPU else torch.float32
# Interpreter: tiny heads (one not a power of two: the masked head_dim path); GPU: real ones.
HEAD_DIMS = (128, 64) if GPU else (16, 12)
BLOCK = 16 if GPU else 4
HEADS = 8 if GPU else 4
# ||out - ref|| / ||ref||: bf16 rounding of the dequantized K/V in the reference against the
# kernel's folded scales, plus bf16 P.V; float32: IEEE dot products.
TOL = 2e-2 if GPU else 1e-4
K_SCALE, V_SCALE = 0.03, 0.011
NAN_BYTE = 0x7F  # an e4m3fn NaN


def _batch(q_lens: list[int], seq_lens: list[int], kv_heads: int, head_dim: int, seed: int):
    """An FP8 cache holding each request's context (written by the torch reference), its
    metadata with shuffled blocks, unused blocks and slots past a context all NaN, and queries.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(need) + 6
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need + [1]) + 1
    nan_block = perm.pop()
    table = torch.full((len(q_lens), width), nan_block, dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    cache = torch.empty((2, num_blocks, BLOCK, kv_heads, head_dim), dtype=FP8_KV_DTYPE)
    cache.view(torch.uint8).fill_(NAN_BYTE)
    ks, vs = torch.tensor([K_SCALE]), torch.tensor([V_SCALE])
    for i, s in enumerate(seq_lens):
        k = torch.randn(s, kv_heads, head_dim, generator=gen) * 4
        v = torch.randn(s, kv_heads, head_dim, generator=gen)
        slots = torch.tensor([int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(s)],
                             dtype=torch.int64)
        write_kv_reference(k, v, cache, slots, ks, vs)
    qsl = np.zeros(len(q_lens) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q_lens)
    seq = np.asarray(seq_lens, dtype=np.int32)
    query = torch.randn(int(qsl[-1]), HEADS, head_dim, generator=gen)
    meta = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(q_lens), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), query_start_loc=torch.from_numpy(qsl).to(DEVICE),
        seq_lens=torch.from_numpy(seq).to(DEVICE), block_table=table.to(DEVICE),
        slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.int64, device=DEVICE),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq,
        num_decodes=sum(1 for q in q_lens if q == 1))
    return (query.to(DEVICE, DTYPE), cache.to(DEVICE), meta, ks.to(DEVICE), vs.to(DEVICE))


def _decode_plan(num_reqs: int, kv_heads: int, splits: int, widen: str = "query",
                 tile_n: int = 64) -> TritonAttentionPlan:
    return TritonAttentionPlan(decode_only=True, block_q=1,
                               block_m=max(16, next_pow2(HEADS // kv_heads)),
                               tile_n=tile_n if GPU else 8, num_splits=splits, num_warps=4,
                               num_stages=1, grid0=num_reqs, fp8_widen=widen)


def _check(query, cache, meta, ks, vs, plan) -> None:
    scale = query.shape[-1] ** -0.5
    out = torch.full_like(query, float("nan"))
    tk.paged_attention(query, cache[0], cache[1], meta.block_table, meta.seq_lens,
                       meta.query_start_loc, meta.num_reqs, scale, out, plan,
                       k_scale=ks, v_scale=vs)
    ref = torch.empty_like(query)
    paged_attention_reference(query, cache, meta, scale, ref, k_scale=ks, v_scale=vs)
    qsl = meta.query_start_loc_cpu
    for i in range(meta.num_reqs):
        a, b = int(qsl[i]), int(qsl[i + 1])
        got, want = out[a:b].double(), ref[a:b].double()
        assert torch.isfinite(got).all(), f"request {i}: NaN (read outside its context?)"
        err = float((got - want).norm() / want.norm())
        assert err < TOL, (i, err)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_write_kv_quantizes_like_the_reference(head_dim, kv_heads):
    gen = torch.Generator().manual_seed(head_dim + kv_heads)
    n, num_blocks = 7, 6
    key = (torch.randn(n, kv_heads, head_dim, generator=gen) * 5).to(DTYPE)
    value = torch.randn(n, kv_heads, head_dim, generator=gen).to(DTYPE)
    key[1, 0, 0] = 100.0  # saturates: 100 / 0.03 > 448
    value[2, -1, -1] = -50.0
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:n]
    slots[3] = -1  # a padding token writes nothing
    ks, vs = torch.tensor([K_SCALE]), torch.tensor([V_SCALE])
    ref = torch.zeros((2, num_blocks, BLOCK, kv_heads, head_dim), dtype=FP8_KV_DTYPE)
    write_kv_reference(key, value, ref, slots, ks, vs)
    got = torch.zeros_like(ref).to(DEVICE)
    tk.write_kv(key.to(DEVICE), value.to(DEVICE), got[0], got[1], slots.to(DEVICE),
                ks.to(DEVICE), vs.to(DEVICE))
    differ = got.cpu().view(torch.uint8) != ref.view(torch.uint8)
    if _INTERPRET:
        # Triton 3.6's interpreter (runtime/interpreter.py, _convert_float) drops the carry
        # into the exponent when rounding up to a power of two: 31.4 becomes 16, not 32. The
        # GPU's cvt.rn.satfinite has no such bug, and there every byte must match.
        r, g = ref.float(), got.cpu().float()
        carry_bug = (g == r / 2) & (r.abs() == torch.exp2(torch.log2(r.abs()).round()))
        differ &= ~carry_bug
    assert not differ.any(), f"{int(differ.sum())} cache bytes differ from the reference"
    flat = got.cpu()[0].view(-1, kv_heads, head_dim)
    assert float(flat[int(slots[1]), 0, 0]) == 448.0
    assert float(got.cpu()[1].view(-1, kv_heads, head_dim)[int(slots[2]), -1, -1]) == -448.0


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_mixed_prefill_and_decode_attention(head_dim, kv_heads):
    # Two decodes, a prefill chunk over earlier context, a whole prompt, odd lengths.
    q_lens, seq_lens = [1, 1, 6, 9], [13, 5, 19, 9]
    query, cache, meta, ks, vs = _batch(q_lens, seq_lens, kv_heads, head_dim, seed=head_dim)
    plan = plan_triton_attention(
        num_tokens=query.shape[0], num_reqs=len(q_lens), max_query_len=max(q_lens),
        num_heads=HEADS, num_kv_heads=kv_heads, head_dim=head_dim, dtype=DTYPE, device=DEVICE)
    _check(query, cache, meta, ks, vs, plan)


@pytest.mark.parametrize("widen", ["query", "f16", "f16_vt"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_decode_attention_unsplit_and_split(splits, head_dim, widen):
    # (On a GPU "f16" / "f16_vt" widen the tiles to float16; float32 queries on the CPU keep
    # float32 whatever the plan says.)
    kv_heads = 2
    seq_lens = [1, 23, 9] if not GPU else [1, 700, 129]
    query, cache, meta, ks, vs = _batch([1] * len(seq_lens), seq_lens, kv_heads, head_dim,
                                        seed=splits)
    _check(query, cache, meta, ks, vs, _decode_plan(len(seq_lens), kv_heads, splits, widen))


@pytest.mark.skipif(not GPU, reason="128-position tiles: GPU shapes (the interpreter's are tiny)")
@pytest.mark.parametrize("widen", ["query", "f16", "f16_vt"])
def test_decode_attention_wide_tiles(widen):
    seq_lens = [1, 700, 129, 128, 255]
    query, cache, meta, ks, vs = _batch([1] * len(seq_lens), seq_lens, 2, 128, seed=7)
    _check(query, cache, meta, ks, vs, _decode_plan(len(seq_lens), 2, 1, widen, tile_n=128))


def test_scales_are_read_at_run_time():
    """A changed scale tensor changes the next launch's result (CUDA-graph safe: no value is
    baked into the launch)."""
    query, cache, meta, ks, vs = _batch([1], [10], 1, HEAD_DIMS[0], seed=5)
    plan = _decode_plan(1, 1, 1)
    scale = query.shape[-1] ** -0.5
    outs = []
    for v in (V_SCALE, 2 * V_SCALE):
        vs.fill_(v)
        out = torch.empty_like(query)
        tk.paged_attention(query, cache[0], cache[1], meta.block_table, meta.seq_lens,
                           meta.query_start_loc, 1, scale, out, plan, k_scale=ks, v_scale=vs)
        outs.append(out.double())
    torch.testing.assert_close(outs[1], 2 * outs[0], rtol=1e-2, atol=1e-4)


# Log-probabilities of one token in one context from two attention paths. The tiny models'
# logits are bfloat16, so a logprob moves in steps of 2^-7 .. 2^-5 (logits of size 1 .. 8),
# and their greedy choices are often that close (top-2 gaps of 0 and 0.008 measured on the
# CPU): exact token equality between two paths is no sound check, with either cache dtype.
# FP8 KV itself moves these logprobs by up to 0.06 against a bfloat16 cache (CPU, torch
# attention); two paths over the same FP8 cache must stay well within TEACHER_TOL of each other.
# A wrong scale, slot or block changes them by whole nats.
TEACHER_TOL = 0.1


def _assert_paths_agree(got, ref, tol: float, label: str) -> None:
    """``got`` and ``ref`` (CompletionOutputs with logprobs) generated greedily from one prompt:
    while their tokens agree (the same context) each token's logprob agrees within ``tol``;
    where they first part, the two choices are a near-tie (within ``tol``) on both sides."""
    for s, (a, b) in enumerate(zip(got.token_ids, ref.token_ids)):
        la, lb = got.logprobs[s], ref.logprobs[s]
        if a == b:
            assert abs(la[a].logprob - lb[a].logprob) <= tol, (label, s, la, lb)
            continue
        assert a in lb and b in la, (label, s, "not a near-tie", la, lb)
        assert lb[b].logprob - lb[a].logprob <= tol, (label, s, la, lb)
        assert la[a].logprob - la[b].logprob <= tol, (label, s, la, lb)
        return


@pytest.mark.skipif(not GPU, reason="the whole engine with CUDA graphs needs a GPU")
def test_tiny_model_with_cuda_graphs_matches_torch_attention(tiny_models):
    from tidal.frontend import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = [[5, 17, 99, 3, 250, 41], [7] * 3 + list(range(20, 60)), [1, 2]]
    for family in ("llama", "qwen3"):
        folder, _ = tiny_models[family]
        for kv_dtype in ("fp8", "auto"):  # auto: the bfloat16 cache, for contrast
            label = f"{family}/{kv_dtype}"
            outs = {}
            forced = []
            for name, kw in (("torch", dict(attention_backend="torch", enforce_eager=True)),
                             ("graphs", {})):
                llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64,
                          device="cuda", dtype="bfloat16", kv_cache_dtype=kv_dtype, **kw)
                try:
                    outs[name] = [o.outputs[0]
                                  for o in llm.generate(prompts, params, use_tqdm=False)]
                    if name == "graphs":
                        # Teacher forcing: the torch path's whole continuation, scored by this
                        # engine as a prompt (prompt logprobs bypass the prefix cache).
                        seqs = [p + list(o.token_ids) for p, o in zip(prompts, outs["torch"])]
                        forced = llm.generate(seqs, SamplingParams(
                            temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
                finally:
                    llm.shutdown()
            for i, (p, ref) in enumerate(zip(prompts, outs["torch"])):
                _assert_paths_agree(outs["graphs"][i], ref, TEACHER_TOL, f"{label}/{i}")
                scored = forced[i].prompt_logprobs[len(p):]
                assert len(scored) == len(ref.token_ids)
                for s, (tok, lp) in enumerate(zip(ref.token_ids, scored)):
                    assert abs(lp[tok].logprob - ref.logprobs[s][tok].logprob) <= TEACHER_TOL, \
                        (label, i, s, lp[tok], ref.logprobs[s][tok])


def _assert_fp8_close(got: torch.Tensor, ref: torch.Tensor, label: str,
                      slack: torch.Tensor | float = 0.0, few: bool = True) -> None:
    """FP8 caches equal up to one e4m3 step where the two sides' float32 math lands on either
    side of a rounding boundary (``few``: in a few entries at most). ``slack`` (e4m3 units, per
    entry): how far apart the values may be before quantization."""
    g, r = got.cpu().float(), ref.cpu().float()
    differ = g != r
    if _INTERPRET:  # see test_write_kv_quantizes_like_the_reference
        differ &= ~((g == r / 2) & (r.abs() == torch.exp2(torch.log2(r.abs()).round())))
    step = (g - r).abs() <= torch.maximum(g.abs(), r.abs()) / 8 + 2.0**-9 + slack
    assert bool((step | ~differ).all()), f"{label}: an entry is off by more than one step"
    if few:
        assert int(differ.sum()) <= max(2, differ.numel() // 100), f"{label}: {int(differ.sum())}"


def _norm_rope_float32(x: torch.Tensor, w: torch.Tensor | None, eps: float, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused kernel's stated math for heads ``x [T, H, D]`` (``_norm_rope_heads``): the
    RMSNorm rounded to ``x.dtype`` where torch's rounds (normalised, then times the weight),
    the rotation in float32 with float32 cos / sin, unrounded. Also each output's magnitude
    ``|x1| |cos| + |x2| |sin|``: a one-unit change of a rounded input moves it by eps times that."""
    dt = x.dtype
    x = x.float()
    if w is not None:
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x = ((x * inv).to(dt).float() * w.float()).to(dt).float()
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None], sin[:, None]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    mag = torch.cat((x1.abs() * c.abs() + x2.abs() * s.abs(),
                     x2.abs() * c.abs() + x1.abs() * s.abs()), dim=-1)
    return out, mag


def _ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fin = torch.finfo(dtype)
    return torch.exp2(torch.floor(torch.log2(v.abs().clamp_min(fin.tiny)))) * fin.eps


@pytest.mark.parametrize("norm", [False, True])
def test_fused_rotary_write_quantizes_like_the_reference(norm):
    from tidal.worker.layers.rotary import build_cos_sin_cache
    from tidal.worker.ops import torch_ops
    from tidal.worker.ops import triton_decode as td

    gen = torch.Generator().manual_seed(7 + norm)
    heads, kv_heads, head_dim = (8, 2, 128) if GPU else (4, 2, 16)
    page, blocks, t = BLOCK, 8, 5
    cs = build_cos_sin_cache(head_dim, 512, 1e4, None).to(DEVICE)
    qkv = (torch.randn((t, (heads + 2 * kv_heads) * head_dim), generator=gen) * 3).to(DEVICE, DTYPE)
    pos = torch.randint(0, 512, (t,), generator=gen).to(DEVICE)
    qw = torch.randn(head_dim, generator=gen).to(DEVICE, DTYPE) if norm else None
    kw = torch.randn(head_dim, generator=gen).to(DEVICE, DTYPE) if norm else None
    slots = torch.randperm(blocks * page, generator=gen)[:t]
    slots[2] = -1
    slots = slots.to(DEVICE)
    ks = torch.tensor([K_SCALE], device=DEVICE)
    vs = torch.tensor([V_SCALE], device=DEVICE)
    shape = (2, blocks, page, kv_heads, head_dim)
    ref = torch.zeros(shape, dtype=FP8_KV_DTYPE, device=DEVICE)
    got = torch.zeros_like(ref)
    args = (pos, heads, kv_heads, head_dim, qw, kw, 1e-6, cs)
    q_ref = torch_ops.qk_norm_rope_write_kv(qkv, *args, ref, slots, k_scale=ks, v_scale=vs)
    assert td.qk_norm_rope_supported(qkv, head_dim, cs, True, got)
    q = td.qk_norm_rope_write_kv(qkv, *args, got, slots, k_scale=ks, v_scale=vs)

    # The kernel against its stated semantics, computed here in float32 on the CPU from the
    # same inputs: q and K rounded once to the model dtype after the rotation, K quantized
    # from that. Not against torch_ops directly: that rotates as HF does, with cos / sin and
    # each product rounded to bfloat16, which moves outputs whose two terms cancel by several
    # bfloat16 units of their own size, and so K by more than one e4m3 step (on an H100).
    cpu = qkv.cpu()
    cos, sin = cs.cpu()[pos.cpu().long()].chunk(2, dim=-1)
    parts = cpu.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    x_q, x_k, x_v = (p.reshape(t, -1, head_dim) for p in parts)
    want_q, mag_q = _norm_rope_float32(x_q, None if qw is None else qw.cpu(), 1e-6, cos, sin)
    want_k, mag_k = _norm_rope_float32(x_k, None if kw is None else kw.cpu(), 1e-6, cos, sin)
    want = torch.zeros(shape, dtype=FP8_KV_DTYPE)
    write_kv_reference(want_k.to(DTYPE), x_v, want, slots.cpu(), ks.cpu(), vs.cpu())
    # Each entry's magnitude where it is stored (a plain float cache of the same layout).
    k_mag = torch.zeros(shape, dtype=torch.float32)
    write_kv_reference(mag_k, torch.zeros_like(mag_k), k_mag, slots.cpu())
    eps = torch.finfo(DTYPE).eps
    # q: its own rounding, plus a one-unit flip of a normed input (float32 on both sides,
    # but rsqrt and the sums' order differ) scaled by the rotation.
    want_q16 = want_q.to(DTYPE).double()
    err = (q.cpu().double() - want_q16).abs()
    assert bool((err <= _ulp(want_q16, DTYPE) + eps * mag_q).all()), "q"
    if DTYPE != torch.float32:
        exact = float((err <= _ulp(want_q16, DTYPE)).double().mean())
        assert exact >= 0.99, exact  # (torch_ops' extra roundings measure ~94 % here)
    _assert_fp8_close(got[0], want[0], "K", eps * k_mag[0] / K_SCALE)
    _assert_fp8_close(got[1], want[1], "V")

    # torch_ops (the CPU path) agrees with that too, up to its bfloat16 rotation: cos / sin
    # and both products rounded (eps / 2 of the magnitude each) and the sum (half a unit).
    err = (q_ref.cpu().double() - want_q16).abs()
    assert bool((err <= _ulp(want_q16, DTYPE) + 2 * eps * mag_q).all()), "torch_ops q"
    _assert_fp8_close(ref[0], want[0], "torch_ops K", 2 * eps * k_mag[0] / K_SCALE, few=False)
    _assert_fp8_close(ref[1], want[1], "torch_ops V")
    assert got.float().abs().max() > 0  # something was written
    with pytest.raises(ValueError, match="k_scale"):
        td.qk_norm_rope_write_kv(qkv, *args, got, slots)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 20.0), (4, 30.0)])
def test_window_and_soft_cap_with_fp8_cache(window, cap):
    q_lens, seq_lens = [1, 4, 7], [11, 13, 7]
    head_dim = HEAD_DIMS[0]
    query, cache, meta, ks, vs = _batch(q_lens, seq_lens, 2, head_dim, seed=11)
    scale = head_dim**-0.5
    plan = plan_triton_attention(
        num_tokens=query.shape[0], num_reqs=len(q_lens), max_query_len=max(q_lens),
        num_heads=HEADS, num_kv_heads=2, head_dim=head_dim, dtype=DTYPE, device=DEVICE)
    out = torch.full_like(query, float("nan"))
    tk.paged_attention(query, cache[0], cache[1], meta.block_table, meta.seq_lens,
                       meta.query_start_loc, meta.num_reqs, scale, out, plan,
                       sliding_window=window, logits_soft_cap=cap, k_scale=ks, v_scale=vs)
    ref = torch.empty_like(query)
    paged_attention_reference(query, cache, meta, scale, ref, window, cap, ks, vs)
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < TOL, err
