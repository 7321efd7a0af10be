"""``strict`` tools under ``tool_choice: "auto"``: the output stays free text, but every call
the model opens is held to the tools by a structural tag (spec.py): a trigger, the marker
a call of the server's format begins with, starts a section that must be a call of one of the
tools with arguments valid under the strict tool's schema (any object for the others).

Only formats whose calls begin with a marker can be held this way:

- hermes (Qwen): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, triggered
  by ``<tool_call>``;
- llama3_json: ``{"name": "f", "parameters": {...}}``, triggered by ``{"name": `` or by
  ``<|python_tag|>`` (then the call follows it); the reader takes only calls opening exactly
  so (what the grammar held), any other object is content;
- mistral: ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``, triggered by
  ``[TOOL_CALLS]``.

pythonic calls open with a bare ``[`` and gpt-oss harmony calls with a header whose parts
come in several orders: no marker to trigger on, so strict tools there are a 400 naming
``strict``. Markers that are special tokens (Qwen's ``<tool_call>``, ``<|python_tag|>``,
``[TOOL_CALLS]``) match as the token too on either backend (spec.structural_tag_lark).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from tidal.engine_core.sampling_params import SamplingParamError
from tidal.engine_core.structured_output.spec import (
    TagStructure,
    structural_tag_params,
    validate,
)
from tidal.frontend.tool_parsers.base import ToolParser
from tidal.frontend.tool_parsers.enforced import EnforcedTools, ToolSpecError
from tidal.frontend.tool_parsers.llama3_json import PYTHON_TAG, Llama3JsonToolParser
from tidal.frontend.tool_parsers.marked import HermesToolParser, MistralToolParser

# Hermes / Qwen calls exactly as their chat templates show them.
HERMES_TRIGGER = "<tool_call>"
HERMES_BEGIN = "<tool_call>\n{\"name\": %s, \"arguments\": "
HERMES_END = "}\n</tool_call>"
# Llama 3.1's template writes a call as {"name": ..., "parameters": ...}.
LLAMA3_TRIGGER = "{\"name\": "
LLAMA3_BEGIN = "{\"name\": %s, \"parameters\": "
MISTRAL_TRIGGER = "[TOOL_CALLS]"

_ANY_OBJECT: dict[str, Any] = {"type": "object"}

# What the builders return: the tag's structures and triggers, and who reads the output.
_Tag = tuple[list[TagStructure], list[str], Callable[[], ToolParser]]


def _hermes(schemas: dict[str, dict[str, Any]], reader: type[ToolParser]) -> _Tag:
    structures = [TagStructure(HERMES_BEGIN % json.dumps(name, ensure_ascii=False), schema,
                               HERMES_END) for name, schema in schemas.items()]
    return structures, [HERMES_TRIGGER], reader


def _llama3(schemas: dict[str, dict[str, Any]], reader: type[ToolParser]) -> _Tag:
    begins = tuple(LLAMA3_BEGIN % json.dumps(name, ensure_ascii=False) for name in schemas)
    structures = []
    for begin, schema in zip(begins, schemas.values(), strict=True):
        structures.append(TagStructure(begin, schema, "}"))
        structures.append(TagStructure(PYTHON_TAG + begin, schema, "}"))
    return structures, [LLAMA3_TRIGGER, PYTHON_TAG], functools.partial(reader,
                                                                       call_begins=begins)


def _mistral(schemas: dict[str, dict[str, Any]], reader: type[ToolParser]) -> _Tag:
    items = [{"type": "object",
              "properties": {"name": {"const": name}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, schema in schemas.items()]
    calls = {"type": "array", "minItems": 1,
             "items": items[0] if len(items) == 1 else {"anyOf": items}}
    # v0.3's template writes "[TOOL_CALLS] [", later ones "[TOOL_CALLS][": either is taken.
    structures = [TagStructure(MISTRAL_TRIGGER, calls, ""),
                  TagStructure(MISTRAL_TRIGGER + " ", calls, "")]
    return structures, [MISTRAL_TRIGGER], reader


# Most specific first: a plugin's subclass of a format gets that format's tag.
_FORMATS: tuple[tuple[type[ToolParser], Callable[..., _Tag]], ...] = (
    (HermesToolParser, _hermes), (Llama3JsonToolParser, _llama3),
    (MistralToolParser, _mistral))


def strict_auto_formats() -> list[str]:
    return [cls.name for cls, _ in _FORMATS]


def supports_strict_auto(reader: type[ToolParser] | None) -> bool:
    return reader is not None and any(issubclass(reader, cls) for cls, _ in _FORMATS)


def enforce_strict_auto(schemas: dict[str, dict[str, Any]], strict: set[str],
                        reader: type[ToolParser]) -> EnforcedTools:
    """The structural tag of ``reader``'s format over the tools in ``schemas`` (name ->
    checked parameters schema); the tools named in ``strict`` are held to their schema.
    ToolSpecError (param ``tools``) if the whole does not compile."""
    build = next(b for cls, b in _FORMATS if issubclass(reader, cls))
    held = {name: schema if name in strict else _ANY_OBJECT for name, schema in schemas.items()}
    structures, triggers, make_reader = build(held, reader)
    try:
        spec = structural_tag_params(structures, triggers)
        validate(spec)
    except SamplingParamError as exc:
        raise ToolSpecError("tools", "the strict tools do not make one grammar for "
                                     f"tool_choice \"auto\": {str(exc)[:1000]}") from None
    return EnforcedTools(None, spec, make_reader)
