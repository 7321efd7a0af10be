"""The few-row tensor-core product (``csrc/skinny_gemm.cu``, ``worker/ops/skinny_gemm.py``)
against plain torch on the same (dequantized) weights: 16-bit, FP8 and INT4 weights, 1-8 rows,
bias, the gated epilogues, every launch shape it is built with, and the shapes it refuses.
GPU only (a CUDA kernel; the CPU runs print why they skip), except the launch-shape rule and
the list of built shapes, which the CPU checks against the .cu file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tidal.worker.ops import int4_torch


def _gpu_skip() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: the few-row product is a CUDA kernel (the torch paths cover CPUs)"
    from tidal.worker.ops.cuda_ext import build_result

    result = build_result()
    if result.module is None:
        return f"the CUDA extension did not build: {result.error}"
    return None


GPU_SKIP = _gpu_skip()
gpu = pytest.mark.skipif(GPU_SKIP is not None, reason=str(GPU_SKIP))

DEV = "cuda"


def _ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, act: str | None,
         dtype: torch.dtype) -> torch.Tensor:
    """torch's rounding: the product in float64 rounded to ``dtype``, then the activation."""
    y = F.linear(x.double(), w.double(), None if bias is None else bias.double()).to(dtype)
    if act is None:
        return y
    g, u = y.double().chunk(2, dim=-1)
    a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
    return (a * u).to(dtype)


def _close(out: torch.Tensor, ref: torch.Tensor, label: str, tol: float = 1.5e-2) -> None:
    assert out.shape == ref.shape, label
    assert torch.isfinite(out).all(), f"{label}: non-finite output"
    err = float((out.double() - ref.double()).norm() / ref.double().norm())
    assert err < tol, f"{label}: relative error {err:.3g}"


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("act", [None, "silu", "gelu_tanh"])
def test_16bit_weights_match_torch(dtype, rows, act):
    from tidal.worker.ops import skinny_gemm as sk

    torch.manual_seed(rows)
    n, k = 136, 512  # 17 tiles of 8: a partial last block at every tile count
    w = torch.randn(2 * n if act else n, k, device=DEV, dtype=dtype) / k ** 0.5
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    bias = None if act else torch.randn(n, device=DEV, dtype=dtype)
    assert sk.supported(x, w, gated=act is not None)
    ref = _ref(x, w, bias, act, dtype)
    for cfg in sorted(sk.BUILT):
        if act and cfg.tiles % 2:
            continue
        out = sk.skinny_gemm(x, w, bias, act=act, config=cfg)
        _close(out, ref, f"{dtype} rows {rows} {act} {cfg}")


@gpu
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("act", [None, "silu"])
def test_fp8_weights_match_weight_only_reference(rows, act):
    from tidal.worker.ops import skinny_gemm as sk

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversion needs compute capability 8.9")
    torch.manual_seed(10 + rows)
    n, k = 64, 1024
    w = torch.randn(2 * n if act else n, k, device=DEV) / k ** 0.5
    w_q, scale = _fp8(w)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    # Large activations: the kernel takes x times 2^-4 in f16 and must not overflow.
    x[0, :8] *= 3000
    ref = _ref(x, w_q.float() * scale, None, act, torch.bfloat16)
    for cfg in sorted(sk.BUILT):
        if act and cfg.tiles % 2:
            continue
        out = sk.skinny_gemm(x, w_q, w_scale=scale, act=act, config=cfg)
        _close(out, ref, f"fp8 rows {rows} {act} {cfg}")


@gpu
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("group", [64, 128, 512])
@pytest.mark.parametrize("act", [None, "silu"])
def test_fp8_group_scales_match_weight_only_reference(rows, group, act):
    """Block-wise FP8 (a float32 scale per row and group of inputs, ``fp8_block_torch``'s
    layout): weight-only, every built launch shape, against the dequantized weight."""
    from tidal.worker.ops import fp8_block_torch as fbt
    from tidal.worker.ops import skinny_gemm as sk

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 conversion needs compute capability 8.9")
    torch.manual_seed(rows * group)
    n, k = 40, 1024
    w = torch.randn(2 * n if act else n, k, device=DEV) / k ** 0.5
    w[:, :group] *= 20  # groups of very different ranges: one row scale would lose the rest
    q, scale = fbt.quantize_weight_blocks(w, 1, group)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    ref = _ref(x, fbt.dequantize_weight(q, scale, group), None, act, torch.bfloat16)
    assert sk.supported(x, q, group, gated=act is not None, fp8_groups=True)
    for cfg in sorted(sk.BUILT):
        if act and cfg.tiles % 2:
            continue
        out = sk.skinny_gemm(x, q, scales=scale, group_size=group, act=act, config=cfg)
        _close(out, ref, f"fp8 groups {group} rows {rows} {act} {cfg}")
    assert not sk.supported(x, q, 32, fp8_groups=True)  # a chunk's 64 inputs share a scale


