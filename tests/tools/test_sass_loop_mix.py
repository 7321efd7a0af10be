"""tools/sass_loop_mix.py: the loop found in a hand-written SASS listing (the longest body from a
label to a branch back to it; forward branches and predicates ignored), and, where a CPU build
of triton is installed, the INT4 group-tiled GEMV compiled for sm_90 with its loop counted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_loop_mix as slm  # noqa: E402

LISTING = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/               @P0 BRA `(.L_x_2) ;
.L_x_0:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R8, R4, 0x780000, R9, 0xf8, !PT ;
        /*0040*/                   FFMA R10, R8, R11, R10 ;
        /*0050*/              @!P1 LOP3.LUT R8, R5, 0x780000, R9, 0xf8, !PT ;
        /*0060*/                   FFMA R10, R8, R12, R10 ;
        /*0070*/               @P2 BRA `(.L_x_0) ;
.L_x_1:
        /*0080*/                   FADD R3, R3, R4 ;
        /*0090*/               @P3 BRA `(.L_x_1) ;
.L_x_2:
        /*00a0*/                   EXIT ;
"""


def test_longest_backward_loop_counted() -> None:
    mix = slm.loop_mix(LISTING)
    assert mix == {"LDG.E.128": 1, "LOP3.LUT": 2, "FFMA": 2, "BRA": 1}


def test_no_loop() -> None:
    assert slm.loop_mix("        /*0000*/                   EXIT ;\n") is None


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (a CPU build compiles for sm_90)")
def test_group_tiled_int4_gemv_has_one_lop3_and_ffma_a_weight() -> None:
    r = slm.report("int4-groups", [32, 4, 1, 0, 4])
    assert r["spill_stores"] == 0
    # the mask-and-exponent is one LOP3 a weight (the exponent in a register), one FFMA each
    assert 0.95 <= r["top"]["LOP3.LUT"] <= 1.1 and 0.95 <= r["top"]["FFMA"] <= 1.1
    assert r["per_weight"] < 5


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed (a CPU build compiles for sm_90)")
def test_fp8_decode_attention_transposes_v_without_byte_loads_only_in_f16_vt() -> None:
    # "f16" (KV_FP8 2) reads each V entry from shared memory as one byte; "f16_vt" (3) widens
    # V before transposing it in registers, so its loop has no LDS.U8 and fewer instructions.
    f16 = slm.report("attn-decode", [2, 128, 4, 3])
    vt = slm.report("attn-decode", [3, 128, 4, 3])
    assert f16["spill_stores"] == vt["spill_stores"] == 0
    assert f16["top"].get("LDS.U8", 0) >= 0.4
    assert "LDS.U8" not in vt["top"]
    assert vt["per_weight"] < f16["per_weight"]
