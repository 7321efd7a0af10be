"""What a chat request's output goes through after generation: the server's reasoning parser
(``--reasoning-parser``) and, for ``tools`` with ``tool_choice: "auto"``, its tool-call parser
(``--tool-call-parser`` with ``--enable-auto-tool-choice``), or for ``tool_choice``
``"required"`` / a named function the reader of the calls the grammar enforced
(``tool_parsers/enforced.py``; ``strict`` tools under "auto" get a grammar too); plus the checks of ``tools``, ``tool_choice`` and
``chat_template_kwargs`` (400s naming the field, before the engine)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.frontend.reasoning import DeltaMessage, ReasoningParser, get_reasoning_parser
from tidal.frontend.reasoning.base import DeltaToolCall
from tidal.frontend.server.errors import bad_request
from tidal.frontend.server.openai_protocol import ChatCompletionRequest, ChatTool
from tidal.frontend.server.structured import requested_forms
from tidal.frontend.tool_parsers import (
    ToolCall,
    ToolParser,
    get_tool_parser,
    load_tool_parser_plugin,
)
from tidal.frontend.tool_parsers.enforced import (
    EnforcedTools,
    ToolSpecError,
    enforce_named,
    enforce_required,
    parameters_schema,
)
from tidal.frontend.tool_parsers.strict_tags import (
    enforce_strict_auto,
    strict_auto_formats,
    supports_strict_auto,
)

logger = logging.getLogger(__name__)

MAX_TOOLS = 128
MAX_TEMPLATE_KWARGS = 32
# Arguments the server itself gives the template (or the tokenizer's call): a request must not
# replace them through chat_template_kwargs.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens",
})


@dataclass(slots=True, frozen=True)
class ChatParsers:
    """The server's parser classes, resolved once per process from its flags."""

    reasoning: type[ReasoningParser] | None = None
    tools: type[ToolParser] | None = None  # None unless --enable-auto-tool-choice


def resolve_parsers(reasoning_parser: str | None, tool_call_parser: str | None,
                    enable_auto_tool_choice: bool, tool_parser_plugin: str | None = None
                    ) -> ChatParsers:
    """Raises ValueError for an unknown name, a plugin that does not load, or a tool parser
    without --enable-auto-tool-choice (and the other way round)."""
    if tool_parser_plugin:
        load_tool_parser_plugin(tool_parser_plugin)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    if tool_call_parser and not enable_auto_tool_choice:
        raise ValueError("--tool-call-parser needs --enable-auto-tool-choice (as in vLLM)")
    parsers = ChatParsers(
        reasoning=get_reasoning_parser(reasoning_parser) if reasoning_parser else None,
        tools=get_tool_parser(tool_call_parser) if tool_call_parser else None)
    if reasoning_parser or tool_call_parser:
        logger.info("chat output parsers: reasoning %s, tool calls %s", reasoning_parser,
                    tool_call_parser)
    return parsers


@dataclass(slots=True, frozen=True)
class ChatTools:
    tools: list[dict[str, Any]] | None  # for the chat template
    parse: bool  # parse the output for calls ("auto", "required" or a named function)
    # "required" / a named function, or "auto" with strict tools: the grammar the output is
    # held to (pass ``enforced.spec`` to chat_params) and its reader (new_output_parse).
    enforced: EnforcedTools | None = None


