"""tools/bench_lora.py: the PASS / MISS verdicts against issue 24's targets (worked out by
hand), the adapters it writes are ones the engine accepts, and a ``--smoke`` run on the CPU
(tiny Llama, the base and the LoRA engine in turn)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_lora  # noqa: E402


def test_verdicts_against_the_targets():
    result = {"base": {"decode_batch": {"tokens_per_s": 1000.0},
                       "decode_b1": {"ms_per_step": 10.0}},
              "lora": {"decode_batch": {"tokens_per_s": 840.0},
                       "decode_b1": {"ms_per_step": 11.4},
                       "hot_load": {"total_ms": 150.0},
                       "cold_adapter": {"extra_ms": 301.0}}}
    v = bench_lora.verdicts(result)
    assert v["decode_batch_ratio"]["value"] == 0.84
    assert v["decode_batch_ratio"]["verdict"] == "MISS"
    assert v["decode_b1_ratio"]["value"] == 1.14
    assert v["decode_b1_ratio"]["verdict"] == "PASS"
    assert v["hot_load_ms"]["verdict"] == "PASS"
    assert v["cold_first_token_extra_ms"]["verdict"] == "MISS"
    # Legs that did not run are not measured, never passed.
    assert {t["verdict"] for t in bench_lora.verdicts({}).values()} == {"n/a"}


def test_written_adapter_is_a_valid_peft_adapter(tmp_path):
    from tidal.engine_core.lora_adapter import inspect_adapter
    from tidal.engine_core.model_arch import arch_from_hf_dict

    cfg = bench_lora.SMOKE_SHAPE
    path = bench_lora.write_adapter(tmp_path / "a", cfg, rank=16, seed=0)
    spec = inspect_adapter(path, arch_from_hf_dict(dict(cfg), str(tmp_path)), 16)
    assert len(spec.modules) == 7 * cfg["num_hidden_layers"]
    assert {m.scaling for m in spec.modules} == {2.0}


@pytest.mark.slow  # two engines in turn: ~10 s on two cores
def test_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "lora.json"
    assert bench_lora.main(["--smoke", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    for leg in ("base", "lora"):
        assert r[leg]["decode_b1"]["ms_per_step"] > 0
        assert r[leg]["decode_batch"]["batch"] == 8
    assert r["lora"]["hot_load"]["total_ms"] > 0
    assert r["lora"]["cold_adapter"]["registered"] == 12
    assert set(r["verdicts"]) == set(bench_lora.TARGETS)
    assert all(t["verdict"] in ("PASS", "MISS") for t in r["verdicts"].values())
