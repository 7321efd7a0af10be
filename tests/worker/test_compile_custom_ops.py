"""The hand-written fused ops kept inside a compiled graph (``compilation_config.custom_ops``,
``worker/compilation/custom_ops.py``): each op is one opaque ``tidal::`` node with the same
results as the op it stands for, the policy routes exactly the named ops through them, and a
compiled engine with all of them gives the eager engine's greedy tokens."""

from __future__ import annotations

import importlib

import pytest
import torch

from tidal.engine_core.compilation_config import CUSTOM_OPS, build_compilation_config
from tidal.engine_core.config import ConfigError
from tidal.engine_core.kernel_config import KernelConfig
from tidal.worker.kernel_policy import DeviceInfo, resolve
from tidal.worker.ops import torch_ops
from tidal.worker.ops.kernels import Kernels


def test_vllm_style_lists_resolve():
    assert build_compilation_config(3).custom_ops == ()
    assert build_compilation_config({"mode": 3, "custom_ops": ["all"]}).custom_ops == CUSTOM_OPS
    cc = build_compilation_config({"mode": 3, "custom_ops": ["all", "-rotary_embedding"]})
    assert "rotary_embedding" not in cc.custom_ops and len(cc.custom_ops) == len(CUSTOM_OPS) - 1
    cc = build_compilation_config({"mode": 3, "custom_ops": ["none", "+silu_and_mul"]})
    assert cc.custom_ops == ("silu_and_mul",)


@pytest.mark.parametrize("raw, words", [
    ({"mode": 3, "custom_ops": "all"}, "must be a list of strings"),
    ({"mode": 3, "custom_ops": ["+layer_norm"]}, r"'\+layer_norm' is not"),
    ({"mode": 3, "custom_ops": ["rms_norm"]}, "'rms_norm' is not"),
    ({"mode": 0, "custom_ops": ["all"]}, "needs mode 3"),
])
def test_bad_lists_are_refused(raw, words):
    with pytest.raises(ConfigError, match=words):
        build_compilation_config(raw)


def _kernels(custom: tuple[str, ...]) -> Kernels:
    return Kernels(resolve(KernelConfig(), DeviceInfo("cpu"), compiled=True, custom_ops=custom))


def test_only_the_named_ops_become_nodes_and_match_the_torch_ops():
    kernels = _kernels(("fused_add_rms_norm", "silu_and_mul", "rotary_embedding"))
    assert kernels.policy.custom_op_impl == "torch"  # a CPU's own implementation
    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    w = torch.randn(16, generator=g)
    q, k = torch.randn(5, 4, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    cache = torch.randn(64, 8, generator=g)
    pos = torch.tensor([0, 3, 7, 9, 63])

    def block(x, res, q, k):
        h, r = kernels.fused_add_rms_norm(x, res, w, 1e-6)
        h = kernels.rms_norm(h, w, 1e-6)  # not named: plain torch ops in the graph
        y = kernels.silu_and_mul(torch.cat([h, h * 2], dim=-1))
        q2, k2 = kernels.rotary_embedding(pos, q, k, cache, True)
        return y, r, q2, k2

    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    got = torch.compile(block, backend=backend, fullgraph=True)(x, res, q, k)
    assert sorted(t for t in seen if t.startswith("tidal.")) == [
        "tidal.fused_add_rms_norm", "tidal.rotary_embedding", "tidal.silu_and_mul"]
    h, r = torch_ops.fused_add_rms_norm(x, res, w, 1e-6)
    h = torch_ops.rms_norm(h, w, 1e-6)
    want = (torch_ops.silu_and_mul(torch.cat([h, h * 2], dim=-1)), r,
            *torch_ops.rotary_embedding(pos, q, k, cache, True))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_each_op_checks_against_its_fake():
    """torch's own consistency check of a custom op: the real and the fake implementations
    agree on shapes, dtypes and strides, autograd registration aside."""
    importlib.import_module("tidal.worker.compilation.custom_ops")  # registers the ops
    x = torch.randn(3, 16)
    w = torch.randn(16)
    q, k, cache = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(16, 8)
    pos = torch.tensor([1, 2, 3])
    cases = [
        (torch.ops.tidal.rms_norm, (x, w, 1e-6, "torch")),
        (torch.ops.tidal.fused_add_rms_norm, (x, x * 2, w, 1e-6, "torch")),
        (torch.ops.tidal.silu_and_mul, (x, "torch")),
        (torch.ops.tidal.gelu_tanh_and_mul, (x, "torch")),
        (torch.ops.tidal.gemma_rms_norm, (x.bfloat16(), w, 1e-6, "torch")),
        (torch.ops.tidal.gemma_add_norm_norm, (x, x * 2, w, w * 2, 1e-6, "torch")),
        (torch.ops.tidal.rotary_embedding, (pos, q, k, cache, False, "torch")),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
def test_a_compiled_engine_with_every_custom_op_matches_eager(tiny_models):
    """Every fused op of the tiny Qwen3 as a custom op (Dynamo's trace through the real model;
    the split graph run as it is, ``backend`` eager, since Inductor adds nothing to test)."""
    from tidal.frontend import LLM, SamplingParams

    folder = tiny_models["qwen3"][0]
    prompts = [list(range(3, 30)), [5, 9, 2, 7, 1]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    kw = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=16, dtype="float32", cpu_threads=1,
              hf_overrides={"num_hidden_layers": 1})
    outs = {}
    for name, cc in (("eager", None), ("custom", {"mode": 3, "backend": "eager",
                                                  "custom_ops": ["all"]})):
        llm = LLM(str(folder), compilation_config=cc, **kw)
        try:
            if cc is not None:
                runner = llm.engine.core.executor.worker.runner
                assert runner.kernel_policy.custom_ops == CUSTOM_OPS
                assert runner.compiled is not None and runner.compiled.stats.dynamo_traces == 1
            outs[name] = [(list(o.outputs[0].token_ids),
                           [o.outputs[0].logprobs[i][t].logprob
                            for i, t in enumerate(o.outputs[0].token_ids)])
                          for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.shutdown()
    assert [t for t, _ in outs["custom"]] == [t for t, _ in outs["eager"]]
    for (_, a), (_, b) in zip(outs["custom"], outs["eager"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
