"""The kernel policy: what a worker resolves the config's kernel section to on a CPU and, with
a device description, on a GPU with or without triton or the CUDA extension (``resolve`` is a
pure function, so every case runs here); the attention rule for windowed / soft-capped
layers; the start-up lines; and a model built with fusions on gives what it gives with them
off (CPU torch ops), its layers wired at construction."""

from __future__ import annotations

import dataclasses
import logging
import re

import msgspec
import numpy as np
import pytest
import torch

from tidal.engine_core.config import ConfigError, EngineArgs, ParallelConfig
from tidal.engine_core.kernel_config import KernelConfig
from tidal.worker.attention.backend import AttentionMetadata, kv_cache_shape
from tidal.worker.attention.torch_backend import TorchAttention
from tidal.worker.kernel_policy import (
    DeviceInfo,
    KernelPolicy,
    apply_tuning,
    building,
    current_kernels,
    describe,
    kernels_for,
    reference_kernels,
    resolve,
)
from tidal.worker.models.registry import build_model
from tidal.worker.ops import torch_ops
from tidal.worker.ops.kernels import Kernels

CPU = DeviceInfo("cpu")
# H100-like: triton, the extension, compute capability 9.0
GPU = DeviceInfo("cuda", triton=True, cuda_ext=True, capability=(9, 0))
GPU_TRITON_ONLY = DeviceInfo("cuda", triton=True, cuda_ext=False)
GPU_BARE = DeviceInfo("cuda", triton=False, cuda_ext=False)  # no triton, no extension
TP2 = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="mp")


@pytest.fixture(scope="module")
def arch(tiny_models):
    return EngineArgs(model=str(tiny_models["llama"][0]),
                      num_kv_blocks=64).create_config().model.arch


def test_cpu_runs_torch_everywhere(arch) -> None:
    policy = resolve(KernelConfig(ops="cuda", attention_backend="triton"), CPU, arch, TP2)
    assert (policy.ops, policy.attention, policy.decode_kernels, policy.gemv,
            policy.vocab_embedding, policy.triton) == ("torch", "torch", False, False, False,
                                                        False)
    assert policy.attention_layers == ("torch",) * arch.num_layers
    assert policy.all_reduce == "gloo" and not policy.push_allreduce
    assert "CPU" in policy.why("ops") and "unavailable on cpu" in policy.why("attention")


def test_gpu_with_triton_and_the_extension(arch) -> None:
    policy = resolve(KernelConfig(), GPU, arch)
    assert (policy.ops, policy.attention, policy.decode_kernels, policy.gemv,
            policy.vocab_embedding, policy.all_reduce) == ("cuda", "triton", True, True, True,
                                                           "none")
    assert policy.reasons == ()  # nothing turned off
    assert policy.gemv_rows
    assert resolve(KernelConfig(ops="triton"), GPU, arch).ops == "triton"
    assert resolve(KernelConfig(attention_backend="cuda"), GPU, arch).attention == "cuda"
    # Tensor parallelism: the symmetric-memory paths are tried; the fused one is opt-in.
    assert resolve(KernelConfig(), GPU, arch, TP2).all_reduce == "symmetric"
    assert not resolve(KernelConfig(), GPU, arch, TP2).push_allreduce
    assert resolve(KernelConfig(push_allreduce=True), GPU, arch, TP2).push_allreduce
    off = resolve(KernelConfig(symm_allreduce=False, push_allreduce=True), GPU, arch, TP2)
    assert off.all_reduce == "nccl" and not off.push_allreduce
    assert "off in the config" in off.why("all_reduce")


def test_gpu_without_triton_or_the_extension(arch) -> None:
    bare = resolve(KernelConfig(attention_backend="triton"), GPU_BARE, arch)
    assert (bare.ops, bare.attention, bare.decode_kernels, bare.gemv) == ("torch", "torch",
                                                                          False, False)
    assert "neither" in bare.why("ops") and "No Triton".lower() in bare.why(
        "decode_kernels").lower()
    assert "triton missing" in bare.why("attention")
    # The extension alone runs the fused ops but no Triton decode kernel.
    ext_only = resolve(KernelConfig(), dataclasses.replace(GPU_BARE, cuda_ext=True), arch)
    assert (ext_only.ops, ext_only.decode_kernels, ext_only.attention) == ("cuda", False,
                                                                           "torch")
    # Asked for but not built: the next best, and why.
    tri = resolve(KernelConfig(ops="cuda", attention_backend="cuda"), GPU_TRITON_ONLY, arch)
    assert (tri.ops, tri.attention) == ("triton", "triton")
    assert "did not build" in tri.why("ops") and "did not build" in tri.why("attention")


