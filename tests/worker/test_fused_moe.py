"""The fused MoE layer on CPU: routing (``select_experts``) in every mode against a per-token
computation written out here, the layer's forward (the torch path) against a dense loop over
each token's experts, tensor-parallel sharding (the ranks' partial sums add up to one rank's
output, each rank holds exactly its slice), and the weight loaders' errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig, select_experts
from tidal.worker.layers.linear import WeightShapeError
from tidal.worker.ops import moe_torch


def reference_routing(logits: torch.Tensor, cfg: RoutingConfig,
                      bias: torch.Tensor | None = None) -> list[dict[int, float]]:
    """Per token, {expert: weight}, computed one token at a time in float64."""
    out = []
    num_experts = logits.shape[1]
    per_group = num_experts // cfg.num_groups
    for row in logits.double():
        if cfg.scoring == "softmax":
            scores = [math.exp(v) for v in row.tolist()]
            total = sum(scores)
            scores = [s / total for s in scores]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row.tolist()]
        choice = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        groups = sorted(range(cfg.num_groups),
                        key=lambda g: -max(choice[g * per_group:(g + 1) * per_group]))
        eligible = [e for e in range(num_experts) if e // per_group in groups[:cfg.topk_groups]]
        chosen = sorted(eligible, key=lambda e: -choice[e])[:cfg.top_k]
        weights = {e: scores[e] for e in chosen}
        if cfg.renormalize:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        out.append({e: w * cfg.routed_scaling_factor for e, w in weights.items()})
    return out


ROUTINGS = {
    "softmax_renorm": (RoutingConfig(top_k=2), 8, False),  # Mixtral / Qwen3-MoE
    "softmax_plain": (RoutingConfig(top_k=3, renormalize=False), 8, False),
    "sigmoid_renorm": (RoutingConfig(top_k=2, scoring="sigmoid"), 8, False),
    "sigmoid_plain_scaled": (RoutingConfig(top_k=2, scoring="sigmoid", renormalize=False,
                                           routed_scaling_factor=2.5), 8, False),
    # DeepSeek-V2: group-limited greedy, no renormalisation, a scaling factor.
    "grouped": (RoutingConfig(top_k=3, renormalize=False, num_groups=4, topk_groups=2,
                              routed_scaling_factor=16.0), 16, False),
    # DeepSeek-V3 style: sigmoid, groups, correction bias for the choice only.
    "grouped_sigmoid_bias": (RoutingConfig(top_k=4, scoring="sigmoid", num_groups=4,
                                           topk_groups=2, routed_scaling_factor=2.5), 16, True),
    "softmax_bias": (RoutingConfig(top_k=2), 8, True),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_select_experts_matches_per_token_reference(name):
    cfg, num_experts, with_bias = ROUTINGS[name]
    gen = torch.Generator().manual_seed(list(ROUTINGS).index(name))
    logits = torch.randn(37, num_experts, generator=gen) * 2
    # A bias large enough to change the choice, so its use for choosing (and not weighing)
    # is what the comparison checks.
    bias = torch.randn(num_experts, generator=gen) if with_bias else None
    weights, ids = select_experts(logits, cfg, bias)
    expected = reference_routing(logits, cfg, bias)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (37, cfg.top_k)
    for t, want in enumerate(expected):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert set(got) == set(want), f"token {t}: experts {sorted(got)} != {sorted(want)}"
        for e, w in want.items():
            assert got[e] == pytest.approx(w, rel=1e-5, abs=1e-7)


def test_select_experts_bias_changes_the_choice_not_the_weights():
    cfg = RoutingConfig(top_k=1, scoring="sigmoid", renormalize=False)
    logits = torch.tensor([[2.0, 0.0, -1.0, -3.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = select_experts(logits, cfg, bias)
    assert ids.tolist() == [[3]]
    assert weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-3.0)).item())


def test_grouped_topk_keeps_to_the_best_groups():
    # Expert 0 alone would win every slot, but its group (0-3) loses on its max to group 4-7.
    cfg = RoutingConfig(top_k=2, num_groups=2, topk_groups=1, renormalize=False)
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.7, 3.1, -5.0, -5.0, -5.0]])
    _, ids = select_experts(logits, cfg)
    assert sorted(ids[0].tolist()) == [4, 5]


@pytest.mark.parametrize("kwargs,experts,match", [
    ({"top_k": 0}, 8, "top_k"),
    ({"top_k": 2, "scoring": "relu"}, 8, "scoring"),
    ({"top_k": 2, "num_groups": 2, "topk_groups": 3}, 8, "topk_groups"),
    ({"top_k": 2, "num_groups": 3}, 8, "groups"),
    ({"top_k": 5, "num_groups": 4, "topk_groups": 1}, 16, "eligible"),
])
def test_bad_routing_is_refused(kwargs, experts, match):
    with pytest.raises(ValueError, match=match):
        cfg = RoutingConfig(**kwargs)
        select_experts(torch.zeros(1, experts), cfg)


# --- the layer ------------------------------------------------------------------------------

E, H, I = 8, 32, 48


def _expert_weights(seed: int, experts: int = E) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "gate": torch.randn(experts, I, H, generator=gen) / math.sqrt(H),
        "up": torch.randn(experts, I, H, generator=gen) / math.sqrt(H),
        "down": torch.randn(experts, H, I, generator=gen) / math.sqrt(I),
    }


def _layer(full: dict[str, torch.Tensor], routing: RoutingConfig, dtype: torch.dtype,
           tp: ParallelGroup | None = None, stacked: bool = False) -> FusedMoE:
    layer = FusedMoE(full["gate"].shape[0], H, I, routing, dtype, tp=tp,
                     reduce_results=tp is None, prefix="layers.0.mlp.experts")
    for which, w in full.items():
        if stacked:
            layer.load_stacked_weight(which, w.to(dtype))
        else:
            for e in range(w.shape[0]):
                layer.load_expert_weight(which, e, w[e].to(dtype))
    assert layer.missing_weights() == []
    return layer


def _dense_reference(x: torch.Tensor, logits: torch.Tensor, full: dict[str, torch.Tensor],
                     routing: RoutingConfig, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its chosen experts, one at a time, in float64."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t, chosen in enumerate(reference_routing(logits, routing, bias)):
        xt = x[t].double()
        for e, w in chosen.items():
            h = F.silu(full["gate"][e].double() @ xt) * (full["up"][e].double() @ xt)
            out[t] += w * (full["down"][e].double() @ h)
    return out


@pytest.mark.parametrize("name", ["softmax_renorm", "grouped", "grouped_sigmoid_bias"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_forward_matches_dense_loop(name, tokens):
    routing, experts, with_bias = ROUTINGS[name]
    full = _expert_weights(1, experts)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    bias = torch.randn(experts, generator=gen) if with_bias else None
    layer = _layer(full, routing, torch.float32)
    got = layer(x, logits, bias)
    want = _dense_reference(x, logits, full, routing, bias)
    assert got.shape == (tokens, H) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_forward_bfloat16_and_stacked_loading():
    routing = ROUTINGS["softmax_renorm"][0]
    full = _expert_weights(2)
    x = torch.randn(16, H).to(torch.bfloat16)
    logits = torch.randn(16, E)
    layer = _layer(full, routing, torch.bfloat16, stacked=True)
    got = layer(x, logits)
    rounded = {k: v.to(torch.bfloat16).float() for k, v in full.items()}
    want = _dense_reference(x.float(), logits, rounded, routing)
    assert got.dtype == torch.bfloat16
    err = (got.double() - want).norm() / want.norm()
    assert err < 1e-2, f"relative error {err:.2e}"


def test_forward_takes_leading_dims_and_empty_batches():
    routing = ROUTINGS["softmax_renorm"][0]
    layer = _layer(_expert_weights(3), routing, torch.float32)
    x = torch.randn(2, 5, H)
    logits = torch.randn(2, 5, E)
    torch.testing.assert_close(layer(x, logits), layer(x.view(10, H), logits.view(10, E))
                               .view(2, 5, H))
    assert layer(torch.empty(0, H), torch.empty(0, E)).shape == (0, H)


def test_unrouted_experts_are_never_read():
    """Only the routed experts' weights take part: NaN everywhere else changes nothing."""
    routing = RoutingConfig(top_k=2)
    full = _expert_weights(4)
    layer = _layer(full, routing, torch.float32)
    x = torch.randn(1, H)
    logits = torch.full((1, E), -10.0)
    logits[0, 2], logits[0, 5] = 1.0, 0.5
    before = layer(x, logits)
    for e in set(range(E)) - {2, 5}:
        layer.w13.data[e] = float("nan")
        layer.w2.data[e] = float("nan")
    torch.testing.assert_close(layer(x, logits), before)


