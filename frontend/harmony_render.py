"""Chat messages rendered as a gpt-oss harmony prompt, for a gpt-oss tokenizer that carries no
chat template (the server then renders with this when it runs ``--reasoning-parser gpt_oss``
or ``--tool-call-parser openai``). Written from the format's public description; the parsers
that read the model's answer back are frontend/reasoning/gpt_oss.py and
frontend/tool_parsers/openai.py.

A prompt is a run of messages ``<|start|>{author}{header}<|message|>{body}{terminator}``:

- ``system``: the model's identity, knowledge cutoff, date, ``Reasoning: {effort}`` and the
  valid channels (plus where function calls go when tools are given);
- ``developer``: the chat's system / developer messages under ``# Instructions`` and the
  tools as a TypeScript-like ``namespace functions``;
- ``user``; ``assistant`` on a channel: ``analysis`` (reasoning), ``final`` (the answer),
  ``commentary`` (a preamble, or a call ``to=functions.NAME <|constrain|>json`` ending in
  ``<|call|>``); a tool's result comes from ``functions.NAME to=assistant`` on commentary;
- the generation prompt: ``<|start|>assistant``.

An earlier turn's reasoning is dropped once that turn gave its final answer (the model never
sees old chains of thought); a turn still calling tools keeps it.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping
from typing import Any

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CALL, CONSTRAIN, RETURN = "<|call|>", "<|constrain|>", "<|return|>"
# Every marker the rendering writes; a tokenizer without them as tokens cannot take it.
MARKERS = (START, END, MESSAGE, CHANNEL, CALL, CONSTRAIN, RETURN)

DEFAULT_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
KNOWLEDGE_CUTOFF = "2024-06"
EFFORTS = ("low", "medium", "high")
# chat_template_kwargs the rendering acts on (gpt-oss's template takes the same names).
TEMPLATE_KWARGS = frozenset({"reasoning_effort", "model_identity"})


class HarmonyRenderError(ValueError):
    """Messages or options harmony cannot express; ``param`` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def missing_markers(tokenizer: Any) -> list[str]:
    """The harmony markers that are not single tokens of ``tokenizer``."""
    added = getattr(tokenizer, "get_added_vocab", None)
    vocab = added() if added is not None else {}
    return [m for m in MARKERS if m not in vocab]


def render_harmony(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True,
                   template_kwargs: Mapping[str, Any] | None = None,
                   today: datetime.date | None = None) -> str:
    """The harmony prompt of chat ``messages`` (the dicts chat templates take: role, content,
    tool_calls, tool_call_id, name; an assistant's ``reasoning_content`` / ``reasoning`` is
    its analysis). Raises HarmonyRenderError for what harmony cannot hold."""
    kwargs = dict(template_kwargs or {})
    unknown = sorted(set(kwargs) - TEMPLATE_KWARGS)
    if unknown:
        raise HarmonyRenderError(f"chat_template_kwargs.{unknown[0][:64]}",
                                 "is not an option of the harmony rendering (it takes "
                                 f"{', '.join(sorted(TEMPLATE_KWARGS))})")
    effort = kwargs.get("reasoning_effort", "medium")
    if effort not in EFFORTS:
        raise HarmonyRenderError("chat_template_kwargs.reasoning_effort",
                                 f"must be one of {', '.join(EFFORTS)}")
    identity = kwargs.get("model_identity", DEFAULT_IDENTITY)
    if not isinstance(identity, str):
        raise HarmonyRenderError("chat_template_kwargs.model_identity", "must be a string")

    instructions = []
    rest = list(messages)
    while rest and rest[0].get("role") in ("system", "developer"):
        instructions.append(_text(rest.pop(0), 0))
    out = [_system(identity, effort, bool(tools), today or datetime.date.today())]
    developer = _developer("\n\n".join(i for i in instructions if i), tools or [])
    if developer:
        out.append(developer)
    names: dict[str, str] = {}  # tool_call_id -> function name, for the results
    offset = len(messages) - len(rest)
    last_final = _last_final_answer(rest, offset)
    for i, m in enumerate(rest, start=offset):
        role = m.get("role")
        if role == "user":
            out.append(f"{START}user{MESSAGE}{_text(m, i)}{END}")
        elif role == "assistant":
            out.append(_assistant(m, i, keep_reasoning=i > last_final, names=names))
        elif role == "tool":
            name = m.get("name") or names.get(m.get("tool_call_id") or "")
            if not name:
                raise HarmonyRenderError(f"messages[{i}].tool_call_id",
                                         "names no earlier tool call (harmony addresses a "
                                         "result from its function)")
            out.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}"
                       f"{_text(m, i)}{END}")
        else:
            raise HarmonyRenderError(f"messages[{i}].role",
                                     f"{str(role)[:40]!r} cannot follow the first messages "
                                     "in harmony (system / developer messages lead)")
    if add_generation_prompt:
        out.append(f"{START}assistant")
    return "".join(out)


def _text(message: dict[str, Any], i: int) -> str:
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise HarmonyRenderError(f"messages[{i}].content", "must be text")
    return content


def _last_final_answer(messages: list[dict[str, Any]], offset: int) -> int:
    """Index (``offset`` + position) of the last assistant message that answered without
    calling tools, -1 when none did: the reasoning of messages up to it is dropped."""
    return max((offset + j for j, m in enumerate(messages)
                if m.get("role") == "assistant" and not m.get("tool_calls")), default=-1)


