"""Build the model class the registry (``tidal.engine_core.model_registry``) names for a family.

The list of families lives in engine_core, which never imports worker code; it names each
implementation as a ``"module:Class"`` string that only the worker imports.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.engine_core.model_registry import family
from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.distributed.parallel_state import ParallelGroup
from tidal.worker.kernel_policy import building, current_kernels
from tidal.worker.models.decoder import AuxHiddenSpec
from tidal.worker.ops.kernels import Kernels


def model_class(arch: ArchSpec) -> type[nn.Module]:
    """The class that implements ``arch``'s family, imported on first use."""
    target = family(arch.family).model_class
    module_name, _, class_name = target.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ValueError(f"model family {arch.family!r}: {target!r} is not an nn.Module class")
    return cls


def build_model(arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                tp: ParallelGroup | None = None, pp: ParallelGroup | None = None,
                kernels: Kernels | None = None, aux_hidden: AuxHiddenSpec | None = None
                ) -> nn.Module:
    """Create the model's modules (parameters uninitialised) on the current default device.
    Its layers take their fused ops from ``kernels`` (the worker's policy; None: those of an
    enclosing ``kernel_policy.building``, else the torch ones). ``aux_hidden``: the model also
    records the hidden states entering those layers (an EAGLE-3 target; decoder families
    only)."""
    cls = model_class(arch)
    with building(kernels or current_kernels()):
        if aux_hidden is None:
            return cls(arch, dtype, impl, tp, pp)
        if not getattr(cls, "supports_aux_hidden_states", False):
            raise ValueError(f"model family {arch.family!r} cannot return auxiliary hidden "
                             "states (EAGLE-3 targets: the Llama-shaped decoder families)")
        return cls(arch, dtype, impl, tp, pp, aux_hidden=aux_hidden)
