"""The exchange of expert parallelism across DP engines (``worker/distributed/expert_parallel``
and ``layers/moe_ep``), two ranks as two threads over gloo on loopback: each rank holds half
the experts of two MoE layers and gets, for its own tokens, the full layers' outputs; with
unequal token counts (padding), a rank with none (the empty step), and dual batch overlap on
and off (two micro-batches, or one where the step is below the threshold), also with router
logits of another dtype than the hidden states (DeepSeek-V2's float32 gate: two gathers). At
the end each rank closes its expert parallelism (what the runner's release does)."""

from __future__ import annotations

import threading

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
          logits_dtype: torch.dtype, static: bool = False) -> None:
    try:
        group = DPExpertGroup(rank, 2, 0, port, torch.device("cpu"))
        if static:  # (a graph's capture asks the other ranks nothing)
            def no_counts(tokens: int) -> list[int]:
                raise AssertionError("token counts exchanged inside static_exchange")

            group.token_counts = no_counts  # type: ignore[method-assign]
        ep = moe_ep.ExpertParallel(ParallelGroup(), rank, 2, group, dbo_threshold=dbo)
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
                         (ep.layers, ep.dp, ep.active, group.closed, group.cpu_group), halves[0])
    except BaseException as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(exc)


def _run_ranks(full: nn.ModuleList, dbo: int | None, tokens: dict[int, list[torch.Tensor]],
               logits_dtype: torch.dtype = torch.float32, static: bool = False) -> dict:
    """``_rank`` on ranks 0 and 1 as two threads meeting through a fresh store; each rank's
    results (fails the test with any rank's error)."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results: dict = {}
    errors: list = []
    threads = [threading.Thread(target=_rank, args=(r, store.port, full, dbo, tokens[r],
                                                    results, errors, logits_dtype, static))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


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
        outs, overlapped, before, after, _ = results[r]
        # Steps of 8 and 6 tokens overlap at a threshold of 6; those of 2 and 3 do not.
        assert overlapped == (0 if dbo is None else 2)
        # Closed: no layer (so no expert weight) kept, the groups shut and dropped.
        assert before == (2, False)
        assert after == ([], None, False, True, None)
        for x, out in zip(tokens[r], outs):
            if x.shape[0] == 0:
                assert out is None
                continue
            *got, l0, l1 = out
            for layer, lg, g in zip(full, (l0, l1), got):
                torch.testing.assert_close(g, layer(x, lg), rtol=1e-5, atol=1e-5)


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
        outs, overlapped, _, _, halves = results[r]
        assert overlapped == 0  # (a capture is not a served step)
        assert halves == (0 if dbo is None else 4)  # two forwards of two layers overlapped
        for x, out in zip(tokens[r], outs):
            *got, l0, l1 = out
            for layer, lg, g in zip(full, (l0, l1), got):
                torch.testing.assert_close(g, layer(x, lg), rtol=1e-5, atol=1e-5)
