"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with a mixture of experts as the
feed-forward block, except on the layers the config keeps dense (``mlp_only_layers``, or off the
``decoder_sparse_step``; ``ArchSpec.moe_layers``). The layers, routing and expert loading are
Mixtral's (``models.mixtral``); only the checkpoint names differ: ``mlp.gate`` for the router
and ``mlp.experts.{e}.{gate,up,down}_proj`` for the experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from tidal.worker.models.mixtral import MixtralForCausalLM


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    FFN_NAME = "mlp"
    EXPERT_PARTS: Mapping[str, str] = MappingProxyType({
        "gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