@pytest.mark.parametrize("stacked", [False, True])
def test_tensor_parallel_shards_sum_to_one_rank(stacked):
    routing = ROUTINGS["grouped"][0]
    full = _expert_weights(5, 16)
    x = torch.randn(9, H)
    logits = torch.randn(9, 16)
    whole = _layer(full, routing, torch.float32)(x, logits)
    parts = []
    for rank in range(2):
        tp = ParallelGroup(rank=rank, world_size=2, ranks=(0, 1))
        layer = _layer(full, routing, torch.float32, tp=tp, stacked=stacked)
        half = I // 2
        rows = slice(rank * half, (rank + 1) * half)
        # Each rank holds its slice of every expert's intermediate dimension, nothing else.
        assert layer.w13.shape == (16, 2 * half, H) and layer.w2.shape == (16, H, half)
        torch.testing.assert_close(layer.w13.data[:, :half], full["gate"][:, rows])
        torch.testing.assert_close(layer.w13.data[:, half:], full["up"][:, rows])
        torch.testing.assert_close(layer.w2.data, full["down"][:, :, rows])
        parts.append(layer(x, logits))  # reduce_results off: the partial sum
    torch.testing.assert_close(parts[0] + parts[1], whole, rtol=1e-5, atol=1e-5)


def test_weight_loading_errors_and_missing_experts():
    routing = RoutingConfig(top_k=2)
    layer = FusedMoE(E, H, I, routing, torch.float32, prefix="layers.3.mlp.experts")
    with pytest.raises(WeightShapeError, match="intermediate size 48"):
        layer.load_expert_weight("gate", 0, torch.zeros(40, H))
    with pytest.raises(WeightShapeError, match="expects"):
        layer.load_expert_weight("down", 0, torch.zeros(H + 1, I))
    with pytest.raises(WeightShapeError, match="out of range"):
        layer.load_expert_weight("up", E, torch.zeros(I, H))
    with pytest.raises(WeightShapeError, match="unknown expert weight"):
        layer.load_expert_weight("proj", 0, torch.zeros(I, H))
    with pytest.raises(WeightShapeError, match="stacked"):
        layer.load_stacked_weight("gate", torch.zeros(E - 1, I, H))
    with pytest.raises(ValueError, match="does not split"):
        FusedMoE(E, H, 47, routing, torch.float32,
                 tp=ParallelGroup(rank=0, world_size=2, ranks=(0, 1)))
    # The parameters' loader, as a model's load_weights calls it.
    w = torch.randn(I, H)
    layer.w13.weight_loader(layer.w13, w, ("up", 6))
    torch.testing.assert_close(layer.w13.data[6, I:], w)
    layer.w2.weight_loader(layer.w2, torch.randn(E, H, I), "down")
    missing = layer.missing_weights()
    assert "up of expert 6" not in missing and "gate of expert 6" in missing
    assert not any(m.startswith("down") for m in missing)


