"""How each reasoning model marks its thinking: one table for both sides.

The frontend's reasoning parsers (``tidal.frontend.reasoning``) split the output text with these
markers; the EngineCore (``structured_output/reasoning_gate.py``) tokenizes the same markers to
hold a request's grammar back until the thinking ends and to force the end when a thinking
budget runs out. Both read the markers from here, so they agree on the text; they still
differ where a tokenizer spells a marker in several tokens (the gate matches the marker's own
token ids) or where the frontend's parser and a remote engine were started with different
``--reasoning-parser`` flags.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ReasoningFormat:
    name: str
    start: str  # opens the reasoning
    end: str  # closes it: the answer follows
    # The reasoning may be open without ``start`` in the output (the prompt opened it, as
    # DeepSeek-R1's template does); otherwise output that does not open with it has none.
    implicit_start: bool
    # What a thinking budget makes the model write to end its reasoning (holds ``end``); the
    # answer (and its grammar) starts after all of it.
    forced_end: str


REASONING_FORMATS: dict[str, ReasoningFormat] = {
    f.name: f for f in (
        ReasoningFormat("qwen3", "<think>", "</think>", False, "\n</think>\n\n"),
        ReasoningFormat("deepseek_r1", "<think>", "</think>", True, "\n</think>\n\n"),
        # gpt-oss harmony: the analysis channel is the reasoning, the final channel the answer;
        # the generation prompt ends with "<|start|>assistant", so the output starts at the
        # channel header (frontend/reasoning/gpt_oss.py).
        ReasoningFormat("gpt_oss", "<|channel|>analysis<|message|>",
                        "<|channel|>final<|message|>", True,
                        "<|end|><|start|>assistant<|channel|>final<|message|>"),
    )
}


def reasoning_format(name: str | None) -> ReasoningFormat | None:
    """The format of a ``--reasoning-parser`` name; None for None. Raises ValueError for a name
    the table lacks."""
    if name is None:
        return None
    fmt = REASONING_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(REASONING_FORMATS))}")
    return fmt
