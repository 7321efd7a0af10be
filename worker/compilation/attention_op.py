"""Attention as one opaque torch op, ``tidal::attention``, for the compiled model.

Dynamo must not trace into attention: its backends plan on the host (the torch backend loops
over requests, the Triton one reads host metadata) and write the paged KV cache in place. So a
compiled model's attention layers call this op instead, with only tensors and the layer's
index; the op finds the layer and the step's ``AttentionMetadata`` in the *step context* the
model runner sets around each forward (``step_context``). The fake implementation gives Dynamo
and Inductor the output's shape without running anything, and the piecewise backend
(``piecewise_backend``) splits the traced graph at every call of this op.

The context is a ``ContextVar`` (not a module global): two engines in one process each set
their own around their own forwards.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tidal.worker.attention.backend import AttentionMetadata
    from tidal.worker.layers.attention import Attention

OP_NAME = "tidal::attention"


@dataclass(slots=True)
class StepContext:
    """What the attention op needs that is not a tensor: the step's metadata and the layers
    (indexed as the op's ``layer`` argument)."""

    meta: AttentionMetadata | None
    layers: Sequence[Attention]


_STEP: ContextVar[StepContext | None] = ContextVar("tidal_attention_step", default=None)


@contextlib.contextmanager
def step_context(meta: AttentionMetadata | None,
                 layers: Sequence[Attention]) -> Iterator[StepContext]:
    ctx = StepContext(meta, layers)
    token = _STEP.set(ctx)
    try:
        yield ctx
    finally:
        _STEP.reset(token)


@torch.library.custom_op(OP_NAME, mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer ``layer``'s attention of this step: writes ``k``/``v`` into its paged cache and
    returns ``[num_tokens, num_heads * head_dim]`` (the cache write is a side effect on a
    tensor the graph never sees, so nothing is declared mutated)."""
    ctx = _STEP.get()
    if ctx is None or ctx.meta is None:
        raise RuntimeError("tidal::attention called outside a step (no step_context): a "
                           "compiled model runs only through the model runner")
    n = ctx.meta.num_actual_tokens
    if q.shape[0] > n:
        # Padding rows of a piecewise CUDA graph (piecewise_graphs): no attention, no KV
        # write; the graph after this one reads the n rows it gets (its input is staged).
        q, k, v = q[:n], k[:n], v[:n]
    return ctx.layers[layer].eager_forward(q, k, v, ctx.meta)


@attention.register_fake
def _attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    layer: int) -> torch.Tensor:
    return q.new_empty((q.shape[0], math.prod(q.shape[1:])))


def is_attention_node(node: torch.fx.Node) -> bool:
    """Whether ``node`` of a Dynamo / AOT graph calls the attention op (either overload)."""
    if node.op != "call_function":
        return False
    target = node.target
    return target is torch.ops.tidal.attention.default or target is torch.ops.tidal.attention \
        or target is attention
