"""The hand-written fused ops as torch custom ops (``tidal::rms_norm``, ...), so a compiled model
can keep them (``--compilation-config '{"custom_ops": ["all"]}'``, vLLM's field).

Dynamo cannot trace into a Triton launcher or the CUDA extension, and by default the compiled
model uses the plain torch ops, which Inductor fuses itself. An op named in ``custom_ops`` is
instead one opaque node of the graph (a fake implementation gives the output shapes) that runs
the implementation the kernel policy would run without compilation (``impl``: "cuda", "triton"
or "torch", an argument so one registration serves every policy). Every op here is
functional: new outputs, inputs untouched (a custom op's output may not alias its input).
"""

from __future__ import annotations

import torch

from tidal.worker.ops.kernels import op_module

_LIB = "tidal"


def _module(impl: str, x: torch.Tensor):
    # CPU tensors always take the torch ops (as ``Kernels.impl_for``).
    return op_module(impl if x.is_cuda else "torch")


def _like(x: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """A contiguous output of ``x``'s shape in the dtype the torch ops give (promoted)."""
    dtype = x.dtype
    for o in others:
        dtype = torch.promote_types(dtype, o.dtype)
    return x.new_empty(x.shape, dtype=dtype)


@torch.library.custom_op(f"{_LIB}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str) -> torch.Tensor:
    return _module(impl, x).rms_norm(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps, impl):
    return _like(x, weight)


@torch.library.custom_op(f"{_LIB}::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _module(impl, x).fused_add_rms_norm(x, residual, weight, eps)
    return out.contiguous(), res.contiguous()


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, impl):
    res = _like(x, residual)
    return _like(res, weight), res


def _half(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op(f"{_LIB}::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor, impl: str) -> torch.Tensor:
    return _module(impl, x).silu_and_mul(x).contiguous()


@silu_and_mul.register_fake
def _(x, impl):
    return _half(x)


@torch.library.custom_op(f"{_LIB}::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(x: torch.Tensor, impl: str) -> torch.Tensor:
    return _module(impl, x).gelu_tanh_and_mul(x).contiguous()


@gelu_tanh_and_mul.register_fake
def _(x, impl):
    return _half(x)


@torch.library.custom_op(f"{_LIB}::gemma_rms_norm", mutates_args=())
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   impl: str) -> torch.Tensor:
    return _module(impl, x).gemma_rms_norm(x, weight, eps).contiguous()


@gemma_rms_norm.register_fake
def _(x, weight, eps, impl):
    return x.new_empty(x.shape)  # (scaled in float32, cast back to x's dtype)


@torch.library.custom_op(f"{_LIB}::gemma_add_norm_norm", mutates_args=())
def gemma_add_norm_norm(x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
                        next_weight: torch.Tensor, eps: float,
                        impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, res = _module(impl, x).gemma_add_norm_norm(x, residual, post_weight, next_weight, eps)
    return out.contiguous(), res.contiguous()


@gemma_add_norm_norm.register_fake
def _(x, residual, post_weight, next_weight, eps, impl):
    res = _like(residual, x)
    return res.new_empty(res.shape), res


@torch.library.custom_op(f"{_LIB}::rotary_embedding", mutates_args=())
def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool,
                     impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = _module(impl, query).rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    return q.contiguous(), k.contiguous()


@rotary_embedding.register_fake
def _(positions, query, key, cos_sin_cache, is_neox, impl):
    return query.new_empty(query.shape), key.new_empty(key.shape)


# --- LoRA (``--enable-lora`` with compilation: always these, on every device) --------------------


def _lora_module(impl: str, x: torch.Tensor):
    if impl == "triton" and x.is_cuda:
        from tidal.worker.ops import triton_lora

        return triton_lora
    return None


@torch.library.custom_op(f"{_LIB}::lora_shrink", mutates_args=())
def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor,
                impl: str) -> torch.Tensor:
    """LoRA's first product, per token (the segmented kernels need per-step host metadata,
    which a compiled graph does not take)."""
    mod = _lora_module(impl, x)
    if mod is not None:
        return mod.lora_shrink(x, a, slots, None)
    from tidal.worker.ops import lora_torch

    return lora_torch.lora_shrink(x, a, slots)


@lora_shrink.register_fake
def _(x, a, slots, impl):
    # (The Triton per-token kernel accumulates in, and returns, float32.)
    dtype = torch.float32 if impl == "triton" and x.is_cuda else x.dtype
    return x.new_empty((x.shape[0], a.shape[1]), dtype=dtype)


@torch.library.custom_op(f"{_LIB}::lora_expand", mutates_args=("y",))
def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
                offsets: list[int], rank: int, impl: str) -> None:
    """LoRA's second product added into ``y`` in place (declared: the graph orders it)."""
    mod = _lora_module(impl, y)
    if mod is not None:
        mod.lora_expand(y, xa, b, slots, tuple(offsets), rank, None)
        return
    from tidal.worker.ops import lora_torch

    lora_torch.lora_expand(y, xa, b, slots, tuple(offsets), rank)


@lora_expand.register_fake
def _(y, xa, b, slots, offsets, rank, impl):
    return None
