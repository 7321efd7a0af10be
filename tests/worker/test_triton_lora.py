"""The Triton LoRA kernels (``triton_lora``) against the torch reference (``lora_torch``):
shrink and expand, per-token and segmented, with one, two and three output slices (o / down,
gate / up, q / k / v), ranks below the slot rank (zero-padded), base-model tokens (-1) left
untouched; a shrink into a zeroed block of the step's scratch; float32 sums expanded into a
bfloat16 output; the one-row path's shrink of partial sums, norming its row or not
(``test_lora_gemv.py`` has the GEMV that reads them); on a GPU also at Llama-3.1-8B shapes in
bfloat16, through the kernel policy, and under CUDA-graph capture.

Runs on a CUDA GPU, or on CPU under the Triton interpreter with tiny shapes::

    PYTHONPATH=<cpu triton> TRITON_INTERPRET=1 python -m pytest -q tests/worker/test_triton_lora.py

and skips, saying why, where Triton cannot run.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("triton", reason="needs triton: the LoRA kernels are written in it")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not INTERPRET:
    pytest.skip("needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on CPU",
                allow_module_level=True)

from tidal.worker.lora.layers import LoRASegments  # noqa: E402
from tidal.worker.ops import lora_torch, triton_lora  # noqa: E402

ON_GPU = torch.cuda.is_available() and not INTERPRET
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


def segments_of(slots: torch.Tensor) -> LoRASegments:
    """Runs of equal non-negative slots (what the LoRA manager builds per eager step)."""
    s = slots.cpu().numpy()
    runs, start = [], 0
    for i in range(1, len(s) + 1):
        if i == len(s) or s[i] != s[start]:
            if s[start] >= 0:
                runs.append((start, i - start, s[start]))
            start = i
    arr = np.array(runs, dtype=np.int32).T.reshape(3, -1)
    # (Separate tensors: the Triton interpreter misreads views at a storage offset.)
    start, length, slot = (torch.tensor(row, device=slots.device) for row in arr)
    return LoRASegments(start, length, slot, len(runs), max((r[1] for r in runs), default=0))


def _case(num_slots, rank, in_f, sizes, slots, dtype, seed=0, low_rank=None):
    gen = torch.Generator().manual_seed(seed)
    s = len(sizes)
    a = torch.randn(num_slots, s * rank, in_f, generator=gen)
    b = torch.randn(num_slots, sum(sizes), rank, generator=gen) * 0.1
    if low_rank is not None:  # an adapter of a smaller rank, zero-padded in its slot
        for k in range(s):
            a[0, k * rank + low_rank:(k + 1) * rank] = 0
        b[0, :, low_rank:] = 0
    x = torch.randn(len(slots), in_f, generator=gen)
    y = torch.randn(len(slots), sum(sizes), generator=gen)
    offsets = tuple(int(v) for v in np.cumsum([0] + list(sizes[:-1])))
    to = dict(device=DEVICE, dtype=dtype)
    return (x.to(**to), a.to(**to), b.to(**to), y.to(**to),
            torch.tensor(slots, dtype=torch.int32, device=DEVICE), offsets)


TINY = [
    # (slots, rank, in, output slices, per-token slot ids)
    (2, 8, 48, (40,), [0, -1, 1, 1, 0]),
    (3, 16, 32, (24, 24), [2, 2, 2, -1, 0, 1]),
    (4, 8, 64, (32, 16, 16), [0] * 17 + [-1] * 3 + [3] * 18 + [1]),
    # Slices wider than the expand's blocks of outputs: most blocks meet one slice.
    (2, 8, 32, (96, 64, 64), [1, 1, 0, -1, 1]),
]


@pytest.mark.parametrize("kind", ["per_token", "per_token_split", "segmented",
                                  "segmented_split", "per_token_split_out",
                                  "segmented_out", "segmented_split_out"])
@pytest.mark.parametrize("case", range(len(TINY)))
def test_triton_matches_torch(case, kind):
    """``*_split``: the inputs in slices summed atomically (what a small decode batch runs on
    a GPU; the tiny shapes here would not split on their own). ``*_out``: into a zeroed block
    of a larger buffer (the LoRA context's scratch), not an output of its own."""
    num_slots, rank, in_f, sizes, slots = TINY[case]
    x, a, b, y, slot_t, offsets = _case(num_slots, rank, in_f, sizes, slots, torch.float32,
                                        seed=case, low_rank=rank // 2)
    segmented = kind.startswith("segmented")
    segs = segments_of(slot_t) if segmented else None
    ref_xa = lora_torch.lora_shrink(x, a, slot_t)
    out = None
    if kind.endswith("_out"):
        t, sr = x.shape[0], a.shape[1]
        scratch = torch.full((3 * t * sr,), float("nan"), device=DEVICE)
        scratch[t * sr:2 * t * sr] = 0.0
        out = scratch[t * sr:2 * t * sr].view(t, sr)
    xa = triton_lora.lora_shrink(x, a, slot_t, segs,
                                 split_k=2 if "split" in kind else None, out=out)
    if out is not None:
        assert xa.data_ptr() == out.data_ptr() and xa.dtype == torch.float32
        assert scratch[:t * sr].isnan().all() and scratch[2 * t * sr:].isnan().all()
    torch.testing.assert_close(xa, ref_xa, rtol=1e-4, atol=1e-4)
    assert not xa[slot_t < 0].any()  # base tokens: nothing
    ref_y, got_y = y.clone(), y.clone()
    lora_torch.lora_expand(ref_y, ref_xa, b, slot_t, offsets, rank)
    triton_lora.lora_expand(got_y, ref_xa, b, slot_t, offsets, rank, segs)
    torch.testing.assert_close(got_y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_y[slot_t < 0], y[slot_t < 0], rtol=0, atol=0)


@pytest.mark.parametrize("split_k", [None, 2])
@pytest.mark.parametrize("case", range(len(TINY)))
def test_grouped_tiles_match_torch(case, split_k):
    """Tokens sorted by adapter and cut in tiles (``lora.grouping``), the kernels reading them
    through the permutation, as a grouped decode graph does: the per-token results (with the
    inputs split in slices, as a GPU's grouped decode batch of a few tiles has them, too)."""
    from tidal.worker.lora.grouping import group_tokens

    num_slots, rank, in_f, sizes, slots = TINY[case]
    slots = slots[::-1] + slots  # adapters interleaved, not in runs
    x, a, b, y, slot_t, offsets = _case(num_slots, rank, in_f, sizes, slots, torch.float32,
                                        seed=case)
    perm, starts, lengths, tile_slots = group_tokens(np.array(slots, dtype=np.int32), 4)
    pad = 3  # the fixed table's unused tiles: length 0
    dev = dict(dtype=torch.int32, device=DEVICE)

    def table(v, fill=0):
        return torch.tensor(list(v) + [fill] * pad, **dev)

    segs = LoRASegments(table(starts), table(lengths), table(tile_slots), len(starts) + pad, 4,
                        perm=torch.tensor(perm.tolist(), **dev))
    ref_xa = lora_torch.lora_shrink(x, a, slot_t)
    xa = triton_lora.lora_shrink(x, a, slot_t, segs, split_k=split_k)
    torch.testing.assert_close(xa, ref_xa, rtol=1e-4, atol=1e-4)
    ref_y, got_y = y.clone(), y.clone()
    lora_torch.lora_expand(ref_y, ref_xa, b, slot_t, offsets, rank)
    triton_lora.lora_expand(got_y, xa, b, slot_t, offsets, rank, segs)
    torch.testing.assert_close(got_y, ref_y, rtol=1e-4, atol=1e-4)


def test_expand_precision():
    """Exact products for a float32 model; float32 sums into 16-bit outputs in three TF32
    products (one would drop ~13 of the sums' bits); 16-bit sums need nothing more."""
    f32, b16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert triton_lora._expand_precision(f32, f32) == "ieee"
    assert triton_lora._expand_precision(f32, b16) == "tf32x3"
    assert triton_lora._expand_precision(b16, b16) == "tf32"


def test_shrink_rejects_an_unfit_out():
    x, a, _, _, slot_t, _ = _case(2, 8, 48, (40,), [0, 1], torch.float32)
    for bad in (torch.zeros(2, 9, device=DEVICE), torch.zeros(2, 8, dtype=torch.float16,
                                                               device=DEVICE)):
        with pytest.raises(ValueError, match="lora_shrink: out"):
            triton_lora.lora_shrink(x, a, slot_t, out=bad)


@pytest.mark.parametrize("case", range(len(TINY)))
def test_segmented_expand_of_float32_sums_into_bf16(case):
    """A split shrink's float32 sums expanded into a bfloat16 output (a GPU's grouped decode
    batch): within the output's rounding of the float32 reference."""
    num_slots, rank, in_f, sizes, slots = TINY[case]
    x, a, b, y, slot_t, offsets = _case(num_slots, rank, in_f, sizes, slots, torch.float32,
                                        seed=case)
    b16, y16 = b.to(torch.bfloat16), y.to(torch.bfloat16)
    xa = lora_torch.lora_shrink(x, a, slot_t)
    ref = y16.float()
    lora_torch.lora_expand(ref, xa, b16.float(), slot_t, offsets, rank)
    got = y16.clone()
    triton_lora.lora_expand(got, xa, b16, slot_t, offsets, rank, segments_of(slot_t))
    torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-2)
    assert torch.equal(got[slot_t < 0], y16[slot_t < 0])


@pytest.mark.parametrize("norm", ["none", "norm", "add_norm"])
@pytest.mark.parametrize("split_k", [None, 3])
@pytest.mark.parametrize("case", range(len(TINY)))
def test_shrink_partials_match_torch(case, split_k, norm):
    """The one-row path's shrink (``lora_shrink_partials``): its slices' partial sums, summed,
    are the reference's shrink of the row it normed (``norm``: ``rms_norm(x)``; ``add_norm``:
    ``rms_norm(x + residual)``), which it returns (with the new residual) as torch_ops has
    them; base-model tokens get zeros in every slice. Several tokens, though the engine calls
    it for one."""
    from tidal.worker.ops import torch_ops

    num_slots, rank, in_f, sizes, slots = TINY[case]
    x, a, _, _, slot_t, _ = _case(num_slots, rank, in_f, sizes, slots, torch.float32,
                                  seed=case, low_rank=rank // 2)
    gen = torch.Generator().manual_seed(case + 10)
    nw = torch.randn(in_f, generator=gen).to(DEVICE)
    res = torch.randn(x.shape, generator=gen).to(DEVICE)
    kw = {} if norm == "none" else dict(norm_weight=nw, eps=1e-6)
    if norm == "add_norm":
        kw["residual"] = res
    parts, h, new_res = triton_lora.lora_shrink_partials(x, a, slot_t, split_k=split_k, **kw)
    if norm == "none":
        ref_h, ref_res = x, None
    elif norm == "norm":
        ref_h, ref_res = torch_ops.rms_norm(x, nw, 1e-6), x
    else:
        ref_h, ref_res = torch_ops.fused_add_rms_norm(x, res, nw, 1e-6)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    if ref_res is None:
        assert new_res is None
    else:
        torch.testing.assert_close(new_res, ref_res, rtol=0, atol=0)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (len(slots), len(sizes) * rank)
    if split_k is not None and in_f > 32:  # (32 inputs are one block: one slice)
        assert parts.shape[0] > 1
    torch.testing.assert_close(parts.sum(0), lora_torch.lora_shrink(ref_h, a, slot_t),
                               rtol=1e-4, atol=1e-4)
    assert not parts[:, slot_t < 0].any()


def test_torch_reference_matches_per_token_math():
    """The reference itself against the definition, token by token."""
    num_slots, rank, in_f, sizes, slots = TINY[2]
    x, a, b, y, slot_t, offsets = _case(num_slots, rank, in_f, sizes, slots, torch.float32)
    xa = lora_torch.lora_shrink(x, a, slot_t)
    out = y.clone()
    lora_torch.lora_expand(out, xa, b, slot_t, offsets, rank)
    ends = offsets[1:] + (sum(sizes),)
    for t, s in enumerate(slots):
        if s < 0:
            assert torch.equal(out[t], y[t])
            continue
        for k, (lo, hi) in enumerate(zip(offsets, ends)):
            part = x[t] @ a[s, k * rank:(k + 1) * rank].t() @ b[s, lo:hi].t()
            torch.testing.assert_close(out[t, lo:hi], y[t, lo:hi] + part, rtol=1e-4, atol=1e-4)


# --- GPU: Llama-3.1-8B shapes -----------------------------------------------------------------

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (8B shapes are too slow to "
                                            "interpret)")
LLAMA8B = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)),
           "gate_up": (4096, (14336, 14336)), "down": (14336, (4096,))}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layer", list(LLAMA8B))
