"""Plain-torch versions of the fused ops: the CPU path and the reference for every kernel.

Rounding follows HF transformers (normalise in float32, cast back, then scale by the weight), so
that tidal's tokens match transformers' in half precision too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(rms_norm(x + residual), x + residual)``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU over a fused [gate | up] input: ``gelu(gate, tanh approximation) * up``."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: the weight is an offset from 1 and scales in float32, before the cast
    back (Llama's norm casts first; in half precision the two orders round differently)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gemma_add_norm_norm(
    x: torch.Tensor, residual: torch.Tensor, post_weight: torch.Tensor,
    next_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gemma sub-block's end and the next one's start: ``r = residual + gemma_rms_norm(x,
    post_weight)``, returns ``(gemma_rms_norm(r, next_weight), r)``."""
    r = residual + gemma_rms_norm(x, post_weight, eps)
    return gemma_rms_norm(r, next_weight, eps), r


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query [T, H, D]`` and ``key [T, Hkv, D]`` by their positions.

    ``cos_sin_cache`` is ``[max_position, rot_dim]``: cos in the first half, sin in the second,
    float32. Only the first ``rot_dim`` channels of each head rotate. ``is_neox``: rotate the two
    halves of the rotary channels (HF's rotate_half); otherwise rotate even/odd pairs (GPT-J).
    """
    cos_sin = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cos_sin.chunk(2, dim=-1)  # [T, rot_dim // 2]
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    dtype = x.dtype
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    if is_neox:
        cos = torch.cat((cos, cos), dim=-1).to(dtype)
        sin = torch.cat((sin, sin), dim=-1).to(dtype)
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        cos = cos.repeat_interleave(2, dim=-1).to(dtype)
        sin = sin.repeat_interleave(2, dim=-1).to(dtype)
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    out = x_rot * cos + rotated * sin
    if x_pass.shape[-1] == 0:
        return out
    return torch.cat((out, x_pass), dim=-1)


# --- fused decode ops (references of ``triton_decode``) ---------------------------------------


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(linear(rms_norm(x + residual)), x + residual)`` (``residual`` None: no add, and the
    second result is ``x``); with ``silu`` the projection is a fused [gate | up] one and the
    result is ``silu(gate) * up``."""
    if residual is None:
        h, residual = rms_norm(x, norm_weight, eps), x
    else:
        h, residual = fused_add_rms_norm(x, residual, norm_weight, eps)
    y = F.linear(h, weight, bias)
    return (silu_and_mul(y) if silu else y), residual


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    gemma_norm: bool = False,
) -> torch.Tensor:
    """Split ``qkv [T, (H + 2 Hkv) D]``; per-head RMSNorm of q and k (when weights are given;
    ``gemma_norm``: Gemma's ``(1 + w)`` norm, ``gemma_rms_norm``);
    neox rotary; K and V written to ``kv_cache [2, blocks, page, Hkv, D]`` at ``slot_mapping``
    (< 0: skipped; an FP8 cache quantized with ``k_scale`` / ``v_scale``). Returns q
    ``[T, H, D]``."""
    from tidal.worker.attention.torch_backend import write_kv_reference

    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    v = v.reshape(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        norm = gemma_rms_norm if gemma_norm else rms_norm
        q = norm(q, q_norm_weight, eps)
        k = norm(k, k_norm_weight, eps)
    q, k = rotary_embedding(positions, q, k, cos_sin_cache, True)
    n = min(t, slot_mapping.shape[0])
    write_kv_reference(k[:n], v[:n], kv_cache, slot_mapping[:n], k_scale, v_scale)
    return q


def vocab_shard_embedding(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Embedding rows of the tokens ``ids`` from ``weight``, the vocabulary shard that starts at
    token ``start``: row ``id - start`` where that lies in the shard, zeros elsewhere (another
    rank holds those; the all-reduce after this fills them in)."""
    local = ids - start
    foreign = (local < 0) | (local >= weight.shape[0])
    out = F.embedding(local.masked_fill(foreign, 0), weight)
    return out.masked_fill_(foreign.unsqueeze(-1), 0)


def argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