def test_config_switches_turn_fusions_off(arch) -> None:
    no_decode = resolve(KernelConfig(decode_kernels=False), GPU, arch)
    assert not no_decode.decode_kernels and not no_decode.gemv
    assert no_decode.why("decode_kernels") == "off in the config"
    no_gemv = resolve(KernelConfig(gemv=False), GPU, arch)
    assert no_gemv.decode_kernels and not no_gemv.gemv and no_gemv.why("gemv")
    torch_ops_only = resolve(KernelConfig(ops="torch"), GPU, arch)
    assert not torch_ops_only.decode_kernels and not torch_ops_only.vocab_embedding
    assert "ops forced to torch" in torch_ops_only.why("decode_kernels")
    limited = resolve(KernelConfig(gemv_max_mb=8, gemv_configs="64x64=4,64,4,1"), GPU, arch)
    assert limited.gemv_max_bytes == 8 * 2**20
    assert limited.gemv_configs == {(64, 64, False, 2): (4, 64, 4, 1)}


def test_few_row_gemv_on_hopper_only(arch) -> None:
    """The few-row GEMV (2-8 rows) runs where its launch shapes were measured: Hopper, with
    the one-row GEMV on; elsewhere cuBLAS, and the policy says why."""
    for capability, on in (((9, 0), True), ((8, 0), False), ((10, 0), False)):
        policy = resolve(KernelConfig(), dataclasses.replace(GPU, capability=capability), arch)
        assert policy.gemv_rows == on, capability
        assert on or "Hopper only" in policy.why("gemv_rows")
    off = resolve(KernelConfig(gemv_rows=False), GPU, arch)
    assert not off.gemv_rows and off.why("gemv_rows") == "off in the config"
    assert "gemv_rows: off (cuBLAS) (off in the config)" in describe(off)
    assert not resolve(KernelConfig(gemv=False), GPU, arch).gemv_rows
    assert not resolve(KernelConfig(), CPU, arch).gemv_rows
    assert Kernels(resolve(KernelConfig(), CPU, arch))._rows is None


def test_moe_direct_path_limit_follows_the_config(arch, monkeypatch) -> None:
    from tidal.worker.ops import moe_configs

    assert resolve(KernelConfig(), GPU, arch).moe_direct_max_pairs == 32
    assert resolve(KernelConfig(), CPU, arch).moe_direct_max_pairs == 0
    off = resolve(KernelConfig(moe_direct_max_pairs=0), GPU, arch)
    assert off.moe_direct_max_pairs == 0 and "direct GEMVs" not in " ".join(describe(off))
    assert "direct GEMVs up to 32" in " ".join(describe(resolve(KernelConfig(), GPU, arch)))
    # A worker hands it to the MoE op's selection rule (the Triton modules it also configures
    # are stubbed: this machine may have no Triton).
    import sys
    import types

    for name in ("attention_plan", "triton_attention_kernels", "triton_decode",
                 "triton_gemv_rows"):
        stub = types.SimpleNamespace(configure=lambda **_: None)
        monkeypatch.setitem(sys.modules, f"tidal.worker.ops.{name}", stub)
        monkeypatch.setattr(sys.modules["tidal.worker.ops"], name, stub, raising=False)
    rows = sys.modules["tidal.worker.ops.triton_gemv_rows"]
    try:
        apply_tuning(off)
        assert not moe_configs.use_direct(1, 128, 8)
        apply_tuning(resolve(KernelConfig(), GPU, arch))
        assert moe_configs.use_direct(1, 128, 8)
        # The few-row GEMV's dependent launch follows its field (and needs ``pdl``).
        assert rows.PDL_DOT is False
        apply_tuning(resolve(KernelConfig(gemv_rows_pdl=True), GPU, arch))
        assert rows.PDL_DOT is True
        policy = resolve(KernelConfig(gemv_rows_pdl=True, pdl=False), GPU, arch)
        assert not policy.gemv_rows_pdl and "gemv_rows_pdl off" in " ".join(describe(policy))
    finally:
        moe_configs.configure_direct(reset=True)


