"""The mixture-of-experts layer: routing (``select_experts``) and the experts' SwiGLU MLPs run
as one fused op (``FusedMoE``).

The router gate (a replicated ``nn.Linear(H, E)``) and any shared experts belong to the model;
it hands ``FusedMoE.forward`` the router logits. Each expert is ``down(silu(gate(x)) * up(x))``;
the experts' gate and up weights are stacked as ``w13 [E, 2 * I_shard, H]`` (each expert's gate
rows, then its up rows, the layout ``silu_and_mul`` takes) and the down weights as
``w2 [E, H, I_shard]``. Tensor parallelism shards every expert's intermediate dimension, like a
column-parallel gate/up followed by a row-parallel down: each rank's output is a partial sum,
completed by one all-reduce when ``reduce_results``.

Built under ``fp8.quantizing`` with FP8 (``--quantization fp8``), the stacked expert weights
are e4m3 with a float32 scale per expert and output row (``w13_weight_scale [E, 2 * I_shard]``,
``w2_weight_scale [E, H]``), each checkpoint tensor quantized per row as it loads (the whole
row, before the tensor-parallel shard is cut, so every rank scales as one rank would). The
experts then compute weight-only (W8A16, ``moe_torch.expert_linear``): the activations stay in
16 bits, which costs the grouped GEMMs nothing at decode sizes, where the weight bytes set the
time. FP8 checkpoints of MoE models are not read yet (refused at start-up).

Which kernels run is the worker's kernel policy (``Kernels.select_experts`` and
``Kernels.fused_moe``): Triton on CUDA (``ops/triton_moe``), plain torch (``ops/moe_torch``,
where ``select_experts`` is defined; this module re-exports it) elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from tidal.worker.distributed.parallel_state import ParallelGroup, single_group
from tidal.worker.kernel_policy import current_kernels
from tidal.worker.layers import fp8
from tidal.worker.layers.linear import WeightShapeError, _shard, as_tensor, set_weight_loader
from tidal.worker.layers.moe_ep import current_expert_parallel
from tidal.worker.ops.fp8_torch import FP8_DTYPE, quantize_rows
from tidal.worker.ops.moe_torch import select_experts

if TYPE_CHECKING:
    from tidal.worker.layers.expert_load import ExpertLoad

__all__ = ["FusedMoE", "RoutingConfig", "select_experts"]

Which = Literal["gate", "up", "down"]


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How router logits pick experts and weigh them.

    ``num_groups`` / ``topk_groups``: grouped top-k (DeepSeek-V2's "group_limited_greedy"): the
    experts fall in ``num_groups`` equal groups, a group's score is the max of its experts'
    scores, and only experts of the ``topk_groups`` best groups are eligible.
    """

    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True  # divide the top-k weights by their sum
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the final weights
    # A group's score: its best expert's (V2), or the sum of its two best (V3's "noaux_tc").
    group_score: Literal["max", "top2_sum"] = "max"

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be at least 1, got {self.top_k}")
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"need 1 <= topk_groups ({self.topk_groups}) <= num_groups "
                             f"({self.num_groups})")

    def check(self, num_experts: int) -> None:
        """Raise ``ValueError`` unless this routing can pick from ``num_experts`` experts."""
        if num_experts % self.num_groups:
            raise ValueError(f"{num_experts} experts do not split into {self.num_groups} groups")
        eligible = num_experts // self.num_groups * self.topk_groups
        if self.top_k > eligible:
            raise ValueError(f"top_k {self.top_k} exceeds the {eligible} eligible experts "
                             f"({num_experts} experts, {self.topk_groups} of "
                             f"{self.num_groups} groups)")


