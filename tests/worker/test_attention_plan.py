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


def test_batch_one_gets_one_tile_per_split_up_to_2k_positions() -> None:
    """A batch-1 decode of 4 KV heads (Qwen3-30B-A3B) on 132 SMs splits its context 32 ways,
    so a 1.1k context's 18 tiles of 64 go one to a split (at 16 splits, 9 of them ran 2 tiles
    each and 7 idled); the cap is per caller: the CUDA kernel and MLA keep their 16."""
    assert ap.MAX_SPLITS == 32
    plan = _decode_plan(1, 4)
    assert plan.num_splits == 32 and plan.tile_n == 64
    assert ap.decode_num_splits(1, 4, DEVICE, max_splits=16) == 16
    assert ap.decode_num_splits(2, 8, DEVICE) == 17  # 2 x 132 / 16 programs: below the cap
    assert ap.decode_num_splits(64, 4, DEVICE) == 1  # 256 programs fill the SMs unsplit


def test_fp8_caches_widen_to_float16_and_full_batches_take_wider_tiles() -> None:
    fp8 = torch.float8_e4m3fn

    def plan(reqs: int, head_dim: int = 128, dtype=torch.bfloat16, q: int = 1):
        return ap.plan_triton_attention(reqs * q, reqs, q, 32, 8, head_dim, dtype, DEVICE,
                                        kv_dtype=fp8)

    full = plan(256)  # 2048 programs: unsplit
    assert (full.fp8_widen, full.tile_n, full.num_stages, full.num_splits) == ("f16", 128, 3, 1)
    split = plan(1)  # split decodes keep their tile and stages
    assert split.num_splits > 1 and split.fp8_widen == "f16"
    assert (split.tile_n, split.num_stages) == (_decode_plan(1, 8).tile_n, ap.SPLIT_STAGES)
    # Not measured, so unchanged: 16-bit caches, float32 queries, wider heads, prompt steps.
    assert _decode_plan(256, 8).fp8_widen == "query"
    assert ap.plan_triton_attention(256, 256, 1, 32, 8, 128, torch.bfloat16, DEVICE,
                                    kv_dtype=torch.bfloat16) == _decode_plan(256, 8)
    assert plan(256, dtype=torch.float32).fp8_widen == "query"
    assert plan(256, head_dim=256).fp8_widen == "query"
    assert plan(4, q=64).fp8_widen == "query"
