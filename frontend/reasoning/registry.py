"""Reasoning parsers by name (``--reasoning-parser NAME``); plugins add theirs with
``register_reasoning_parser``."""

from __future__ import annotations

from tidal.frontend.reasoning.base import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
)
from tidal.frontend.reasoning.gpt_oss import GptOssReasoningParser

_PARSERS: dict[str, type[ReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    GptOssReasoningParser.name: GptOssReasoningParser,
}


def register_reasoning_parser(name: str, cls: type[ReasoningParser]) -> None:
    if not issubclass(cls, ReasoningParser):
        raise TypeError(f"{cls!r} is not a ReasoningParser")
    _PARSERS[name] = cls


def reasoning_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    cls = _PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(reasoning_parser_names())}")
    return cls
