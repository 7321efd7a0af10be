"""Tool parsers by name (``--tool-call-parser NAME``); plugins add theirs with
``register_tool_parser``, from a package or a file given as ``--tool-parser-plugin PATH``."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

from tidal.frontend.tool_parsers.base import ToolParser
from tidal.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.frontend.tool_parsers.marked import HermesToolParser, MistralToolParser
from tidal.frontend.tool_parsers.openai import OpenAIToolParser
from tidal.frontend.tool_parsers.pythonic import PythonicToolParser

logger = logging.getLogger(__name__)

_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                              PythonicToolParser, OpenAIToolParser)
}


def register_tool_parser(name: str, cls: type[ToolParser]) -> None:
    if not issubclass(cls, ToolParser):
        raise TypeError(f"{cls!r} is not a ToolParser")
    _PARSERS[name] = cls


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> type[ToolParser]:
    cls = _PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of "
                         f"{', '.join(tool_parser_names())} (or add one with "
                         "--tool-parser-plugin)")
    return cls


def load_tool_parser_plugin(path: str) -> None:
    """Run the Python file at ``path`` once per process; it registers its parsers. Raises
    ValueError when it cannot be loaded."""
    module_name = f"tidal_tool_parser_plugin_{abs(hash(os.path.abspath(path)))}"
    if module_name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None or not os.path.isfile(path):
        raise ValueError(f"cannot load the tool parser plugin {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ValueError(f"the tool parser plugin {path!r} failed to load: {exc}") from exc
    logger.info("loaded the tool parser plugin %s", path)
