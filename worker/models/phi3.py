"""Phi-3 (and Phi-3.5 mini): the decoder's math with a different checkpoint layout.

The layer is Llama's (RMSNorm → attention → RMSNorm → SiLU-gated MLP, full rotary), so the
shared decoder runs it. What differs:

- the checkpoint stores q/k/v as one ``qkv_proj`` tensor (rows: all q heads, then k, then v)
  and gate/up as one ``gate_up_proj`` (rows: gate, then up). Each is cut into its parts here
  and handed to the tensor-parallel layers' loaders part by part, so every rank takes its own
  heads of each part (a fused tensor cannot be split evenly by rows across ranks);
- LongRoPE ("su"/"longrope") rope scaling, in ``layers.rotary`` (which factor set is used is
  decided once per model; see ``_longrope_inv_freq``);
- a sliding window on every layer when the config sets one (Phi-3-mini-4k: 2047); the
  config normaliser leaves ``window_layers`` unset, so the decoder windows them all.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.models.decoder import DecoderForCausalLM, WeightLoadError

_QKV = ".qkv_proj."
_GATE_UP = ".gate_up_proj."


class _RowSlice:
    """Rows ``[start, start + length)`` of a lazy checkpoint tensor, still lazy: a
    tensor-parallel loader narrowing it reads only its own shard from the file."""

    __slots__ = ("_base", "_start", "shape")

    def __init__(self, base: Any, start: int, length: int) -> None:
        self._base = base
        self._start = start
        self.shape = torch.Size((length, *base.shape[1:]))

    def dim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if dim == 0:
            return self._base.narrow(0, self._start + start, length)
        return self.materialize().narrow(dim, start, length)

    def materialize(self) -> torch.Tensor:
        return self._base.narrow(0, self._start, self.shape[0])


def _rows(t: Any, start: int, length: int) -> Any:
    if isinstance(t, torch.Tensor):
        return t.narrow(0, start, length)
    return _RowSlice(t, start, length)


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], arch: ArchSpec
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3 checkpoint names → the decoder's per-projection names; the fused tensors become
    their parts (row slices, no copy). Sizes are the whole model's, before any sharding."""
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    for name, tensor in weights:
        if _QKV in name:
            if tensor.shape[0] != q + 2 * kv:
                raise WeightLoadError(name, f"fused q/k/v has {tensor.shape[0]} rows, the "
                                      f"config needs {q} + 2 x {kv}")
            yield name.replace(_QKV, ".q_proj."), _rows(tensor, 0, q)
            yield name.replace(_QKV, ".k_proj."), _rows(tensor, q, kv)
            yield name.replace(_QKV, ".v_proj."), _rows(tensor, q + kv, kv)
        elif _GATE_UP in name:
            if tensor.shape[0] != 2 * inter:
                raise WeightLoadError(name, f"fused gate/up has {tensor.shape[0]} rows, the "
                                      f"config needs 2 x {inter}")
            yield name.replace(_GATE_UP, ".gate_proj."), _rows(tensor, 0, inter)
            yield name.replace(_GATE_UP, ".up_proj."), _rows(tensor, inter, inter)
        else:
            yield name, tensor


class Phi3ForCausalLM(DecoderForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_fused(weights, self.arch))
