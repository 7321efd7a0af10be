"""The exchange of expert parallelism across DP engines (``worker/distributed/expert_parallel``
and ``layers/moe_ep``), two ranks as two threads over gloo on loopback: each rank holds half
the experts of two MoE layers and gets, for its own tokens, the full layers' outputs; with
unequal token counts (padding), a rank with none (the empty step), and dual batch overlap on
and off (two micro-batches, or one where the step is below the threshold, given or measured
at start-up), also with router logits of another dtype than the hidden states (DeepSeek-V2's
float32 gate: two gathers). At the end each rank closes its expert parallelism (what the
runner's release does)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from tidal.worker.distributed.expert_parallel import DPExpertGroup
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.layers import moe_ep
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig

E, H, INTER = 8, 16, 24


def _full_layers() -> nn.ModuleList:
    torch.manual_seed(0)
    layers = nn.ModuleList(FusedMoE(E, H, INTER, RoutingConfig(top_k=2), torch.float32)
                           for _ in range(2))
    for layer in layers:
        layer.w13.data.normal_()
        layer.w2.data.normal_()
    return layers


def _rank(rank: int, port: int, full: nn.ModuleList, dbo: int | None,
          tokens: list[torch.Tensor], results: dict, errors: list,
          logits_dtype: torch.dtype, static: bool = False, calibrate: Any = None,
          all2all: str = "allgather_reducescatter") -> None:
    try:
        group = DPExpertGroup(rank, 2, 0, port, torch.device("cpu"))
        if static:  # (a graph's capture asks the other ranks nothing)
            def no_counts(tokens: int) -> list[int]:
                raise AssertionError("token counts exchanged inside static_exchange")

            group.token_counts = no_counts  # type: ignore[method-assign]
        ep = moe_ep.ExpertParallel(ParallelGroup(), rank, 2, group, dbo_threshold=dbo,
                                   all2all=all2all)
        halves = [0]  # layers that ran two micro-batches
        overlapped_layer = ep._overlapped

        def count_halves(*args):
            halves[0] += 1
            return overlapped_layer(*args)

        ep._overlapped = count_halves  # type: ignore[method-assign]
        with moe_ep.building(ep):
            model = nn.ModuleList(FusedMoE(E, H, INTER, RoutingConfig(top_k=2), torch.float32)
                                  for _ in range(2))
        for mine, ref in zip(model, full):
            for e in mine.local_experts:
                mine.load_expert_weight("gate", e, ref.w13[e, :INTER])
                mine.load_expert_weight("up", e, ref.w13[e, INTER:])
                mine.load_expert_weight("down", e, ref.w2[e])
        ep.bind(model)
        ep.activate()
        measured = None
        if calibrate is not None:  # (max tokens an engine, and the timing: None = real)
            max_tokens, timed = calibrate
            measured = ep.calibrate_dbo(max_tokens, reps=2,
                                        timed=None if timed is None else
                                        (lambda t: timed(rank, t)))
        outs = []
        for x in tokens:  # one forward per entry: both layers, in order
            if x.shape[0] == 0:
                ep.run_empty_step()
                outs.append(None)
                continue
            logits = [torch.randn(x.shape[0], E, generator=torch.Generator().manual_seed(i),
                                  dtype=logits_dtype) for i in range(2)]
            if static:
                with ep.static_exchange():
                    outs.append([layer(x, lg) for layer, lg in zip(model, logits)] + logits)
            else:
                outs.append([layer(x, lg) for layer, lg in zip(model, logits)] + logits)
        closed = (len(ep.layers), group.closed)
        ep.close()
        results[rank] = (outs, ep.overlapped_steps, closed,
                         (ep.layers, ep.dp, ep.active, group.closed, group.cpu_group), halves[0],
                         measured, (ep.alltoallv_layers, ep.alltoallv_rows_sent,
                                    ep.alltoallv_rows_gathered))
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def _run_ranks(full: nn.ModuleList, dbo: int | None, tokens: dict[int, list[torch.Tensor]],
               logits_dtype: torch.dtype = torch.float32, static: bool = False,
               calibrate: Any = None, all2all: str = "allgather_reducescatter") -> dict:
    """``_rank`` on ranks 0 and 1 as two threads meeting through a fresh store; each rank's
    results (fails the test with any rank's error)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: dict = {}
    errors: list = []
    threads = [threading.Thread(target=_rank, args=(r, store.port, full, dbo, tokens[r],
                                                    results, errors, logits_dtype, static,
                                                    calibrate, all2all))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def _assert_full_outputs(full: nn.ModuleList, tokens: list[torch.Tensor], outs: list) -> None:
    """Each forward's outputs (both layers', then their logits) equal the full layers' on the
    rank's tokens; a forward without tokens (the empty step) has none."""
    for x, out in zip(tokens, outs):
        if x.shape[0] == 0:
            assert out is None
            continue
        *got, l0, l1 = out
        for layer, lg, g in zip(full, (l0, l1), got):
            torch.testing.assert_close(g, layer(x, lg), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dbo, logits_dtype", [
    (None, torch.float32), (6, torch.float32), (None, torch.float64), (6, torch.float64)],
    ids=["one-exchange", "dual-batch-overlap", "one-exchange-mixed-dtypes",
         "dual-batch-overlap-mixed-dtypes"])
def test_two_ranks_get_the_full_layers_outputs(dbo, logits_dtype) -> None:
    full = _full_layers()
    gen = torch.Generator().manual_seed(1)
    # Per forward, each rank's tokens: unequal (padding), one rank empty (the empty step), and
    # a small step (below the overlap threshold of 6 tokens over both ranks).
    counts = [(5, 3), (6, 0), (0, 2), (2, 1)]
    tokens = {r: [torch.randn(c[r], H, generator=gen) for c in counts] for r in (0, 1)}
    results = _run_ranks(full, dbo, tokens, logits_dtype)
    for r in (0, 1):
        outs, overlapped, before, after, _, _, _ = results[r]
        # Steps of 8 and 6 tokens overlap at a threshold of 6; those of 2 and 3 do not.
        assert overlapped == (0 if dbo is None else 2)
        # Closed: no layer (so no expert weight) kept, the groups shut and dropped.
        assert before == (2, False)
        assert after == ([], None, False, True, None)
        _assert_full_outputs(full, tokens[r], outs)


@pytest.mark.parametrize("dbo", [None, 6], ids=["one-exchange", "dual-batch-overlap"])
def test_static_exchange_needs_no_counts_and_gives_the_same_outputs(dbo) -> None:
    """Inside ``static_exchange`` (the decode graphs' capture: every rank holds the graph's
    rows) the layers exchange without asking the others' counts, in one or two micro-batches,
    and each rank still gets the full layers' outputs for its rows."""
    full = _full_layers()
    gen = torch.Generator().manual_seed(2)
    counts = [4, 3, 1]  # per forward, on both ranks: 8 and 6 tokens overlap at 6, 2 not
    tokens = {r: [torch.randn(c, H, generator=gen) for c in counts] for r in (0, 1)}
    results = _run_ranks(full, dbo, tokens, static=True)
    for r in (0, 1):
        outs, overlapped, _, _, halves, _, _ = results[r]
        assert overlapped == 0  # (a capture is not a served step)
        assert halves == (0 if dbo is None else 4)  # two forwards of two layers overlapped
        _assert_full_outputs(full, tokens[r], outs)


def test_the_overlap_threshold_rule() -> None:
    """Measured at 128, 256, ... tokens over the engines, up to every engine's largest step;
    on from the smallest size from which every ratio is at least 1.05 (the two largest sizes
    at least), else off."""
    assert moe_ep.dbo_ladder(2, 4096) == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert moe_ep.dbo_ladder(4, 8192) == [128 << i for i in range(8)]  # (capped at 16384)
    assert moe_ep.dbo_ladder(2, 32) == []
    rule = moe_ep.dbo_threshold_from
    sizes = [128, 256, 512, 1024]
    assert rule(sizes, [0.9, 1.02, 1.1, 1.2]) == 512
    assert rule(sizes, [1.2, 0.9, 1.1, 1.06]) == 512  # (a faster small size alone: not on)
    assert rule(sizes, [1.1] * 4) == 128
    assert rule(sizes, [1.2, 1.2, 1.2, 1.04]) is None  # slower at the largest: never on
    assert rule(sizes, [0.5, 0.6, 0.7, 1.1]) is None  # the largest alone: maybe noise
    assert rule([128], [1.1]) == 128  # (one size measured: it alone decides)
    assert rule([], []) is None


def _timed(rank: int, tokens: int) -> tuple[float, float]:
    """Made-up (without, with) times: rank 0's overlap slower below 256 tokens a rank (512
    over both), faster from there; rank 1's the same either way (its sums decide nothing
    alone)."""
    if rank == 1:
        return 1.0, 1.0
    return 1.0, 1.2 if tokens < 256 else 0.8


def test_both_ranks_take_the_threshold_measured_over_both() -> None:
    """``calibrate_dbo``: the ranks sum their times, so each decides the same threshold; the
    forwards after it overlap from there (a step of 600 tokens over both) and not below (200),
    with the full layers' outputs either way."""
    full = _full_layers()
    gen = torch.Generator().manual_seed(3)
    counts = [(300, 300), (100, 100)]
    tokens = {r: [torch.randn(c[r], H, generator=gen) for c in counts] for r in (0, 1)}
    results = _run_ranks(full, moe_ep.DBO_MEASURE, tokens, calibrate=(512, _timed))
    for r in (0, 1):
        outs, overlapped, _, _, _, measured, _ = results[r]
        assert measured.sizes == [128, 256, 512, 1024]
        assert measured.ratios == [round(2 / 2.2, 3)] * 2 + [round(2 / 1.8, 3)] * 2
        assert measured.threshold == 512 and "on from 512 tokens" in measured.describe()
        assert overlapped == 1  # (the 600-token step; the 200-token one below)
        _assert_full_outputs(full, tokens[r], outs)


def test_a_real_measurement_agrees_across_ranks_and_leaves_the_layers_intact() -> None:
    """Timed for real (two tiny layers on the CPU: whatever it decides), both ranks decide
    alike from the same numbers, and the exchange afterwards still gives the full layers'
    outputs; an overlap never faster than 1.05x leaves it off."""
    full = _full_layers()
    gen = torch.Generator().manual_seed(4)
    tokens = {r: [torch.randn(70, H, generator=gen)] for r in (0, 1)}
    results = _run_ranks(full, moe_ep.DBO_MEASURE, tokens, calibrate=(128, None))
    m0, m1 = results[0][5], results[1][5]
    assert m0 == m1 and m0.sizes == [128, 256]
    assert m0.threshold == moe_ep.dbo_threshold_from(m0.sizes, m0.ratios)
    assert all(r > 0 for r in m0.ratios)
    for r in (0, 1):
        outs, overlapped, *_ = results[r]
        assert overlapped == (1 if m0.threshold is not None and m0.threshold <= 140 else 0)
        _assert_full_outputs(full, tokens[r], outs)


def test_an_unmeasured_threshold_means_no_overlap() -> None:
    """``DBO_MEASURE`` before (or without) ``calibrate_dbo``: no step overlaps."""
    full = _full_layers()
    gen = torch.Generator().manual_seed(5)
    tokens = {r: [torch.randn(40, H, generator=gen)] for r in (0, 1)}
    results = _run_ranks(full, moe_ep.DBO_MEASURE, tokens)
    assert results[0][1] == results[1][1] == 0


def test_alltoallv_sends_rows_only_where_their_experts_are() -> None:
    """``all2all="alltoallv"``: each rank routes its own tokens and sends each only to the rank
    holding one of its experts (fewer rows than the gather sends), with unequal counts and a
    rank without tokens (the empty step, which may still receive rows), and gets the full
    layers' outputs; inside ``static_exchange`` (a decode graph's capture) the layers gather
    instead, with the same outputs."""
    full = _full_layers()
    gen = torch.Generator().manual_seed(6)
    counts = [(5, 3), (6, 0), (0, 2), (9, 7)]
    tokens = {r: [torch.randn(c[r], H, generator=gen) for c in counts] for r in (0, 1)}
    results = _run_ranks(full, None, tokens, all2all="alltoallv")
    for r in (0, 1):
        outs, overlapped, _, _, _, _, (layers, sent, gathered) = results[r]
        assert overlapped == 0
        assert layers == 2 * len(counts)  # every layer of every forward, the empty ones too
        assert gathered == 2 * sum(c[r] for c in counts)
        assert 0 < sent < gathered  # (top-2 of 8 experts: some tokens stay on one rank)
        _assert_full_outputs(full, tokens[r], outs)
    static = {r: [torch.randn(4, H, generator=gen)] for r in (0, 1)}
    results = _run_ranks(full, None, static, static=True, all2all="alltoallv")
    for r in (0, 1):
        outs, *_, (layers, _, _) = results[r]
        assert layers == 0
        _assert_full_outputs(full, static[r], outs)


def test_an_unknown_all2all_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="expected one of"):
        moe_ep.ExpertParallel(ParallelGroup(), all2all="deepep_low_latency")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_rows_and_their_routing_travel_together_bit_for_bit(dtype) -> None:
    """The all-to-all of rows and their float32 routing (weights, slots): one collective with
    the routing's bytes as extra columns for 2- and 4-byte rows, two otherwise; both arrive
    unchanged (a one-rank group's all-to-all hands the rows back)."""
    class OneRank:
        calls = 0

        def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
            assert send == recv == [x.shape[0]]
            OneRank.calls += 1
            return x.clone()

    ep = moe_ep.ExpertParallel(ParallelGroup())
    ep.dp = OneRank()  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(5, H, generator=gen).to(dtype)
    route = torch.cat([torch.rand(5, 2, generator=gen), torch.tensor([[3., 8.]] * 5)], dim=1)
    got_rows, got_route = ep._all_to_all_rows(rows, route, [5], [5])
    assert torch.equal(got_rows, rows) and got_rows.is_contiguous()
    assert torch.equal(got_route, route) and got_route.dtype == torch.float32
    assert OneRank.calls == (2 if dtype == torch.float64 else 1)