def check_tools(req: ChatCompletionRequest, parsers: ChatParsers) -> ChatTools:
    choice = req.tool_choice
    named = _named_choice(choice) if isinstance(choice, dict) else None
    if named is None and choice not in (None, "none", "auto", "required"):
        raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or a named "
                          f"function, got {str(choice)[:40]!r}", "tool_choice")
    enforce = named is not None or choice == "required"
    if not req.tools:
        if choice == "auto" or enforce:
            raise bad_request(f"tool_choice {_choice_text(choice)} needs tools", "tool_choice")
        return ChatTools(None, False)
    if len(req.tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(req.tools)} entries; the limit is {MAX_TOOLS}",
                          "tools")
    if enforce and parsers.reasoning is not None and parsers.reasoning.name == "gpt_oss":
        raise bad_request(f"tool_choice {_choice_text(choice)} is enforced by a grammar on the "
                          "final channel, while gpt-oss calls tools on its commentary channel; "
                          "use \"auto\" with --tool-call-parser openai", "tool_choice",
                          code="unsupported_field")
    # A schema is compiled only where a grammar will hold the arguments to it (an enforced
    # choice, a strict tool): elsewhere it only reaches the template, and a valid schema the
    # grammar backends cannot enforce (uniqueItems, ...) must not be refused.
    checked = [_tool(t, i, enforce or (choice != "none" and bool(t.function.strict)))
               for i, t in enumerate(req.tools)]
    tools = [t for t, _ in checked]
    if choice == "none":  # no call is made: strict or not changes nothing
        return ChatTools(tools, False)
    if enforce:
        return ChatTools(tools, True, _enforced(req, named, checked))
    strict = next((i for i, t in enumerate(req.tools) if t.function.strict), None)
    if strict is not None and not supports_strict_auto(parsers.tools):
        raise bad_request("strict: true with tool_choice \"auto\" is enforced (by a structural "
                          "tag: the grammar applies inside each call) for the tool-call "
                          "formats whose calls open with a marker "
                          f"({', '.join(strict_auto_formats())}) only; this server "
                          + (f"parses {parsers.tools.name}" if parsers.tools is not None
                             else "has no --tool-call-parser")
                          + ". Use tool_choice \"required\" or a named function to enforce "
                          "the schema, or leave strict out", f"tools[{strict}].function.strict",
                          code="unsupported_field")
    if strict is not None:
        return ChatTools(tools, True, _strict_auto(req, strict, checked, parsers))
    if parsers.tools is None:  # "auto", given or (tools present) by default
        raise bad_request("tool_choice \"auto\" (the default when tools are given) needs the "
                          "server started with --enable-auto-tool-choice and "
                          "--tool-call-parser; send tool_choice \"none\" to show the tools to "
                          "the model without parsing calls, or \"required\" / a named "
                          "function to have the grammar enforce a call",
                          "tool_choice" if choice else "tools", code="unsupported_field")
    return ChatTools(tools, True)


def _named_choice(choice: dict[str, Any]) -> str:
    """The function a ``{"type": "function", "function": {"name": ...}}`` tool_choice names."""
    if choice.get("type") != "function":
        raise bad_request("a tool_choice object must be {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", "tool_choice.type")
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice.function.name must name one of the tools",
                          "tool_choice.function.name")
    return name


def _choice_text(choice: Any) -> str:
    return "naming a function" if isinstance(choice, dict) else f"\"{choice}\""


def _enforced(req: ChatCompletionRequest, named: str | None,
              checked: list[tuple[dict[str, Any], dict[str, Any]]]) -> EnforcedTools:
    """The grammar of a required / named tool_choice (no tool parser needed: as in vLLM)."""
    forms = requested_forms(req)
    if forms:
        raise bad_request(f"tool_choice {_choice_text(req.tool_choice)} sets the output's "
                          f"grammar itself: it cannot be combined with {forms[0]}",
                          "tool_choice")
    schemas = _schemas(checked)
    if named is not None:
        if named not in schemas:
            raise bad_request(f"tool_choice names {named[:64]!r}, which is not one of the tools",
                              "tool_choice.function.name")
        return enforce_named(named, schemas[named])
    try:
        return enforce_required(schemas, req.parallel_tool_calls is not False)
    except ToolSpecError as exc:
        raise bad_request(exc.message, exc.param) from None


def _strict_auto(req: ChatCompletionRequest, strict: int,
                 checked: list[tuple[dict[str, Any], dict[str, Any]]],
                 parsers: ChatParsers) -> EnforcedTools:
    """tool_choice "auto" with strict tools (hermes, llama3_json or mistral server): free
    text, calls enforced."""
    assert parsers.tools is not None
    forms = requested_forms(req)
    if forms:
        raise bad_request(f"strict tools set the output's grammar themselves: they cannot be "
                          f"combined with {forms[0]}", f"tools[{strict}].function.strict")
    schemas = _schemas(checked)
    names = {t.function.name for t in req.tools or () if t.function.strict}
    try:
        return enforce_strict_auto(schemas, names, parsers.tools)
    except ToolSpecError as exc:
        raise bad_request(exc.message, exc.param) from None


