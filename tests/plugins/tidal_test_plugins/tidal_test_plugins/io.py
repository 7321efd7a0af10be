"""An IO processor: ``{"texts": [...], "max_tokens": N}`` in, each text's greedy continuation
and token counts out."""

from __future__ import annotations

from typing import Any

from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.server.server_plugins import IOProcessorInput


class TokenCounts:
    def __init__(self, config: Any, tokenizer: Any) -> None:
        self.model = config.model.served_model_name

    def parse_request(self, body: Any) -> IOProcessorInput:
        if not isinstance(body, dict) or not isinstance(body.get("texts"), list):
            raise ValueError("the body needs \"texts\": a list of strings")
        texts = body["texts"]
        if not texts or not all(isinstance(t, str) and t for t in texts):
            raise ValueError("texts must be non-empty strings")
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 4)), temperature=0.0)
        return IOProcessorInput(prompts=list(texts), params=params)

    def output_to_response(self, body: Any, outputs: list[Any]) -> Any:
        return {"model": self.model, "results": [
            {"text": out.outputs[0].text, "prompt_tokens": len(out.prompt_token_ids),
             "completion_tokens": len(out.outputs[0].token_ids)} for out in outputs]}