def _system(identity: str, effort: str, tools: bool, today: datetime.date) -> str:
    lines = [identity, f"Knowledge cutoff: {KNOWLEDGE_CUTOFF}", f"Current date: {today:%Y-%m-%d}",
             "", f"Reasoning: {effort}", "",
             "# Valid channels: analysis, commentary, final. Channel must be included for "
             "every message."]
    if tools:
        lines.append("Calls to these tools must go to the commentary channel: 'functions'.")
    return f"{START}system{MESSAGE}" + "\n".join(lines) + END


def _developer(instructions: str, tools: list[dict[str, Any]]) -> str:
    parts = []
    if instructions:
        parts.append(f"# Instructions\n\n{instructions}")
    if tools:
        parts.append("# Tools\n\n## functions\n\nnamespace functions {\n\n"
                     + "".join(_tool(t) for t in tools) + "} // namespace functions")
    if not parts:
        return ""
    return f"{START}developer{MESSAGE}" + "\n\n".join(parts) + END


def _tool(tool: dict[str, Any]) -> str:
    fn = tool.get("function", tool)
    lines = []
    if fn.get("description"):
        lines.extend(f"// {ln}" for ln in str(fn["description"]).splitlines())
    params = fn.get("parameters")
    if not params or not params.get("properties"):
        lines.append(f"type {fn['name']} = () => any;")
    else:
        lines.append(f"type {fn['name']} = (_: {_object(params, 0)}) => any;")
    return "\n".join(lines) + "\n\n"


def _object(schema: dict[str, Any], depth: int) -> str:
    props = schema.get("properties") or {}
    if not props:
        return "object"
    required = set(schema.get("required") or ())
    pad = "  " * depth
    lines = ["{"]
    for name, prop in props.items():
        prop = prop if isinstance(prop, dict) else {}
        if prop.get("description"):
            lines.extend(f"{pad}// {ln}" for ln in str(prop["description"]).splitlines())
        optional = "" if name in required else "?"
        line = f"{pad}{name}{optional}: {_type(prop, depth + 1)},"
        if "default" in prop:
            line += f" // default: {json.dumps(prop['default'], ensure_ascii=False)}"
        lines.append(line)
    lines.append(pad[:-2] + "}" if depth else "}")
    return "\n".join(lines)


def _type(schema: dict[str, Any], depth: int) -> str:
    """A JSON schema as a TypeScript-like type (what the model was trained to read)."""
    if depth > 16:
        return "any"
    if "enum" in schema:
        return " | ".join(json.dumps(v, ensure_ascii=False) for v in schema["enum"]) or "never"
    if "const" in schema:
        return json.dumps(schema["const"], ensure_ascii=False)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return " | ".join(_type(s if isinstance(s, dict) else {}, depth + 1)
                              for s in schema[key]) or "any"
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(_type(dict(schema, type=k), depth + 1) for k in kind) or "any"
    if kind == "string":
        return "string"
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        items = schema.get("items")
        inner = _type(items, depth + 1) if isinstance(items, dict) else "any"
        return f"({inner})[]" if " | " in inner else f"{inner}[]"
    if kind == "object":
        return _object(schema, depth)
    return "any"


def _assistant(m: dict[str, Any], i: int, keep_reasoning: bool, names: dict[str, str]) -> str:
    out = []
    reasoning = m.get("reasoning_content") or m.get("reasoning")
    if reasoning and keep_reasoning:
        out.append(f"{START}assistant{CHANNEL}analysis{MESSAGE}{reasoning}{END}")
    content = _text(m, i)
    calls = m.get("tool_calls") or []
    if content:
        # Text beside calls is a preamble (commentary); without calls it is the answer.
        channel = "commentary" if calls else "final"
        out.append(f"{START}assistant{CHANNEL}{channel}{MESSAGE}{content}{END}")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else {}
        name, args = fn.get("name"), fn.get("arguments", {})
        if not isinstance(name, str) or not name:
            raise HarmonyRenderError(f"messages[{i}].tool_calls[{j}].function.name",
                                     "must be a function name")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        if isinstance(call, dict) and call.get("id"):
            names[call["id"]] = name
        out.append(f"{START}assistant{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json"
                   f"{MESSAGE}{args}{CALL}")
    if not out:
        out.append(f"{START}assistant{CHANNEL}final{MESSAGE}{END}")
    return "".join(out)


def uses_harmony(tokenizer: Any, reasoning_parser: str | None,
                 tool_call_parser: str | None) -> bool:
    """Whether the server renders chats as harmony: a gpt-oss server (by its parsers) whose
    tokenizer has no chat template of its own."""
    return (tokenizer is not None and getattr(tokenizer, "chat_template", None) is None
            and (reasoning_parser == "gpt_oss" or tool_call_parser == "openai"))


def harmony_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None,
                       add_generation_prompt: bool = True,
                       continue_final_message: bool = False,
                       template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of the harmony prompt (``render_harmony``); ``continue_final_message``
    leaves the last assistant message open. Raises HarmonyRenderError."""
    missing = missing_markers(tokenizer)
    if missing:
        raise HarmonyRenderError("messages", "this tokenizer has no chat template, and "
                                 "harmony's markers are not its tokens (missing "
                                 f"{', '.join(missing)}): cannot render a gpt-oss prompt")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"
                                   or messages[-1].get("tool_calls")):
        raise HarmonyRenderError("continue_final_message", "needs a last assistant message "
                                 "without tool_calls to continue")
    text = render_harmony(messages, tools, add_generation_prompt, template_kwargs)
    if continue_final_message:
        text = text.removesuffix(END)
    # The markers are special tokens of the text: encoded as such, and no BOS is added
    # (harmony prompts open with <|start|>).
    return list(tokenizer.encode(text, add_special_tokens=False))
