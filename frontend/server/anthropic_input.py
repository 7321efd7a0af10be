"""An Anthropic Messages request as the chat-completion request that asks the engine for the
same thing (``to_chat_request``): content blocks to chat messages (tool_use to assistant
``tool_calls``, tool_result to ``tool`` messages), tools and tool_choice to chat's, thinking to
the reasoning parser's output and the engine's thinking budget, output_config.format to
``response_format``. Chat's own checks then run on it (``checked_tools``, ``sampling_params``),
their 400s worded in this API's terms.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.server.anthropic_protocol import (
    CountTokensRequest,
    InputBlock,
    MessagesRequest,
)
from tidal.frontend.server.chat_parsing import (
    MAX_TOOLS,
    ChatParsers,
    ChatTools,
    check_tools,
    reads_special_tokens,
    server_parsers,
)
from tidal.frontend.server.errors import APIError, bad_request
from tidal.frontend.server.openai_protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    MessageToolCall,
)
from tidal.frontend.server.sampling import chat_params, with_thinking_budget
from tidal.frontend.server.serving_chat import MAX_MESSAGES
from tidal.frontend.server.state import ServerState

MAX_BLOCKS = 1024  # content blocks in one message (or in system, or in one tool result)

# Declared request fields this server cannot honour; each would change the result.
UNSUPPORTED = {
    "container": "code execution containers are not supported",
    "mcp_servers": "MCP server connectors are not supported",
    "context_management": "context management (clearing earlier tool results or thinking) is "
                          "not supported",
}
_TEXT_ONLY = "this server takes text only"


@dataclass(slots=True, frozen=True)
class _Thinking:
    show: bool  # thinking blocks in the output
    template_kwargs: dict[str, Any]
    budget: int | None = None  # budget_tokens: the engine ends the thinking after this many


def _thinking(req: CountTokensRequest, parsers: ChatParsers) -> _Thinking:
    """thinking -> whether the reasoning parser's output becomes thinking blocks, and the
    template switch (``enable_thinking``) that templates of thinking models read."""
    t = req.thinking
    if t is None:
        # No thinking blocks unless asked for; a thinking model's reasoning is parsed out.
        return _Thinking(False, {})
    if t.type == "disabled":
        return _Thinking(False, {"enable_thinking": False})
    if t.type not in ("enabled", "adaptive"):
        raise bad_request(f"must be \"enabled\", \"adaptive\" or \"disabled\", got "
                          f"{t.type[:40]!r}", "thinking.type")
    if parsers.reasoning is None:
        raise bad_request("thinking needs a reasoning model served with --reasoning-parser "
                          "(its thinking becomes thinking blocks); this server has none",
                          "thinking", code="unsupported_field")
    if t.display not in (None, "summarized"):
        raise bad_request("only the full thinking is returned here (display \"summarized\" "
                          "or unset)", "thinking.display", code="unsupported_field")
    if t.type == "enabled":
        # Anthropic's floor of 1,024 is for its models; small local models think less.
        if t.budget_tokens is None or t.budget_tokens < 1:
            raise bad_request("type \"enabled\" needs budget_tokens >= 1",
                              "thinking.budget_tokens")
        max_tokens = getattr(req, "max_tokens", None)
        if max_tokens is not None and t.budget_tokens >= max_tokens:
            raise bad_request(f"budget_tokens ({t.budget_tokens}) must be less than max_tokens "
                              f"({max_tokens}): the thinking counts toward it",
                              "thinking.budget_tokens")
        return _Thinking(True, {"enable_thinking": True}, t.budget_tokens)
    if t.budget_tokens is not None:
        raise bad_request("budget_tokens goes with type \"enabled\"", "thinking.budget_tokens")
    return _Thinking(True, {"enable_thinking": True})


def _text_of(blocks: str | list[InputBlock], param: str) -> str:
    """Text blocks (or a string) as one text; any other block type is a 400."""
    if isinstance(blocks, str):
        return blocks
    _check_count(blocks, param)
    texts = []
    for j, b in enumerate(blocks):
        if b.type != "text" or b.text is None:
            raise _block_error(b, f"{param}[{j}]", "text blocks")
        texts.append(b.text)
    return "\n".join(texts)


def _check_count(blocks: list[InputBlock], param: str) -> None:
    if len(blocks) > MAX_BLOCKS:
        raise bad_request(f"has {len(blocks)} content blocks; the limit is {MAX_BLOCKS}", param)


def _block_error(block: InputBlock, param: str, allowed: str) -> APIError:
    kind = block.type[:40]
    if kind in ("image", "document", "search_result", "container_upload"):
        return bad_request(f"{kind} blocks are not supported: {_TEXT_ONLY}", param,
                           code="unsupported_field")
    return bad_request(f"blocks of type {kind!r} are not allowed here; use {allowed}", param)


def _user_messages(content: str | list[InputBlock], param: str,
                   tool_names: dict[str, str]) -> list[ChatMessage]:
    """A user turn: its text, and each tool_result as a chat "tool" message, in order."""
    if isinstance(content, str):
        return [ChatMessage(role="user", content=content)]
    _check_count(content, param)
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, b in enumerate(content):
        where = f"{param}[{j}]"
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_result":
            if texts:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            if not b.tool_use_id:
                raise bad_request("tool_result needs the tool_use_id it answers",
                                  f"{where}.tool_use_id")
            result = "" if b.content is None else _text_of(b.content, f"{where}.content")
            if b.is_error:
                # Chat templates have no error flag: the model reads it in the result.
                result = f"Error: {result}"
            out.append(ChatMessage(role="tool", content=result, tool_call_id=b.tool_use_id,
                                   name=tool_names.get(b.tool_use_id)))
        else:
            raise _block_error(b, where, "text or tool_result blocks")
    if texts or not out:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _assistant_message(content: str | list[InputBlock], param: str,
                       tool_names: dict[str, str]) -> ChatMessage:
    """An assistant turn: its text and tool_use blocks; thinking blocks of earlier turns are
    dropped, as Anthropic drops them from the context."""
    if isinstance(content, str):
        return ChatMessage(role="assistant", content=content)
    _check_count(content, param)
    texts: list[str] = []
    calls: list[MessageToolCall] = []
    for j, b in enumerate(content):
        where = f"{param}[{j}]"
        if b.type == "text" and b.text is not None:
            texts.append(b.text)
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise bad_request("tool_use needs an id and a name", where)
            if not isinstance(b.input, dict):
                raise bad_request("tool_use input must be an object", f"{where}.input")
            tool_names[b.id] = b.name
            calls.append(MessageToolCall(id=b.id, function=FunctionCall(
                b.name, json.dumps(b.input, ensure_ascii=False))))
        elif b.type not in ("thinking", "redacted_thinking"):
            raise _block_error(b, where, "text, tool_use or thinking blocks")
    return ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)


def _chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    if not req.messages:
        raise bad_request("must hold at least one message", "messages")
    if len(req.messages) > MAX_MESSAGES:
        raise bad_request(f"has {len(req.messages)} messages; the limit is {MAX_MESSAGES}",
                          "messages")
    out: list[ChatMessage] = []
    if req.system is not None:
        system = _text_of(req.system, "system")
        if system:
            out.append(ChatMessage(role="system", content=system))
    tool_names: dict[str, str] = {}
    for i, m in enumerate(req.messages):
        where = f"messages[{i}].content"
        if m.role == "user":
            out.extend(_user_messages(m.content, where, tool_names))
        elif m.role == "assistant":
            out.append(_assistant_message(m.content, where, tool_names))
        else:
            raise bad_request(f"must be \"user\" or \"assistant\", got {m.role[:40]!r} (the "
                              "system prompt is the top-level system field)",
                              f"messages[{i}].role")
    if out[-1].role == "assistant" and out[-1].tool_calls:
        raise bad_request("the last message may be an assistant prefill of text, not a "
                          "tool_use", f"messages[{len(req.messages) - 1}].content")
    return out


def _tools(req: CountTokensRequest) -> list[ChatTool] | None:
    if req.tools is None:
        return None
    if len(req.tools) > MAX_TOOLS:
        raise bad_request(f"has {len(req.tools)} tools; the limit is {MAX_TOOLS}", "tools")
    out = []
    for i, t in enumerate(req.tools):
        if t.type not in (None, "custom"):
            raise bad_request(f"server tools ({t.type[:60]!r}) are not supported; give client "
                              "tools (name, description, input_schema)", f"tools[{i}].type",
                              code="unsupported_field")
        if t.input_schema is None:
            raise bad_request("is required", f"tools[{i}].input_schema")
        out.append(ChatTool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.input_schema,
            strict=t.strict)))
    return out


def _tool_choice(req: CountTokensRequest) -> tuple[str | dict[str, Any] | None, bool | None]:
    """tool_choice -> chat's tool_choice and parallel_tool_calls."""
    tc = req.tool_choice
    if tc is None:
        return None, None
    parallel = False if tc.disable_parallel_tool_use else None
    if tc.type in ("auto", "none"):
        return tc.type, parallel
    if tc.type == "any":
        return "required", parallel
    if tc.type == "tool":
        if not tc.name:
            raise bad_request("tool_choice of type \"tool\" needs the tool's name",
                              "tool_choice.name")
        return {"type": "function", "function": {"name": tc.name}}, parallel
    raise bad_request(f"must be \"auto\", \"any\", \"tool\" or \"none\", got {tc.type[:40]!r}",
                      "tool_choice.type")


