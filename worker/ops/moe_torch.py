"""The mixture-of-experts ops in plain torch, routing (``select_experts``) and the experts
(``fused_moe``): the CPU path and the reference for the Triton kernels.

The (token, slot) pairs are sorted by expert, and each expert runs its SwiGLU MLP on just the
tokens routed to it, so the work is that of the routed experts only (no dense pass over all
experts). The router weights scale each expert's output and the top-k sum accumulate in
float32, then the result is cast to the input's dtype.

Reading the per-expert counts syncs with the device, which a CUDA graph cannot capture: while
a graph is being captured (a GPU without Triton) ``fused_moe_dense`` runs instead, every expert
over every token with the unrouted ones weighted zero. GPUs with Triton take ``triton_moe``.

FP8 experts (``--quantization fp8``): ``w13`` / ``w2`` in e4m3 with float32 scales per expert
and output row (``w13_scale [E, 2I]``, ``w2_scale [E, H]``). Weight-only: each projection is
the activation (as it is) times the dequantized weight, accumulated in float32 and rounded to
the activation's dtype where the 16-bit path rounds (``expert_linear``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tidal.worker.layers.fused_moe import RoutingConfig


def select_experts(router_logits: torch.Tensor, cfg: RoutingConfig,
                   correction_bias: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits [T, E]`` -> ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``.

    ``correction_bias [E]`` (DeepSeek-V3 style load balancing) is added to the scores for the
    choice of experts only; the weights are the unbiased scores of the chosen ones. The ids
    come best first. Scores are computed in float32 whatever the logits' dtype, as HF does.
    """
    num_experts = router_logits.shape[-1]
    cfg.check(num_experts)
    logits = router_logits.reshape(-1, num_experts).float()
    if cfg.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_groups > 1:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.num_groups, -1)
        if getattr(cfg, "group_score", "max") == "top2_sum":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(cfg.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        # expand, not repeat_interleave (which copies its count to the device: no CUDA graph).
        keep = keep.unsqueeze(-1).expand(t, cfg.num_groups, num_experts // cfg.num_groups)
        choice = choice.masked_fill(~keep.reshape(t, num_experts), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        # The tiny term guards sigmoid scores that all round to zero (no effect otherwise).
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids.to(torch.int32)


def expert_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T`` for one expert's weight ``w``; an FP8 ``w`` with its row ``scale``
    (weight-only: ``x`` is not quantized), in float32, rounded to ``x.dtype``."""
    if scale is None:
        return F.linear(x, w)
    return (F.linear(x.float(), w.float()) * scale.float().reshape(1, -1)).to(x.dtype)


def check_moe_scales(w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor | None,
                     w2_scale: torch.Tensor | None) -> None:
    """FP8 weights come with both scales, of one float32 value per expert and output row."""
    fp8 = w13.dtype == torch.float8_e4m3fn
    if (w2.dtype == torch.float8_e4m3fn) != fp8 or (w13_scale is not None) != fp8 or \
            (w2_scale is not None) != fp8:
        raise ValueError("FP8 expert weights (both w13 and w2) take w13_scale and w2_scale, "
                         "and only they do")
    if fp8 and (tuple(w13_scale.shape) != tuple(w13.shape[:2])
                or tuple(w2_scale.shape) != tuple(w2.shape[:2])):
        raise ValueError(f"scales {tuple(w13_scale.shape)}, {tuple(w2_scale.shape)} must be "
                         f"{tuple(w13.shape[:2])}, {tuple(w2.shape[:2])}")


def check_moe_args(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """Raise ``ValueError`` naming the first argument whose shape does not fit the others."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    t, h = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"w13 must be [E, 2 * I, {h}], got shape {tuple(w13.shape)}")
    e, i = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (e, h, i):
        raise ValueError(f"w2 must be [{e}, {h}, {i}], got shape {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be [{t}, k], got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} must match topk_ids "
                         f"{tuple(topk_ids.shape)}")


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with
    ``e = topk_ids[t, j]``; ``hidden [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` ->
    ``[T, H]`` in ``hidden``'s dtype. FP8 weights take their scales (module docstring)."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    check_moe_scales(w13, w2, w13_scale, w2_scale)
    if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
        return fused_moe_dense(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    t, h = hidden.shape
    k = topk_ids.shape[1]
    i = w13.shape[1] // 2
    flat_ids = topk_ids.reshape(-1).long()
    flat_w = topk_weights.reshape(-1).float()
    order = torch.argsort(flat_ids, stable=True)
    # An id of E names an expert held by another expert-parallel rank (layers/moe_ep): it
    # sorts last and is skipped, its pairs' rows left zero.
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()[:w13.shape[0]]
    out = torch.zeros(t * k, h, dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        x = hidden.index_select(0, pairs // k)
        gate_up = expert_linear(x, w13[expert], None if w13_scale is None else w13_scale[expert])
        act = F.silu(gate_up[:, :i]) * gate_up[:, i:]
        y = expert_linear(act, w2[expert], None if w2_scale is None else w2_scale[expert])
        out.index_copy_(0, pairs, y.float() * flat_w.index_select(0, pairs).unsqueeze(1))
    return out.view(t, k, h).sum(dim=1).to(hidden.dtype)


def fused_moe_dense(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``fused_moe`` with no data-dependent shapes (CUDA-graph safe): each expert runs on every
    token, weighted by the router weight it got (zero where unrouted). E / k times the work."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids)
    e, i = w13.shape[0], w13.shape[1] // 2
    # [T, E]: each token's weight per expert (a token names an expert at most once).
    # (A column more for id E, an expert on another expert-parallel rank: never read.)
    per_expert = torch.zeros(hidden.shape[0], e + 1, dtype=torch.float32, device=hidden.device)
    per_expert.scatter_add_(1, topk_ids.long(), topk_weights.float())
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in range(e):
        gate_up = expert_linear(hidden, w13[expert],
                                None if w13_scale is None else w13_scale[expert])
        y = expert_linear(F.silu(gate_up[:, :i]) * gate_up[:, i:], w2[expert],
                          None if w2_scale is None else w2_scale[expert])
        out.add_(y.float() * per_expert[:, expert:expert + 1])
    return out.to(hidden.dtype)
