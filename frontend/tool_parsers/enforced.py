"""Tool calls the grammar enforces: ``tool_choice: "required"`` or a named function, and
``strict`` tools under ``"auto"`` (strict_tags.py: the formats whose calls open with a marker).

The request gets a JSON schema that constrained decoding holds the output to, so the calls
are there whatever the model would have written (as in vLLM, no tool parser and no
``--enable-auto-tool-choice`` are needed):

- named: the output *is* the function's arguments, an object under its ``parameters``;
- required: the output is an array of one or more ``{"name": <a tool's name>, "parameters":
  <that tool's arguments>}`` (``anyOf`` over the tools; at most one item with
  ``parallel_tool_calls: false``).

One incremental scanner reads that output, whole or streamed: a call's first delta (index,
id, type, name) leaves as soon as its name is complete, then its arguments as raw slices of
the output, so the joined deltas equal the whole-output parse however the text was split.

``"auto"`` with strict tools keeps free text and holds each call the model opens to the tools
(a structural tag, strict_tags.py); the server's tool parser reads that output as usual.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tidal.engine_core.sampling_params import SamplingParamError, StructuredOutputsParams
from tidal.engine_core.structured_output.spec import validate
from tidal.frontend.reasoning.base import DeltaMessage, DeltaToolCall
from tidal.frontend.tool_parsers.base import Piece, ScanState, ToolCall, ToolParser
from tidal.frontend.tool_parsers.scanning import string_end

logger = logging.getLogger(__name__)

# A function without parameters takes none: ``{}`` (an open object would let a weak model
# invent keys until max_tokens).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolSpecError(ValueError):
    """A tool definition that cannot be enforced; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def parameters_schema(parameters: dict[str, Any] | None, param: str,
                      compile_schema: bool = True) -> dict[str, Any]:
    """The schema a call's arguments are held to; ToolSpecError unless ``parameters`` is a JSON
    schema of an object (that compiles, with ``compile_schema``)."""
    if parameters is None:
        return NO_PARAMETERS
    kind = parameters.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and kind == ["object"]):
        raise ToolSpecError(param, "must describe a JSON object (\"type\": \"object\"): "
                                   "function arguments are an object")
    schema = dict(parameters, type="object")
    if not compile_schema:
        return schema
    error = _schema_error(json.dumps(schema, ensure_ascii=False, sort_keys=True))
    if error:
        raise ToolSpecError(param, f"is not a valid JSON schema: {error}")
    return schema


def _schema_error(schema_text: str) -> str:
    """Why the schema does not compile ("" when it does). (Clients send the same tools with
    every turn of a conversation: ``validate`` keeps its verdicts.)"""
    try:
        validate(StructuredOutputsParams(json=schema_text))
    except SamplingParamError as exc:
        return str(exc).removeprefix(exc.param).strip().removeprefix(
            "is not a valid JSON schema:").strip()[:1000]
    return ""


@dataclass(slots=True, frozen=True)
class EnforcedTools:
    """What an enforced tool_choice asks of the engine (``spec``) and who reads the output:
    ``EnforcedToolParser`` for "required" / a named function, the server's own tool parser
    (``reader``) for "auto" with strict tools."""

    named: str | None  # the named function; None: "required" (or "auto" with a reader)
    spec: StructuredOutputsParams
    reader: Callable[[], ToolParser] | None = None  # a new parser per output

    def parser(self) -> ToolParser:
        if self.reader is not None:
            return self.reader()
        return EnforcedToolParser(named=self.named)


def enforce_named(name: str, schema: dict[str, Any]) -> EnforcedTools:
    """The output is the arguments of ``name``, under its (checked) ``schema``."""
    return EnforcedTools(name, StructuredOutputsParams(json=schema))


