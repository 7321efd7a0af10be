"""Launch planning of the Triton attention kernels (``worker/ops/attention_plan.py``), on any
machine: the SM count is stubbed to an H100's."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.ops import attention_plan as ap

DEVICE = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _h100(monkeypatch) -> None:
    monkeypatch.setattr(ap, "num_sms", lambda index: 132)


def _decode_plan(reqs: int, kv_heads: int) -> ap.TritonAttentionPlan:
    return ap.plan_triton_attention(reqs, reqs, 1, 4 * kv_heads, kv_heads, 128, torch.bfloat16,
                                    DEVICE)


def test_split_decodes_run_unpipelined_and_full_batches_keep_two_stages() -> None:
    one = _decode_plan(1, 4)  # Llama-3.1-8B heads at TP2, batch 1
    assert one.decode_only and one.num_splits == ap.MAX_SPLITS
    assert one.num_stages == ap.SPLIT_STAGES == 1
    batch = _decode_plan(64, 4)  # 256 programs without splitting: no split, pipelined loop
    assert batch.num_splits == 1 and batch.num_stages == 2


def test_split_stages_setting_reaches_the_plan(monkeypatch) -> None:
    monkeypatch.setattr(ap, "SPLIT_STAGES", 2)
    assert _decode_plan(1, 8).num_stages == 2
    monkeypatch.setattr(ap, "SPLIT_STAGES", 3)
    assert _decode_plan(2, 8).num_stages == 3
    # Prefill plans are not split decodes: their stages do not follow the setting.
    prefill = ap.plan_triton_attention(512, 1, 512, 32, 8, 128, torch.bfloat16, DEVICE)
    assert not prefill.decode_only and prefill.num_stages == 2
