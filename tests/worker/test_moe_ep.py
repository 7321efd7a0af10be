"""Expert parallelism inside one engine (``--enable-expert-parallel``, ``worker/layers/moe_ep``):
contiguous expert placement, each rank loading only its whole experts (safetensors and GGUF),
the EP ranks' partial outputs summing to the full layer's, experts held elsewhere never read,
and, end to end, EP=2 over TP=2 giving HF's greedy tokens and logprobs (as TP=1 does) on a tiny
Qwen3-MoE (float32, CPU)."""

from __future__ import annotations

import re

import pytest
import torch

import moe_harness as mh
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.layers import moe_ep
from tidal.worker.layers.fused_moe import FusedMoE, RoutingConfig
from tidal.worker.ops import moe_torch

PROMPT_LENGTHS = (5, 40)
EXPERTS = 8


def _config(**overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{**mh.SHAPES, "num_hidden_layers": 3, "head_dim": 32,
                             "intermediate_size": 96, "moe_intermediate_size": 48,
                             "num_experts": EXPERTS, "mlp_only_layers": [1],
                             "norm_topk_prob": True, "tie_word_embeddings": True, **overrides})


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory) -> mh.TinyMoE:
    return mh.make_tiny_moe(_config(), tmp_path_factory.mktemp("tiny-qwen3-moe-ep"),
                            PROMPT_LENGTHS)


def _ep(rank: int, size: int) -> moe_ep.ExpertParallel:
    """EP rank ``rank`` of ``size`` inside one engine's TP group (no process group: the
    layers here never reduce)."""
    return moe_ep.ExpertParallel(ParallelGroup(rank=rank, world_size=size,
                                               ranks=tuple(range(size))))


def test_placement_is_contiguous_and_refuses_an_uneven_split() -> None:
    ranges = [moe_ep.place_experts(8, r, 4).experts for r in range(4)]
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match="multiple of DP x TP"):
        moe_ep.place_experts(8, 0, 3)
    ids = torch.tensor([[0, 5], [3, 4], [7, 2]])
    # Rank 1 of 2 holds experts 4..7 as slots 0..3; the others map to the sentinel 4.
    assert moe_ep.local_expert_ids(ids, range(4, 8)).tolist() == [[4, 1], [4, 0], [3, 4]]


def test_the_engine_config_turns_it_on_or_refuses(qwen3_moe, tiny_models) -> None:
    from tidal.engine_core.cli import build_parser, engine_args_from
    from tidal.engine_core.config import ConfigError

    ns = build_parser().parse_args(["--model", str(qwen3_moe.folder), "--num-kv-blocks", "64",
                                    "--data-parallel-size", "2", "--enable-expert-parallel"])
    par = engine_args_from(ns).create_config().parallel
    # Across DP engines every rank must join every step's exchange: lockstep comes with it.
    assert par.enable_expert_parallel and par.data_parallel_lockstep
    with pytest.raises(ConfigError, match="8 experts do not split over 3"):
        engine_args_from(build_parser().parse_args([
            "--model", str(qwen3_moe.folder), "--data-parallel-size", "3",
            "--enable-expert-parallel"])).create_config()
    with pytest.raises(ConfigError, match="--enable-dbo needs --enable-expert-parallel with"):
        engine_args_from(build_parser().parse_args([
            "--model", str(qwen3_moe.folder), "--enable-dbo"])).create_config()
    par = engine_args_from(build_parser().parse_args([
        "--model", str(qwen3_moe.folder), "--num-kv-blocks", "64", "--data-parallel-size", "2",
        "--enable-expert-parallel", "--enable-dbo", "--dbo-token-threshold", "8"])
    ).create_config().parallel
    assert par.enable_dbo and par.dbo_token_threshold == 8
    # A threshold without --enable-dbo would change nothing: refused, naming the flag.
    with pytest.raises(ConfigError, match="--dbo-token-threshold needs --enable-dbo"):
        engine_args_from(build_parser().parse_args([
            "--model", str(qwen3_moe.folder), "--num-kv-blocks", "64",
            "--data-parallel-size", "2", "--enable-expert-parallel",
            "--dbo-token-threshold", "8"])).create_config()
    dense, _ = tiny_models["qwen3"]
    par = engine_args_from(build_parser().parse_args([
        "--model", str(dense), "--num-kv-blocks", "64", "--data-parallel-size", "2",
        "--enable-expert-parallel"])).create_config().parallel
    assert not par.enable_expert_parallel and not par.data_parallel_lockstep
    # --all2all-backend: vLLM's default name, tidal's all-to-all across engines, refusals.
    ep_flags = ["--model", str(qwen3_moe.folder), "--num-kv-blocks", "64",
                "--data-parallel-size", "2", "--enable-expert-parallel"]
    assert par.all2all_backend == "allgather_reducescatter"
    par = engine_args_from(build_parser().parse_args(
        ep_flags + ["--all2all-backend", "alltoallv"])).create_config().parallel
    assert par.all2all_backend == "alltoallv"
    for extra, match in ((["--all2all-backend", "deepep_low_latency"], "vLLM backend tidal"),
                         (["--all2all-backend", "bogus"], "unknown"),
                         (["--all2all-backend", "alltoallv", "--enable-dbo"], "not supported"),
                         (["--all2all-backend", "alltoallv", "--data-parallel-size", "1"],
                          "needs --enable-expert-parallel with --data-parallel-size > 1")):
        with pytest.raises(ConfigError, match=match):
            engine_args_from(build_parser().parse_args(ep_flags + extra)).create_config()


