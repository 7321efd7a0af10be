"""Kernel dispatch and backend selection on any machine: the CPU path never touches triton or
the CUDA extension, and the choices are validated. (The policy itself: test_kernel_policy.py.)"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from tidal.engine_core.kernel_config import KernelConfig
from tidal.worker.attention.selector import get_attention_impl
from tidal.worker.kernel_policy import kernels_for, reference_kernels
from tidal.worker.ops import torch_ops


def test_importing_ops_loads_no_gpu_toolchain() -> None:
    code = (
        "import sys\n"
        "import tidal.worker.ops, tidal.worker.attention.selector\n"
        "bad = [m for m in ('triton', 'torch.utils.cpp_extension', 'tidal.worker.ops.cuda_ops',"
        " 'tidal.worker.ops.triton_ops') if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"import pulled in {proc.stdout.strip()} {proc.stderr[-2000:]}"


def test_cpu_tensors_take_the_torch_path() -> None:
    x = torch.randn(3, 64)
    kernels = kernels_for(torch.device("cpu"), KernelConfig(ops="cuda"))
    assert kernels.impl_for(x) is torch_ops and kernels.name == "torch"
    w = torch.randn(64)
    assert torch.equal(kernels.rms_norm(x, w, 1e-6), torch_ops.rms_norm(x, w, 1e-6))
    out, res = kernels.fused_add_rms_norm(x, x, w, 1e-6)
    ref_out, ref_res = torch_ops.fused_add_rms_norm(x, x, w, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(res, ref_res)


def test_gated_projection_on_cpu() -> None:
    """``act(gate) * up`` of a fused [gate | up] linear, through ``Kernels.gated_linear`` and
    the MLP's ``GatedActivation.project`` (also where the layer has a bias, which the one-op
    path does not take), equals the linear then the activation."""
    from tidal.worker.layers.activation import GeluTanhAndMul, SiluAndMul
    from tidal.worker.layers.linear import MergedColumnParallelLinear

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 32, generator=gen)
    kernels = kernels_for(torch.device("cpu"), KernelConfig())
    for act, ref in ((SiluAndMul(), torch_ops.silu_and_mul),
                     (GeluTanhAndMul(), torch_ops.gelu_tanh_and_mul)):
        for bias in (False, True):
            layer = MergedColumnParallelLinear(32, [24, 24], bias, torch.float32)
            layer.weight.data.copy_(torch.randn(48, 32, generator=gen))
            if bias:
                layer.bias.data.copy_(torch.randn(48, generator=gen))
            expected = ref(torch.nn.functional.linear(x, layer.weight, layer.bias))
            assert torch.equal(act.project(layer, x), expected), (act.act, bias)
            if not bias:
                assert torch.equal(kernels.gated_linear(x, layer.weight, act.act), expected)
    with pytest.raises(ValueError, match="unknown gated activation 'relu'"):
        kernels.gated_linear(x, torch.randn(48, 32), "relu")


def test_selector_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert get_attention_impl(None, cpu).name == "torch"
    assert get_attention_impl("torch", cpu).name == "torch"
    # A GPU backend asked for on a CPU device degrades to torch (with a warning), never crashes.
    assert get_attention_impl("triton", cpu).name == "torch"
    assert get_attention_impl("cuda", cpu).name == "torch"
    with pytest.raises(ValueError):
        get_attention_impl("flash", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine with no GPU")
def test_extension_unavailable_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    from tidal.worker.ops import cuda_ext

    loader = cuda_ext._ExtensionLoader()  # a fresh loader: the process-wide one may be cached
    with caplog.at_level(logging.WARNING, logger=cuda_ext.__name__):
        assert loader.result().module is None
        assert loader.result().module is None
    warned = [r for r in caplog.records if "CUDA kernels unavailable" in r.getMessage()]
    assert len(warned) == 1
    assert "no CUDA device" in (loader.result().error or "")


def test_pending_sum_is_completed_where_no_kernel_takes_it() -> None:
    """A tensor-parallel ``PendingSum`` reaching ``rms_norm_linear`` where the fused GEMV does
    not apply (here: CPU tensors) is summed first (``wait``) and then takes the plain path, so
    the result equals that of the finished sum; the layer routing always sends one there. Its
    pushed rows and its norm statistics are not asked for."""
    from tidal.worker.distributed.pending_sum import PendingSum

    total = torch.randn(1, 64)
    calls = []

    class Finished(PendingSum):
        like = torch.empty(1, 64)

        def wait(self) -> torch.Tensor:
            calls.append("wait")
            return total

        def parts(self):
            calls.append("parts")

        def reduce_add_stats(self, residual):
            calls.append("stats")

    res, nw, w = torch.randn(1, 64), torch.randn(64) + 1, torch.randn(96, 64)
    kernels = reference_kernels()
    assert kernels.one_row_fusion_applies(Finished())
    y, new_res = kernels.rms_norm_linear(Finished(), res, nw, 1e-6, w, silu=True)
    ref_y, ref_res = torch_ops.rms_norm_linear(total, res, nw, 1e-6, w, silu=True)
    assert calls == ["wait"]
    assert torch.equal(y, ref_y) and torch.equal(new_res, ref_res)


def test_fused_allreduce_needs_a_group() -> None:
    """Asked for in a group of one, the fused all-reduce is simply absent (no collective)."""
    from tidal.worker.distributed.parallel_state import single_group
    from tidal.worker.distributed.push_allreduce import make_push_all_reduce

    group = single_group()
    assert make_push_all_reduce(group, torch.device("cpu"), torch.float32, 64, 8,
                                enabled=True) is None
    group.begin_step()  # no fused all-reduce: nothing to reset
