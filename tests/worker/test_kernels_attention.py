"""Triton and CUDA paged attention (and their K/V cache writes) against the torch reference.

Batches are built the way the model runner builds them: a flat run of tokens, decodes first,
block tables whose block ids are shuffled and scattered over a cache with unused blocks, plus
padding requests (no query, no context) and padding tokens (slot -1). Unused cache blocks and the
slots past each context are NaN, so a kernel that reads outside a request's context poisons its
output; outputs start as NaN, so an unwritten row fails too. Errors are measured per request as
||out - ref|| / ||ref|| against a float64 reference.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU: the Triton/CUDA attention kernels run only on one",
        allow_module_level=True,
    )
pytest.importorskip("triton", reason="needs triton: the Triton attention backend is written in it")

from tidal.worker.attention.backend import AttentionMetadata  # noqa: E402
from tidal.worker.attention.torch_backend import (  # noqa: E402
    paged_attention_reference,
    write_kv_reference,
)

DEVICE = torch.device("cuda")
NUM_HEADS = 16
BLOCK_SIZE = 16
# ||out - ref|| / ||ref|| per request. bf16: 8 mantissa bits on the output and on the softmax
# weights fed to the P.V product (about 2e-3 each); fp16: 11 bits; fp32: IEEE dot products.
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 3e-3, torch.float32: 1e-4}


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    q_lens: list[int]
    seq_lens: list[int]


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    pad_reqs: int = 0,
    pad_tokens: int = 0,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> Batch:
    """A flat batch; requests with q_len 1 must come first (num_decodes counts them)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    q_lens = list(q_lens) + [0] * pad_reqs
    seq_lens = list(seq_lens) + [0] * pad_reqs
    num_reqs = len(q_lens)
    need = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(need) + max(8, sum(need) // 2)  # unused blocks are holes between requests
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    max_blocks = max(need + [1]) + 2
    nan_block = ids.pop()  # table entries past a request's context point at an all-NaN block
    table = torch.full((num_reqs, max_blocks), nan_block, dtype=torch.int32)
    used: list[int] = []
    for i, n in enumerate(need):
        row = [ids.pop() for _ in range(n)]
        used += row
        table[i, :n] = torch.tensor(row, dtype=torch.int32)

    kv = torch.randn((2, num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), generator=gen)
    keep = torch.zeros(num_blocks, dtype=torch.bool)
    keep[used] = True
    kv[:, ~keep] = float("nan")
    for i, s in enumerate(seq_lens):  # slots past the context in the last block
        if s % BLOCK_SIZE:
            kv[:, int(table[i, s // BLOCK_SIZE]), s % BLOCK_SIZE :] = float("nan")

    num_tokens = sum(q_lens) + pad_tokens
    query = torch.randn((num_tokens, NUM_HEADS, head_dim), generator=gen)
    qsl = np.zeros(num_reqs + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(q_lens)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    for i, (q, s) in enumerate(zip(q_lens, seq_lens)):
        for j in range(q):
            pos = s - q + j
            block = int(table[i, pos // BLOCK_SIZE])
            slots[int(qsl[i]) + j] = block * BLOCK_SIZE + pos % BLOCK_SIZE
    num_decodes = 0
    while num_decodes < num_reqs and q_lens[num_decodes] == 1:
        num_decodes += 1
    seq_np = np.asarray(seq_lens, dtype=np.int32)
    meta = AttentionMetadata(
        num_actual_tokens=sum(q_lens),
        num_reqs=num_reqs,
        max_query_len=max(q_lens + [0]),
        max_seq_len=max(seq_lens + [0]),
        query_start_loc=torch.from_numpy(qsl).to(device),
        seq_lens=torch.from_numpy(seq_np).to(device),
        block_table=table.to(device),
        slot_mapping=slots.to(device),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_np,
        num_decodes=num_decodes,
    )
    return Batch(query.to(device, dtype), kv.to(device, dtype), meta, q_lens, seq_lens)


def reference_out(batch: Batch, scale: float, window: int | None = None,
                  cap: float | None = None) -> torch.Tensor:
    ref = torch.zeros(batch.query.shape, dtype=torch.float64, device=batch.query.device)
    paged_attention_reference(batch.query.double(), batch.kv_cache.double(), batch.meta, scale, ref,
                              window, cap)
    return ref


def request_errors(out: torch.Tensor, ref: torch.Tensor, batch: Batch) -> list[float]:
    qsl = batch.meta.query_start_loc_cpu
    errs = []
    for i, (q, s) in enumerate(zip(batch.q_lens, batch.seq_lens)):
        if q == 0 or s == 0:
            continue
        o = out[int(qsl[i]) : int(qsl[i + 1])].double()
        r = ref[int(qsl[i]) : int(qsl[i + 1])]
        errs.append(float((o - r).norm() / r.norm()))
    return errs


def run_and_check(impl, batch: Batch, dtype: torch.dtype, label: str, window: int | None = None,
                  cap: float | None = None) -> None:
    head_dim = batch.query.shape[-1]
    scale = head_dim**-0.5
    out = torch.full_like(batch.query, float("nan"))
    if window is None and cap is None:
        impl.forward(batch.query, batch.kv_cache, batch.meta, scale, out)
    else:
        impl.forward(batch.query, batch.kv_cache, batch.meta, scale, out, sliding_window=window,
                     logits_soft_cap=cap)
    torch.cuda.synchronize()
    ref = reference_out(batch, scale, window, cap)
    errs = request_errors(out, ref, batch)
    worst = max(errs)
    assert worst < TOL[dtype], f"{label}: worst request error {worst:.3g} (all: {errs})"


def mixed_case(rng: random.Random) -> tuple[list[int], list[int]]:
    """Decodes (one at 8k context) first, then a prefill chunk that is the tail of a longer
    context, a whole prompt, a medium chunk and a few speculative-style tokens."""
    decode_ctx = [8192, 1, 17, rng.randint(2, 4000), rng.randint(100, 3000)]
    q_lens = [1] * len(decode_ctx) + [37, 300, 130, 3]
    seq_lens = decode_ctx + [3000, 300, 1100, 50]
    return q_lens, seq_lens


COMBOS = [
    # (dtype, head_dim, queries per KV head): every GQA ratio, head size and dtype appears.
    (torch.bfloat16, 128, 2),
    (torch.bfloat16, 128, 8),
    (torch.bfloat16, 64, 1),
    (torch.bfloat16, 64, 4),
    (torch.float16, 128, 4),
    (torch.float16, 128, 1),
    (torch.float16, 64, 8),
    (torch.float16, 64, 2),
]
FP32_COMBOS = [(torch.float32, 128, 4), (torch.float32, 64, 1)]
# Gemma's 256-wide heads (the Triton backend; their decode plan has its own warp count).
WIDE_COMBOS = [(torch.bfloat16, 256, 2)]


def _id(c: tuple[torch.dtype, int, int]) -> str:
    return f"{str(c[0]).removeprefix('torch.')}-d{c[1]}-gqa{c[2]}"


def _seed(c: tuple[torch.dtype, int, int]) -> int:
    return sum(map(ord, _id(c)))  # stable across processes, unlike hash()


def _impl(name: str):
    if name == "triton":
        from tidal.worker.attention.triton_attn import TritonAttention

        return TritonAttention()
    from tidal.worker.attention.cuda_attn import CudaAttention

    return CudaAttention()


def _check_backend(name: str, combo: tuple[torch.dtype, int, int], seed: int,
                   window: int | None = None, cap: float | None = None) -> None:
    dtype, head_dim, qpk = combo
    kv_heads = NUM_HEADS // qpk
    impl = _impl(name)
    rng = random.Random(seed)
    opts = dict(window=window, cap=cap)
    q_lens, seq_lens = mixed_case(rng)
    batch = make_batch(
        q_lens, seq_lens, kv_heads, head_dim, dtype, pad_reqs=2, pad_tokens=5, seed=seed
    )
    _poison_outside_windows(batch, window)
    run_and_check(impl, batch, dtype, f"{name} mixed", **opts)
    # Small decode batch: few (request, KV head) pairs, so the context is split.
    ctx = [rng.randint(1, 8192) for _ in range(3)] + [8192]
    batch = make_batch(
        [1] * 4, ctx, kv_heads, head_dim, dtype, pad_reqs=1, pad_tokens=2, seed=seed + 1
    )
    _poison_outside_windows(batch, window)
    run_and_check(impl, batch, dtype, f"{name} decode split", **opts)
    # Wide decode batch: enough programs that the context is not split.
    n = max(4, 300 // kv_heads)
    ctx = [rng.randint(1, 700) for _ in range(n)]
    batch = make_batch([1] * n, ctx, kv_heads, head_dim, dtype, seed=seed + 2)
    _poison_outside_windows(batch, window)
    run_and_check(impl, batch, dtype, f"{name} decode wide", **opts)


def _poison_outside_windows(batch: Batch, window: int | None) -> None:
    """NaN into the cache positions that lie in whole 128-position runs before the first query's
    window of each request: a kernel must skip those tiles (any tile width divides 128), not
    load them (a masked score still multiplies a NaN value by 0)."""
    if window is None:
        return
    for i, (q, s) in enumerate(zip(batch.q_lens, batch.seq_lens)):
        end = max(0, s - q - window + 1) // 128 * 128
        for pos in range(0, end, BLOCK_SIZE):
            batch.kv_cache[:, int(batch.meta.block_table[i, pos // BLOCK_SIZE])] = float("nan")


@pytest.mark.parametrize("combo", COMBOS + FP32_COMBOS + WIDE_COMBOS, ids=_id)
def test_triton_attention_matches_reference(combo) -> None:
    _check_backend("triton", combo, seed=_seed(combo))


# (window, soft-cap): windows far shorter than the contexts (tiles skipped, tiles straddling
# the window start masked, splits starting mid-context), a window of one position, windows longer
# than every context (must equal no window), a soft-cap small enough to reshape the softmax of
# unit-variance scores, and both together.
WINDOW_CASES = [(100, None), (1, None), (777, None), (20000, None), (None, 1.0), (300, 2.0)]
WINDOW_COMBOS = [(torch.bfloat16, 128, 4), (torch.float16, 64, 2), (torch.float32, 128, 8)]


@pytest.mark.parametrize("window,cap", WINDOW_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("combo", WINDOW_COMBOS, ids=_id)
def test_triton_window_and_soft_cap_match_reference(combo, window, cap) -> None:
    _check_backend("triton", combo, seed=_seed(combo) + 5, window=window, cap=cap)


def test_window_and_soft_cap_cases_change_the_reference() -> None:
    """The cases above would let a kernel that ignores the options pass unless the options change
    the answer: they do (and a window past every context changes nothing)."""
    q_lens, seq_lens = mixed_case(random.Random(1))
    batch = make_batch(q_lens, seq_lens, 4, 64, torch.float32, seed=1)
    scale = 64**-0.5
    plain = reference_out(batch, scale)
    for window, cap in WINDOW_CASES:
        diff = float((reference_out(batch, scale, window, cap) - plain).abs().max())
        if window is not None and window >= max(seq_lens) and cap is None:
            assert diff == 0.0
        else:
            assert diff > 1e-2, (window, cap)


def test_triton_window_prefill_only_chunks() -> None:
    impl = _impl("triton")
    q_lens = [64, 65, 1, 127, 500]
    seq_lens = [64, 2000, 5, 127, 7000]
    batch = make_batch(q_lens, seq_lens, 8, 128, torch.bfloat16, pad_reqs=1, seed=6)
    _poison_outside_windows(batch, 96)
    run_and_check(impl, batch, torch.bfloat16, "triton window prefill", window=96, cap=30.0)


def _cuda_ext_or_fail():
    from tidal.worker.ops.cuda_ext import build_result

    result = build_result()
    assert result.module is not None, f"CUDA extension failed to build: {result.error}"
    return result.module


@pytest.mark.parametrize("combo", COMBOS, ids=_id)
def test_cuda_attention_matches_reference(combo) -> None:
    _cuda_ext_or_fail()
    _check_backend("cuda", combo, seed=17 + _seed(combo))


def test_prefill_only_chunks() -> None:
    """Prefill-only batch (no decodes): long prompt tails, one request per q block boundary."""
    impl = _impl("triton")
    q_lens = [64, 65, 1, 127, 500]  # the lone 1 sits mid-batch: not a "decode" for num_decodes
    seq_lens = [64, 2000, 5, 127, 7000]
    batch = make_batch(q_lens, seq_lens, 8, 128, torch.bfloat16, pad_reqs=1, seed=5)
    run_and_check(impl, batch, torch.bfloat16, "triton prefill")
    _cuda_ext_or_fail()
    run_and_check(_impl("cuda"), batch, torch.bfloat16, "cuda prefill")


@pytest.mark.parametrize("name,window,cap", [("triton", None, None), ("cuda", None, None),
                                             ("triton", 200, None), ("triton", 1000, 3.0)])
def test_decode_replays_in_cuda_graph(name: str, window: int | None, cap: float | None) -> None:
    """Capture one decode step, grow every context in place, replay: same answer as eager.
    A window is a per-layer constant captured with the launch; the window start moves with
    each context."""
    if name == "cuda":
        _cuda_ext_or_fail()
    impl = _impl(name)
    opts = {} if window is None and cap is None else dict(sliding_window=window,
                                                           logits_soft_cap=cap)
    dtype, head_dim, kv_heads = torch.bfloat16, 128, 8
    final_ctx = [3000, 40, 1500, 8000]
    big = make_batch([1] * 4, final_ctx, kv_heads, head_dim, dtype, pad_reqs=2, seed=11)
    meta = big.meta
    seq_lens = meta.seq_lens.clone()
    meta.seq_lens.copy_(torch.tensor([17, 1, 300, 64, 0, 0], dtype=torch.int32))
    out = torch.full_like(big.query, float("nan"))
    scale = head_dim**-0.5
    impl.forward(big.query, big.kv_cache, meta, scale, out, **opts)  # warm-up: compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.forward(big.query, big.kv_cache, meta, scale, out, **opts)
    meta.seq_lens.copy_(seq_lens)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_out(big, scale, window, cap)
    worst = max(request_errors(out, ref, big))
    assert worst < TOL[dtype], f"{name} graph replay: worst request error {worst:.3g}"


def _kv_inputs(num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    """key/value as strided slices of one fused QKV projection output, like the model's."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn((num_tokens, (NUM_HEADS + 2 * kv_heads) * head_dim), generator=gen)
    qkv = qkv.to(DEVICE, dtype)
    k = qkv[:, NUM_HEADS * head_dim : (NUM_HEADS + kv_heads) * head_dim]
    v = qkv[:, (NUM_HEADS + kv_heads) * head_dim :]
    return k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim)


@pytest.mark.parametrize("name", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("head_dim,kv_heads", [(128, 8), (64, 2)])
def test_write_kv_matches_reference(
    name: str, dtype: torch.dtype, head_dim: int, kv_heads: int
) -> None:
    if name == "cuda":
        _cuda_ext_or_fail()
    impl = _impl(name)
    num_blocks, num_tokens = 64, 300
    gen = torch.Generator().manual_seed(head_dim + kv_heads)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:40]] = -1  # padding tokens
    key, value = _kv_inputs(num_tokens, kv_heads, head_dim, dtype, seed=3)
    cache = torch.randn((2, num_blocks, BLOCK_SIZE, kv_heads, head_dim), generator=gen)
    cache = cache.to(DEVICE, dtype)
    expected = cache.clone()
    slot_mapping = slots.to(DEVICE)
    write_kv_reference(key, value, expected, slot_mapping)
    meta = AttentionMetadata(
        num_actual_tokens=num_tokens,
        num_reqs=0,
        max_query_len=0,
        max_seq_len=0,
        query_start_loc=torch.zeros(1, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.zeros(0, dtype=torch.int32, device=DEVICE),
        block_table=torch.zeros((0, 1), dtype=torch.int32, device=DEVICE),
        slot_mapping=slot_mapping,
        query_start_loc_cpu=np.zeros(1, dtype=np.int32),
        seq_lens_cpu=np.zeros(0, dtype=np.int32),
    )
    impl.write_kv(key, value, cache, meta)
    torch.cuda.synchronize()
    assert torch.equal(cache, expected), f"{name} write_kv differs from the reference scatter"


def test_selector_picks_gpu_backends() -> None:
    from tidal.worker.attention.selector import get_attention_impl

    assert get_attention_impl(None, DEVICE).name == "triton"
    assert get_attention_impl("triton", DEVICE).name == "triton"
    assert get_attention_impl("torch", DEVICE).name == "torch"
    _cuda_ext_or_fail()
    assert get_attention_impl("cuda", DEVICE).name == "cuda"
