"""The engine config's kernel section: every setting that chooses a kernel or a kernel variant.

``KernelConfig`` is what the user asked for, validated once and frozen; it travels inside
``EngineConfig.runner`` to the workers, which resolve it against their device into a
``tidal.worker.kernel_policy.KernelPolicy`` (what actually runs there, and why).

Where a value comes from, first match wins:

1. a command-line flag (``--attention-backend``, ``--ops-backend``);
2. ``--kernel-config '{"gemv": false, ...}'`` (JSON, the field names below);
3. the ``TIDAL_*`` environment variable of the field (``envs.KERNEL_ENV``; read here, once,
   when the config is built: existing scripts keep working);
4. the default below.

An unknown key or a bad value is a ``ConfigError`` naming the key (or the variable).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import msgspec

from tidal.engine_core import envs

OPS_BACKENDS = ("auto", "torch", "triton", "cuda")
ATTENTION_BACKENDS = ("torch", "triton", "cuda")
LAMPORT_MODES = ("on", "off", "force")
# (N, K, gate/up with SiLU, element size) -> (BLOCK_N, BLOCK_K, num_warps, PREFETCH)
GemvShapes = dict[tuple[int, int, bool, int], tuple[int, int, int, int]]


class KernelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    # Which implementation runs the fused ops (norms, rotary, SiLU) on GPU tensors: auto = the
    # CUDA extension if it builds, else Triton, else torch. CPU tensors always take torch.
    ops: str = "auto"
    # None: the best available on the device (Triton on a GPU with triton, else torch).
    attention_backend: str | None = None
    # The fused Triton decode ops: one-row GEMV (+ its norm / SiLU fusions), q/k-norm + rotary
    # + K/V write, few-row argmax.
    decode_kernels: bool = True
    gemv: bool = True  # only the one-row GEMV and the fusions built on it
    gemv_max_mb: float | None = None  # larger weights stay on cuBLAS; None: no limit
    gemv_stream: bool = True  # GEMV weights loaded evict-first from L2
    gemv_configs: str = ""  # launch-shape overrides, "NxK[s]=BLOCK_N,BLOCK_K,WARPS,PREFETCH;..."
    # 2 to 8 rows (decode at batch 2-8, a speculative verify) on the few-row tensor-core GEMV
    # (worker/ops/triton_gemv_rows.py; Hopper, where it was measured), not cuBLAS.
    gemv_rows: bool = True
    # The few-row GEMV's first weight chunk loaded before the programmatic-dependent-launch wait
    # (with ``pdl``); off: 2-7 % per call on an H200, nothing end to end (EAGLE-3 batch 1).
    gemv_rows_pdl: bool = False
    # 2 to 8 rows of an INT4 (AWQ / GPTQ) linear on the CUDA extension's few-row tensor-core
    # product (csrc/skinny_gemm.cu), not the Triton split-K GEMV.
    skinny_w4a16: bool = True
    # 1 to 8 rows of a block-wise FP8 linear (``weight_block_size`` checkpoints,
    # ``--fp8-group-size``) weight-only on the same product, reading a scale per row and group,
    # not the Triton block GEMM (which quantizes the activations): on an H200, Llama-3.1-8B
    # with groups of 128, the decode step at batch 1 / 4 took 3.48 / 3.61 ms against 4.32 /
    # 4.48 (tools/results/quant_h200_llama8b_fp8_block_e2e.json); 3.08 / 3.30 since its SiLU
    # epilogue and dependent launch (quant_h200_llama8b_stop55_skinny_pdl.json).
    skinny_fp8_block: bool = True
    norm_apart: bool = True  # before large weights the norm runs as its own one-row kernel
    pdl: bool = True  # programmatic dependent launch (Hopper and later)
    attn_fused_merge: bool = False  # split-decode partials merged inside the attention kernel
    attn_preload: bool = True  # a split's first tile loaded before the dependent-launch wait
    attn_split_stages: int = 1  # software-pipeline stages of split decode
    # Tensor-parallel all-reduce.
    symm_allreduce: bool = True  # off: NCCL only
    symm_allreduce_max_bytes: int = 2 << 20  # largest one-shot all-reduce
    lamport_allreduce: str = "on"  # the signal-free all-reduce: on (if it wins), off, force
    push_allreduce: bool = False  # all-reduce fused into the batch-1 decode GEMVs (opt-in)
    # LoRA (--enable-lora): decode steps of at least this many tokens group them by adapter
    # (tiles that share each weight load; lora/grouping.py); 0: per-token kernels always.
    # (H100, Llama-8B's four LoRA'd linears x 32 layers, 8 adapters: grouped 1.04 / 1.45 /
    # 2.09 ms against per-token 0.88 / 2.46 / 8.33 at 8 / 64 / 256 tokens; even near 16.)
    lora_grouped_min_tokens: int = 16
    # MoE layers: calls of at most this many (token, expert) pairs take the direct GEMV path
    # (worker/ops/triton_moe_gemv.py) where its rule allows; 0: the grouped GEMMs always.
    # (32 is worker/ops/moe_configs.DIRECT_MAX_PAIRS.)
    moe_direct_max_pairs: int = 32


_FIELDS: dict[str, Any] = {f.name: f.default for f in msgspec.structs.fields(KernelConfig)}


def _error(message: str) -> Exception:
    from tidal.engine_core.config import ConfigError  # config.py imports this module

    return ConfigError(message)


def parse_gemv_configs(spec: str, where: str = "gemv_configs") -> GemvShapes:
    """``NxK=BLOCK_N,BLOCK_K,WARPS,PREFETCH`` entries separated by ``;`` (``NxKs=`` for a
    gate/up GEMV with its activation, SiLU or GeGLU, as the epilogue, ``N`` its output rows):
    launch shapes for 16-bit GEMVs."""
    out: GemvShapes = {}
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        try:
            key, val = entry.split("=")
            silu = key.endswith("s")
            n, k = (int(v) for v in key.rstrip("s").split("x"))
            bn, bk, warps, prefetch = (int(v) for v in val.split(","))
        except ValueError:
            raise _error(f"{where} entry {entry!r}: expected "
                         "NxK[s]=BLOCK_N,BLOCK_K,WARPS,PREFETCH") from None
        if (bn < 1 or bk < 1 or bn & (bn - 1) or bk & (bk - 1)
                or warps not in (1, 2, 4, 8, 16) or prefetch < 1):
            raise _error(f"{where} entry {entry!r}: BLOCK_N and BLOCK_K must be powers of two, "
                         "WARPS 1-16, PREFETCH >= 1")
        out[(n, k, silu, 2)] = (bn, bk, warps, prefetch)
    return out


def _from_env(field: str, name: str, raw: str) -> Any:
    """An environment value, by the knobs' historical rules: a default-on flag is off only
    for "0", a default-off one on only for "1"."""
    default = _FIELDS[field]
    if isinstance(default, bool):
        return raw != "0" if default else raw == "1"
    if field == "lamport_allreduce":
        return "off" if raw == "0" else "force" if raw == "force" else "on"
    try:
        if field == "gemv_max_mb":
            value = float(raw)
            return None if math.isinf(value) and value > 0 else value
        if field in ("attn_split_stages", "symm_allreduce_max_bytes",
                     "lora_grouped_min_tokens", "moe_direct_max_pairs"):
            return int(raw)
    except ValueError:
        raise _error(f"{name}={raw!r}: expected a number") from None
    return raw


def _check(field: str, value: Any, where: str) -> Any:
    """``value`` for ``field`` (normalised), or a ConfigError naming ``where``."""
    default = _FIELDS[field]
    if field == "ops":
        if value not in OPS_BACKENDS:
            raise _error(f"{where} must be one of {', '.join(OPS_BACKENDS)}, got {value!r}")
    elif field == "attention_backend":
        if value is not None and value not in ATTENTION_BACKENDS:
            raise _error(f"{where} must be torch, triton or cuda, got {value!r}")
    elif field == "lamport_allreduce":
        if isinstance(value, bool):
            value = "on" if value else "off"
        if value not in LAMPORT_MODES:
            raise _error(f"{where} must be true, false or 'force', got {value!r}")
    elif isinstance(default, bool):
        if not isinstance(value, bool):
            raise _error(f"{where} must be true or false, got {value!r}")
    elif field == "gemv_max_mb":
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise _error(f"{where} must be a number of MiB > 0 (or null: no limit), "
                         f"got {value!r}")
        value = None if value is None or math.isinf(value) else float(value)
    elif field in ("attn_split_stages", "symm_allreduce_max_bytes"):
        low = 1 if field == "attn_split_stages" else 1024
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _error(f"{where} must be an integer >= {low}, got {value!r}")
        if field == "attn_split_stages" and value > 4:
            raise _error(f"{where} must be at most 4, got {value}")
    elif field in ("lora_grouped_min_tokens", "moe_direct_max_pairs"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _error(f"{where} must be an integer >= 0 (0: off), got {value!r}")
    elif field == "gemv_configs":
        if not isinstance(value, str):
            raise _error(f"{where} must be a string, got {value!r}")
        parse_gemv_configs(value, where)
    return value


def build_kernel_config(
    overrides: Mapping[str, Any] | str | None = None,
    *,
    env: Mapping[str, tuple[str, str]] | None = None,
    **flags: Any,
) -> KernelConfig:
    """The kernel section from the flags (a None flag is not given), the ``--kernel-config``
    JSON ``overrides`` (an object or its text), the environment (``env``: as
    ``envs.kernel_env()`` returns it, which is read when not given) and the defaults."""
    values: dict[str, Any] = {}
    for field, (name, raw) in (envs.kernel_env() if env is None else env).items():
        values[field] = _check(field, _from_env(field, name, raw), name)
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as exc:
            raise _error(f"kernel_config is not valid JSON: {exc}") from None
    if overrides is not None and not isinstance(overrides, Mapping):
        raise _error(f"kernel_config must be a JSON object, got {overrides!r}")
    for key, value in (overrides or {}).items():
        if key not in _FIELDS:
            raise _error(f"kernel_config: unknown key {key!r}; known: {', '.join(_FIELDS)}")
        values[key] = _check(key, value, f"kernel_config.{key}")
    for key, value in flags.items():
        if key not in _FIELDS:
            raise TypeError(f"build_kernel_config: no kernel setting {key!r}")
        if value is not None:
            values[key] = _check(key, value, key)
    return KernelConfig(**values)
