"""gpt-oss harmony prompts rendered from chat messages (frontend/harmony_render.py), checked by
reading each rendered assistant turn back through the server's own harmony parsers (the
``gpt_oss`` reasoning parser with the ``openai`` tool parser): the reasoning, answer, preamble
and calls that went in come out. Also: the tools' TypeScript-like listing, old reasoning
dropped, every marker a single token, the 400s, and a chat server on a tokenizer without a
chat template rendering harmony itself (``/tokenize`` shows the ids)."""

from __future__ import annotations

import asyncio
import datetime
import json
from typing import Any

import pytest

from tidal.frontend.harmony_render import (
    END,
    MARKERS,
    START,
    HarmonyRenderError,
    harmony_prompt_ids,
    render_harmony,
    uses_harmony,
)
from tidal.frontend.reasoning import get_reasoning_parser, harmony
from tidal.frontend.server.chat_parsing import ChatParsers, new_output_parse
from tidal.frontend.tool_parsers import get_tool_parser

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "description": "City name"},
    "unit": {"enum": ["c", "f"], "default": "c"},
    "days": {"type": ["integer", "null"]},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "Weather now.\nAnd later."}},
         {"type": "function", "function": {"name": "now"}}]
CALLS = [{"id": "c1", "type": "function",
          "function": {"name": "get_weather", "arguments": {"city": "Zürich", "days": None}}},
         {"id": "c2", "type": "function", "function": {"name": "now", "arguments": {}}}]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Call both tools.",
     "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "{\"sky\": \"clear\"}"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
]
DAY = datetime.date(2026, 11, 26)


def _messages(text: str) -> list[str]:
    """The rendered messages, each from its <|start|>."""
    return [START + m for m in text.split(START)[1:]]


def _read_turn(text: str):
    """An assistant turn as the model would have written it (the generation prompt's
    ``<|start|>assistant`` stripped), through the gpt_oss + openai parsers."""
    parse = new_output_parse(ChatParsers(get_reasoning_parser("gpt_oss"),
                                         get_tool_parser("openai")), parse_tools=True)
    assert parse is not None
    return parse.whole(text.removeprefix(f"{START}assistant"))


def test_turns_read_back_through_the_harmony_parsers():
    text = render_harmony(CHAT, TOOLS, today=DAY)
    msgs = _messages(text)
    authors = [harmony.parse_header(m)[1] or m[len(START):].split("<|")[0].split(" ")[0]
               for m in msgs]
    assert authors[:4] == ["system", "developer", "user", "assistant"]
    assert msgs[-1] == f"{START}assistant"  # the generation prompt
    # The finished first turn: its answer, its reasoning dropped.
    first = _read_turn(msgs[3])
    assert (first.reasoning, first.content, first.calls) == (None, "Hello!", [])
    assert "A greeting." not in text
    # The turn still calling tools keeps its reasoning; preamble and calls come back.
    turn = "".join(m for m in msgs[5:] if m.startswith(f"{START}assistant") and m != msgs[-1])
    second = _read_turn(turn)
    assert second.reasoning == "Call both tools." and second.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in second.calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in CALLS]
    # The results come from the functions the calls named, to the assistant.
    results = [m for m in msgs if m.startswith(f"{START}functions.")]
    assert [harmony.parse_header(m) for m in results] == [("commentary", "assistant")] * 2
    assert [m.split(" ")[0][len(START):] for m in results] == ["functions.get_weather",
                                                                "functions.now"]
    assert [m.split(harmony.MESSAGE, 1)[1].removesuffix(END) for m in results] == [
        "{\"sky\": \"clear\"}", "12:00"]


def test_system_and_developer_messages():
    text = render_harmony(CHAT, TOOLS, template_kwargs={"reasoning_effort": "high"}, today=DAY)
    system, developer = _messages(text)[:2]
    assert "Reasoning: high" in system and "Current date: 2026-11-26" in system
    assert "'functions'" in system  # calls go to the commentary channel
    body = developer.split(harmony.MESSAGE, 1)[1]
    assert body.startswith("# Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
                           "namespace functions {\n\n")
    assert "// Weather now.\n// And later.\ntype get_weather = (_: {\n" in body
    for line in ["// City name\ncity: string,", 'unit?: "c" | "f", // default: "c"',
                 "days?: number | null,", "tags?: string[],", "type now = () => any;"]:
        assert line in body, line
    assert body.endswith("} // namespace functions" + END)
    plain = render_harmony([{"role": "user", "content": "x"}], today=DAY)
    assert "developer" not in plain and "'functions'" not in plain


