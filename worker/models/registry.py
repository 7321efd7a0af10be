"""Which module implements which model family."""

from __future__ import annotations

import torch
from torch import nn

from tidal.engine_core.model_arch import ArchSpec
from tidal.worker.attention.backend import AttentionImpl
from tidal.worker.distributed.parallel_state import ParallelGroup


def build_model(arch: ArchSpec, dtype: torch.dtype, impl: AttentionImpl,
                tp: ParallelGroup | None = None, pp: ParallelGroup | None = None) -> nn.Module:
    """Create the model's modules (parameters uninitialised) on the current default device."""
    if arch.family in ("llama", "qwen2", "qwen3"):
        from tidal.worker.models.decoder import DecoderForCausalLM

        return DecoderForCausalLM(arch, dtype, impl, tp, pp)
    if arch.family == "bert":
        from tidal.worker.models.bert import BertEmbeddingModel

        return BertEmbeddingModel(arch, dtype)
    raise ValueError(f"no model implementation for family {arch.family!r} ({arch.architecture})")
