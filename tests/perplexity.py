"""Perplexity of a fixed public-domain text (tests/data/pride_and_prejudice_ch1.txt) through
the engine's prompt logprobs: the accuracy measure of the quantization tests (issue 23)."""

from __future__ import annotations

import math
from pathlib import Path

from tidal.frontend import LLM, SamplingParams

TEXT = (Path(__file__).parent / "data" / "pride_and_prejudice_ch1.txt").read_text()
# A second public-domain text (984 tokens), on which the quantized formats are scored too: one
# short text can flatter a format (FP8 W8A8 costs SmolLM2 ~1 % on TEXT, +6.45 % on this one).
SECOND_TEXT = (Path(__file__).parent / "data" / "calibration_public_domain.txt").read_text()
PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def perplexity(llm: LLM, text: str = TEXT) -> tuple[float, int]:
    """(perplexity, tokens scored) of ``text`` under ``llm``."""
    out = llm.generate([text], PARAMS, use_tqdm=False)[0]
    ids = out.prompt_token_ids
    nll = [-lp[tok].logprob for tok, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(sum(nll) / len(nll)), len(nll)