def test_torch_op_checks_shapes():
    x = torch.randn(2, H)
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="w2"):
        moe_torch.fused_moe(x, w13, w2.transpose(1, 2), torch.ones(2, 2), ids)
    with pytest.raises(ValueError, match="topk_weights"):
        moe_torch.fused_moe(x, w13, w2, torch.ones(2, 3), ids)


# --- two real ranks (gloo) --------------------------------------------------------------------


def _tp_rank(rank: int, conn) -> None:
    from tidal.worker.distributed.parallel_state import (
        destroy_distributed,
        init_distributed,
        serve_store,
    )

    torch.set_num_threads(1)
    try:
        store = None
        if rank == 0:
            store = serve_store("127.0.0.1")
            conn.send_bytes(str(store.port).encode())
        port = int(conn.recv_bytes().decode())
        tp, _ = init_distributed(rank=rank, tp_size=2, pp_size=1, host="127.0.0.1", port=port,
                                 device=torch.device("cpu"), store=store)
        routing = ROUTINGS["grouped_sigmoid_bias"][0]
        layer = FusedMoE(16, H, I, routing, torch.float32, tp=tp)
        for which, w in _expert_weights(6, 16).items():
            layer.load_stacked_weight(which, w)
        gen = torch.Generator().manual_seed(0)
        x, logits = torch.randn(7, H, generator=gen), torch.randn(7, 16, generator=gen)
        out = layer(x, logits, torch.randn(16, generator=gen))
        destroy_distributed()
        conn.send_bytes(out.numpy().tobytes())
    except Exception as exc:  # noqa: BLE001 - reported to the test
        conn.send_bytes(f"error: {type(exc).__name__}: {exc}".encode())


