"""Tensor parallelism on CPU (gloo): greedy tokens at TP=2 equal a single worker's exactly, for a
tiny random Llama (separate LM head) and Qwen3 (tied embeddings, q/k norms); and each rank's
weight loaders take exactly its shard, reading only that slice of the checkpoint (lazy
safetensors), with KV heads replicated when there are more ranks than KV heads."""

from __future__ import annotations

import random

import pytest
import torch

from tidal.frontend import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def _generate(folder, prompts, **kw) -> list[list[int]]:
    # On the CPU (gloo) whatever the machine: a one-GPU host has no second device, and exact
    # token equality across world sizes holds in float32; NCCL paths have GPU tests of their own.
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=256, cpu_threads=1,
              max_num_batched_tokens=128, device="cpu", **kw)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.shutdown()


@pytest.mark.slow
# Each family's sharding once, and each scheduling mode once: async scheduling's hold of
# the step's reply on the output rank does not depend on the family.
@pytest.mark.parametrize("family,async_scheduling", [("llama", False), ("qwen3", True)])
def test_tp2_matches_single_worker(tiny_models, family, async_scheduling):
    folder, hf = tiny_models[family]
    # Prompts longer than the token budget: chunked prefill steps go through TP too.
    prompts = _prompts(6, hf.config.vocab_size) + [list(range(3, 200))]
    reference = _generate(folder, prompts)
    # Async scheduling (the GPU default) also makes the output rank hold each step's reply
    # until the next step is launched.
    tp2 = _generate(folder, prompts, tensor_parallel_size=2, distributed_executor_backend="mp",
                    async_scheduling=async_scheduling)
    assert tp2 == reference
    assert all(len(t) == GREEDY.max_tokens for t in tp2)


# --- loading: each rank gets its shard, and reads no more -------------------------------------


def _rank_model(folder, rank: int, world: int, count_reads: dict):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.distributed.parallel_state import ParallelGroup
    from tidal.worker.loader import safetensors_weights
    from tidal.worker.loader.model_loader import load_model
    from tidal.worker.attention.torch_backend import TorchAttention

    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64).create_config()
    tp = ParallelGroup(rank=rank, world_size=world, ranks=tuple(range(world)))
    original = safetensors_weights.LazyTensor.materialize

    def counting(self):
        count_reads[self.name] = count_reads.get(self.name, 0) + 1
        return original(self)

    safetensors_weights.LazyTensor.materialize = counting
    try:
        return load_model(config.model, torch.device("cpu"), TorchAttention(), tp, None)
    finally:
        safetensors_weights.LazyTensor.materialize = original


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_loads_only_its_shard(tiny_models, world):
    folder, hf = tiny_models["llama"]  # 4 heads, 2 KV heads: TP=4 replicates each KV head
    state = hf.state_dict()
    cfg = hf.config
    d = cfg.hidden_size // cfg.num_attention_heads
    kv_heads = cfg.num_key_value_heads
    for rank in range(world):
        reads: dict[str, int] = {}
        model = _rank_model(folder, rank, world, reads)
        # Only replicated tensors (norms) are read whole; every sharded one is narrowed.
        assert reads and all("norm" in name for name in reads), sorted(reads)
        layer = model.layers["0"]
        qkv = layer.self_attn.qkv_proj.weight
        q_rows = cfg.num_attention_heads * d // world
        kv_rank = rank // max(1, world // kv_heads)
        kv_per_rank = max(1, kv_heads // world)
        kv_rows = kv_per_rank * d
        q = state["model.layers.0.self_attn.q_proj.weight"]
        k = state["model.layers.0.self_attn.k_proj.weight"]
        v = state["model.layers.0.self_attn.v_proj.weight"]
        assert torch.equal(qkv[:q_rows], q[rank * q_rows:(rank + 1) * q_rows])
        assert torch.equal(qkv[q_rows:q_rows + kv_rows],
                           k[kv_rank * kv_rows:(kv_rank + 1) * kv_rows])
        assert torch.equal(qkv[q_rows + kv_rows:], v[kv_rank * kv_rows:(kv_rank + 1) * kv_rows])
        inter = cfg.intermediate_size // world
        gate_up = layer.mlp.gate_up_proj.weight
        gate = state["model.layers.0.mlp.gate_proj.weight"]
        up = state["model.layers.0.mlp.up_proj.weight"]
        assert torch.equal(gate_up[:inter], gate[rank * inter:(rank + 1) * inter])
        assert torch.equal(gate_up[inter:], up[rank * inter:(rank + 1) * inter])
        down = state["model.layers.0.mlp.down_proj.weight"]
        assert torch.equal(layer.mlp.down_proj.weight, down[:, rank * inter:(rank + 1) * inter])
        o = state["model.layers.0.self_attn.o_proj.weight"]
        assert torch.equal(layer.self_attn.o_proj.weight, o[:, rank * q_rows:(rank + 1) * q_rows])
        rows = cfg.vocab_size // world
        emb = state["model.embed_tokens.weight"]
        assert torch.equal(model.embed_tokens.weight, emb[rank * rows:(rank + 1) * rows])
        head = state["lm_head.weight"]
        assert torch.equal(model.lm_head.weight, head[rank * rows:(rank + 1) * rows])
        assert layer.self_attn.num_kv_heads == kv_per_rank


def test_vocab_padding_when_vocab_does_not_split(tiny_models, tmp_path):
    """A vocabulary that does not divide by TP is padded; the padding rows are zero and never
    produce a logit."""
    import reference

    reference.make_tiny_model("llama", tmp_path, vocab_size=383)
    reads: dict[str, int] = {}
    model = _rank_model(tmp_path, 1, 2, reads)
    head = model.lm_head
    assert head.padded_vocab == 384 and head.shard_size == 192
    assert torch.count_nonzero(head.weight[-1]) == 0  # row 383 is padding
