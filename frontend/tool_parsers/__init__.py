"""Tool-call parsers: find the calls in a model's output (hermes, llama3_json, mistral,
pythonic), whole or as a stream of OpenAI ``tool_calls`` deltas, with the same answer either
way."""

from __future__ import annotations

from tidal.frontend.tool_parsers.base import ToolCall, ToolParser
from tidal.frontend.tool_parsers.registry import (
    get_tool_parser,
    load_tool_parser_plugin,
    register_tool_parser,
    tool_parser_names,
)

__all__ = ["ToolCall", "ToolParser", "get_tool_parser", "load_tool_parser_plugin",
           "register_tool_parser", "tool_parser_names"]
