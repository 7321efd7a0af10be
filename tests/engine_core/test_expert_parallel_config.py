"""``--enable-expert-parallel`` / ``--enable-dbo`` / ``--all2all-backend`` checks (engine_core/expert_parallel_config.py):
what runs is accepted, what does not is refused naming the reason, and a dense model gets a
warning (the flag changes nothing there, as in vLLM)."""

from __future__ import annotations

import logging

import pytest

from tidal.engine_core.expert_parallel_config import (
    ExpertParallelConfigError,
    check_all2all_backend,
    check_dbo_threshold,
    check_expert_parallel,
)
from tidal.engine_core.model_arch import arch_from_hf_dict

BASE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "moe_intermediate_size": 48, "num_experts_per_tok": 2}
MOE = arch_from_hf_dict({**BASE, "num_experts": 8}, "qwen3_moe.json")
DENSE = arch_from_hf_dict({**BASE, "architectures": ["Qwen3ForCausalLM"]}, "qwen3.json")


def _check(**kw) -> bool:
    args = dict(enabled=True, enable_dbo=False, arch=MOE, tensor_parallel_size=1,
                pipeline_parallel_size=1, data_parallel_size=2, compiled=False,
                speculative=False, lora=False)
    return check_expert_parallel(**{**args, **kw})


def test_accepted_layouts() -> None:
    assert _check()
    assert _check(data_parallel_size=1, tensor_parallel_size=2)
    assert _check(data_parallel_size=2, tensor_parallel_size=4)  # 8 ranks, one expert each
    assert not _check(enabled=False)
    assert _check(enable_dbo=True)  # across engines: the exchange to overlap
    assert check_dbo_threshold(1) == 1
    with pytest.raises(ExpertParallelConfigError, match="--dbo-token-threshold must be >= 1"):
        check_dbo_threshold(0)
    # Not given: the default, with or without --enable-dbo; given without it: refused (it
    # would change nothing), as --enable-dbo without what it needs is.
    assert check_dbo_threshold(None) == check_dbo_threshold(None, enable_dbo=False) == 0
    with pytest.raises(ExpertParallelConfigError, match="--dbo-token-threshold needs "
                                                        "--enable-dbo"):
        check_dbo_threshold(64, enable_dbo=False)


@pytest.mark.parametrize("kw, match", [
    (dict(data_parallel_size=3), "8 experts do not split over 3"),
    (dict(data_parallel_size=4, tensor_parallel_size=4), "over 16 expert-parallel ranks"),
    (dict(pipeline_parallel_size=2), "pipeline-parallel-size > 1 is not yet supported"),
    (dict(compiled=True), "torch.compile"),
    (dict(speculative=True), "speculative decoding"),
    (dict(lora=True), "LoRA"),
    (dict(enable_dbo=True, data_parallel_size=1, tensor_parallel_size=2),
     "--enable-dbo needs --enable-expert-parallel with --data-parallel-size > 1"),
    (dict(enabled=False, enable_dbo=True), "--enable-dbo needs"),
    (dict(arch=DENSE, enable_dbo=True), "has no experts"),
])
def test_refused(kw, match) -> None:
    with pytest.raises(ExpertParallelConfigError, match=match):
        _check(**kw)


def test_a_dense_model_gets_a_warning_and_no_expert_parallelism(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        assert not _check(arch=DENSE, data_parallel_size=3)  # (no split to refuse either)
    assert "has no experts (a dense model); the flag has no effect" in caplog.text


def test_all2all_backend() -> None:
    """The default always passes; ``alltoallv`` needs EP across engines and no overlap;
    vLLM's other backends and unknown names are refused, naming the two tidal has."""
    ok = dict(expert_parallel=True, data_parallel_size=2, enable_dbo=False)
    assert check_all2all_backend("allgather_reducescatter", **ok) == "allgather_reducescatter"
    assert check_all2all_backend("allgather_reducescatter", expert_parallel=False,
                                 data_parallel_size=1, enable_dbo=False)
    assert check_all2all_backend("alltoallv", **ok) == "alltoallv"
    with pytest.raises(ExpertParallelConfigError, match="vLLM backend tidal does not have"):
        check_all2all_backend("pplx", **ok)
    with pytest.raises(ExpertParallelConfigError, match="unknown; choose one of "
                       "allgather_reducescatter, alltoallv"):
        check_all2all_backend("nccl", **ok)
    for bad in (dict(ok, expert_parallel=False), dict(ok, data_parallel_size=1)):
        with pytest.raises(ExpertParallelConfigError, match="needs --enable-expert-parallel"):
            check_all2all_backend("alltoallv", **bad)
    with pytest.raises(ExpertParallelConfigError, match="with --enable-dbo is not supported"):
        check_all2all_backend("alltoallv", **dict(ok, enable_dbo=True))
