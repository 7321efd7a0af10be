"""Which type the KV cache is stored in, validated once at start-up.

``--kv-cache-dtype`` takes vLLM's names: ``auto`` (the model dtype) or ``fp8`` / ``fp8_e4m3``
(FP8 e4m3fn with one float32 scale per attention layer for K and one for V). A cache write
stores ``clamp(x / scale, -448, 448)`` cast to e4m3; a read multiplies by the scale again.
The scales come from the checkpoint when it has them (compressed-tensors ``kv_cache_scheme``
writes ``...self_attn.k_scale`` / ``v_scale``); otherwise they are 1.0, as in vLLM. That
default keeps SmolLM2's perplexity within 0.1 % of the unquantized cache (K and V of these
models lie well inside e4m3's normal range, where its relative precision does not depend on
the scale).

Paths that cannot store FP8 yet are refused here, naming what is missing, rather than run
with a cache of another type than the one asked for.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
FP8_E4M3 = "fp8_e4m3"


class KVCacheDtypeError(ValueError):
    """An unsupported ``--kv-cache-dtype`` request; the message names it."""


def resolve_kv_cache_dtype(requested: str) -> str:
    """``auto`` or ``fp8_e4m3`` (``fp8`` is e4m3, as in vLLM)."""
    if requested == "fp8_e5m2":
        raise KVCacheDtypeError("--kv-cache-dtype fp8_e5m2 is not yet implemented in tidal "
                                "(use fp8 / fp8_e4m3)")
    if requested not in KV_CACHE_DTYPES:
        raise KVCacheDtypeError(f"--kv-cache-dtype must be one of {KV_CACHE_DTYPES}, got "
                                f"{requested!r}")
    return "auto" if requested == "auto" else FP8_E4M3


def check_fp8_kv_supported(*, is_mla: bool, task: str, attention_backend: str | None,
                           speculative_uses_model: bool) -> None:
    """Refuse the combinations whose caches or kernels do not take FP8 yet."""
    if task != "generate":
        raise KVCacheDtypeError(f"--kv-cache-dtype fp8 with task {task!r} (an encoder keeps no "
                                "KV cache) is not supported")
    if is_mla:
        raise KVCacheDtypeError("--kv-cache-dtype fp8 with multi-head latent attention (the "
                                "MLA latent cache) is not yet implemented in tidal")
    if attention_backend == "cuda":
        raise KVCacheDtypeError("--kv-cache-dtype fp8 with --attention-backend cuda is not yet "
                                "implemented in tidal (use triton or torch)")
    if speculative_uses_model:
        raise KVCacheDtypeError("--kv-cache-dtype fp8 with a draft model or EAGLE-3 head "
                                "(speculative decoding with its own KV cache) is not yet "
                                "implemented in tidal")
