"""INT4 (AWQ / GPTQ) models end to end on the CPU: tiny random Llama / Qwen2 / Qwen3 written as
AWQ and GPTQ checkpoints by round-to-nearest (``int4_writer``), their greedy tokens against HF
transformers on the dequantized weights, the tensor-parallel sharding of the INT4 tensors, a
TP=2 run, a tensor-parallel size that would split a group, and dummy INT4 weights."""

from __future__ import annotations

import pytest
import torch

from tests.reference import hf_greedy, max_logprob_diff
from tests.worker.int4_writer import dequantized_hf, write_int4_checkpoint
from tidal.frontend import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [[5, 17, 99, 3, 250, 41], [7] * 3 + list(range(20, 50)), [1, 2]]


def _run(folder, **kw):
    llm = LLM(str(folder), skip_tokenizer_init=True, num_kv_blocks=64, device="cpu",
              cpu_threads=1, **kw)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outs]
    return tokens, logprobs


def _hf_run(model):
    runs = [hf_greedy(model, p, PARAMS.max_tokens) for p in PROMPTS]
    return [r[0] for r in runs], [r[1] for r in runs]


def _flat_diff(a, b) -> float:
    return max(max_logprob_diff(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("family,method,kw", [
    ("llama", "awq", {"group_size": 32}),
    ("qwen3", "gptq", {"group_size": 32, "sym": True}),
    ("qwen3", "gptq", {"group_size": 32, "act_order": True}),  # shuffled g_idx
    ("qwen2", "gptq", {"group_size": -1, "v2": True}),  # q/k/v bias, one group per row
    ("llama", "gptq", {"group_size": 64, "act_order": True, "sym": True}),
])
def test_int4_greedy_matches_hf_on_dequantized_weights(tiny_models, tmp_path, family, method,
                                                       kw):
    folder, hf = tiny_models[family]
    deq = write_int4_checkpoint(folder, tmp_path / method, hf, method, **kw)
    tokens, logprobs = _run(tmp_path / method)  # detected from config.json
    ref_tokens, ref_logprobs = _hf_run(dequantized_hf(hf, deq))
    assert tokens == ref_tokens
    assert _flat_diff(logprobs, ref_logprobs) < 1e-4
    # Quantization changed the numbers: the unquantized model's logprobs differ.
    _, plain = _hf_run(hf)
    assert _flat_diff(logprobs, plain) > 1e-3


def _layer0(folder, rank: int, world: int, **kw):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.attention.torch_backend import TorchAttention
    from tidal.worker.distributed.parallel_state import ParallelGroup
    from tidal.worker.loader.model_loader import load_model

    config = EngineArgs(model=str(folder), device="cpu", num_kv_blocks=64, **kw).create_config()
    tp = ParallelGroup(rank=rank, world_size=world, ranks=tuple(range(world)))
    return load_model(config.model, torch.device("cpu"), TorchAttention(), tp, None).layers["0"]


@pytest.mark.parametrize("act_order", [False, True])
def test_tp_shards_int4_tensors_like_one_rank(tiny_models, tmp_path, act_order):
    folder, hf = tiny_models["llama"]
    dst = tmp_path / "gptq"
    write_int4_checkpoint(folder, dst, hf, "gptq", group_size=32, act_order=act_order)
    whole = _layer0(dst, 0, 1)
    inter = hf.config.intermediate_size // 2
    x = torch.randn(3, inter * 2, generator=torch.Generator().manual_seed(0))
    for rank in range(2):
        part = _layer0(dst, rank, 2)
        rows = slice(rank * inter, (rank + 1) * inter)
        gu, gu1 = part.mlp.gate_up_proj, whole.mlp.gate_up_proj
        for name in ("qweight", "scales", "qzeros"):
            got, full = getattr(gu, name), getattr(gu1, name)
            assert torch.equal(got[:inter], full[rows])  # gate rows of this rank
            assert torch.equal(got[inter:], full[inter * 2:][rows])  # up rows
        assert torch.equal(gu.g_idx, gu1.g_idx)  # column-parallel: every input channel
        # Row-parallel: a range of whole packed words of every output row; groups likewise,
        # except act-order, where a rank's channels may be in any group (all of them kept).
        down, down1 = part.mlp.down_proj, whole.mlp.down_proj
        assert torch.equal(down.qweight, down1.qweight[:, rank * inter // 8:][:, :inter // 8])
        assert torch.equal(down.g_idx, down1.g_idx[rows])
        groups = slice(None) if act_order else slice(rank * inter // 32, (rank + 1) * inter // 32)
        assert torch.equal(down.scales, down1.scales[:, groups])
        assert torch.equal(down.qzeros, down1.qzeros[:, groups])
        # (Each rank's product before the all-reduce; their sum is one rank's.)
        part_y = down.matmul(x[:, rows], None)
        total = part_y if rank == 0 else total + part_y
    torch.testing.assert_close(total, whole.mlp.down_proj(x), rtol=1e-5, atol=1e-5)


def test_tp_size_that_splits_a_group_is_refused(tiny_models, tmp_path):
    folder, hf = tiny_models["llama"]
    dst = tmp_path / "awq128"
    write_int4_checkpoint(folder, dst, hf, "awq", group_size=128)
    assert _layer0(dst, 0, 1).mlp.down_proj.scales.shape[1] == 1  # 128 inputs: one group
    with pytest.raises(ValueError, match="tensor-parallel size 2 splits .* a group of 128"):
        _layer0(dst, 0, 2)


def test_dummy_int4_weights(tiny_models):
    folder, _ = tiny_models["qwen3"]
    layer = _layer0(folder, 0, 1, load_format="dummy", quantization="awq")
    proj = layer.self_attn.o_proj
    assert proj.weight is None and proj.qweight.dtype == torch.int32
    assert (proj.scales > 0).all() and (proj.scales <= 2e-3 / 15 + 1e-9).all()
    tokens, _ = _run(folder, load_format="dummy", quantization="gptq")
    assert all(len(t) == PARAMS.max_tokens for t in tokens)


@pytest.mark.slow
def test_tp2_int4_act_order_matches_single_worker(tiny_models, tmp_path):
    folder, hf = tiny_models["qwen3"]
    dst = tmp_path / "gptq-act"
    write_int4_checkpoint(folder, dst, hf, "gptq", group_size=32, act_order=True)
    one = _run(dst)
    two = _run(dst, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert two[0] == one[0]
    # Weight-only: the ranks' partial sums differ from one rank's by float rounding only.
    assert _flat_diff(two[1], one[1]) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the W4A16 Triton "
                    "kernels, captured in CUDA graphs, run on a GPU)")
@pytest.mark.parametrize("method,kw", [("awq", {"group_size": 32}),
                                       ("gptq", {"group_size": 32, "act_order": True})])
def test_gpu_int4_with_cuda_graphs_matches_hf(tiny_models, tmp_path, method, kw):
    """A tiny INT4 Llama on the GPU in float32 (the Triton kernels without TF32): one request
    at a time (decode rows: the split-K GEMV, in CUDA graphs) and the prompts together (the
    GEMM), against HF on the dequantized weights."""
    folder, hf = tiny_models["llama"]
    dst = tmp_path / method
    deq = write_int4_checkpoint(folder, dst, hf, method, **kw)
    llm = LLM(str(dst), skip_tokenizer_init=True, dtype="float32", device="cuda",
              num_kv_blocks=64)
    try:
        alone = [llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0] for p in PROMPTS]
        batched = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.shutdown()
    ref = dequantized_hf(hf, deq)
    for p, one, many in zip(PROMPTS, alone, batched):
        tokens, logprobs = hf_greedy(ref, p, PARAMS.max_tokens)
        for out in (one, many):
            assert list(out.token_ids) == tokens
            got = [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]
            assert max_logprob_diff(got, logprobs) < 2e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device (the CUDA few-row "
                    "INT4 product, captured in CUDA graphs, runs on a GPU)")
def test_gpu_int4_bf16_decode_rows_on_the_cuda_product_match_triton(tmp_path):
    """bfloat16 INT4 Llama wide enough for the CUDA few-row product (K of 256 and 512): the
    three prompts decode together (3-row steps in CUDA graphs) with ``skinny_w4a16`` on and
    off (the Triton split-K GEMV); the tokens agree until a near-tie, the logprobs closely."""
    from tests.reference import make_tiny_model
    from tidal.worker.ops import skinny_gemm

    src = tmp_path / "src"
    src.mkdir()
    hf = make_tiny_model("llama", src, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    dst = tmp_path / "awq"
    write_int4_checkpoint(src, dst, hf, "awq", group_size=128)
    x = torch.zeros(3, 256, device="cuda", dtype=torch.bfloat16)
    assert skinny_gemm.supported(x, torch.zeros(512, 32, device="cuda", dtype=torch.int32), 128)
    runs = {}
    for skinny in (True, False):
        llm = LLM(str(dst), skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
                  num_kv_blocks=64, kernel_config={"skinny_w4a16": skinny})
        try:
            runs[skinny] = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        finally:
            llm.shutdown()
    for a, b in zip(runs[True], runs[False]):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            la, lb = a.logprobs[i], b.logprobs[i]
            if ta != tb:  # summed in another order: only a near-tie may flip
                assert abs(la[ta].logprob - lb[tb].logprob) < 0.05, (i, ta, tb)
                break
            assert abs(la[ta].logprob - lb[tb].logprob) < 0.05