def test_the_few_row_products_dependent_launch_follows_pdl(arch, monkeypatch) -> None:
    """The CUDA few-row product (INT4, block-wise FP8) launches as a programmatic dependent
    unless ``pdl`` is off; set at start-up with or without Triton."""
    from tidal.worker.ops import skinny_gemm

    ext_only = DeviceInfo("cuda", triton=False, cuda_ext=True, capability=(9, 0))
    monkeypatch.setattr(skinny_gemm, "PDL", True)
    off = resolve(KernelConfig(pdl=False), ext_only, arch)
    assert off.skinny_w4a16 and off.skinny_fp8_block
    apply_tuning(off)
    assert skinny_gemm.PDL is False
    apply_tuning(resolve(KernelConfig(), ext_only, arch))
    assert skinny_gemm.PDL is True


@pytest.mark.parametrize("overrides, what", [
    ({"sliding_window": 8, "window_layers": (1,)}, "sliding window 8 (attention layer 1)"),
    ({"attn_logit_softcap": 50.0}, "logit soft-cap 50.0 (attention layer 0)"),
])
def test_windowed_layers_never_get_the_extension_attention(arch, overrides, what) -> None:
    special = msgspec.structs.replace(arch, **overrides)
    with pytest.raises(ConfigError,
                       match=rf"'cuda' has no kernel for .*{re.escape(what)}.*triton, torch"):
        resolve(KernelConfig(attention_backend="cuda"), GPU, special)
    # Not asked for by name (the extension did not build, so Triton): no error.
    assert resolve(KernelConfig(attention_backend="cuda"), GPU_TRITON_ONLY,
                   special).attention == "triton"
    assert resolve(KernelConfig(), GPU, special).attention == "triton"
    # Plain layers keep the extension's attention.
    assert resolve(KernelConfig(attention_backend="cuda"), GPU, arch).attention == "cuda"


def test_resolution_is_pure_and_described(arch) -> None:
    kc = KernelConfig(gemv=False, lamport_allreduce="force")
    assert resolve(kc, GPU, arch, TP2) == resolve(kc, GPU, arch, TP2)
    lines = describe(resolve(kc, GPU, arch, TP2))
    assert lines[0].startswith("ops: cuda")
    assert any(line.startswith(f"attention: triton on all {arch.num_layers} layers")
               for line in lines)
    assert any(line.startswith("gemv: off (off in the config)") for line in lines)
    assert any("signal-free force" in line for line in lines)
    cpu_lines = describe(resolve(KernelConfig(), CPU, arch))
    assert "decode_kernels: off (CPU)" in cpu_lines
    assert not any(line.startswith("variants") for line in cpu_lines)  # no Triton here


def test_layers_take_their_kernels_at_construction(arch) -> None:
    fake = Kernels(_gpu_like_policy(arch))
    model = build_model(arch, torch.float32, TorchAttention(), kernels=fake)
    layer = model.layers["0"]
    assert layer.input_layernorm.kernels is fake and layer.self_attn.qkv_proj.kernels is fake
    assert layer.defer_reduce is True  # the policy's GEMV: fixed in the model
    assert current_kernels() is reference_kernels()  # the build scope ended with the build
    plain = build_model(arch, torch.float32, TorchAttention())
    assert plain.layers["0"].input_layernorm.kernels is reference_kernels()
    assert plain.layers["0"].defer_reduce is False
    with building(fake):
        assert current_kernels() is fake


def _gpu_like_policy(arch) -> KernelPolicy:
    """What an H100 resolves to, every fusion on, but bound here to CPU tensors (which never
    reach a GPU kernel): the layer routing and residual handling of the fused build."""
    return dataclasses.replace(resolve(KernelConfig(), GPU, arch), ops="torch")


