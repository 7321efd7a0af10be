"""The signal-free all-reduce kernel (``ops.triton_allreduce``) with the ranks simulated on one
GPU: each rank's receive buffer is plain device memory, and each rank's kernel runs on its own
stream so they run at once (every rank waits for the others' values). The result must be, on
every rank, exactly the float32 sum in rank order rounded once, over ragged sizes, inputs of
negative zero and many rounds (the buffers must come back re-armed, the parities alternate);
and with a residual added and the RMSNorm's sums of squares returned.
``test_lamport_allreduce_gpu.py`` runs it across real GPUs against NCCL, in CUDA graphs too."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU: the all-reduce kernel runs only on one",
                allow_module_level=True)
pytest.importorskip("triton", reason="needs triton: the all-reduce kernel is written in it")

from tidal.worker.ops import triton_allreduce as ta  # noqa: E402

DEVICE = torch.device("cuda")
ROW = 4096 * 64  # elements per rank row in the simulated buffers (the kernel's limit)


def reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """Negative zeros sent as positive, summed in float32 in rank order, rounded once."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32, device=DEVICE)
    for x in xs:
        acc = acc + torch.where(x == 0, torch.zeros_like(x), x).float()
    return acc.to(xs[0].dtype)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_rank_gets_the_rank_order_sum(world: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(world)
    bufs = torch.full((world, 2, world, ROW), ta.SENTINEL, dtype=torch.int16, device=DEVICE)
    ptrs = torch.tensor([bufs[r].data_ptr() for r in range(world)], device=DEVICE)
    counts = torch.zeros((world, ta.MAX_PROGRAMS), dtype=torch.int32, device=DEVICE)
    streams = [torch.cuda.Stream() for _ in range(world)]
    sizes = [4096, 1, 1000, ROW, 513, 4096, 7]  # odd count: the parities drift per program
    for rnd in range(3):
        for n in sizes:
            xs = [(torch.randn(n, generator=gen, device=DEVICE) * (r + 1)).to(dtype)
                  for r in range(world)]
            xs[0][: n // 3] = -0.0  # sent as +0.0
            if n > 3:
                for x in xs:
                    x[1] = -0.0  # all negative zeros: the sum comes out +0.0
            outs = [torch.full_like(x, float("nan")) for x in xs]
            torch.cuda.synchronize()
            for r in range(world):
                with torch.cuda.stream(streams[r]):
                    ta.lamport_all_reduce(xs[r], outs[r], ptrs, counts[r], r, world, ROW)
            torch.cuda.synchronize()
            want = reference(xs)
            label = f"round {rnd}, {n} elements"
            for r in range(world):
                assert torch.equal(outs[r].view(torch.int16), want.view(torch.int16)), \
                    f"{label}: rank {r}"
            assert bool((bufs == ta.SENTINEL).all()), f"{label}: buffers not re-armed"
    programs = -(-max(sizes) // ta.CHUNK)
    calls = [sum(1 for n in sizes if n > p * ta.CHUNK) * 3 for p in range(programs)]
    assert counts[:, :programs].tolist() == [calls] * world


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_residual_and_sums_of_squares(dtype: torch.dtype) -> None:
    """With a residual the all-reduce returns sum + residual (exactly the add of
    ``fused_add_rms_norm``) and each chunk's sum of squares of that row."""
    world = 2
    gen = torch.Generator(device=DEVICE).manual_seed(21)
    bufs = torch.full((world, 2, world, ROW), ta.SENTINEL, dtype=torch.int16, device=DEVICE)
    ptrs = torch.tensor([bufs[r].data_ptr() for r in range(world)], device=DEVICE)
    counts = torch.zeros((world, ta.MAX_PROGRAMS), dtype=torch.int32, device=DEVICE)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for n in (4096, 1000, 4096):
        xs = [torch.randn(1, n, generator=gen, device=DEVICE).to(dtype) for _ in range(world)]
        res = torch.randn(1, n, generator=gen, device=DEVICE).to(dtype)
        outs = [torch.full_like(res, float("nan")) for _ in range(world)]
        sss = [torch.full((16,), float("nan"), device=DEVICE) for _ in range(world)]
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                ta.lamport_all_reduce(xs[r], outs[r], ptrs, counts[r], r, world, ROW,
                                      residual=res, sum_squares=sss[r])
        torch.cuda.synchronize()
        want = reference(xs) + res
        chunks = -(-n // ta.CHUNK)
        want_ss = torch.nn.functional.pad(want.float().pow(2), (0, chunks * ta.CHUNK - n))
        want_ss = want_ss.view(chunks, ta.CHUNK).sum(1)
        for r in range(world):
            assert torch.equal(outs[r], want), f"{n}: rank {r} sum + residual"
            torch.testing.assert_close(sss[r][:chunks], want_ss, rtol=1e-5, atol=1e-3)
            assert torch.equal(sss[r][:chunks], sss[0][:chunks]), "ranks disagree"
            assert bool(sss[r][chunks:].isnan().all()), "wrote past its chunks"
        assert bool((bufs == ta.SENTINEL).all())


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_in_turn_with_sums(world: int) -> None:
    """The all-gather form (the LM head's vocabulary slices) on the same buffers and counters as
    the sums, alternating with them: every rank gets every rank's input in rank order (negative
    zero as +0), the sums stay exact, and the buffers come back re-armed."""
    gen = torch.Generator(device=DEVICE).manual_seed(40 + world)
    bufs = torch.full((world, 2, world, ROW), ta.SENTINEL, dtype=torch.int16, device=DEVICE)
    ptrs = torch.tensor([bufs[r].data_ptr() for r in range(world)], device=DEVICE)
    counts = torch.zeros((world, ta.MAX_PROGRAMS), dtype=torch.int32, device=DEVICE)
    streams = [torch.cuda.Stream() for _ in range(world)]
    for n in (64128, 4096, 1, 1000, 64128):
        xs = [torch.randn(n, generator=gen, device=DEVICE).to(torch.bfloat16)
              for _ in range(world)]
        xs[-1][: n // 2] = -0.0
        gathered = [torch.full((world, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                    for _ in range(world)]
        sums = [torch.full_like(x, float("nan")) for x in xs]
        torch.cuda.synchronize()
        for r in range(world):
            with torch.cuda.stream(streams[r]):
                ta.lamport_all_gather(xs[r], gathered[r], ptrs, counts[r], r, world, ROW)
                ta.lamport_all_reduce(xs[r], sums[r], ptrs, counts[r], r, world, ROW)
        torch.cuda.synchronize()
        want = torch.stack([torch.where(x == 0, torch.zeros_like(x), x) for x in xs])
        for r in range(world):
            assert torch.equal(gathered[r].view(torch.int16), want.view(torch.int16)), \
                f"{n} elements: rank {r} gather"
            assert torch.equal(sums[r], reference(xs)), f"{n} elements: rank {r} sum"
        assert bool((bufs == ta.SENTINEL).all()), f"{n} elements: buffers not re-armed"
