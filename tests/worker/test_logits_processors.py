"""Logits processors in the sampler (``worker/sample/logits_processors.py``): applied to the rows
that name them only, before logit bias, against a plain torch reference; global ones to every
row; the per-request rows gathered from the persistent batch."""

from __future__ import annotations

import numpy as np
import torch

from tidal.worker.sample.logits_processors import BatchState
from tidal.worker.sample.metadata import SamplingMetadata
from tidal.worker.sample.sampler import Sampler


class AddOne:
    """Adds 1 to column ``row index`` of its rows: a change that differs per row."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.calls: list[BatchState] = []

    def apply(self, logits: torch.Tensor, state: BatchState) -> torch.Tensor:
        self.calls.append(state)
        logits[state.rows, state.rows] += 100.0
        return logits


def test_processor_changes_only_its_rows_before_bias():
    torch.manual_seed(0)
    logits = torch.randn(3, 16)
    proc = AddOne(16, torch.device("cpu"))
    state = BatchState(torch.tensor([0, 2]), ["a", "c"], [[], [5]])
    meta = SamplingMetadata(temperature=torch.zeros(3), all_greedy=True, all_random=False,
                            logits_procs=[(proc, state)],
                            bias_rows=torch.tensor([2]), bias_cols=torch.tensor([9]),
                            bias_vals=torch.tensor([1000.0]))
    out = Sampler()(logits.clone(), meta)
    ref = logits.clone()
    ref[[0, 2], [0, 2]] += 100.0
    ref[2, 9] += 1000.0
    assert out.token_ids.tolist() == ref.argmax(dim=-1).tolist()
    assert out.token_ids.tolist()[0] == 0 and out.token_ids.tolist()[2] == 9
    assert len(proc.calls) == 1


def test_builder_gathers_named_and_global_rows(monkeypatch):
    from tidal.engine_core.protocol import NewRequestData
    from tidal.engine_core.sampling_params import SamplingParams
    from tidal.worker.input_batch import InputBatch
    from tidal.worker.sample import logits_processors as lp
    from tidal.worker.sample.metadata import SamplingMetadataBuilder

    made: dict[str, AddOne] = {}

    def resolve(name: str):
        def make(vocab: int, device: torch.device) -> AddOne:
            made[name] = AddOne(vocab, device)
            return made[name]
        return make

    monkeypatch.setattr(lp, "resolve_class", resolve)
    procs = lp.LogitsProcessors(16, torch.device("cpu"), ["everyone"])
    builder = SamplingMetadataBuilder(16, torch.device("cpu"), processors=procs)
    batch = InputBatch(4, 64, 8, (0,))

    def New(rid: str, params: SamplingParams) -> NewRequestData:  # noqa: N802
        return NewRequestData(rid, [3, 4], [5], params, [0], 0)

    batch.add(New("a", SamplingParams(temperature=0.0, logits_processors=["named"])), 16)
    batch.add(New("b", SamplingParams(temperature=0.0)), 16)
    rows = np.array([batch.row_of["a"], batch.row_of["b"]])
    meta = builder.build(batch, rows, lambda a, dt: torch.from_numpy(a).to(dt))
    assert meta.logits_procs is not None
    by_proc = {id(p): s for p, s in meta.logits_procs}
    everyone, named = by_proc[id(made["everyone"])], by_proc[id(made["named"])]
    assert everyone.rows.tolist() == [0, 1] and everyone.req_ids == ["a", "b"]
    assert named.rows.tolist() == [0] and named.req_ids == ["a"]
    assert named.output_token_ids == [[5]]