def enforce_required(schemas: dict[str, dict[str, Any]], parallel: bool) -> EnforcedTools:
    """The output is an array of calls of the tools in ``schemas`` (name -> checked
    parameters schema); ToolSpecError (param ``tools``) if the whole does not compile."""
    items = [{"type": "object",
              "properties": {"name": {"const": name}, "parameters": schema},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, schema in schemas.items()]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel:
        array["maxItems"] = 1
    try:
        spec = StructuredOutputsParams(json=array)
        validate(spec)
    except SamplingParamError as exc:
        raise ToolSpecError("tools", "the tools do not make one grammar for tool_choice "
                                     f"\"required\": {str(exc)[:1000]}") from None
    return EnforcedTools(None, spec)


@dataclass(slots=True)
class _CallScan(ScanState):
    """The scan of a required-calls array: ``mode`` is text (not opened yet) | items |
    members | args | after | junk; the current item's name and where its arguments are."""

    name: str | None = None
    call_id: str = ""
    item_start: int = 0  # where the current item opened
    args_start: int = -1  # the arguments value of the current item starts here
    args_end: int = -1  # ... and ends here (-1: not yet)
    args_sent: int = -1  # arguments text before this went out


def _new_id() -> str:
    return ToolCall(name="", arguments="").id  # the id format the other parsers use


def _string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    return i


class EnforcedToolParser(ToolParser):
    """Reads the output of an enforced ``tool_choice``. Anything that is not the expected shape
    (the grammar rules it out; a stop string could cut it) ends the calls: the rest is content
    and counted in ``failures``. An output cut short keeps the calls whose names arrived,
    with the arguments as far as they got (``finish_reason`` says "length")."""

    name = "enforced"

    def __init__(self, tokenizer: Any = None, named: str | None = None) -> None:
        super().__init__(tokenizer)
        self.named = named
        self._calls = _CallScan()

    def extract_tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        st = _CallScan(text=text)
        deltas, content = self._read(st)
        calls: dict[int, ToolCall] = {}
        for d in deltas:
            call = calls.get(d.index)
            if call is None:
                assert d.name is not None and d.id is not None
                call = calls[d.index] = ToolCall(name=d.name, arguments="", id=d.id)
            call.arguments += d.arguments or ""
        self.num_calls_found += len(calls)
        out = list(calls.values())
        return (content or None) if out else content, out

    def extract_tool_calls_streaming(self, delta_text: str) -> DeltaMessage | None:
        self._calls.text += delta_text
        return self._message(*self._read(self._calls))

    def finish_streaming(self) -> DeltaMessage | None:
        # Nothing is held back: every decision was made on text that no later text changes.
        return self._message(*self._read(self._calls))

    def _scan(self, st: ScanState, final: bool) -> list[Piece]:
        raise NotImplementedError("EnforcedToolParser reads with _read")

    def _message(self, deltas: list[DeltaToolCall], content: str) -> DeltaMessage | None:
        self.num_calls_found += sum(1 for d in deltas if d.name is not None)
        merged: list[DeltaToolCall] = []
        for d in deltas:  # one delta per call per piece: its name and arguments together
            if merged and merged[-1].index == d.index:
                merged[-1].arguments = (merged[-1].arguments or "") + (d.arguments or "")
            else:
                merged.append(d)
        if not merged and not content:
            return None
        return DeltaMessage(content=content or None, tool_calls=merged)

    def _read(self, st: _CallScan) -> tuple[list[DeltaToolCall], str]:
        """The news of ``st.text`` past ``st.pos``: call deltas and content."""
        deltas: list[DeltaToolCall] = []
        content: list[str] = []
        if self.named is not None:
            self._named(st, deltas)
        else:
            self._array(st, deltas)
        if st.mode == "junk" and st.pos < len(st.text):
            content.append(st.content.feed(st.text[st.pos:]))
            st.pos = len(st.text)
        return deltas, "".join(content)

    def _named(self, st: _CallScan, deltas: list[DeltaToolCall]) -> None:
        # The whole output is the arguments: nothing to wait for.
        if st.mode != "args":
            st.mode = "args"
            st.call_id = _new_id()
            deltas.append(DeltaToolCall(index=0, id=st.call_id, type="function",
                                        name=self.named, arguments=""))
            st.num_calls = 1
        if st.pos < len(st.text):
            deltas.append(DeltaToolCall(index=0, arguments=st.text[st.pos:]))
            st.pos = len(st.text)

    def _array(self, st: _CallScan, deltas: list[DeltaToolCall]) -> None:
        text = st.text
        while st.mode != "junk":
            if st.mode == "args":
                end = st.bracket_end(st.args_start)
                self._send_args(st, len(text) if end is None else end, deltas)
                if end is None:
                    return
                st.args_end = st.pos = end
                st.mode = "members"
                continue
            i = _skip_ws(text, st.pos)
            if i >= len(text):
                return
            ch = text[i]
            if st.mode == "text":  # ScanState's first mode: the array has not opened
                if ch != "[":
                    return self._junk(st, i)
                st.pos, st.mode = i + 1, "items"
            elif st.mode == "items":
                if ch == ",":
                    st.pos = i + 1
                elif ch == "{":
                    st.pos, st.mode, st.item_start = i + 1, "members", i
                    st.name, st.args_start, st.args_end, st.args_sent = None, -1, -1, -1
                elif ch == "]":
                    st.pos, st.mode = i + 1, "after"
                else:
                    return self._junk(st, i)
            elif st.mode == "members":
                if ch == ",":
                    st.pos = i + 1
                elif ch == "}":
                    if st.name is None:
                        return self._junk(st, i)
                    st.pos, st.mode = i + 1, "items"
                elif ch == "\"":
                    if not self._member(st, i, deltas):
                        return
                else:
                    return self._junk(st, i)
            else:  # "after": only whitespace may follow the array
                return self._junk(st, i)

    def _member(self, st: _CallScan, i: int, deltas: list[DeltaToolCall]) -> bool:
        """Read the member whose key opens at ``i``; False: wait for more text (or it was not
        one of ours: then the scan is junk from ``i``)."""
        text = st.text
        key_end = string_end(text, i)
        if key_end is None:
            return False
        colon = _skip_ws(text, key_end)
        value = _skip_ws(text, colon + 1)
        if colon >= len(text) or value >= len(text):
            return False
        key = _string(text[i:key_end])
        if text[colon] != ":" or key not in ("name", "parameters"):
            self._junk(st, i)
            return False
        if key == "parameters":
            if text[value] != "{" or st.args_start >= 0:
                self._junk(st, i)
                return False
            st.args_start, st.pos, st.mode = value, value, "args"
            return True
        if text[value] != "\"" or st.name is not None:
            self._junk(st, i)
            return False
        value_end = string_end(text, value)
        if value_end is None:
            return False
        name = _string(text[value:value_end])
        if not name:
            self._junk(st, i)
            return False
        st.name = name
        st.call_id = _new_id()
        deltas.append(DeltaToolCall(index=st.num_calls, id=st.call_id, type="function",
                                    name=st.name, arguments=""))
        st.num_calls += 1
        st.pos = value_end
        if st.args_start >= 0:  # the arguments came first: they go out now
            self._send_args(st, st.args_end if st.args_end >= 0 else len(text), deltas)
        return True

    @staticmethod
    def _send_args(st: _CallScan, stop: int, deltas: list[DeltaToolCall]) -> None:
        if st.name is None:
            return  # held until the name is known
        start = max(st.args_sent, st.args_start)
        if stop > start:
            deltas.append(DeltaToolCall(index=st.num_calls - 1, arguments=st.text[start:stop]))
            st.args_sent = stop

    def _junk(self, st: _CallScan, i: int) -> None:
        """The text that did not become calls is content: all of it when no call was read,
        else from the item that failed (from ``i`` if its call already went out)."""
        self.failures += 1
        logger.debug("enforced tool calls: unexpected text at %d of %d characters; kept as "
                     "content", i, len(st.text))
        if st.num_calls == 0:
            i = 0
        elif st.mode == "members" and st.name is None:
            i = st.item_start
        st.pos, st.mode = i, "junk"