@gpu
@pytest.mark.parametrize("group", [32, 64, 128, 256, 1024])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_weights_match_dequantized_reference(group, rows, dtype):
    from tidal.worker.ops import skinny_gemm as sk

    torch.manual_seed(group + rows)
    n, k = 48, 1024
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    qw, s, z = int4_torch.quantize_rtn(w, group)
    s = s.to(dtype)
    x = torch.randn(rows, k, device=DEV, dtype=dtype)
    dense = int4_torch.dequantize(qw, s, z, group, dtype=dtype)
    ref = _ref(x, dense, None, None, dtype)
    # The torch path the CPUs run, for the same inputs.
    _close(int4_torch.w4a16_linear(x, qw, s, z, group), ref, "torch reference")
    assert sk.supported(x, qw, group)
    for cfg in sorted(sk.BUILT):
        out = sk.skinny_gemm(x, qw, scales=s, zeros=z, group_size=group, config=cfg)
        _close(out, ref, f"int4 group {group} rows {rows} {dtype} {cfg}", tol=1e-2)


@gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8_groups", "int4_staged", "int4_direct"])
def test_a_dependent_launch_reads_what_the_norm_before_it_wrote(fmt, monkeypatch):
    """Launched as a programmatic dependent right after the Triton one-row norm (which lets its
    dependents start at once), the product still reads the norm's output, not what that memory
    held before: bit for bit the result of the same calls launched plainly, eagerly and
    replayed from a CUDA graph."""
    from tidal.worker.ops import fp8_block_torch as fbt
    from tidal.worker.ops import skinny_gemm as sk

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 (Hopper) or later")
    try:
        from tidal.worker.ops import triton_decode as td
    except ImportError as exc:
        pytest.skip(f"the one-row norm before it is a Triton kernel: {exc}")
    if not td.pdl_enabled(torch.device(DEV)):
        pytest.skip("the Triton kernels run without dependent launch here")
    torch.manual_seed(5)
    n, k = 2048, 4096
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    if fmt == "bf16":
        wq, kw = w.to(torch.bfloat16), {}
    elif fmt == "fp8_groups":
        wq, scale = fbt.quantize_weight_blocks(w, 1, 128)
        kw = dict(scales=scale, group_size=128)
    else:
        group = 128 if fmt == "int4_staged" else 64  # (groups under 128: the direct form)
        wq, s, z = int4_torch.quantize_rtn(w, group)
        kw = dict(scales=s.to(torch.bfloat16), zeros=z, group_size=group)
    nw = (torch.rand(k, device=DEV) + 0.5).to(torch.bfloat16)
    xs = [torch.randn(1, k, device=DEV, dtype=torch.bfloat16) * (i + 1) for i in range(4)]
    res = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)

    def calls(pdl: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(sk, "PDL", pdl)
        return [sk.skinny_gemm(td.add_rms_norm_row(x, res, nw, 1e-6)[0], wq, **kw) for x in xs]

    want = calls(False)
    got = calls(True)
    graph = torch.cuda.CUDAGraph()
    calls(True)  # (warm-up outside the capture)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = calls(True)
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b, c) in enumerate(zip(want, got, captured)):
            assert torch.equal(a, b), f"{fmt}: call {i}, eager"
            assert torch.equal(a, c), f"{fmt}: call {i}, graph replay {step}"


