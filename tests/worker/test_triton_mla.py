"""The Triton MLA kernels (``ops.triton_mla``) against their plain-torch references
(``ops.mla_torch``): the absorbed decode over a paged latent cache (split and unsplit, several
head groups, a padding request with no context, pages scattered in the pool) and the latent
write (padding slots skipped); on the GPU, a captured decode replayed as the contexts grow.

Runs on a CUDA GPU, or on the CPU under the Triton interpreter
(``PYTHONPATH=/work/tritoncpu TRITON_INTERPRET=1``) with tiny shapes; skips otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not torch.cuda.is_available() and not _INTERPRET:
    pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1 (the Triton interpreter) to run the "
                "MLA kernels", allow_module_level=True)
pytest.importorskip("triton", reason="needs triton: the MLA kernels are written in it")

from tidal.worker.ops import mla_torch  # noqa: E402
from tidal.worker.ops import triton_mla  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Interpreter: tiny latent sizes (non-powers of two to exercise the masks); GPU: V2-Lite's.
SHAPE = dict(r=24, dr=8, page=4) if DEVICE.type == "cpu" else dict(r=512, dr=64, page=16)


def _pool(num_blocks: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    d = SHAPE["r"] + SHAPE["dr"]
    return torch.randn(num_blocks, SHAPE["page"], d, generator=gen).to(DEVICE, dtype)


def _tables(seq_lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    page = SHAPE["page"]
    width = max(1, max(-(-n // page) for n in seq_lens))
    # Every request's pages drawn at random from the pool (shared pages are fine for reads).
    perm = torch.randperm(num_blocks, generator=gen)
    rows = [perm[(i * width) % num_blocks:][:width] for i in range(len(seq_lens))]
    rows = [torch.cat((r, perm[:width - r.numel()])) for r in rows]
    return torch.stack(rows).to(DEVICE, torch.int32)


@pytest.mark.parametrize("heads,seq_lens,splits", [
    (3, [1, 7, 13], 1),          # fewer heads than a head group; contexts within a few pages
    (20, [33, 0, 70], 3),        # two head groups; a padding request; more splits than tiles
    (16, [65], None),            # the default split count
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_decode_matches_reference(heads: int, seq_lens: list[int], splits: int | None,
                                      dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 31 + len(seq_lens))
    r, dr = SHAPE["r"], SHAPE["dr"]
    num_blocks = 48
    cache = _pool(num_blocks, dtype, gen)
    table = _tables(seq_lens, num_blocks, gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(seq_lens), heads, r + dr, generator=gen).to(DEVICE, dtype)
    scale = (r + dr) ** -0.5
    got = triton_mla.mla_decode(q, cache, table, lens, scale, r, num_splits=splits)
    want = mla_torch.mla_decode(q, cache, table, lens, scale, r)
    assert got.shape == (len(seq_lens), heads, r) and got.dtype == dtype
    tol = 2e-2 if dtype == torch.float16 or DEVICE.type == "cuda" else 1e-5
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(got[i], torch.zeros_like(got[i]))


def test_write_latent_matches_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    r, dr, page = SHAPE["r"], SHAPE["dr"], SHAPE["page"]
    t = 6
    latent = torch.randn(t, r, generator=gen).to(DEVICE)
    # A strided rope key, as the layer's split of the kv_a projection leaves it.
    k_rope = torch.randn(t, 2 * dr, generator=gen).to(DEVICE)[:, :dr]
    slots = torch.tensor([5, -1, 0, 17, -1, 3 * page + 1], dtype=torch.int64, device=DEVICE)
    got = torch.zeros(6, page, r + dr, device=DEVICE)
    want = torch.zeros_like(got)
    triton_mla.write_latent(latent, k_rope, got, slots)
    mla_torch.write_latent(latent, k_rope, want, slots)
    assert torch.equal(got, want)
    assert torch.count_nonzero(got.view(-1, r + dr).abs().sum(-1)) == 4  # padding not written


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a GPU")
def test_mla_decode_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed after the contexts grew: the split count and every launch depend
    on the batch shape only, as a captured decode step needs."""
    gen = torch.Generator().manual_seed(9)
    r, dr = SHAPE["r"], SHAPE["dr"]
    cache = _pool(64, torch.bfloat16, gen)
    table = _tables([200, 200], 64, gen)
    lens = torch.tensor([3, 17], dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, 16, r + dr, generator=gen).to(DEVICE, torch.bfloat16)
    scale = (r + dr) ** -0.5
    triton_mla.mla_decode(q, cache, table, lens, scale, r)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_mla.mla_decode(q, cache, table, lens, scale, r)
    for grown in ([40, 9], [199, 150]):
        lens.copy_(torch.tensor(grown, dtype=torch.int32))
        graph.replay()
        want = mla_torch.mla_decode(q, cache, table, lens, scale, r)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
