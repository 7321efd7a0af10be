"""The draft-model proposer: a tiny draft (random weights, the target's vocabulary) proposes
k greedy tokens per request equal to k greedy decode steps of the same draft run alone in HF
transformers, for several requests of different lengths in one batch and again in the next
round, after some drafts were accepted and the rest overwritten (its KV cache kept between
calls, addressed by the target's block tables). With temperature > 0 each draft is drawn from
the returned q, which equals the HF draft's softmax(logits / T) along the drawn chain."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import reference
from tidal.worker.attention.torch_backend import TorchAttention

K = 4
BLOCK = 16
BLOCKS_PER_REQ = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = tmp_path_factory.mktemp("spec-target")
    draft = tmp_path_factory.mktemp("spec-draft")
    reference.make_tiny_model("llama", target, seed=0)
    hf_draft = reference.make_tiny_model("qwen2", draft, seed=1, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=2)
    return target, draft, hf_draft


def _proposer(models):
    from tidal.engine_core.config import EngineArgs
    from tidal.worker.loader.model_loader import load_model
    from tidal.worker.spec_decode.draft_proposer import DraftModelProposer, draft_model_config

    target, draft, _ = models
    tcfg = EngineArgs(model=str(target), device="cpu", num_kv_blocks=64,
                      dtype="float32").create_config()
    dcfg = draft_model_config(str(draft), tcfg.model)
    assert dcfg.arch.family == "qwen2" and dcfg.dtype == "float32"
    model = load_model(dcfg, torch.device("cpu"), TorchAttention())
    proposer = DraftModelProposer(model, K, tcfg.model.arch, tcfg.model.max_model_len)
    return proposer


def test_greedy_drafts_equal_the_draft_run_alone(models):
    from tidal.worker.spec_decode.draft_proposer import make_batch

    hf = models[2]
    proposer = _proposer(models)
    a = proposer.attention_layers()[0]
    assert proposer.kv_bytes_per_block(BLOCK) == 2 * 2 * BLOCK * a.num_kv_heads * a.head_dim * 4
    proposer.bind_kv_cache(3 * BLOCKS_PER_REQ, BLOCK)
    table = torch.arange(3 * BLOCKS_PER_REQ, dtype=torch.int32).view(3, -1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 384, (n,), generator=g).tolist() for n in (1, 9, 30)]
    # Round 1: the whole prompts, the last token of each standing for the target's sample.
    counts = np.array([len(p) for p in prompts])
    batch = make_batch(torch.tensor(sum(prompts, [])), counts, np.zeros(3, np.int64), table,
                       BLOCK)
    out = proposer.propose(batch)
    assert out.probs is None and out.token_ids.shape == (3, K)
    for r, p in enumerate(prompts):
        assert out.token_ids[r].tolist() == reference.hf_greedy(hf, p, K)[0], f"request {r}"
    # Round 2: request r accepted r drafts and the target sampled another token after them;
    # the draft is fed what it has not seen (the accepted drafts, the sample) at their
    # positions. Its cache holds K/V of drafts at positions now rewritten.
    seqs, rows, starts = [], [], []
    for r, p in enumerate(prompts):
        accepted = out.token_ids[r, :r].tolist()
        sample = (7 * r + 3) % 384
        seqs.append(p + accepted + [sample])
        rows.append(accepted + [sample])
        starts.append(len(p))
    batch = make_batch(torch.tensor(sum(rows, [])), np.array([len(x) for x in rows]),
                       np.array(starts), table, BLOCK)
    out = proposer.propose(batch)
    for r, seq in enumerate(seqs):
        assert out.token_ids[r].tolist() == reference.hf_greedy(hf, seq, K)[0], f"request {r}"


@torch.no_grad()
def test_random_drafts_return_their_distribution(models):
    from tidal.worker.spec_decode.draft_proposer import make_batch

    hf = models[2]
    proposer = _proposer(models)
    proposer.bind_kv_cache(2 * BLOCKS_PER_REQ, BLOCK)
    table = torch.arange(2 * BLOCKS_PER_REQ, dtype=torch.int32).view(2, -1)
    prompts = [[5, 17, 300, 42, 8], [99, 3, 250]]
    temp = torch.tensor([1.3, 0.0])
    batch = make_batch(torch.tensor(sum(prompts, [])), np.array([5, 3]), np.zeros(2, np.int64),
                       table, BLOCK, temperature=temp, all_greedy=False,
                       generator=torch.Generator().manual_seed(2))
    out = proposer.propose(batch)
    assert out.probs.shape == (2, K, 384)
    seq = list(prompts[0])
    for s in range(K):
        want = torch.softmax(hf(torch.tensor([seq])).logits[0, -1] / 1.3, -1)
        torch.testing.assert_close(out.probs[0, s], want, rtol=1e-4, atol=1e-6)
        seq.append(int(out.token_ids[0, s]))
    # The greedy row: argmax drafts, one-hot distributions.
    assert out.token_ids[1].tolist() == reference.hf_greedy(hf, prompts[1], K)[0]
    assert torch.equal(out.probs[1], torch.nn.functional.one_hot(out.token_ids[1], 384).float())
    # Drawn, not argmax: over many seeds a T = 1.3 first draft is not always the mode.
    firsts = set()
    for seed in range(20):
        batch.generator = torch.Generator().manual_seed(seed)
        firsts.add(int(proposer.propose(batch).token_ids[0, 0]))
    assert len(firsts) > 1