class FusedMoE(nn.Module):
    """``num_experts`` SwiGLU experts behind a router; ``forward(hidden, router_logits)``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 routing: RoutingConfig, dtype: torch.dtype, tp: ParallelGroup | None = None,
                 reduce_results: bool = True, prefix: str = "") -> None:
        super().__init__()
        self.tp = tp or single_group()
        routing.check(num_experts)
        # Expert parallelism (``moe_ep``): this rank holds a contiguous range of whole experts
        # instead of every expert's tensor-parallel shard.
        self.ep = current_expert_parallel()
        self.placement = self.ep.place(num_experts) if self.ep is not None else None
        tp_shards = 1 if self.ep is not None else self.tp.world_size
        if intermediate_size % tp_shards:
            raise ValueError(f"{prefix or 'MoE'}: intermediate size {intermediate_size} does not "
                             f"split over {self.tp.world_size} tensor-parallel ranks")
        self.kernels = current_kernels()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.shard_size = intermediate_size // tp_shards
        # Experts held here: all of them, or this expert-parallel rank's range.
        self.local_experts = range(num_experts) if self.placement is None else \
            self.placement.experts
        num_local = len(self.local_experts)
        self.routing = routing
        self.reduce_results = reduce_results
        self.prefix = prefix
        i = self.shard_size
        quant = fp8.current_quant()
        if quant is not None and (quant.method != "fp8" or quant.prequantized):
            raise ValueError(f"{prefix or 'MoE'}: expert weights take FP8 quantized on load "
                             f"only; {quant.method} checkpoints of them are not yet "
                             "implemented in tidal")
        self.quantized = quant is not None
        wdt = FP8_DTYPE if self.quantized else dtype
        self.w13 = nn.Parameter(torch.empty(num_local, 2 * i, hidden_size, dtype=wdt),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_local, hidden_size, i, dtype=wdt),
                               requires_grad=False)
        set_weight_loader(self.w13, self.weight_loader)
        set_weight_loader(self.w2, self.weight_loader)
        if self.quantized:
            self.w13_weight_scale = nn.Parameter(
                torch.ones(num_local, 2 * i, dtype=torch.float32), requires_grad=False)
            self.w2_weight_scale = nn.Parameter(
                torch.ones(num_local, hidden_size, dtype=torch.float32), requires_grad=False)
            for p in (self.w13_weight_scale, self.w2_weight_scale):
                p.derived_on_load = True  # type: ignore[attr-defined]  # computed as they load
        else:
            self.register_parameter("w13_weight_scale", None)
            self.register_parameter("w2_weight_scale", None)
        # (which, expert) pairs loaded so far, so a model can tell a checkpoint that lacks some.
        self._loaded: set[tuple[str, int]] = set()
        # The routing counter for /metrics and this layer's row in it (``expert_load``; None:
        # not counted).
        self.expert_load: ExpertLoad | None = None
        self.expert_load_index = 0

    def extra_repr(self) -> str:
        held = "" if self.placement is None else f" (ep: {self.placement.describe()})"
        return (f"experts={self.num_experts}{held}, hidden={self.hidden_size}, "
                f"intermediate={self.shard_size}/{self.intermediate_size}, "
                f"routing={self.routing}" + (", fp8" if self.quantized else ""))

    # --- weights ------------------------------------------------------------------------------

    def _slot(self, which: str, expert: int) -> torch.Tensor:
        """This rank's place for ``which`` of ``expert`` (a view into w13 or w2)."""
        i = self.shard_size
        if which == "gate":
            return self.w13.data[expert, :i]
        if which == "up":
            return self.w13.data[expert, i:]
        if which == "down":
            return self.w2.data[expert]
        raise WeightShapeError(f"unknown expert weight {which!r} (gate, up or down)")

    def _check_intermediate(self, which: str, weight: Any, dim: int) -> str:
        what = f"{self.prefix or 'MoE'} expert {which}"
        full = self.intermediate_size
        if weight.shape[dim] != full:
            raise WeightShapeError(f"{what}: expected intermediate size {full} in dimension "
                                   f"{dim % len(weight.shape)}, got shape {tuple(weight.shape)}")
        return what

    def _rank_part(self, which: str, weight: Any, dim: int) -> torch.Tensor:
        """This rank's shard of a full checkpoint tensor: gate/up split their output rows,
        down its input columns (``dim`` counts from the end so stacked tensors work too)."""
        what = self._check_intermediate(which, weight, dim)
        if self.tp.world_size == 1 or self.ep is not None:  # (expert parallel: whole experts)
            return as_tensor(weight)
        return as_tensor(_shard(weight, dim % len(weight.shape), self.tp.rank,
                                self.tp.world_size, what))

    def _scale_slot(self, which: str) -> torch.Tensor:
        """Every expert's scales of ``which`` (FP8): ``[E, rows]``."""
        i = self.shard_size
        if which == "down":
            return self.w2_weight_scale.data
        return self.w13_weight_scale.data[:, :i] if which == "gate" else \
            self.w13_weight_scale.data[:, i:]

    def _quantized_part(self, which: str, weight: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8: ``weight`` (one expert's ``[rows, cols]`` or stacked ``[E, rows, cols]``)
        quantized per whole row, then this rank's shard of it and of its scales ``[..., rows]``
        (gate/up shard their rows, and so their scales; down its columns, all scales kept)."""
        t = as_tensor(weight).to(self.w13.device)
        q, s = quantize_rows(t.reshape(-1, t.shape[-1]))
        del t
        q = q.view(*weight.shape)
        s = s.view(*weight.shape[:-1], 1)
        if which == "down":
            return self._rank_part(which, q, -1), s.squeeze(-1)
        return self._rank_part(which, q, -2), self._rank_part(which, s, -2).squeeze(-1)

    def load_expert_weight(self, which: Which, expert: int, weight: Any) -> None:
        """Load one expert's FULL checkpoint tensor (gate/up ``[I, H]``, down ``[H, I]``); this
        rank keeps its shard of the intermediate dimension."""
        if not 0 <= expert < self.num_experts:
            raise WeightShapeError(f"{self.prefix or 'MoE'}: expert {expert} out of range "
                                   f"(0..{self.num_experts - 1})")
        if expert not in self.local_experts:
            return  # another expert-parallel rank's
        slot = expert - self.local_experts.start
        dim = -2 if which != "down" else -1
        scale = None
        if self.quantized:
            self._check_intermediate(which, weight, dim)  # before any work
            part, scale = self._quantized_part(which, weight)
        else:
            part = self._rank_part(which, weight, dim)
        dst = self._slot(which, slot)
        if dst.shape != part.shape:
            raise WeightShapeError(f"{self.prefix or 'MoE'} expert {expert} {which}: the model "
                                   f"expects {tuple(dst.shape)}, the checkpoint gives "
                                   f"{tuple(part.shape)}")
        dst.copy_(part)
        if scale is not None:
            self._scale_slot(which)[slot].copy_(scale)
        self._loaded.add((which, expert))

    def load_stacked_weight(self, which: Which, weight: Any) -> None:
        """Load every expert's ``which`` from one stacked tensor (``[E, I, H]`` for gate/up,
        ``[E, H, I]`` for down, full size), as GGUF stores them."""
        if len(weight.shape) != 3 or weight.shape[0] != self.num_experts:
            raise WeightShapeError(f"{self.prefix or 'MoE'} stacked {which}: expected "
                                   f"{self.num_experts} experts stacked in a 3-d tensor, got "
                                   f"shape {tuple(weight.shape)}")
        if self.placement is not None:  # (a lazy checkpoint tensor reads only this range)
            r = self.local_experts
            weight = (weight.narrow(0, r.start, len(r)) if hasattr(weight, "narrow")
                      else weight[r.start:r.stop])
        i = self.shard_size
        dst = {"gate": self.w13.data[:, :i], "up": self.w13.data[:, i:],
               "down": self.w2.data}.get(which)
        if dst is None:
            raise WeightShapeError(f"unknown expert weight {which!r} (gate, up or down)")
        if self.quantized:
            self._check_intermediate(which, weight, -2 if which != "down" else -1)
            part, scale = self._quantized_part(which, weight)
            slot = self._scale_slot(which)
            if slot.shape == scale.shape and dst.shape == part.shape:
                slot.copy_(scale)  # (a mismatch is reported below)
        else:
            part = self._rank_part(which, weight, -2 if which != "down" else -1)
        if dst.shape != part.shape:
            raise WeightShapeError(f"{self.prefix or 'MoE'} stacked {which}: the model expects "
                                   f"{tuple(dst.shape)}, the checkpoint gives "
                                   f"{tuple(part.shape)}")
        dst.copy_(part)
        self._loaded.update((which, e) for e in self.local_experts)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """The parameters' loader: ``shard_id`` is ``(which, expert)`` for one expert's tensor,
        ``(which, None)`` or ``which`` for a stacked one."""
        if isinstance(shard_id, tuple) and len(shard_id) == 2 and shard_id[1] is not None:
            self.load_expert_weight(shard_id[0], int(shard_id[1]), loaded)
            return
        which = shard_id[0] if isinstance(shard_id, tuple) else shard_id
        if which is None:
            raise WeightShapeError(f"{self.prefix or 'MoE'}: an expert tensor needs a shard id "
                                   "(which, expert)")
        self.load_stacked_weight(which, loaded)

    def missing_weights(self) -> list[str]:
        """The expert tensors not loaded yet, as ``'<which> of expert <e>'``."""
        return [f"{w} of expert {e}" for e in self.local_experts
                for w in ("gate", "up", "down") if (w, e) not in self._loaded]

    @torch.no_grad()
    def dummy_fill(self, low: float, high: float, gen: torch.Generator) -> None:
        """FP8 experts for ``--load-format dummy``: each expert's weights drawn in float32 like
        any dummy weight and quantized as a checkpoint tensor would be."""
        for w, scale in ((self.w13, self.w13_weight_scale), (self.w2, self.w2_weight_scale)):
            for e in range(w.shape[0]):
                tmp = torch.empty(w.shape[1:], dtype=torch.float32, device=w.device)
                tmp.uniform_(low, high, generator=gen)
                q, s = quantize_rows(tmp)
                w.data[e].copy_(q)
                scale.data[e].copy_(s.reshape(-1))

    # --- forward ------------------------------------------------------------------------------

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [T, H]`` (or ``[..., H]``) and ``router_logits [T, E]`` -> ``[T, H]``, summed
        over the tensor-parallel ranks when ``reduce_results``. ``correction_bias [E]`` biases
        the choice of experts only (``select_experts``)."""
        shape = hidden.shape
        x = hidden.reshape(-1, self.hidden_size)
        if self.ep is not None:
            return self.ep.forward(self, x, router_logits.reshape(-1, self.num_experts),
                                   correction_bias).view(shape)
        count = (self.expert_load.into(self.expert_load_index)
                 if self.expert_load is not None else None)
        weights, ids = self.kernels.select_experts(router_logits.reshape(-1, self.num_experts),
                                                   self.routing, correction_bias, count)
        out = self.kernels.fused_moe(x, self.w13, self.w2, weights, ids,
                                     self.w13_weight_scale, self.w2_weight_scale)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        return out.view(shape)
