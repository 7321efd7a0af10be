"""The sampling metadata builder reads only the host batch for what it computes at once: arrays
it stages reach the device when the step's inputs are flushed, after ``build`` returns, so a
computation that used them right away would see the previous step's values (on a GPU: wrong
penalty counts, or an out-of-range scatter and a device-side assert)."""

from __future__ import annotations

import numpy as np
import torch

from tidal.engine_core.protocol import NewRequestData
from tidal.engine_core.sampling_params import SamplingParams
from tidal.worker.input_batch import InputBatch
from tidal.worker.sample.metadata import SamplingMetadataBuilder

VOCAB = 16


def _not_flushed_yet(arr: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A staged array as the device holds it before the flush: someone else's values."""
    return torch.full((arr.shape[0],), 10**6, dtype=dtype)


def test_penalty_counts_do_not_read_staged_arrays():
    b = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=4, eos_token_ids=(0,))
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.2)
    b.add(NewRequestData("a", [1, 2, 3], [4, 4, 5], params, [0], 6), VOCAB)
    b.add(NewRequestData("b", [6], [7], params, [1], 2), VOCAB)
    rows, _ = b.rows_of(["a", "b"])
    meta = SamplingMetadataBuilder(VOCAB, torch.device("cpu")).build(b, rows, _not_flushed_yet)
    counts = torch.zeros(2, VOCAB)
    counts[0, 4], counts[0, 5], counts[1, 7] = 2, 1, 1
    prompt = torch.zeros(2, VOCAB, dtype=torch.bool)
    prompt[0, [1, 2, 3]] = True
    prompt[1, 6] = True
    assert torch.equal(meta.output_counts, counts)
    assert torch.equal(meta.prompt_mask, prompt)