def _response_format(req: CountTokensRequest) -> dict[str, Any] | None:
    """output_config.format (a JSON schema the text must follow) as chat's response_format."""
    config = req.output_config
    if config is None:
        return None
    fmt = config.format
    if fmt is None:
        return None
    if fmt.type != "json_schema":
        raise bad_request(f"must be \"json_schema\", got {fmt.type[:40]!r}",
                          "output_config.format.type")
    if fmt.schema is None:
        raise bad_request("is required", "output_config.format.schema")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}}


# Chat's words for what this request called otherwise, in the 400s of chat's checks.
_TERMS = [(re.compile(p), r) for p, r in (
    (r"response_format\.json_schema\.schema", "output_config.format.schema"),
    (r"response_format", "output_config.format"),
    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"tool_choice naming a function", "tool_choice {\"type\": \"tool\"}"),
    (r"\"required\" / a named function", "{\"type\": \"any\"} / {\"type\": \"tool\"}"),
    (r"tool_choice \"required\"", "tool_choice {\"type\": \"any\"}"),
    (r"tool_choice \"(auto|none)\"", "tool_choice {\"type\": \"\\1\"}"),
    (r"parallel_tool_calls", "disable_parallel_tool_use"),
)]


@contextmanager
def _anthropic_terms() -> Iterator[None]:
    try:
        yield
    except APIError as err:
        if err.status != 400:
            raise
        message, param = err.message, err.param
        for pattern, repl in _TERMS:
            message = pattern.sub(repl, message)
            param = pattern.sub(repl, param) if param else param
        raise APIError(400, message, param=param, code=err.code) from None