def test_tokens_and_errors(harmony_tokenizer):
    tok = harmony_tokenizer
    ids = harmony_prompt_ids(tok, CHAT, TOOLS)
    text = render_harmony(CHAT, TOOLS)
    assert tok.decode(ids) == text
    start = tok.convert_tokens_to_ids(START)
    assert ids.count(start) == text.count(START)  # each marker one token
    cont = harmony_prompt_ids(tok, CHAT[:3], add_generation_prompt=False,
                              continue_final_message=True)
    assert tok.decode(cont).endswith("Hello!")
    with pytest.raises(HarmonyRenderError) as err:
        render_harmony(CHAT, template_kwargs={"enable_thinking": False})
    assert err.value.param == "chat_template_kwargs.enable_thinking"
    with pytest.raises(HarmonyRenderError) as err:
        render_harmony(CHAT, template_kwargs={"reasoning_effort": "max"})
    assert err.value.param == "chat_template_kwargs.reasoning_effort"
    with pytest.raises(HarmonyRenderError) as err:
        render_harmony([{"role": "tool", "tool_call_id": "zz", "content": "1"}])
    assert err.value.param == "messages[0].tool_call_id"
    with pytest.raises(HarmonyRenderError) as err:
        harmony_prompt_ids(tok, CHAT[:2], continue_final_message=True,
                           add_generation_prompt=False)
    assert err.value.param == "continue_final_message"
    assert uses_harmony(tok, "gpt_oss", None) and uses_harmony(tok, None, "openai")
    assert not uses_harmony(tok, "qwen3", "hermes")


def test_a_tokenizer_without_the_markers_is_refused(smollm2_tokenizer):
    with pytest.raises(HarmonyRenderError, match="<\\|start\\|>"):
        harmony_prompt_ids(smollm2_tokenizer, CHAT)


@pytest.fixture(scope="module")
def harmony_tokenizer(smollm2_tokenizer, tmp_path_factory):
    """SmolLM2's tokenizer with harmony's markers as special tokens and no chat template."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("harmony-tokenizer")
    smollm2_tokenizer.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"additional_special_tokens": list(MARKERS)})
    tok.chat_template = None
    return tok


@pytest.mark.slow
def test_a_gpt_oss_server_renders_harmony(harmony_tokenizer, tmp_path):
    """``/tokenize`` and a chat completion on a gpt-oss server whose tokenizer has no
    template: the prompt is the harmony rendering; a chat_template_kwargs it does not take is
    a 400 naming it."""
    import aiohttp
    from aiohttp.test_utils import TestServer

    import reference
    from tidal.engine_core.config import EngineArgs
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.server.app import build_app, create_state
    from tidal.frontend.server.state import ServerSettings

    tok = harmony_tokenizer
    reference.make_tiny_model("llama", tmp_path, vocab_size=(len(tok) + 63) // 64 * 64,
                              hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                              eos_token_id=tok.convert_tokens_to_ids("<|call|>"))
    tok.save_pretrained(tmp_path)
    engine = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tmp_path), served_model_name="tiny-oss", num_kv_blocks=128, max_num_seqs=4,
        max_model_len=512, cpu_threads=1, dtype="float32"))
    settings = ServerSettings(reasoning_parser="gpt_oss", tool_call_parser="openai",
                              enable_auto_tool_choice=True)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather?"}]

    async def go() -> tuple[Any, ...]:
        state = create_state(engine, settings)
        async with TestServer(build_app(state)) as server, aiohttp.ClientSession() as http:
            async def post(path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
                async with http.post(server.make_url(path), json=body) as resp:
                    return resp.status, await resp.json()

            tokenized = await post("/tokenize", {"model": "tiny-oss", "messages": messages})
            chat = await post("/v1/chat/completions", {
                "model": "tiny-oss", "messages": messages, "max_tokens": 4, "tools": TOOLS,
                "chat_template_kwargs": {"reasoning_effort": "low"}})
            bad = await post("/v1/chat/completions", {
                "model": "tiny-oss", "messages": messages, "max_tokens": 4,
                "chat_template_kwargs": {"enable_thinking": True}})
            return tokenized, chat, bad

    try:
        (status, tokenized), (chat_status, chat), (bad_status, bad) = asyncio.run(go())
    finally:
        engine.shutdown()
    assert status == 200 and tokenized["tokens"] == harmony_prompt_ids(tok, messages)
    assert chat_status == 200, chat
    expected = harmony_prompt_ids(tok, messages, TOOLS,
                                  template_kwargs={"reasoning_effort": "low"})
    assert chat["usage"]["prompt_tokens"] == len(expected)
    assert bad_status == 400 and bad["error"]["param"] == "chat_template_kwargs.enable_thinking"