def _load(folder, ep: moe_ep.ExpertParallel | None):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.loader.model_loader import load_model

    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64).create_config()
    tp = ep.tp if ep is not None else None
    with moe_ep.building(ep):
        model = load_model(config.model, torch.device("cpu"), TorchAttention(), tp, None)
    if ep is not None:
        ep.bind(model)
    return model


def _assert_holds_whole_experts(model, full, rank: int, size: int,
                                layers: tuple[int, ...] = (0, 2)) -> None:
    per = EXPERTS // size
    for layer in layers:  # (layer 1 of the fixture's model is dense)
        experts = model.layers[str(layer)].mlp.experts
        ref = full.layers[str(layer)].mlp.experts
        assert experts.local_experts == range(rank * per, (rank + 1) * per)
        assert experts.w13.shape[0] == per and experts.shard_size == 48  # whole, not TP shards
        torch.testing.assert_close(experts.w13, ref.w13[rank * per:(rank + 1) * per],
                                   rtol=0, atol=0)
        torch.testing.assert_close(experts.w2, ref.w2[rank * per:(rank + 1) * per],
                                   rtol=0, atol=0)
        assert experts.missing_weights() == []


def test_each_rank_loads_only_its_whole_experts(qwen3_moe, tmp_path) -> None:
    full = _load(qwen3_moe.folder, None)
    ep = _ep(1, 2)
    _assert_holds_whole_experts(_load(qwen3_moe.folder, ep), full, 1, 2)
    assert len(ep.layers) == 2  # the two MoE layers, in forward order
    # GGUF stores each layer's experts stacked: the rank slices its range out (llama.cpp's
    # qwen3moe has no dense layers).
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    hf = AutoModelForCausalLM.from_config(_config(num_hidden_layers=2, mlp_only_layers=[]),
                                          dtype=torch.float32)
    path = tmp_path / "tiny.gguf"
    mh.write_moe_gguf(hf, path, "qwen3moe",
                      {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
    _assert_holds_whole_experts(_load(path, _ep(3, 4)), _load(path, None), 3, 4, (0, 1))


def _layer(ep: moe_ep.ExpertParallel | None, full: FusedMoE | None = None) -> FusedMoE:
    routing = RoutingConfig(top_k=2)
    with moe_ep.building(ep):
        moe = FusedMoE(EXPERTS, 16, 24, routing, torch.float32, reduce_results=False)
    if full is None:
        torch.manual_seed(0)
        moe.w13.data.normal_()
        moe.w2.data.normal_()
    else:
        for e in moe.local_experts:
            moe.load_expert_weight("gate", e, full.w13[e, :24])
            moe.load_expert_weight("up", e, full.w13[e, 24:])
            moe.load_expert_weight("down", e, full.w2[e])
    return moe


def test_ep_ranks_sum_to_the_full_layer_and_never_read_other_experts() -> None:
    full = _layer(None)
    ranks = [_layer(_ep(r, 2), full) for r in range(2)]
    x = torch.randn(5, 16)
    logits = torch.randn(5, EXPERTS)
    want = full(x, logits)
    got = ranks[0](x, logits) + ranks[1](x, logits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Batch 1: poison every expert of rank 1 but the one the token picks there (if any): the
    # output is still exact, so no other expert's weights were read.
    one_x, one_logits = x[:1], logits[:1]
    _, ids = moe_torch.select_experts(one_logits, full.routing)
    rank1 = ranks[1]
    for slot, e in enumerate(rank1.local_experts):
        if e not in ids[0].tolist():
            rank1.w13.data[slot] = float("nan")
            rank1.w2.data[slot] = float("nan")
    got_one = ranks[0](one_x, one_logits) + rank1(one_x, one_logits)
    torch.testing.assert_close(got_one, want[:1], rtol=1e-5, atol=1e-5)
    # ... and the CUDA-graph-safe dense fallback skips the sentinel too.
    weights, ids = moe_torch.select_experts(logits, full.routing)
    local = moe_ep.local_expert_ids(ids, ranks[0].local_experts)
    dense = moe_torch.fused_moe_dense(x, ranks[0].w13, ranks[0].w2, weights, local)
    torch.testing.assert_close(dense, ranks[0](x, logits), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ep2_over_tp2_matches_hf(qwen3_moe) -> None:
    """EP=2 (TP=2): attention heads split, each rank holding 4 whole experts; chunked prefill
    and a mixed batch included. The same tolerance TP=1 meets against HF."""
    got = mh.generate(qwen3_moe.folder, qwen3_moe.prompts, tensor_parallel_size=2,
                      distributed_executor_backend="mp", cpu_threads=1,
                      max_num_batched_tokens=32, enable_expert_parallel=True)
    mh.assert_matches(got, qwen3_moe.refs, qwen3_moe.prompts)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs: EP=2 over TP=2 with NCCL and the Triton "
                           "fused-MoE kernel's skipped experts")
def test_ep2_over_tp2_matches_hf_on_two_gpus(qwen3_moe) -> None:
    got = mh.generate_on(qwen3_moe.folder, qwen3_moe.prompts, device="cuda",
                         tensor_parallel_size=2, distributed_executor_backend="mp",
                         enable_expert_parallel=True)
    mh.assert_matches(got, qwen3_moe.refs, qwen3_moe.prompts, tol=mh.GPU_LOGPROB_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: the Triton fused-MoE kernel runs only on one")
def test_triton_kernel_skips_experts_held_elsewhere() -> None:
    """The Triton path of one EP rank's layer (ids of other ranks' experts = the sentinel)
    against the torch path; then batch 1 with every unrouted expert poisoned."""
    from tidal.engine_core.kernel_config import KernelConfig
    from tidal.worker.kernel_policy import building, kernels_for

    dev = torch.device("cuda")
    kernels = kernels_for(dev, KernelConfig(ops="triton"))
    assert kernels._moe is not None, "a GPU with triton should get the Triton MoE kernels"
    with building(kernels), torch.device(dev):
        full = _layer(None)
        rank = _layer(_ep(1, 2), full)
    x = torch.randn(64, 16, device=dev)
    logits = torch.randn(64, EXPERTS, device=dev)
    weights, ids = moe_torch.select_experts(logits, full.routing)
    local = moe_ep.local_expert_ids(ids, rank.local_experts)
    want = moe_torch.fused_moe(x, rank.w13, rank.w2, weights, local)
    torch.testing.assert_close(rank(x, logits), want, rtol=1e-2, atol=1e-2)
    routed = set(ids[0].tolist())
    for slot, e in enumerate(rank.local_experts):
        if e not in routed:
            rank.w13.data[slot] = float("nan")
            rank.w2.data[slot] = float("nan")
    torch.testing.assert_close(rank(x[:1], logits[:1]), want[:1], rtol=1e-2, atol=1e-2)


def _generate_dp(folder, prompts: list[list[int]], alone: int,
                 **kw) -> tuple[list, list[int]]:
    """Through two DP engines with their experts split between them (TP=1 each): prompt
    ``alone`` by itself first (the other engine idle, joining each step's exchange with no
    tokens), then all of them at once (both engines busy, with different token counts). Returns
    the second round's (tokens, logprobs) per prompt and the requests each engine got."""
    import asyncio

    from tidal.engine_core.config import EngineArgs
    from tidal.frontend.async_llm import AsyncLLM

    args = EngineArgs(**{**dict(model=str(folder), num_kv_blocks=128, max_num_seqs=8,
                                dtype="float32", device="cpu", cpu_threads=1,
                                max_num_batched_tokens=32, data_parallel_size=2,
                                enable_expert_parallel=True), **kw})
    llm = AsyncLLM.from_engine_args(args, skip_tokenizer_init=True)

    async def one(prompt: list[int], rid: str) -> tuple[list[int], list[float]]:
        final = None
        async for out in llm.generate(prompt, mh.GREEDY, rid):
            final = out
        assert final is not None
        got = final.outputs[0]
        return (list(got.token_ids),
                [got.logprobs[i][t].logprob for i, t in enumerate(got.token_ids)])

    async def rounds() -> tuple[tuple, list]:
        first = await one(prompts[alone], "alone")
        both = await asyncio.gather(*(one(p, f"r{i}") for i, p in enumerate(prompts)))
        return first, list(both)

    try:
        first, both = asyncio.run(rounds())
        routed = [r.routed for r in llm.client.coordinator.ranks]
    finally:
        llm.shutdown()
    assert first[0] == both[alone][0]  # (logprobs: batched sums round a little otherwise)
    tol = mh.GPU_LOGPROB_TOL if kw.get("device") == "cuda" else mh.LOGPROB_TOL
    assert mh.max_logprob_diff(first[1], both[alone][1]) < tol
    return both, routed


@pytest.mark.slow
def test_ep_across_two_dp_engines_matches_hf(qwen3_moe, capfd) -> None:
    """EP=2 over DP=2 (TP=1): the same greedy tokens and logprobs as one engine (HF's), with
    one engine idle in the first round and both busy in the second; dual batch overlap on
    from 4 tokens a step (prefill chunks and the second round's decodes overlap, the first
    round's decodes do not)."""
    prompts = qwen3_moe.prompts
    got, routed = _generate_dp(qwen3_moe.folder, prompts, alone=1, enable_dbo=True,
                               dbo_token_threshold=4)
    mh.assert_matches(got, qwen3_moe.refs, prompts)
    assert sum(routed) == len(prompts) + 1 and min(routed) >= 1, routed
    # Each engine really held half the experts (so the tokens above needed the exchange).
    log = capfd.readouterr().err
    for rank, held in ((0, "experts 0..3 of 8, rank 0/2"), (1, "experts 4..7 of 8, rank 1/2")):
        assert f"expert parallel rank {rank}/2: 2 MoE layers, {held}; tokens exchanged with 2 " \
            "data-parallel engines; dual batch overlap from 4 tokens per step" in log, log[-3000:]
        assert f"expert parallel rank {rank}: first step with dual batch overlap" in log


@pytest.mark.slow
def test_ep_across_two_dp_engines_by_all_to_all_matches_hf(qwen3_moe, capfd) -> None:
    """``--all2all-backend alltoallv``: the same greedy tokens and logprobs as one engine
    (HF's), every layer's tokens moved by all-to-all (the CPU's steps are all eager), one
    engine idle in the first round."""
    prompts = qwen3_moe.prompts
    got, _ = _generate_dp(qwen3_moe.folder, prompts, alone=0, all2all_backend="alltoallv")
    mh.assert_matches(got, qwen3_moe.refs, prompts)
    log = capfd.readouterr().err
    for rank in (0, 1):
        assert f"expert parallel rank {rank}: first layer exchanged by all-to-all" in log, \
            log[-3000:]


@pytest.mark.slow
def test_the_overlap_threshold_is_measured_when_not_given(qwen3_moe, capfd) -> None:
    """``--enable-dbo`` without ``--dbo-token-threshold``: once the engines meet, each worker
    times the first MoE layer with and without the overlap at 128 tokens over both engines
    (their largest step, 64 tokens each), every one decides alike, the start-up log says what
    and why, and serving gives one engine's (HF's) tokens."""
    prompts = qwen3_moe.prompts
    got, _ = _generate_dp(qwen3_moe.folder, prompts, alone=0, enable_dbo=True,
                          max_num_batched_tokens=64)
    mh.assert_matches(got, qwen3_moe.refs, prompts)
    log = capfd.readouterr().err
    assert "dual batch overlap from the step size measured once the engines meet" in log
    decided = re.findall(r"dual batch overlap: (on from 128 tokens|off: never)", log)
    assert decided and len(set(decided)) == 1, log[-3000:]  # (rank 0 logs it)
    assert "128: " in log and "x)" in log


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs: one engine on each, exchanging tokens over NCCL")
@pytest.mark.parametrize("dbo, eager", [(False, True), (True, True), (True, False),
                                       ("measure", False), ("alltoallv", False)],
                         ids=["one-exchange", "dual-batch-overlap", "decode-graphs",
                              "measured-overlap", "all-to-all"])
def test_ep_across_two_dp_engines_matches_hf_on_two_gpus(qwen3_moe, dbo, eager,
                                                         capfd) -> None:
    """Over NCCL, eagerly (with and without the overlap) and with the decode graphs agreed
    between the engines (the prompt steps overlap, eagerly; decode steps replay graphs, the
    idle engine's in the first round on a dummy batch); with the overlap's threshold
    measured at start-up, before those graphs; and with the prompt steps' tokens moved by
    all-to-all (``--all2all-backend alltoallv``; the decode graphs gather)."""
    prompts = qwen3_moe.prompts
    # ("measure": no threshold given, so the engines time the overlap at start-up, at 128
    # tokens over both, their largest step.)
    a2a = dbo == "alltoallv"
    got, routed = _generate_dp(qwen3_moe.folder, prompts, alone=1, device="cuda",
                               enforce_eager=eager, enable_dbo=bool(dbo) and not a2a,
                               dbo_token_threshold=4 if dbo is True else None,
                               **({"max_num_batched_tokens": 64} if dbo == "measure" else {}),
                               **({"all2all_backend": "alltoallv"} if a2a else {}))
    mh.assert_matches(got, qwen3_moe.refs, prompts, tol=mh.GPU_LOGPROB_TOL)
    assert min(routed) >= 1, routed
    log = capfd.readouterr().err
    replayed = "first decode step replaying the graph agreed with the other data-parallel"
    assert (replayed in log) != eager, log[-3000:]
    if not eager:
        assert "exchange graph capture" in log, log[-3000:]
    if dbo == "measure":
        assert re.search(r"dual batch overlap: (on from 128|off: never)", log), log[-3000:]
    if a2a:
        assert "first layer exchanged by all-to-all" in log, log[-3000:]


def test_exchange_headroom_covers_every_engines_rows() -> None:
    """The KV sizing's reserve for the exchange across DP engines (the start-up profile runs
    each engine alone): every engine's rows gathered ([hidden | logits] in their dtypes), the
    experts' temporaries (the [pairs, I] activations, the float32 [pairs, H] output) over the
    rows the profile did not have, and the combine's buffers."""
    dp, t, h, e, k, i, b, lb = 4, 256, 64, 8, 2, 48, 2, 4
    got = moe_ep.exchange_headroom_bytes(dp_size=dp, tokens=t, hidden=h, num_experts=e,
                                         top_k=k, intermediate=i, dtype_bytes=b,
                                         logits_bytes=lb)
    rows, extra = dp * t, (dp - 1) * t
    gathered = rows * (h * b + e * lb)  # one [dp * t, H + E] gather
    experts = extra * k * (i * b + 4 * h)  # activations and float32 outputs of the extra pairs
    combine = rows * h * b  # every engine's rows of the output, before the reduce-scatter
    assert got >= gathered + experts + combine
    # Linear in the rows (no term forgotten that grows with the engines), nothing for one.
    more = moe_ep.exchange_headroom_bytes(dp_size=2 * dp, tokens=t, hidden=h, num_experts=e,
                                          top_k=k, intermediate=i, dtype_bytes=b,
                                          logits_bytes=lb)
    assert more > 2 * got - t * (h * b + e * lb) - t * h * b - 1
    assert moe_ep.exchange_headroom_bytes(dp_size=1, tokens=t, hidden=h, num_experts=e,
                                          top_k=k, intermediate=i, dtype_bytes=b,
                                          logits_bytes=lb) == 0
    # An ExpertParallel sizes it from its layers and the router logits' dtype it has seen.
    ep = moe_ep.ExpertParallel(ParallelGroup(), 0, 2)
    layers = [_layer(ep) for _ in range(2)]
    ep.bind(torch.nn.ModuleList(layers))
    want = moe_ep.exchange_headroom_bytes(dp_size=2, tokens=t, hidden=16, num_experts=EXPERTS,
                                          top_k=2, intermediate=24, dtype_bytes=4,
                                          logits_bytes=4)
    assert ep.exchange_headroom(t) == want > 0
    layers[0](torch.randn(3, 16), torch.randn(3, EXPERTS, dtype=torch.float64))
    assert ep.logits_dtype == torch.float64 and ep.exchange_headroom(t) > want
    assert _ep(0, 2).exchange_headroom(t) == 0  # within one engine: nothing exchanged


def test_release_drops_the_expert_layers(qwen3_moe) -> None:
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.model_runner import ModelRunner

    cfg = EngineArgs(model=str(qwen3_moe.folder), device="cpu", num_kv_blocks=64,
                     enable_expert_parallel=True).create_config()
    runner = ModelRunner(cfg, torch.device("cpu"))
    runner.load_model()
    ep = runner.ep
    assert ep is not None and len(ep.layers) == 2
    runner.release()
    # Nothing keeps the model's expert weights alive after the runner lets the model go.
    assert runner.ep is None and ep.layers == [] and not ep.active


def test_expert_load_counts_each_engines_tokens_once() -> None:
    """The /metrics expert-load counter (layers/expert_load) under EP: an engine's own rows
    are counted as they are routed (padding masked); across DP engines every engine routes
    every engine's gathered rows alike and counts only its own among them, so the engines'
    counts add up to one count of every token."""
    from tidal.worker.layers.expert_load import ExpertLoad

    x = torch.randn(6, 16)
    logits = torch.randn(6, EXPERTS)
    _, ids = moe_torch.select_experts(logits, RoutingConfig(top_k=2))

    def bins(rows: torch.Tensor) -> list[int]:
        return torch.bincount(rows.reshape(-1), minlength=EXPERTS).tolist()

    counted = []
    for dp_rank in (0, 1):
        ep = moe_ep.ExpertParallel(ParallelGroup(), dp_rank, 2)
        layer = _layer(ep)
        load = ExpertLoad([layer], torch.tensor([4], dtype=torch.int32), 8,
                          torch.device("cpu"))
        # Engine 0 sent 4 tokens, engine 1 sent 2: the 6 gathered rows in rank order.
        mine = moe_ep.Exchange.of([4, 2], dp_rank, torch.device("cpu"))
        assert (mine.offset, mine.tokens) == ((0, 4), (4, 2))[dp_rank]
        ep._local_experts(layer, x, logits, None, mine=mine)
        counted.append(load.snapshot().tolist())
        # This engine's own rows (start-up, or EP inside one engine): the first 4 are tokens.
        ep._local_experts(layer, x, logits, None)
        assert load.snapshot().tolist() == bins(ids[:4])
    assert counted == [bins(ids[:4]), bins(ids[4:])]
