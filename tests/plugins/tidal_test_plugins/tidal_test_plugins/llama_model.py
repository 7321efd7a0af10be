"""The test family's model class, imported only where the model is built (the worker)."""

from __future__ import annotations

from tidal.worker.models.decoder import DecoderForCausalLM


class TidalTestLlamaForCausalLM(DecoderForCausalLM):
    """The Llama decoder under another architecture name."""
