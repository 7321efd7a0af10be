"""Checks of ``--enable-expert-parallel`` (and ``--enable-dbo``, ``--all2all-backend``) against
the rest of the engine's configuration, made once at start-up (``EngineArgs.create_config``).

Expert parallelism splits each MoE layer's experts over the DP x TP workers
(``worker/layers/moe_ep.py``). As in vLLM, the flag on a model without experts changes nothing
(a warning says so). Combinations the runtime does not handle are refused here with the reason,
never accepted half-wired.
"""

from __future__ import annotations

import logging

from tidal.engine_core.model_arch import ArchSpec

logger = logging.getLogger(__name__)


class ExpertParallelConfigError(ValueError):
    pass


# Dual batch overlap hides the experts' exchange between engines behind their compute: without
# that exchange there is nothing to overlap.
_DBO_NEEDS = ("--enable-dbo needs --enable-expert-parallel with --data-parallel-size > 1 on a "
              "mixture-of-experts model (it overlaps the experts' exchange between engines)")


# ``--all2all-backend``: how the experts' tokens move between engines (worker/layers/moe_ep.py).
# vLLM's name for the default; "alltoallv" is tidal's (uneven NCCL / gloo all-to-alls).
ALL2ALL_BACKENDS = ("allgather_reducescatter", "alltoallv")
_VLLM_ONLY_ALL2ALL = ("naive", "pplx", "deepep_high_throughput", "deepep_low_latency",
                      "flashinfer_all2allv")


def check_all2all_backend(backend: str, *, expert_parallel: bool, data_parallel_size: int,
                          enable_dbo: bool) -> str:
    """``--all2all-backend``, refused where it names a backend tidal lacks or would change
    nothing (no exchange between engines) or clash with dual batch overlap (which splits the
    gather's exchange)."""
    if backend not in ALL2ALL_BACKENDS:
        known = "a vLLM backend tidal does not have" if backend in _VLLM_ONLY_ALL2ALL else \
            "unknown"
        raise ExpertParallelConfigError(
            f"--all2all-backend {backend!r}: {known}; choose one of "
            f"{', '.join(ALL2ALL_BACKENDS)}")
    if backend == ALL2ALL_BACKENDS[0]:
        return backend
    if not expert_parallel or data_parallel_size < 2:
        raise ExpertParallelConfigError(
            f"--all2all-backend {backend} needs --enable-expert-parallel with "
            "--data-parallel-size > 1 on a mixture-of-experts model (it moves the experts' "
            "tokens between engines)")
    if enable_dbo:
        raise ExpertParallelConfigError(
            f"--all2all-backend {backend} with --enable-dbo is not supported: dual batch "
            "overlap splits the all-gather / reduce-scatter exchange")
    return backend


# Not given: measured once the engines meet (worker/layers/moe_ep's ``DBO_MEASURE``, kept here
# as a number: this module stays free of torch).
DBO_MEASURED = 0


def check_dbo_threshold(threshold: int | None, *, enable_dbo: bool = True) -> int:
    """``--dbo-token-threshold`` (None: not given: ``DBO_MEASURED``, the workers time the
    exchange with and without the overlap at start-up and pick it). Given without
    ``--enable-dbo`` it would change nothing: refused, as ``--enable-dbo`` without what it
    needs is."""
    if threshold is None:
        return DBO_MEASURED
    if not enable_dbo:
        raise ExpertParallelConfigError("--dbo-token-threshold needs --enable-dbo (it sets "
                                        "the step size from which dual batch overlap applies)")
    if threshold < 1:
        raise ExpertParallelConfigError(f"--dbo-token-threshold must be >= 1, got {threshold}")
    return threshold


def check_expert_parallel(*, enabled: bool, enable_dbo: bool, arch: ArchSpec,
                          tensor_parallel_size: int, pipeline_parallel_size: int,
                          data_parallel_size: int, compiled: bool, speculative: bool,
                          lora: bool) -> bool:
    """Whether expert parallelism is on (the flag, on a model with experts); raises
    ``ExpertParallelConfigError`` for what it cannot run with."""
    if not enabled:
        if enable_dbo:
            raise ExpertParallelConfigError(_DBO_NEEDS)
        return False
    if not arch.num_experts:
        if enable_dbo:
            raise ExpertParallelConfigError(_DBO_NEEDS + f" ({arch.architecture} has no experts)")
        logger.warning("--enable-expert-parallel: %s has no experts (a dense model); the flag "
                       "has no effect", arch.architecture)
        return False
    tp, dp = tensor_parallel_size, data_parallel_size
    ep = tp * dp
    if pipeline_parallel_size > 1:
        raise ExpertParallelConfigError(
            "--enable-expert-parallel with --pipeline-parallel-size > 1 is not yet supported")
    if arch.num_experts % ep:
        raise ExpertParallelConfigError(
            f"--enable-expert-parallel: the model's {arch.num_experts} experts do not split "
            f"over {ep} expert-parallel ranks (data-parallel size {dp} x tensor-parallel size "
            f"{tp}); the expert count must be a multiple of DP x TP")
    if enable_dbo and dp == 1:
        raise ExpertParallelConfigError(_DBO_NEEDS)
    if ep == 1:
        logger.warning("--enable-expert-parallel with one worker (DP x TP = 1): every expert "
                       "stays on it")
    if dp > 1:
        # Every rank must run every MoE layer's exchange in every step with shapes agreed for
        # that step: decode graphs are agreed per step (engine_core/dp_lockstep), compiled
        # pieces and the drafters' and adapters' steps are not.
        what = ("speculative decoding" if speculative else "LoRA" if lora
                else "torch.compile (--compilation-config)" if compiled else None)
        if what is not None:
            raise ExpertParallelConfigError(
                f"--enable-expert-parallel across data-parallel engines with {what} is not "
                "yet supported")
    return True
