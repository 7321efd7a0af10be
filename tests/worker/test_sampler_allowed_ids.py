"""``allowed_token_ids`` in the worker: the metadata builder's (row, token) pairs and the
sampler's mask, against plain torch (every other logit of a restricted row set to -inf)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.engine_core.protocol import NewRequestData
from tidal.engine_core.sampling_params import SamplingParamError, SamplingParams
from tidal.worker.input_batch import InputBatch
from tidal.worker.sample.metadata import SamplingMetadata, SamplingMetadataBuilder
from tidal.worker.sample.sampler import Sampler

V = 64


def _reference_mask(logits: torch.Tensor, allowed: dict[int, list[int]]) -> torch.Tensor:
    out = logits.clone()
    for row, ids in allowed.items():
        keep = torch.zeros(logits.shape[1], dtype=torch.bool)
        keep[ids] = True
        out[row, ~keep] = float("-inf")
    return out


def _pairs(allowed: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [r for r, ids in allowed.items() for _ in ids]
    cols = [t for ids in allowed.values() for t in ids]
    return torch.tensor(rows), torch.tensor(cols)


def _meta(temp: list[float], allowed: dict[int, list[int]], **kw) -> SamplingMetadata:
    t = torch.tensor(temp)
    rows, cols = _pairs(allowed)
    return SamplingMetadata(temperature=t, all_greedy=bool((t == 0).all()),
                            all_random=bool((t > 0).all()), allowed_rows=rows,
                            allowed_cols=cols, **kw)


def test_greedy_and_logprobs_match_the_masked_reference():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0))
    # Row 1 is free; row 3 allows only tokens far below the best.
    allowed = {0: [3, 9, 40], 2: [7], 3: [int(i) for i in logits[3].argsort()[:5]]}
    temp = [0.0, 0.0, 0.7, 0.0]
    out = Sampler()(logits, _meta(temp, allowed, max_num_logprobs=4))
    masked = _reference_mask(logits, allowed)
    ref = (masked / torch.tensor([1.0, 1.0, 0.7, 1.0]).unsqueeze(1)).log_softmax(-1)
    assert out.token_ids.tolist()[:2] == masked[:2].argmax(-1).tolist()
    assert int(out.token_ids[2]) == 7 and int(out.token_ids[3]) == int(masked[3].argmax())
    lp = out.logprobs
    assert lp is not None
    for row in range(4):
        tok = int(out.token_ids[row])
        assert torch.allclose(lp.logprobs[row, 0], ref[row, tok], atol=1e-5)
        top = ref[row].topk(4)
        finite = torch.isfinite(top.values)
        assert torch.allclose(lp.logprobs[row, 1:][finite], top.values[finite], atol=1e-5)
        assert set(lp.token_ids[row, 1:][finite].tolist()) == set(top.indices[finite].tolist())
        assert not torch.isfinite(lp.logprobs[row, 1:][~finite]).any()


def test_random_rows_draw_only_allowed_tokens_in_proportion():
    base = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    n = 2000  # draws of one restricted row, as one batch; the last row is free
    logits = torch.cat((base[0].expand(n, V), base[1:]))
    allowed = {row: [2, 5, 11] for row in range(n)}
    torch.manual_seed(3)
    tokens = Sampler()(logits, _meta([1.0] * (n + 1), allowed)).token_ids
    counts = torch.bincount(tokens[:n], minlength=V).float()
    assert set(counts.nonzero().flatten().tolist()) <= {2, 5, 11}
    want = _reference_mask(base[:1], {0: [2, 5, 11]})[0].softmax(-1)[[2, 5, 11]]
    assert torch.allclose(counts[[2, 5, 11]] / n, want, atol=0.04)
    # The free row is not masked: its draw follows its own (peaked) distribution.
    free = torch.zeros(V)
    free[int(base[1].argmax())] = 50.0
    out = Sampler()(torch.stack((base[0], free)), _meta([1.0, 1.0], {0: [2, 5, 11]}))
    assert int(out.token_ids[0]) in (2, 5, 11) and int(out.token_ids[1]) == int(free.argmax())


def test_mask_composes_with_bias_penalty_free_top_k():
    logits = torch.zeros(1, V)
    logits[0, 10] = 5.0  # best overall, but not allowed
    # A bias lifts token 21 above 20 among the allowed ones; top-k=1 keeps that one.
    m = _meta([1.0], {0: [20, 21, 22]}, bias_rows=torch.tensor([0]),
              bias_cols=torch.tensor([21]), bias_vals=torch.tensor([3.0]),
              top_k=torch.tensor([1]))
    assert Sampler()(logits, m).token_ids.tolist() == [21]


def _add(b: InputBatch, rid: str, row_tokens: list[int], params: SamplingParams,
         block: int) -> None:
    b.add(NewRequestData(rid, row_tokens, [], params, [block], 0), V)


def test_builder_emits_the_pairs_of_restricted_rows_only():
    b = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=4, eos_token_ids=(0,))
    _add(b, "a", [1, 2], SamplingParams(temperature=0.0, allowed_token_ids=[9, 4, 9]), 0)
    _add(b, "b", [3], SamplingParams(temperature=0.0), 1)
    _add(b, "c", [5], SamplingParams(temperature=1.0, allowed_token_ids=[63]), 2)
    rows, _ = b.rows_of(["b", "a", "c"])

    def stage(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)

    meta = SamplingMetadataBuilder(V, torch.device("cpu")).build(b, rows, stage)
    pairs = sorted(zip(meta.allowed_rows.tolist(), meta.allowed_cols.tolist()))
    assert pairs == [(1, 4), (1, 9), (2, 63)]  # deduplicated, in sampling-row order
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(2))
    tokens = Sampler()(logits, meta).token_ids.tolist()
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[1] == (4 if logits[1, 4] >= logits[1, 9] else 9) and tokens[2] == 63
    with pytest.raises(ValueError, match="allowed_token_ids"):
        _add(b, "d", [1], SamplingParams(allowed_token_ids=[1, V]), 3)
    assert "d" not in b


@pytest.mark.parametrize("ids,match", [([], "at least one"), ([3, -1], ">= 0")])
def test_sampling_params_reject_empty_and_negative_ids(ids, match):
    with pytest.raises(SamplingParamError, match=match) as err:
        SamplingParams(allowed_token_ids=ids)
    assert err.value.param == "allowed_token_ids"
