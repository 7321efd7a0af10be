"""A step's sampled tokens go to the grammar backends in one call
(``StructuredOutputManager.advance_all`` -> ``consume_each``: llguidance consumes them on its
threads, xgrammar in one batch): the matchers must end exactly where feeding each its token
alone leaves them (same masks, same stops, same rejections)."""

from __future__ import annotations

import json

import numpy as np

from tidal.engine_core.sampling_params import StructuredOutputsParams
from tidal.engine_core.structured_output import manager as mgr_module

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"}},
          "required": ["name", "n"], "additionalProperties": False}
TEXTS = [{"name": "ab", "n": 12}, {"name": "xyz", "n": -3}, {"name": "", "n": 7}]


def test_batched_consume_matches_one_by_one(manager, qwen3_tokenizer, admit, monkeypatch):
    tok = qwen3_tokenizer
    spec = StructuredOutputsParams(json=SCHEMA)
    n = 12  # above _BATCH_CONSUME: one backend call per step
    assert n >= mgr_module._BATCH_CONSUME
    rids = [f"r{i}" for i in range(n)]
    for rid in rids:
        admit(manager, rid, [1, 2, 3], structured_outputs=spec)
    seqs = [tok.encode(json.dumps(TEXTS[i % 3]),  # (", " and ": ": the grammar's spacing)
                       add_special_tokens=False) for i in range(n)]
    bad = tok.encode("!", add_special_tokens=False)[0]
    seqs[5] = seqs[5][:2] + [bad]  # rejected at its third token
    # The same requests' twins, fed one token per call.
    twins = {rid: manager.states[rid].matcher.deep_copy() for rid in rids}
    verdicts: dict[str, str | None] = {}
    for step in range(max(map(len, seqs))):
        batch = [(rid, [seq[step]]) for rid, seq in zip(rids, seqs)
                 if step < len(seq) and verdicts.get(rid) is None]
        got = manager.advance_all(batch)
        for (rid, toks), verdict in zip(batch, got, strict=True):
            twin = twins[rid]
            accepted = twin.consume_tokens(toks)
            want = None if accepted and not twin.is_stopped() else (
                "stop" if accepted else "error")
            assert (verdict if verdict in (None, "stop") else "error") == want, (rid, step)
            verdicts[rid] = verdict
            if verdict is None:
                mine = manager.fill_bitmask([rid])
                ref = np.empty_like(mine)
                manager._backend.fill([twin], ref)
                assert np.array_equal(mine, ref), (rid, step)
    assert verdicts["r5"] is not None and "rejected" in verdicts["r5"]
    assert all(verdicts[rid] in (None, "stop") for rid in rids if rid != "r5")
    manager.drop(rids)