def sampling_params(chat: ChatCompletionRequest, state: ServerState, tools: ChatTools
              ) -> SamplingParams:
    """chat's sampling params; tool_choice any / tool: with the grammar of the call."""
    cfg = state.settings
    parsers = server_parsers(cfg.reasoning_parser, cfg.tool_call_parser,
                             cfg.enable_auto_tool_choice, cfg.tool_parser_plugin)
    with _anthropic_terms():
        params = chat_params(chat, state.limits,
                             tools.enforced.spec if tools.enforced is not None else None,
                             reads_special_tokens(parsers, tools))
    return with_thinking_budget(params, chat.thinking_token_budget, "thinking.budget_tokens",
                                state.settings.reasoning_parser)


def checked_tools(chat: ChatCompletionRequest, parsers: ChatParsers) -> ChatTools:
    with _anthropic_terms():
        return check_tools(chat, parsers)


def check_stop_sequences(stops: list[str] | None, state: ServerState) -> None:
    """Named as Anthropic names them (chat_params checks them again as "stop")."""
    limits = state.limits
    if stops is None:
        return
    if len(stops) > limits.max_stop_strings:
        raise bad_request(f"at most {limits.max_stop_strings} stop sequences, got {len(stops)}",
                          "stop_sequences")
    for s in stops:
        if not s or len(s) > limits.max_stop_string_chars:
            raise bad_request(f"each stop sequence must have 1 to "
                              f"{limits.max_stop_string_chars} characters", "stop_sequences")


def to_chat_request(req: CountTokensRequest, parsers: ChatParsers,
                    for_count: bool = False) -> ChatCompletionRequest:
    """The chat-completion request that asks the engine for what ``req`` asks for.
    ``for_count``: only the prompt matters (count_tokens), so tools are shown to the template
    without asking for the server's tool parser."""
    for name, reason in UNSUPPORTED.items():
        if getattr(req, name) is not None:
            raise bad_request(f"is not supported: {reason}", name, code="unsupported_field")
    thinking = _thinking(req, parsers)
    messages = _chat_messages(req)
    prefill = messages[-1].role == "assistant"
    tools = _tools(req)
    choice, parallel = _tool_choice(req)
    if for_count and tools:
        choice = "none"
    chat = ChatCompletionRequest(
        model=req.model, messages=messages, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel, chat_template_kwargs=thinking.template_kwargs or None,
        include_reasoning=thinking.show, thinking_token_budget=thinking.budget,
        response_format=_response_format(req),
        # (As chat's reasoning_effort: serving_messages checks it under its own name.)
        reasoning_effort=req.output_config.effort if req.output_config is not None else None,
        # A last assistant message is a prefill: the model continues it.
        add_generation_prompt=not prefill, continue_final_message=prefill)
    if isinstance(req, MessagesRequest):
        chat.max_tokens = req.max_tokens
        chat.temperature = req.temperature
        chat.top_p = req.top_p
        chat.top_k = req.top_k
        chat.stop = req.stop_sequences
        chat.stream = req.stream
    return chat