@pytest.mark.slow
def test_two_gloo_ranks_reduce_to_one_rank_output():
    import multiprocessing as mp

    spawn = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(2):
        parent, child = spawn.Pipe()
        p = spawn.Process(target=_tp_rank, args=(rank, child), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        assert conns[0].poll(120), "rank 0 did not report the store port"
        port = conns[0].recv_bytes()
        for c in conns:
            c.send_bytes(port)
        outs = []
        for c in conns:
            assert c.poll(120), "a rank did not report"
            raw = c.recv_bytes()
            assert not raw.startswith(b"error"), raw.decode()
            outs.append(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(7, H))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    routing = ROUTINGS["grouped_sigmoid_bias"][0]
    layer = _layer(_expert_weights(6, 16), routing, torch.float32)
    gen = torch.Generator().manual_seed(0)
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, 16, generator=gen)
    want = layer(x, logits, torch.randn(16, generator=gen))
    for out in outs:  # every rank holds the full sum
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_graph_safe_dense_torch_path_matches_sorted_one():
    """The torch path a CUDA graph captures on a GPU without Triton: every expert on every
    token, the unrouted ones weighted zero."""
    full = _expert_weights(7)
    w13 = torch.cat([full["gate"], full["up"]], dim=1)
    x = torch.randn(11, H)
    weights, ids = select_experts(torch.randn(11, E), RoutingConfig(top_k=3))
    torch.testing.assert_close(moe_torch.fused_moe_dense(x, w13, full["down"], weights, ids),
                               moe_torch.fused_moe(x, w13, full["down"], weights, ids),
                               rtol=1e-5, atol=1e-5)


def test_policy_picks_the_moe_kernels_by_device():
    """Triton on a GPU with triton (unless the fused ops are forced to torch), torch elsewhere;
    the start-up log says which."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import DeviceInfo, describe, reference_kernels, resolve

    gpu = DeviceInfo("cuda", triton=True)
    assert ("fused_moe: triton (routing, expert alignment, grouped GEMMs; direct GEMVs up to "
            "32 (token, expert) pairs)") in describe(resolve(KernelConfig(), gpu))
    assert "fused_moe: triton (routing, expert alignment, grouped GEMMs)" in \
        describe(resolve(KernelConfig(moe_direct_max_pairs=0), gpu))
    assert "fused_moe: torch" in describe(resolve(KernelConfig(ops="torch"), gpu))
    assert "fused_moe: torch" in describe(resolve(KernelConfig(), DeviceInfo("cpu")))
    assert reference_kernels()._moe is None  # CPU tensors: the torch ops