@pytest.mark.parametrize("tokens,mode", [(64, "per_token"), (1, "per_token"),
                                         (600, "segmented"), (64, "grouped"), (256, "grouped")])
def test_gpu_llama8b_shapes(layer, tokens, mode):
    """``grouped``: a decode batch sorted by adapter in tiles, as ``lora_grouped_min_tokens``
    runs it (its few tiles split the shrink's inputs)."""
    from tidal.worker.lora.grouping import group_tokens

    in_f, sizes = LLAMA8B[layer]
    rng = np.random.default_rng(0)
    if mode == "segmented":  # prompts of a few adapters and the base model, in runs
        slots = np.repeat(rng.integers(-1, 8, 6), rng.multinomial(tokens, [1 / 6] * 6))
    else:
        slots = rng.integers(-1, 8, tokens)
    x, a, b, y, slot_t, offsets = _case(8, 16, in_f, sizes, slots.tolist(), torch.bfloat16)
    segs = segments_of(slot_t) if mode == "segmented" else None
    if mode == "grouped":
        perm, starts, lengths, tile_slots = group_tokens(slots.astype(np.int32), 16)
        dev = dict(dtype=torch.int32, device=DEVICE)
        segs = LoRASegments(torch.tensor(starts.tolist(), **dev),
                            torch.tensor(lengths.tolist(), **dev),
                            torch.tensor(tile_slots.tolist(), **dev), len(starts), 16,
                            perm=torch.tensor(perm.tolist(), **dev))
    ref_xa = lora_torch.lora_shrink(x.float(), a.float(), slot_t)
    xa = triton_lora.lora_shrink(x, a, slot_t, segs)
    torch.testing.assert_close(xa.float(), ref_xa, rtol=2e-2, atol=2e-1)
    ref_y = y.float().clone()
    lora_torch.lora_expand(ref_y, xa.float(), b.float(), slot_t, offsets, 16)
    got = y.clone()
    triton_lora.lora_expand(got, xa, b, slot_t, offsets, 16, segs)
    torch.testing.assert_close(got.float(), ref_y, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("layer", list(LLAMA8B))
def test_gpu_llama8b_shrink_partials(layer):
    """The one-row path's shrink at batch 1, Llama-3.1-8B shapes (its default slices of the
    inputs), norming the row before q/k/v and gate/up as the engine runs it: the per-token
    shrink's sums of the same row."""
    from tidal.worker.ops import torch_ops

    in_f, sizes = LLAMA8B[layer]
    x, a, _, _, slot_t, _ = _case(8, 16, in_f, sizes, [3], torch.bfloat16)
    kw = {}
    if layer in ("qkv", "gate_up"):
        nw = torch.ones(in_f, device=DEVICE, dtype=torch.bfloat16)
        kw = dict(norm_weight=nw, residual=torch.randn_like(x), eps=1e-5)
    parts, h, res = triton_lora.lora_shrink_partials(x, a, slot_t, **kw)
    assert parts.shape[0] > 1
    if kw:
        ref_h, ref_res = torch_ops.fused_add_rms_norm(x, kw["residual"], nw, 1e-5)
        torch.testing.assert_close(res, ref_res, rtol=0, atol=0)
        torch.testing.assert_close(h, ref_h, rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(parts.sum(0), triton_lora.lora_shrink(h, a, slot_t),
                               rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@gpu
def test_gpu_policy_dispatch_and_graph_capture():
    """The GPU policy picks the Triton kernels; a captured per-token shrink + expand replays
    with the slot ids written into its buffer after capture."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import kernels_for

    kernels = kernels_for(torch.device("cuda"), KernelConfig(), None, None)
    assert kernels.policy.triton_lora
    x, a, b, y, slot_t, offsets = _case(4, 16, 256, (128, 64, 64), [0] * 32, torch.bfloat16)
    slots = torch.full((32,), -1, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(y)

    def run():
        out.copy_(y)
        kernels.lora_expand(out, kernels.lora_shrink(x, a, slots), b, slots, offsets, 16)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    slots.copy_(torch.tensor([0, 1, 2, 3, -1, 1, 2, 3] * 4, dtype=torch.int32))
    graph.replay()
    ref = y.float().clone()
    lora_torch.lora_expand(ref, lora_torch.lora_shrink(x.float(), a.float(), slots),
                           b.float(), slots, offsets, 16)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=5e-2)
