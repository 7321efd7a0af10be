"""tidal's frontends: offline ``LLM``, ``AsyncLLM``, the OpenAI-compatible server and client."""

from __future__ import annotations

from tidal.engine_core.lora_request import LoRARequest
from tidal.engine_core.sampling_params import OutputKind, SamplingParams
from tidal.frontend.beam_search import BeamSearchParams
from tidal.frontend.client import AsyncClient
from tidal.frontend.llm import LLM
from tidal.frontend.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["AsyncClient", "BeamSearchParams", "LLM", "CompletionOutput", "Logprob",
           "LoRARequest", "OutputKind", "RequestOutput", "SamplingParams"]