def _schemas(checked: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Tool name -> arguments schema; a name given twice is a 400 (a grammar needs to know
    which tool a call is of)."""
    schemas: dict[str, dict[str, Any]] = {}
    for i, (tool, schema) in enumerate(checked):
        name = tool["function"]["name"]
        if name in schemas:
            raise bad_request(f"two tools are named {name[:64]!r}",
                              f"tools[{i}].function.name")
        schemas[name] = schema
    return schemas


def _tool(tool: ChatTool, i: int, compile_schema: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the tool as the chat template takes it, the schema of its arguments); with
    ``compile_schema``, a parameters schema the grammar cannot compile is a 400."""
    if tool.type != "function":
        raise bad_request(f"tools of type {tool.type[:40]!r} are not supported; use "
                          "\"function\"", f"tools[{i}].type")
    fn = tool.function
    if not fn.name or len(fn.name) > 64:
        raise bad_request("a function name must have 1 to 64 characters",
                          f"tools[{i}].function.name")
    try:
        schema = parameters_schema(fn.parameters, f"tools[{i}].function.parameters",
                                   compile_schema)
    except ToolSpecError as exc:
        raise bad_request(f"{exc.param} {exc.message}", exc.param) from None
    out: dict[str, Any] = {"name": fn.name}
    if fn.description is not None:
        out["description"] = fn.description
    if fn.parameters is not None:
        out["parameters"] = fn.parameters
    return {"type": "function", "function": out}, schema


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    kwargs = req.chat_template_kwargs or {}
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise bad_request(f"chat_template_kwargs has {len(kwargs)} entries; the limit is "
                          f"{MAX_TEMPLATE_KWARGS}", "chat_template_kwargs")
    for key in kwargs:
        if key in _RESERVED_KWARGS or not key.isidentifier():
            raise bad_request(f"chat_template_kwargs cannot set {key[:40]!r}"
                              + (" (the request's own field sets it)"
                                 if key in _RESERVED_KWARGS else ""), "chat_template_kwargs")
    return dict(kwargs)


REASONING_EFFORTS = ("low", "medium", "high")


def with_reasoning_effort(kwargs: dict[str, Any], effort: str | None, param: str,
                          read: Callable[[], bool]) -> dict[str, Any]:
    """``kwargs`` (the chat template's variables) with the request's own reasoning effort
    (chat's ``reasoning_effort``, the Responses API's ``reasoning.effort``) as the variable
    ``reasoning_effort``, which gpt-oss's template and tidal's harmony renderer read. ``read()``:
    whether this server's prompt renderer reads it (``serving_chat.reads_reasoning_effort``);
    where it does not, the effort would change nothing, so it is a 400 rather than ignored."""
    if effort is None:
        return kwargs
    if effort not in REASONING_EFFORTS:
        raise bad_request(f"{param} must be one of {', '.join(REASONING_EFFORTS)}, got "
                          f"{str(effort)[:20]!r}", param)
    if not read():
        raise bad_request(f"{param} would change nothing here: this model's chat template "
                          "does not read a reasoning effort (the variable reasoning_effort, "
                          "as gpt-oss's does); leave it out", param, code="unsupported_field")
    other = kwargs.get("reasoning_effort")
    if other is not None and other != effort:
        raise bad_request(f"{param} {effort!r} and chat_template_kwargs.reasoning_effort "
                          f"{str(other)[:20]!r} disagree; give one", param)
    return {**kwargs, "reasoning_effort": effort}


def template_tool_calls(calls: list[Any], param: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments decoded (the
    templates serialize them again)."""
    if len(calls) > MAX_TOOLS:
        raise bad_request(f"a message may carry at most {MAX_TOOLS} tool calls", param)
    out = []
    for j, call in enumerate(calls):
        if call.type != "function":
            raise bad_request(f"tool calls of type {call.type[:40]!r} are not supported; use "
                              "\"function\"", f"{param}[{j}].type")
        try:
            args = json.loads(call.function.arguments)
        except (ValueError, RecursionError):  # the body's depth check does not see inside
            args = None
        if not isinstance(args, dict):
            raise bad_request("function.arguments must be a JSON object (as a string)",
                              f"{param}[{j}].function.arguments")
        out.append({"id": call.id, "type": call.type,
                    "function": {"name": call.function.name, "arguments": args}})
    return out


@dataclass(slots=True)
class ParsedMessage:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


@dataclass(slots=True)
class OutputParse:
    """One choice's parsers: reasoning first, then tool calls in what is left."""

    reasoning: ReasoningParser | None
    tools: ToolParser | None
    include_reasoning: bool = True  # false: parsed out, then dropped
    one_call: bool = False  # parallel_tool_calls false: calls after the first are dropped

    @property
    def failures(self) -> int:
        return 0 if self.tools is None else self.tools.failures

    def whole(self, text: str) -> ParsedMessage:
        reasoning, content = None, text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text)
            reasoning = reasoning if self.include_reasoning else None
        if self.tools is None:
            return ParsedMessage(reasoning, content)
        body, calls = self.tools.extract_tool_calls(content or "")
        return ParsedMessage(reasoning, body, calls[:1] if self.one_call else calls)

    def delta(self, text: str, final: bool) -> DeltaMessage | None:
        """The news of ``text``; ``final``: the output ended, so flush what was held."""
        if self.reasoning is None:
            steps: list[DeltaMessage | None] = [DeltaMessage(content=text)]
        else:
            steps = [self.reasoning.extract_delta(text)]
            if final:
                steps.append(self.reasoning.finish())
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        for msg in steps:
            if msg is None:
                continue
            reasoning.append(msg.reasoning_content or "")
            if self.tools is None:
                content.append(msg.content or "")
            elif msg.content:
                self._take(self.tools.extract_tool_calls_streaming(msg.content), content, calls)
        if final and self.tools is not None:
            self._take(self.tools.finish_streaming(), content, calls)
        if not self.include_reasoning:
            reasoning.clear()
        if self.one_call:
            calls = [c for c in calls if c.index == 0]
        out = DeltaMessage(reasoning_content="".join(reasoning) or None,
                           content="".join(content) or None, tool_calls=calls)
        return None if out.is_empty() else out

    @staticmethod
    def _take(msg: DeltaMessage | None, content: list[str], calls: list[DeltaToolCall]) -> None:
        if msg is not None:
            content.append(msg.content or "")
            calls.extend(msg.tool_calls)


_RESOLVED: dict[tuple[Any, ...], ChatParsers] = {}


def reads_special_tokens(parsers: ChatParsers, tools: ChatTools) -> bool:
    """Whether this request's output goes to a parser whose markers are special tokens: the
    reasoning parser (always), the tool parser (when it parses the output: "auto")."""
    if parsers.reasoning is not None and parsers.reasoning.needs_special_tokens:
        return True
    return (tools.parse and tools.enforced is None and parsers.tools is not None
            and parsers.tools.needs_special_tokens)


def server_parsers(reasoning_parser: str | None, tool_call_parser: str | None,
                   enable_auto_tool_choice: bool, tool_parser_plugin: str | None) -> ChatParsers:
    """``resolve_parsers``, once per process (the CLI checked the flags at start-up)."""
    key = (reasoning_parser, tool_call_parser, enable_auto_tool_choice, tool_parser_plugin)
    parsers = _RESOLVED.get(key)
    if parsers is None:
        parsers = _RESOLVED[key] = resolve_parsers(*key)
    return parsers


def new_output_parse(parsers: ChatParsers, parse_tools: bool, include_reasoning: bool = True,
                     parallel_tool_calls: bool | None = None,
                     enforced: EnforcedTools | None = None) -> OutputParse | None:
    """One choice's parsers; with ``enforced`` (``ChatTools.enforced``) its reader takes the
    place of the server's tool parser."""
    if enforced is not None:
        tools: ToolParser | None = enforced.parser()
    else:
        tools = parsers.tools() if parse_tools and parsers.tools is not None else None
    reasoning = parsers.reasoning() if parsers.reasoning is not None else None
    if tools is None and reasoning is None:
        return None
    return OutputParse(reasoning, tools, include_reasoning, parallel_tool_calls is False)