def _meta(start: int, count: int, block: int, blocks: int) -> AttentionMetadata:
    """One request whose tokens ``start .. start + count`` are this step's queries."""
    qsl = np.array([0, count], dtype=np.int32)
    seq = np.array([start + count], dtype=np.int32)
    return AttentionMetadata(
        num_actual_tokens=count, num_reqs=1, max_query_len=count, max_seq_len=start + count,
        query_start_loc=torch.from_numpy(qsl), seq_lens=torch.from_numpy(seq),
        block_table=torch.arange(blocks, dtype=torch.int32).view(1, -1),
        slot_mapping=torch.arange(start, start + count, dtype=torch.int64),
        query_start_loc_cpu=qsl, seq_lens_cpu=seq, num_decodes=int(count == 1))


def _greedy(model, arch, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    block, blocks = 16, 4
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(kv_cache_shape(blocks, block, attn.num_kv_heads,
                                                   attn.head_dim))
    tokens, all_logits = list(prompt), []
    with torch.inference_mode():
        start, new = 0, list(prompt)
        for _ in range(steps):
            ids = torch.tensor(new)
            pos = torch.arange(start, start + len(new))
            hidden, _ = model(ids, pos, _meta(start, len(new), block, blocks))
            logits = model.compute_logits(hidden[-1:])
            all_logits.append(logits)
            start += len(new)
            new = [int(logits.argmax(-1))]
            tokens += new
    return tokens[len(prompt):], torch.cat(all_logits)


def test_fusions_on_or_off_give_the_same_tokens(arch) -> None:
    """The fused build (norm + linear ops, deferred reductions) against the reference build
    with the same weights: the same greedy tokens and bit-identical logits; and against the
    layer written out as norm -> attention -> norm -> MLP with the torch ops."""
    on = build_model(arch, torch.float32, TorchAttention(), kernels=Kernels(_gpu_like_policy(arch)))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in on.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    off = build_model(arch, torch.float32, TorchAttention())
    off.load_state_dict(on.state_dict())
    prompt = [3, 17, 42, 7, 99, 5, 23]
    got_on, logits_on = _greedy(on, arch, prompt, 6)
    got_off, logits_off = _greedy(off, arch, prompt, 6)
    assert got_on == got_off and torch.equal(logits_on, logits_off)

    # The first layer's output equals the plain composition of its modules.
    layer = off.layers["0"]
    x = torch.randn(5, arch.hidden_size, generator=gen)
    meta = _meta(0, 5, 16, 4)
    with torch.inference_mode():
        hidden, residual = layer(torch.arange(5), x, None, meta)
        h = torch_ops.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        attn = layer.self_attn(torch.arange(5), h, meta)
        h, res = torch_ops.fused_add_rms_norm(attn, x, layer.post_attention_layernorm.weight,
                                              layer.post_attention_layernorm.eps)
        want = layer.mlp(h)
    assert torch.equal(hidden, want) and torch.equal(residual, res)


def test_cpu_kernels_for_applies_nothing_gpu_side() -> None:
    kernels = kernels_for(torch.device("cpu"), KernelConfig(pdl=False, attn_split_stages=3))
    assert kernels.name == "torch" and not kernels.policy.triton
    from tidal.worker.ops import attention_plan

    assert attention_plan.SPLIT_STAGES == 1  # variants reach the kernels only where they run


def test_worker_logs_the_resolved_policy(tiny_models, caplog) -> None:
    from tidal.worker.worker import Worker

    cfg = EngineArgs(model=str(tiny_models["llama"][0]), num_kv_blocks=64, device="cpu",
                     kernel_config={"gemv": False}).create_config()
    with caplog.at_level(logging.INFO, logger="tidal.worker.kernel_policy"):
        worker = Worker(cfg, 0, 0)
    text = [r.getMessage() for r in caplog.records]
    assert "rank 0 kernels: ops: torch (rms_norm, fused add + rms_norm, rotary, silu_and_mul) " \
           "(CPU)" in text
    assert any(t.startswith("rank 0 kernels: attention: torch on all") for t in text)
    assert worker.runner.kernel_policy.attention == "torch"
    assert worker.runner.sampler is not None
