"""Reasoning parsers: split a reasoning model's output into ``reasoning_content`` and
``content``, whole or as a stream, with the same answer either way."""

from __future__ import annotations

from tidal.frontend.reasoning.base import DeltaMessage, ReasoningParser
from tidal.frontend.reasoning.registry import (
    get_reasoning_parser,
    reasoning_parser_names,
    register_reasoning_parser,
)

__all__ = ["DeltaMessage", "ReasoningParser", "get_reasoning_parser", "reasoning_parser_names",
           "register_reasoning_parser"]