@gpu
@pytest.mark.parametrize("rows,k", [(1, 640), (3, 1024), (2, 4096), (1, 14336), (8, 8192)])
@pytest.mark.parametrize("act", [None, "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_staged_and_direct_activations_match_reference(rows, k, act, dtype):
    """Both INT4 forms for groups of 128: one row's activations staged in shared memory as
    scaled f16 pairs (an odd and an even count of 128-input chunks, up to the largest row that
    fits) and 2-8 rows read directly, with activations from 1e-3 up to 3e4 (past f16's range
    unscaled)."""
    from tidal.worker.ops import skinny_gemm as sk

    torch.manual_seed(rows * k)
    n, group = 24, 128
    w = torch.randn(2 * n if act else n, k, device=DEV) / k ** 0.5
    qw, s, z = int4_torch.quantize_rtn(w, group)
    s = s.to(dtype)
    x = torch.randn(rows, k, device=DEV) * torch.logspace(-3, 0, k, device=DEV)
    if dtype == torch.bfloat16:
        x[:, ::97] *= 3e4
    x = x.to(dtype)
    dense = int4_torch.dequantize(qw, s, z, group, dtype=dtype)
    ref = _ref(x, dense, None, act, dtype)
    staged = sk.stages_activations(rows, k, group)
    assert staged == (rows == 1), (rows, k)  # the cases cover both forms
    for cfg in (sk.Launch(2, 8, 4), sk.Launch(2, 4, 2), sk.Launch(4, 2, 1)):
        out = sk.skinny_gemm(x, qw, scales=s, zeros=z, group_size=group, act=act, config=cfg)
        _close(out, ref, f"int4 rows {rows} k {k} staged {staged} {dtype} {cfg}", tol=1e-2)


def test_staged_layout_constants_match_the_cuda_file():
    from tidal.worker.ops import skinny_gemm as sk

    src = (Path(__file__).resolve().parents[2] / "csrc" / "skinny_gemm.cu").read_text()
    assert int(re.search(r"constexpr int kXsLane = (\d+);", src).group(1)) == sk.XS_LANE
    assert (int(re.search(r"kXsMaxBytes = (\d+) \* 1024;", src).group(1)) * 1024
            == sk.XS_MAX_BYTES)
    # Rows start 64 bytes apart modulo 128 (four 16-byte bank units), for any chunk count.
    for k in (128, 640, 1024, 4096, 14336):
        assert sk.xs_row_bytes(k) % 16 == 0 and sk.xs_row_bytes(k) // 16 % 8 == 4
        assert sk.xs_row_bytes(k) >= k // 128 * 4 * sk.XS_LANE
    assert sk.stages_activations(1, 14336, 128) and not sk.stages_activations(1, 14336, 64)
    assert not sk.stages_activations(2, 1024, 128)  # one row only
    assert not sk.stages_activations(1, 16384, 128)  # 41 KB: does not fit


@gpu
def test_int4_gated_matches_reference():
    from tidal.worker.ops import skinny_gemm as sk

    torch.manual_seed(3)
    n, k, group = 40, 512, 128
    w = torch.randn(2 * n, k, device=DEV) / k ** 0.5
    qw, s, z = int4_torch.quantize_rtn(w, group)
    s = s.to(torch.bfloat16)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    dense = int4_torch.dequantize(qw, s, z, group, dtype=torch.bfloat16)
    ref = _ref(x, dense, None, "silu", torch.bfloat16)
    out = sk.skinny_gemm(x, qw, scales=s, zeros=z, group_size=group, act="silu")
    _close(out, ref, "int4 gated")


@gpu
def test_rows_past_the_batch_are_not_written_and_strided_rows_work():
    from tidal.worker.ops import skinny_gemm as sk

    k, n = 256, 32
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    big = torch.randn(3, 2 * k, device=DEV, dtype=torch.bfloat16)
    x = big[:, :k]  # a row stride of 2k
    out = sk.skinny_gemm(x, w)
    _close(out, _ref(x, w, None, None, torch.bfloat16), "strided rows")


@gpu
def test_refuses_what_it_does_not_take():
    from tidal.worker.ops import skinny_gemm as sk

    w = torch.randn(64, 256, device=DEV, dtype=torch.bfloat16)
    assert not sk.supported(torch.randn(9, 256, device=DEV, dtype=torch.bfloat16), w)
    assert not sk.supported(torch.randn(1, 200, device=DEV, dtype=torch.bfloat16),
                            torch.randn(64, 200, device=DEV, dtype=torch.bfloat16))
    assert not sk.supported(torch.randn(1, 256, device=DEV, dtype=torch.bfloat16),
                            torch.randn(60, 256, device=DEV, dtype=torch.bfloat16))
    assert not sk.supported(torch.randn(1, 256, device=DEV), w.float())  # float32
    qw = torch.zeros(64, 32, dtype=torch.int32, device=DEV)
    x = torch.randn(1, 256, device=DEV, dtype=torch.bfloat16)
    assert not sk.supported(x, qw, group_size=96)
    assert not sk.supported(x, qw, group_size=16)
    assert sk.supported(x, qw, group_size=128)
    assert sk.supported(x, qw, group_size=256)  # one group over all of K
    with pytest.raises(ValueError, match="1 to 8 rows"):
        sk.skinny_gemm(torch.randn(9, 256, device=DEV, dtype=torch.bfloat16), w)


@gpu
def test_int4_one_group_over_a_row_that_is_no_power_of_two():
    from tidal.worker.ops import skinny_gemm as sk

    torch.manual_seed(5)
    n, k = 16, 640  # GPTQ's group -1: one group of 640
    w = torch.randn(n, k, device=DEV) / k ** 0.5
    qw, s, z = int4_torch.quantize_rtn(w, k)
    s = s.to(torch.bfloat16)
    x = torch.randn(2, k, device=DEV, dtype=torch.bfloat16)
    ref = _ref(x, int4_torch.dequantize(qw, s, z, k, dtype=torch.bfloat16), None, None,
               torch.bfloat16)
    assert sk.supported(x, qw, k)
    _close(sk.skinny_gemm(x, qw, scales=s, zeros=z, group_size=k), ref, "one group")



def test_built_launch_shapes_match_the_cuda_file():
    from tidal.worker.ops import skinny_gemm as sk

    src = (Path(__file__).resolve().parents[2] / "csrc" / "skinny_gemm.cu").read_text()
    warps = {int(w) for w in re.findall(r"TIDAL_SKINNY_CASE\(R_, (\d+), U_\)", src)}
    pairs = re.findall(r"^ +TIDAL_SKINNY_WARPS\((\d+), (\d+)\)$", src, re.M)
    built = {sk.Launch(int(r), w, int(u)) for r, u in pairs for w in warps}
    assert built and built == sk.BUILT


@pytest.mark.parametrize("fmt", [0, 1, 2, 3])
@pytest.mark.parametrize("n,k,gated", [(6144, 4096, False), (4096, 4096, False),
                                       (14336, 4096, True), (4096, 14336, False),
                                       (128256, 4096, False), (136, 512, False),
                                       (40, 512, True)])
def test_launch_shape_is_built_and_tiles_whole_gate_up_pairs(fmt, n, k, gated):
    from tidal.worker.ops import skinny_gemm as sk

    cfg = sk.launch_shape(n, fmt, gated)
    assert cfg in sk.BUILT
    assert not gated or cfg.tiles % 2 == 0


def test_int4_launch_shapes_are_the_measured_best_for_llama_8b():
    """The rule reproduces the H200 sweep's best (or within 1 %) per Llama-3.1-8B weight."""
    from tidal.worker.ops import skinny_gemm as sk

    shape = {(n, gated): tuple(sk.launch_shape(n, sk.FORMAT_INT4, gated))
             for n, gated in [(6144, False), (4096, False), (14336, True), (128256, False)]}
    assert shape == {(6144, False): (2, 8, 1), (4096, False): (1, 8, 4),
                     (14336, True): (2, 2, 1), (128256, False): (2, 4, 1)}
    # One row with staged activations (tools/results/skinny_gemm_h200_llama8b_int4_staged.json).
    staged = {(n, gated): tuple(sk.launch_shape(n, sk.FORMAT_INT4, gated, staged=True))
              for n, gated in [(6144, False), (4096, False), (14336, True), (128256, False)]}
    assert staged == {(6144, False): (2, 8, 1), (4096, False): (2, 8, 2),
                      (14336, True): (2, 2, 1), (128256, False): (4, 2, 1)}
    assert sk.group_ok(128, 4096) and sk.group_ok(640, 640) and not sk.group_ok(96, 4096)
    assert sk.group_ok(64, 4096, smallest=64) and not sk.group_ok(32, 4096, smallest=64)


def test_fp8_block_launch_shapes_are_the_measured_best_for_llama_8b():
    """Block-wise FP8 at one and four rows, H200 sweep
    (tools/results/skinny_gemm_h200_llama8b_fp8_block.json): the best or within 2 %."""
    from tidal.worker.ops import skinny_gemm as sk

    shape = {(n, gated): tuple(sk.launch_shape(n, sk.FORMAT_FP8_GROUPS, gated))
             for n, gated in [(6144, False), (4096, False), (14336, True), (128256, False)]}
    assert shape == {(6144, False): (1, 8, 1), (4096, False): (1, 8, 4),
                     (14336, True): (2, 4, 2), (128256, False): (2, 4, 1)}


@gpu
@pytest.mark.parametrize("call", ["skinny", "skinny_format", "rms_norm", "rms_norm_shape"])
def test_a_bad_argument_raises_in_python_not_a_crash(call):
    """A failed check inside the extension's bindings must reach Python as RuntimeError. On the
    H200 image (system g++ 13.3) a check whose message held a number (nine rows; an unknown
    format; a shape) killed the process with a segmentation fault: `std::ostream << int64_t`
    compiled into the extension crashed there, even outside any check. The messages format
    numbers with std::to_string now. Each case runs in a child process, so that a crash fails
    this test instead of the whole run."""
    import subprocess
    import sys

    body = {
        "skinny": "w = torch.randn(64, 256, device='cuda', dtype=torch.bfloat16)\n"
                  "x = torch.randn(9, 256, device='cuda', dtype=torch.bfloat16)\n"
                  "out = torch.empty(9, 64, device='cuda', dtype=torch.bfloat16)\n"
                  "ext.skinny_gemm(out, x, w, 0, None, None, None, None, 0, 0, 1, 4, 1, False)\n",
        "skinny_format": "w = torch.randn(64, 256, device='cuda', dtype=torch.bfloat16)\n"
                         "x = torch.randn(4, 256, device='cuda', dtype=torch.bfloat16)\n"
                         "out = torch.empty(4, 64, device='cuda', dtype=torch.bfloat16)\n"
                         "ext.skinny_gemm(out, x, w, 7, None, None, None, None, 0, 0, 1, 4, 1, "
                         "False)\n",
        "rms_norm_shape": "x = torch.randn(4, 256, device='cuda', dtype=torch.bfloat16)\n"
                          "ext.rms_norm(torch.empty(3, 256, device='cuda', dtype=torch.bfloat16), "
                          "x, torch.ones(256, device='cuda', dtype=torch.bfloat16), 1e-6)\n",
        "rms_norm": "x = torch.randn(4, 256, device='cuda', dtype=torch.bfloat16)\n"
                    "ext.rms_norm(torch.empty_like(x), x, torch.ones(100, device='cuda', "
                    "dtype=torch.bfloat16), 1e-6)\n",
    }[call]
    script = ("import torch\nfrom tidal.worker.ops import cuda_ext\n"
              "ext = cuda_ext.require_extension()\ntry:\n"
              + "".join("    " + line + "\n" for line in body.splitlines())
              + "except RuntimeError as exc:\n    print('raised:', exc)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (f"the {call} binding's check crashed the process "
                                 f"(exit {run.returncode}): {run.stderr[-2000:]}")
    assert "raised:" in run.stdout, run.stdout
    expected = {"skinny": "got 9", "skinny_format": "format 7", "rms_norm": "[hidden]",
                "rms_norm_shape": "got [3, 256]"}[call]
    assert expected in run.stdout, run.stdout  # the message names the value


@gpu
def test_the_opt_in_weight_ring_matches_the_register_ring():
    """``TIDAL_SKINNY_RING=1`` (read once per process, so in a child process): the one-row INT4
    staged form with its weights in flight through shared memory gives, bit for bit, what the
    register ring gives, for every launch shape the ring is built with (others fall back) and
    for a fused gate/up; and it matches the dequantized reference."""
    import json
    import subprocess
    import sys

    script = """
import json, torch
from tidal.worker.ops import int4_torch, skinny_gemm as sk
torch.manual_seed(0)
out = {}
for k, act in ((4096, None), (14336, None), (4096, "silu")):
    n = 1024
    w = torch.randn(2 * n if act else n, k, device="cuda") / k ** 0.5
    qw, s, z = int4_torch.quantize_rtn(w, 128)
    s = s.to(torch.bfloat16)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for cfg in sorted(sk.BUILT):
        if act and cfg.tiles % 2:
            continue
        y = sk.skinny_gemm(x, qw, scales=s, zeros=z, group_size=128, act=act, config=cfg)
        out[f"{k} {act} {tuple(cfg)}"] = y.float().cpu().tolist()
    dense = int4_torch.dequantize(qw, s, z, 128, dtype=torch.bfloat16).double()
    ref = x.double() @ dense.t()
    if act:
        g, u = ref.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(g) * u
    out[f"ref {k} {act}"] = ref.float().cpu().tolist()
print("RESULT" + json.dumps(out))
"""

    def run(ring: str) -> dict:
        import os

        env = dict(os.environ, TIDAL_SKINNY_RING=ring)
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT"))
        return json.loads(line[len("RESULT"):])

    plain, ring = run("0"), run("1")
    assert plain.keys() == ring.keys()
    for key, want in plain.items():
        got = ring[key]
        assert got == want, f"{key}: the weight ring differs from the register ring"
        if not key.startswith("ref"):
            k, act = key.split()[:2]
            ref = torch.tensor(plain[f"ref {k} {act}"])
            err = float((torch.tensor(got) - ref).norm() / ref.norm())
            assert err < 1e-2, f"{key}: relative error {err:.3g}"
