"""Perplexity of a fixed public-domain text (tests/data/pride_and_prejudice_ch1.txt) through
the engine's prompt logprobs: the accuracy measure of the quantization tests (issue 23)."""

from __future__ import annotations

import math
from pathlib import Path

from tidal.frontend import LLM, SamplingParams

TEXT = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt").read_text()
PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def perplexity(llm: LLM) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``TEXT`` under ``llm``."""
    out = llm.generate([TEXT], PARAMS, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    nll = [-lp[tok].logprob for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll)), len(nll)
