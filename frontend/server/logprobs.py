"""Log-probabilities in the shapes of the completion and chat APIs.

Each generated position arrives as ``{token id: Logprob}``: the sampled token (with its true rank)
plus the top-N, deduplicated, so the sampled token appears once even when it is in the top-N.
"""

from __future__ import annotations

from tidal.frontend.outputs import Logprob, PositionLogprobs
from tidal.frontend.server.openai_protocol import (
    ChatLogprobEntry,
    CompletionLogprobs,
    TopLogprob,
)


def _text(lp: Logprob | None, fallback: str = "") -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else fallback


def _append(out: CompletionLogprobs, tok: int, pos: PositionLogprobs, offset: int) -> int:
    """Append one position holding log-probabilities; returns the text offset after it."""
    chosen = pos.get(tok)
    text = _text(chosen)
    out.tokens.append(text)
    out.token_logprobs.append(None if chosen is None else chosen.logprob)
    out.top_logprobs.append({_text(lp): lp.logprob for lp in pos.values()})
    out.text_offset.append(offset)
    return offset + len(text)


def extend_completion_logprobs(out: CompletionLogprobs, positions: list[PositionLogprobs],
                               token_ids: list[int], offset: int) -> int:
    """Append generated positions to ``out``; returns the text offset after them."""
    for tok, pos in zip(token_ids, positions):
        offset = _append(out, tok, pos, offset)
    return offset


def extend_prompt_logprobs(out: CompletionLogprobs, positions: list[PositionLogprobs | None],
                           token_ids: list[int], first_token_text: str) -> int:
    """Append the prompt's positions (``echo``); position 0 has no log-probability."""
    offset = 0
    for k, tok in enumerate(token_ids):
        pos = positions[k] if k < len(positions) else None
        if pos is not None:
            offset = _append(out, tok, pos, offset)
            continue
        text = first_token_text if k == 0 else ""
        out.tokens.append(text)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(text)
    return offset


def chat_logprob_entries(positions: list[PositionLogprobs], token_ids: list[int],
                         top_n: int) -> list[ChatLogprobEntry]:
    entries = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos.get(tok)
        text = _text(chosen)
        # The top-N by rank; the sampled token is among them only if it ranked that high.
        top = sorted((lp for lp in pos.values() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda lp: lp.rank or 0)
        entries.append(ChatLogprobEntry(
            token=text,
            logprob=float("-inf") if chosen is None else chosen.logprob,
            bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(_text(lp), lp.logprob, list(_text(lp).encode("utf-8")))
                          for lp in top],
        ))
    return entries
