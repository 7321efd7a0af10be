"""A Responses API request in chat terms: ``input`` items to chat-template messages, and the
request's ``tools`` / ``tool_choice`` / ``text.format`` / sampling fields to a chat request, so
the chat machinery (tool and reasoning parsers, structured outputs, sampling bounds) serves both
APIs. Errors name the Responses field (``input[2].content[0]``, ``text.format.schema``), also
those the chat checks raise (``rename_params``)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tidal.frontend.server.chat_parsing import MAX_TOOLS
from tidal.frontend.server.errors import APIError, bad_request
from tidal.frontend.server.openai_protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionDefinition,
)
from tidal.frontend.server.responses_output import item_id
from tidal.frontend.server.responses_protocol import ResponsesRequest

MAX_INPUT_ITEMS = 1024
MAX_METADATA = 16  # OpenAI's bounds on metadata
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text"})
_MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
_BUILT_IN = "built-in tools (web search, file search, code interpreter, MCP, ...) are not " \
            "available on this server; only \"function\" tools are"

# Chat field names (as the chat checks raise them) -> the Responses API's.
_RENAMES = (
    (re.compile(r"^max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"^response_format\.json_schema\.schema"), "text.format.schema"),
    (re.compile(r"^response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\."), r"tools[\1]."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^messages"), "input"),
)
_TEXT_RENAMES = (("max_completion_tokens", "max_output_tokens"),
                 ("response_format.json_schema.", "text.format."),
                 ("response_format", "text.format"))


@contextmanager
def rename_params() -> Iterator[None]:
    """400s raised by the chat checks inside, with the Responses API's field names."""
    try:
        yield
    except APIError as err:
        if err.status != 400:
            raise
        if err.param:
            for pattern, repl in _RENAMES:
                err.param = pattern.sub(repl, err.param)
        for old, new in _TEXT_RENAMES:
            err.message = err.message.replace(old, new)
        raise


# --- input ---------------------------------------------------------------------------------------


def input_messages(value: str | list[Any] | None, have_history: bool) -> list[dict[str, Any]]:
    """``input`` as chat-template messages (function calls become the assistant's
    ``tool_calls``, their outputs ``tool`` messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        if have_history:
            return []
        raise bad_request("input is required: a string or a list of input items", "input")
    if len(value) > MAX_INPUT_ITEMS:
        raise bad_request(f"input has {len(value)} items; the limit is {MAX_INPUT_ITEMS}",
                          "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{param} must be an object (an input item)", param)
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, param))
        elif kind == "function_call":
            _function_call(out, item, param)
        elif kind == "function_call_output":
            out.append(_function_call_output(item, param))
        elif kind == "reasoning":
            # Earlier reasoning is not shown to the model again (chat templates drop it too).
            continue
        else:
            raise bad_request(f"input items of type {str(kind)[:40]!r} are not supported; use "
                              "message, function_call, function_call_output or reasoning",
                              f"{param}.type")
    return out


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                   "reasoning": "rs"}
_MAX_ITEM_ID = 256


def input_items(value: str | list[Any] | None) -> list[dict[str, Any]]:
    """``input`` (checked by ``input_messages``) as ``GET /v1/responses/{id}/input_items``
    lists it: each item with its own id or a new one, a status, and a message's string
    content as one text part."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    out = []
    for item in value or []:
        entry = dict(item)
        kind = entry.setdefault("type", "message")
        own = entry.get("id")
        if not (isinstance(own, str) and 0 < len(own) <= _MAX_ITEM_ID):
            entry["id"] = item_id(_ITEM_ID_PREFIX[kind])
        entry.setdefault("status", "completed")
        if kind == "message" and isinstance(entry.get("content"), str):
            entry["content"] = [
                {"type": "output_text", "text": entry["content"], "annotations": []}
                if entry.get("role") == "assistant"
                else {"type": "input_text", "text": entry["content"]}]
        out.append(entry)
    return out


def _string(item: dict[str, Any], key: str, param: str, limit: int = 1 << 20) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{key} must be a string", f"{param}.{key}")
    if len(value) > limit:
        raise bad_request(f"{param}.{key} has {len(value)} characters; the limit is {limit}",
                          f"{param}.{key}")
    return value


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(sorted(_ROLES))}, got "
                          f"{str(role)[:40]!r}", f"{param}.role")
    return {"role": role, "content": _text(item.get("content"), f"{param}.content")}


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{param} must be a string or a list of content parts", param)
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise bad_request(f"content parts of type {kind!r} are not supported; this server "
                              "takes text only", where)
        if kind not in _TEXT_PARTS:
            raise bad_request(f"content parts must be input_text or output_text, got "
                              f"{str(kind)[:40]!r}", where)
        texts.append(_string(part, "text", where))
    return "\n".join(texts)


def _function_call(out: list[dict[str, Any]], item: dict[str, Any], param: str) -> None:
    call_id = _string(item, "call_id", param, 256)
    name = _string(item, "name", param, 64)
    raw = _string(item, "arguments", param)
    try:
        args = json.loads(raw)
    except (ValueError, RecursionError):
        args = None
    if not isinstance(args, dict):
        raise bad_request(f"{param}.arguments must be a JSON object (as a string)",
                          f"{param}.arguments")
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
    last = out[-1] if out else None
    # Parallel calls are one assistant turn; so is a call after the assistant's text.
    if last is not None and last["role"] == "assistant":
        calls = last.setdefault("tool_calls", [])
        if len(calls) >= MAX_TOOLS:
            raise bad_request(f"an assistant turn may carry at most {MAX_TOOLS} function calls",
                              param)
        calls.append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def _function_call_output(item: dict[str, Any], param: str) -> dict[str, Any]:
    call_id = _string(item, "call_id", param, 256)
    output = item.get("output")
    text = output if isinstance(output, str) else _text(output, f"{param}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": text}


