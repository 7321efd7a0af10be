"""The expert-load counter behind ``/metrics``' ``moe_expert_load_tokens`` (worker/layers/
expert_load.py): padding rows of a graph step count nothing, snapshots sum the layers and start
again, and through the engine the per-expert counts equal HF transformers' own routing of the
same tokens (its router logits' top-k), dense layers left out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_harness as mh
from tidal.engine_core.config import EngineArgs
from tidal.engine_core.core import EngineCore
from tidal.engine_core.protocol import EngineCoreRequest
from tidal.engine_core.sampling_params import SamplingParams
from tidal.worker.layers.expert_load import ExpertLoad

TOP_K = mh.SHAPES["num_experts_per_tok"]
NUM_EXPERTS = 8
PROMPT_LENGTHS = (5, 23, 40)
NEW_TOKENS = 6


def test_padding_rows_count_nothing_and_snapshots_start_again():
    layers = [SimpleNamespace(num_experts=4) for _ in range(2)]
    valid = torch.tensor([2], dtype=torch.int32)  # the step's real tokens: rows 0 and 1
    load = ExpertLoad(layers, valid, max_rows=8, device=torch.device("cpu"))
    assert [(m.expert_load, m.expert_load_index) for m in layers] == [(load, 0), (load, 1)]
    # Row 2 is a padding row of the graph: its router read garbage (ids out of range).
    ids = torch.tensor([[0, 1], [1, 3], [9, -1]])
    load.into(0).add(ids)
    load.into(1).add(ids[:1])
    assert load.snapshot().tolist() == [2, 3, 0, 1]  # layer 0: 0,1,1,3; layer 1: 0,1
    assert load.snapshot().tolist() == [0, 0, 0, 0]
    load.into(1).add(ids[:2].to(torch.int32))
    load.into(0).add(torch.empty(0, 2, dtype=torch.int64))
    assert load.snapshot().tolist() == [1, 2, 0, 1]
    # A graph of 4 rows with 3 real ones, in two micro-batches of 2 (dual batch overlap):
    # the second's rows are rows 2 and 3 of the step, the last a padding row.
    graph = torch.tensor([[0, 1], [1, 3], [2, 3], [9, -1]])
    valid.fill_(3)
    load.into(0).add(graph[:2], start=0)
    load.into(0).add(graph[2:], start=2)
    assert load.snapshot().tolist() == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="expert counts"):
        ExpertLoad([SimpleNamespace(num_experts=4), SimpleNamespace(num_experts=8)], None, 8,
                   torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> mh.TinyMoE:
    from transformers import Qwen3MoeConfig

    # Three layers, the middle one dense: two MoE layers counted.
    cfg = Qwen3MoeConfig(**{**mh.SHAPES, "num_hidden_layers": 3, "head_dim": 32,
                            "intermediate_size": 96, "moe_intermediate_size": 48,
                            "num_experts": NUM_EXPERTS, "mlp_only_layers": [1],
                            "norm_topk_prob": False})
    return mh.make_tiny_moe(cfg, tmp_path_factory.mktemp("tiny-qwen3-moe-load"),
                            PROMPT_LENGTHS)


def _hf_routing(hf, tokens: list[int]) -> list[int]:
    """Per expert, how often HF's routers pick it over ``tokens`` (every MoE layer)."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_router_logits=True)
    counts = torch.zeros(NUM_EXPERTS, dtype=torch.int64)
    for logits in out.router_logits:
        ids = logits.reshape(-1, NUM_EXPERTS).topk(TOP_K, dim=-1).indices
        counts += torch.bincount(ids.reshape(-1), minlength=NUM_EXPERTS)
    return counts.tolist()


def _run(folder, prompts: list[list[int]], device: str, dtype: str = "float32"):
    """Greedy generation through an EngineCore (a 16-token budget: prompt chunks beside
    decodes in mixed steps; async scheduling on); returns the tokens, each expert's reported
    routings and the tokens the steps forwarded."""
    args = EngineArgs(model=str(folder), dtype=dtype, device=device, num_kv_blocks=64,
                      max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    core = EngineCore(args.create_config())
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"r{i}", p, params))
        generated: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        load = [0] * NUM_EXPERTS
        forwarded = 0
        for _ in range(200):
            if not core.has_unfinished_requests():
                break
            out = core.step()
            for o in out.outputs:
                generated[o.request_id] += o.new_token_ids
            stats = out.scheduler_stats
            forwarded += sum(stats.iteration_tokens)
            for e, n in enumerate(stats.moe_expert_load):
                load[e] += n
            assert stats.moe_ep_ranks in (0, 1)
        graphs = core.executor.worker.runner.graphs
    finally:
        core.shutdown()
    assert all(len(g) == NEW_TOKENS for g in generated.values())
    return generated, load, forwarded, graphs


def test_engine_counts_hf_routing_of_every_forwarded_token(tiny_moe):
    prompts = tiny_moe.prompts
    generated, load, forwarded, _ = _run(tiny_moe.folder, prompts, "cpu")
    # Every forwarded token, each of 2 MoE layers picking top-k experts.
    assert sum(load) == forwarded * 2 * TOP_K
    # The last generated token is never forwarded.
    want = [0] * NUM_EXPERTS
    for i, p in enumerate(prompts):
        for e, n in enumerate(_hf_routing(tiny_moe.hf, p + generated[f"r{i}"][:-1])):
            want[e] += n
    assert load == want


@pytest.mark.gpu
def test_graph_padding_rows_count_nothing_on_gpu(tiny_moe):
    """On a GPU the decode batches of 3 replay the graph of 4 and the mixed steps pad to their
    graphs' sizes: the padding rows' routings must not count."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: padded CUDA-graph steps")
    _, load, forwarded, graphs = _run(tiny_moe.folder, tiny_moe.prompts, "cuda")
    assert graphs is not None and graphs.mixed_replays > 0, "no padded graph step ran"
    assert sum(load) == forwarded * 2 * TOP_K
