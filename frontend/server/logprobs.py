"""Log-probabilities in the shapes of the completion and chat APIs, and vLLM's
``prompt_logprobs``.

Each position arrives as ``{token id: Logprob}``: the sampled (or prompt) token with its true rank,
then the top-N, deduplicated, so that token appears once even when it is in the top-N.

Tokens are shown as their text, or as ``token_id:<id>`` (``return_tokens_as_token_ids``, vLLM's
form for tokens that are not valid text on their own); text offsets always count the real text.
A log-probability of -inf (a masked token) is shown as -9999.0, as OpenAI and vLLM do, since JSON
has no infinity.
"""

from __future__ import annotations

from tidal.frontend.outputs import Logprob, PositionLogprobs
from tidal.frontend.server.openai_protocol import (
    ChatLogprobEntry,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

_FLOOR = -9999.0


def _text(lp: Logprob | None, fallback: str = "") -> str:
    return lp.decoded_token if lp is not None and lp.decoded_token is not None else fallback


def _shown(tok: int, lp: Logprob | None, as_ids: bool) -> str:
    return f"token_id:{tok}" if as_ids else _text(lp)


def _value(logprob: float) -> float:
    return logprob if logprob >= _FLOOR else _FLOOR


def _append(out: CompletionLogprobs, tok: int, pos: PositionLogprobs, offset: int,
            as_ids: bool, top_n: int | None = None) -> int:
    """Append one position holding log-probabilities (``top_n``: keep only the top-N of a wider
    position besides the token itself); returns the text offset after it."""
    chosen = pos.get(tok)
    text = _text(chosen)
    out.tokens.append(_shown(tok, chosen, as_ids))
    out.token_logprobs.append(None if chosen is None else _value(chosen.logprob))
    out.top_logprobs.append({
        _shown(t, lp, as_ids): _value(lp.logprob) for t, lp in pos.items()
        if top_n is None or t == tok or (lp.rank or 0) <= top_n})
    out.text_offset.append(offset)
    return offset + len(text)


def extend_completion_logprobs(out: CompletionLogprobs, positions: list[PositionLogprobs],
                               token_ids: list[int], offset: int, as_ids: bool = False) -> int:
    """Append generated positions to ``out``; returns the text offset after them."""
    for tok, pos in zip(token_ids, positions):
        offset = _append(out, tok, pos, offset, as_ids)
    return offset


def extend_prompt_logprobs(out: CompletionLogprobs, positions: list[PositionLogprobs | None],
                           token_ids: list[int], first_token_text: str, as_ids: bool = False,
                           top_n: int | None = None) -> int:
    """Append the prompt's positions (``echo``); position 0 has no log-probability. ``top_n``:
    how many of each position's top entries to show (the engine may have computed more)."""
    offset = 0
    for k, tok in enumerate(token_ids):
        pos = positions[k] if k < len(positions) else None
        if pos is not None:
            offset = _append(out, tok, pos, offset, as_ids, top_n)
            continue
        text = first_token_text if k == 0 else ""
        out.tokens.append(f"token_id:{tok}" if as_ids else text)
        out.token_logprobs.append(None)
        out.top_logprobs.append(None)
        out.text_offset.append(offset)
        offset += len(text)
    return offset


def prompt_logprobs(positions: list[PositionLogprobs | None] | None, token_ids: list[int],
                    top_n: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: per prompt position (the first is null), token id -> its
    log-probability, rank and text: the prompt's token, then the top ``top_n``."""
    out: PromptLogprobs = []
    for k, tok in enumerate(token_ids):
        pos = positions[k] if positions is not None and k < len(positions) else None
        if pos is None:
            out.append(None)
            continue
        out.append({t: PromptLogprob(_value(lp.logprob), lp.rank, lp.decoded_token)
                    for t, lp in pos.items() if t == tok or (lp.rank or 0) <= top_n})
    return out


def chat_logprob_entries(positions: list[PositionLogprobs], token_ids: list[int],
                         top_n: int, as_ids: bool = False) -> list[ChatLogprobEntry]:
    entries = []
    for tok, pos in zip(token_ids, positions):
        chosen = pos.get(tok)
        text = _text(chosen)
        # The top-N by rank; the sampled token is among them only if it ranked that high.
        top = sorted(((t, lp) for t, lp in pos.items() if lp.rank is not None and lp.rank <= top_n),
                     key=lambda item: item[1].rank or 0)
        entries.append(ChatLogprobEntry(
            token=_shown(tok, chosen, as_ids),
            logprob=_FLOOR if chosen is None else _value(chosen.logprob),
            bytes=list(text.encode("utf-8")),
            top_logprobs=[TopLogprob(_shown(t, lp, as_ids), _value(lp.logprob),
                                     list(_text(lp).encode("utf-8")))
                          for t, lp in top],
        ))
    return entries


def tokens_as_ids(requested: bool | None, server_default: bool) -> bool:
    """Whether to show tokens as ``token_id:<id>``: the request's choice, else the server's."""
    return server_default if requested is None else requested