# --- the rest of the request ---------------------------------------------------------------------


def tools_of(req: ResponsesRequest) -> tuple[list[ChatTool] | None, list[dict[str, Any]]]:
    """Function tools as chat's, and as the response echoes them."""
    if not req.tools:
        return None, []
    if len(req.tools) > MAX_TOOLS:
        raise bad_request(f"tools has {len(req.tools)} entries; the limit is {MAX_TOOLS}",
                          "tools")
    chat, echo = [], []
    for i, tool in enumerate(req.tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad_request(f"{param} must be an object", param)
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools of type {str(kind)[:40]!r} are not supported: {_BUILT_IN}",
                              f"{param}.type", code="unsupported_field")
        name = _string(tool, "name", param, 64)
        description = tool.get("description")
        parameters = tool.get("parameters")
        strict = tool.get("strict")
        if description is not None and not isinstance(description, str):
            raise bad_request(f"{param}.description must be a string", f"{param}.description")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{param}.parameters must be a JSON schema object",
                              f"{param}.parameters")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{param}.strict must be a boolean", f"{param}.strict")
        chat.append(ChatTool(type="function", function=FunctionDefinition(
            name=name, description=description, parameters=parameters, strict=strict)))
        echo.append({"type": "function", "name": name, "description": description,
                     "parameters": parameters, "strict": strict})
    return chat, echo


def tool_choice_of(value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses' ``tool_choice`` in chat's form (named: ``{"type": "function", "name"}`` ->
    ``{"type": "function", "function": {"name"}}``)."""
    if value is None or isinstance(value, str):
        return value
    if value.get("type") != "function":
        raise bad_request(f"tool_choice of type {str(value.get('type'))[:40]!r} is not "
                          "supported; use \"none\", \"auto\", \"required\" or {\"type\": "
                          "\"function\", \"name\": ...} (only function tools are available)",
                          "tool_choice", code="unsupported_field")
    name = value.get("name")
    if not isinstance(name, str):
        raise bad_request("tool_choice.name must be a string", "tool_choice.name")
    return {"type": "function", "function": {"name": name}}


def response_format_of(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` in chat's ``response_format`` form."""
    if text is None:
        return None
    if text.get("verbosity") is not None:
        raise bad_request("text.verbosity is not supported: the output length follows the "
                          "model and max_output_tokens", "text.verbosity",
                          code="unsupported_field")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object such as {\"type\": \"json_object\"}",
                          "text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        name = fmt.get("name")
        if name is not None and not isinstance(name, str):
            raise bad_request("text.format.name must be a string", "text.format.name")
        return {"type": "json_schema", "json_schema": {
            "name": name, "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got "
                      f"{str(kind)[:40]!r}", "text.format.type")


def check_reasoning(reasoning: dict[str, Any] | None) -> None:
    """Of the reasoning config, only ``effort`` (``chat_parsing.with_reasoning_effort`` takes
    it): this server does not summarize a model's reasoning."""
    for key, value in (reasoning or {}).items():
        if value is not None and key != "effort":
            raise bad_request(f"reasoning.{key[:40]} is not supported: this server does not "
                              "steer or summarize a model's reasoning (with --reasoning-parser "
                              "it is returned as a reasoning item)", f"reasoning.{key[:40]}",
                              code="unsupported_field")


def check_metadata(metadata: dict[str, Any] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA:
        raise bad_request(f"metadata has {len(metadata)} keys; the limit is {MAX_METADATA}",
                          "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise bad_request(f"metadata keys have at most {MAX_METADATA_KEY} characters",
                              "metadata")
        if not isinstance(value, str) or len(value) > MAX_METADATA_VALUE:
            raise bad_request(f"metadata values are strings of at most {MAX_METADATA_VALUE} "
                              "characters", f"metadata.{key}")
    return metadata


OUTPUT_LOGPROBS = "message.output_text.logprobs"


def wants_logprobs(req: ResponsesRequest) -> bool:
    """Whether ``include`` asks for the output's log-probabilities (the one extra this server
    has); ``top_logprobs`` alone is a 400 (it would change nothing)."""
    include = req.include or []
    if len(include) > 16:
        raise bad_request(f"include has {len(include)} entries", "include")
    for i, value in enumerate(include):
        if value != OUTPUT_LOGPROBS:
            raise bad_request(f"include {str(value)[:60]!r} is not available here; only "
                              f"{OUTPUT_LOGPROBS!r} is (no encrypted reasoning, images or "
                              "built-in tool results)", f"include[{i}]",
                              code="unsupported_field")
    wanted = OUTPUT_LOGPROBS in include
    if req.top_logprobs is not None and not wanted:
        raise bad_request(f"top_logprobs needs include: [{OUTPUT_LOGPROBS!r}] (without it no "
                          "log-probabilities are returned)", "top_logprobs")
    return wanted


def chat_request(req: ResponsesRequest, tools: list[ChatTool] | None) -> ChatCompletionRequest:
    """The chat request whose checks (sampling bounds, tools, structured outputs) this
    response goes through."""
    logprobs = wants_logprobs(req)
    return ChatCompletionRequest(
        logprobs=logprobs, top_logprobs=req.top_logprobs if logprobs else None,
        model=req.model, temperature=req.temperature, top_p=req.top_p, stream=req.stream,
        max_completion_tokens=req.max_output_tokens, tools=tools,
        tool_choice=tool_choice_of(req.tool_choice),
        parallel_tool_calls=req.parallel_tool_calls,
        response_format=response_format_of(req.text), user=req.user,
        chat_template_kwargs=req.chat_template_kwargs)
