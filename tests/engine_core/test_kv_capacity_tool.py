"""tools/bench_kv_capacity.py's block accounting (its ``--dry-run``, the mode CI can run): the
issue's capacity targets at 32k hold for the shapes' layouts, and the real KV cache managers,
filled with requests, admit what the arithmetic says."""

from __future__ import annotations

import json

import pytest

import reference


@pytest.fixture(scope="module")
def tool():
    with reference.tool_module("bench_kv_capacity") as module:
        yield module


def per_request_gain(hybrid, full) -> float:
    return (full.blocks_per_request * full.bytes_per_block) / (
        hybrid.blocks_per_request * hybrid.bytes_per_block)


@pytest.mark.parametrize("shape,target", [("gemma3-27b", 4.5), ("mistral-7b", 6.0)])
def test_issue_targets_at_32k(tool, shape, target):
    gib = 40 * 2**30
    hybrid = tool.arithmetic(shape, 32768, gib, 16, hybrid=True)
    full = tool.arithmetic(shape, 32768, gib, 16, hybrid=False)
    assert hybrid.padding_waste <= 0.05 and full.padding_waste == 0.0
    gain = per_request_gain(hybrid, full)
    assert gain >= target, f"{shape}: {gain:.2f}x"
    # The arithmetic ceiling: every windowed layer keeping only its window.
    assert gain <= {"gemma3-27b": 5.33, "mistral-7b": 8.0}[shape]
    assert hybrid.tokens >= target * full.tokens


@pytest.mark.parametrize("shape", ["gemma3-27b", "mistral-7b", "gemma2-9b"])
def test_managers_admit_what_the_arithmetic_says(tool, shape):
    # Small numbers: an 8k context (longer than every window), a pool of a few requests.
    context, bs = 8192, 16
    for hybrid in (True, False):
        cap = tool.arithmetic(shape, context, 16 * 2**30, bs, hybrid)
        assert cap.requests >= 2
        held = tool.simulate(shape, context, cap.pool_blocks, bs, hybrid, chunk=bs)
        # A request prefilling holds one block more per windowed group than one decoding:
        # the last one may not fit where it would once decoding.
        assert cap.requests - 1 <= held <= cap.requests, (hybrid, held, cap.requests)


def test_dry_run_command_line(tool, tmp_path, capsys):
    out = tmp_path / "caps.json"
    assert tool.main(["--dry-run", "--shape", "mistral-7b", "--context", "4096",
                      "--kv-gib", "1", "--chunk", "512", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["layout"] for r in rows] == ["hybrid", "all-full"]
    # Every layer windowed at 4096 within a 4096 context never slides: the same layout.
    assert rows[0]["blocks_per_request"] == rows[1]["blocks_per_request"]
    assert "mistral-7b @ 4096" in capsys.readouterr().out


@pytest.mark.slow
def test_engine_run_holds_what_the_arithmetic_says(tool, tmp_path):
    """The GPU mode's engine path, on the CPU with a shrunk Gemma 3: the engine filled with
    requests holds about as much context as the arithmetic says, more with the hybrid manager."""
    out = tmp_path / "caps.json"
    assert tool.main(["--shape", "tiny-gemma3", "--context", "256", "--kv-gib",
                      str(1 / 1024), "--device", "cpu", "--dtype", "float32", "--chunk", "64",
                      "--max-num-seqs", "32", "--json", str(out)]) == 0
    hybrid, full = json.loads(out.read_text())
    for row in (hybrid, full):
        assert row["pool_blocks"] > 0
        # Running requests held at least all but one request's worth of the arithmetic.
        assert row["measured_tokens"] >= (row["requests"] - 1) * 256 * 0.9, row
        assert row["measured_requests"] <= row["requests"] + 1
    assert hybrid["measured_tokens"] > 1.3 * full["measured_tokens"]


def test_fp8_kv_cache_doubles_the_blocks(tool, tmp_path):
    """``--kv-cache-dtype fp8``: one byte a cached value, so the same KV memory holds twice
    the bfloat16 blocks (and requests); the command line carries it to the arithmetic."""
    gib = 16 * 2**30
    bf16 = tool.arithmetic("mistral-7b", 8192, gib, 16, hybrid=True)
    fp8 = tool.arithmetic("mistral-7b", 8192, gib, 16, hybrid=True, kv_cache_dtype="fp8")
    assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
    assert fp8.pool_blocks == 2 * bf16.pool_blocks and fp8.requests >= 2 * bf16.requests
    out = tmp_path / "caps.json"
    assert tool.main(["--dry-run", "--shape", "mistral-7b", "--context", "8192", "--kv-gib",
                      "16", "--kv-cache-dtype", "fp8", "--no-simulate", "--json",
                      str(out)]) == 0
    rows = json.loads(out.read_text())
    assert rows[0]["bytes_per_block"] == fp8.bytes_per_block
