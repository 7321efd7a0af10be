"""``strict`` tools under ``tool_choice: "auto"`` for every tool-call format whose calls open
with a marker (frontend/tool_parsers/strict_tags.py): hermes, llama3_json and mistral get a
structural tag, pythonic and openai a 400 naming ``strict``; markers that are special tokens
(Qwen's ``<tool_call>``) trigger the grammar on llguidance as well as xgrammar.

The generation test runs a tiny random-weight Qwen3 with the real Qwen3 tokenizer (where
``<tool_call>`` / ``</tool_call>`` are single added tokens) plus ``<|python_tag|>`` and
``[TOOL_CALLS]`` added as special tokens, biased towards each format's marker token so that
calls happen; every call the server's reader finds must validate against the strict tool's
schema (``jsonschema`` is the reference), whatever the weights.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from tidal.engine_core.sampling_params import SamplingParams
from tidal.frontend.server.chat_parsing import ChatParsers, check_tools
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.openai_protocol import ChatCompletionRequest
from tidal.frontend.tool_parsers.base import ToolParser
from tidal.frontend.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.frontend.tool_parsers.marked import HermesToolParser, MistralToolParser
from tidal.frontend.tool_parsers.openai import OpenAIToolParser
from tidal.frontend.tool_parsers.pythonic import PythonicToolParser

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Zürich", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "strict": True}},
    {"type": "function", "function": {"name": "now"}},  # not strict: any object
]
FORMATS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser}
# The marker each format's calls open with, as a single token in the test tokenizer.
MARKERS = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}


def _request(**kw: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **kw},
                           ChatCompletionRequest)


def _enforced(fmt: str):
    tools = check_tools(_request(tools=TOOLS), ChatParsers(tools=FORMATS[fmt]))
    assert tools.parse and tools.enforced is not None
    assert tools.enforced.spec.kind == "structural_tag"
    return tools.enforced


def _check_calls(calls) -> None:
    for call in calls:
        args = json.loads(call.arguments)
        if call.name == "get_weather":
            jsonschema.validate(args, WEATHER)
        else:
            assert call.name == "now" and isinstance(args, dict), call


@pytest.mark.parametrize("reader", [PythonicToolParser, OpenAIToolParser, None])
def test_formats_without_a_marker_are_400s_naming_strict(reader):
    with pytest.raises(APIError) as err:
        check_tools(_request(tools=TOOLS), ChatParsers(tools=reader))
    assert err.value.status == 400 and err.value.param == "tools[0].function.strict"
    assert "hermes, llama3_json, mistral" in str(err.value), str(err.value)


# Outputs as each format's chat template writes calls: the grammar (llguidance, text form of
# the markers) must take the good ones and refuse the bad ones; the reader's calls validate.
_GOOD_ARGS = {"city": "Zürich", "days": 3}
_BAD_ARGS = [{"city": "Rome", "days": 3}, {"city": "Oslo", "days": 9}, {"city": "Oslo"},
             {"city": "Oslo", "days": 2, "extra": 1}]


def _call_text(fmt: str, name: str, args: dict[str, Any]) -> str:
    body = json.dumps(args, ensure_ascii=False)
    if fmt == "hermes":
        return f'<tool_call>\n{{"name": "{name}", "arguments": {body}}}\n</tool_call>'
    if fmt == "llama3_json":
        return f'{{"name": "{name}", "parameters": {body}}}'
    return f'[TOOL_CALLS] [{{"name": "{name}", "arguments": {body}}}]'


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_call_is_held_to_the_tools(fmt, smollm2_tokenizer):
    import llguidance.hf
    from llguidance import LLMatcher

    from tidal.engine_core.structured_output.spec import to_grammar

    enforced = _enforced(fmt)
    grammar = to_grammar(enforced.spec)
    ll_tokenizer = llguidance.hf.from_tokenizer(smollm2_tokenizer)

    def accepts(text: str) -> bool:
        m = LLMatcher(ll_tokenizer, grammar)
        return m.consume_tokens(smollm2_tokenizer.encode(text, add_special_tokens=False)) \
            and not m.is_error() and m.is_accepting()

    call = _call_text(fmt, "get_weather", _GOOD_ARGS)
    sep = "; " if fmt == "llama3_json" else " "
    good = [call, call + sep + _call_text(fmt, "now", {"any": [1, "x"]}),
            "No call needed." if fmt != "llama3_json" else "No {call} needed."]
    if fmt == "llama3_json":
        good.append("<|python_tag|>" + call)
    for text in good:
        assert accepts(text), text
        reader = enforced.parser()
        _, calls = reader.extract_tool_calls(text)
        _check_calls(calls)
        assert reader.failures == 0
    assert len(enforced.parser().extract_tool_calls(good[1])[1]) == 2
    bad = [_call_text(fmt, "get_weather", a) for a in _BAD_ARGS]
    bad.append(_call_text(fmt, "send_mail", {}))
    if fmt == "llama3_json":
        bad.append("<|python_tag|>" + _call_text(fmt, "get_weather", _BAD_ARGS[0]))
    for text in bad:
        assert not accepts("Sure. " + text), text


def test_llama3_reader_takes_only_the_calls_the_grammar_held():
    """Objects at the start of the output that do not open as the grammar's calls (which the
    trigger never saw) are content under strict tools; the plain parser reads them."""
    reader = _enforced("llama3_json").parser()
    assert isinstance(reader, Llama3JsonToolParser)
    for text in ['{"parameters": {"city": "Rome"}, "name": "get_weather"}',
                 '{ "name": "get_weather", "parameters": {"city": "Rome"}}',
                 '{"name":"get_weather","parameters":{"days":99}}']:
        content, calls = reader.extract_tool_calls(text)
        assert calls == [] and content == text and reader.failures == 1
        # Streamed in small pieces: the same answer.
        reader = _enforced("llama3_json").parser()
        deltas = [reader.extract_tool_calls_streaming(text[i:i + 3])
                  for i in range(0, len(text), 3)] + [reader.finish_streaming()]
        assert "".join(d.content or "" for d in deltas if d) == text
        assert not any(d.tool_calls for d in deltas if d)
        reader = _enforced("llama3_json").parser()
        assert len(Llama3JsonToolParser().extract_tool_calls(text)[1]) == 1


# --- Qwen's <tool_call> as one added token ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_qwen3_tools(qwen3_tokenizer, tmp_path_factory):
    """Tiny random Qwen3; the Qwen3 tokenizer plus two special tokens (room is left in the
    embedding: Qwen3's 151,669 tokens are padded to 151,680 and more)."""
    from transformers import AutoTokenizer

    import reference

    folder = tmp_path_factory.mktemp("tiny-qwen3-tools")
    qwen3_tokenizer.save_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "[TOOL_CALLS]"]})
    reference.make_tiny_qwen3_with_tokenizer(tok, folder)
    return folder, tok


def test_a_special_token_marker_triggers_on_llguidance(tiny_qwen3_tools):
    """llguidance matches special tokens only by id: with a text trigger alone the model's
    single ``<tool_call>`` token would be refused outright. It opens the section now, and
    the section holds the call to the tools, closed by the text or the ``</tool_call>``
    token; the text form of the marker is held as before."""
    from tidal.engine_core.config import EngineArgs
    from tidal.engine_core.structured_output.router import BackendRouter

    folder, tok = tiny_qwen3_tools
    model = EngineArgs(model=str(folder), device="cpu").create_config().model
    guidance = BackendRouter(model, "guidance").backend("guidance")
    assert guidance.special_tokens["<tool_call>"] == tok.convert_tokens_to_ids("<tool_call>")
    spec = _enforced("hermes").spec
    open_, close = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    def consumes(ids: list[int]) -> bool:
        m = guidance.compile(spec)
        return m.consume_tokens(ids) and not m.is_error()

    body = '\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n'
    bad = '\n{"name": "get_weather", "arguments": {"city": "Rome"'
    assert enc("<tool_call>") == [open_]  # the case under test
    assert consumes(enc("Sure. ") + [open_] + enc(body) + [close] + enc(" Done."))
    assert consumes([open_] + enc(body) + enc("</") + enc("tool_call>"))
    assert not consumes(enc("Sure. ") + [open_] + enc(bad))
    # The marker spelt in pieces of text still opens a held section.
    pieces = enc("<") + enc("tool") + enc("_call>")
    assert open_ not in pieces
    assert consumes(pieces + enc(body) + [close])
    assert not consumes(pieces + enc(bad))


def test_generated_calls_validate_on_both_backends(tiny_qwen3_tools):
    """Each format, each backend: outputs biased towards the marker token hold calls (the
    single token: on llguidance too), and every call the format's reader finds validates.
    The strict tool alone is offered: its calls are short, so many fit in max_tokens."""
    pytest.importorskip("xgrammar")
    from tidal.frontend import LLM

    folder, tok = tiny_qwen3_tools
    llm = LLM(str(folder), max_num_seqs=24, num_kv_blocks=512, max_model_len=256,
              cpu_threads=1, dtype="float32")
    try:
        prompts, params, cases = [], [], []
        for fmt in FORMATS:
            tools = check_tools(_request(tools=TOOLS[:1]), ChatParsers(tools=FORMATS[fmt]))
            assert tools.enforced is not None
            marker = tok.convert_tokens_to_ids(MARKERS[fmt])
            for backend in ("guidance", "xgrammar"):
                spec = msgspec.structs.replace(tools.enforced.spec, backend=backend)
                for seed in range(4):
                    prompts.append("Weather?")
                    params.append(SamplingParams(
                        temperature=1.0, seed=seed, max_tokens=64, logit_bias={marker: 12.0},
                        skip_special_tokens=False, structured_outputs=spec))
                    cases.append((fmt, backend, tools.enforced, marker))
        outs = llm.generate(prompts, params, use_tqdm=False)
        found: dict[tuple[str, str], int] = {}
        for out, (fmt, backend, enforced, marker) in zip(outs, cases, strict=True):
            c = out.outputs[0]
            assert marker in c.token_ids, (fmt, backend, c.text)
            _, calls = enforced.parser().extract_tool_calls(c.text)
            for call in calls:
                assert call.name == "get_weather", c.text
                jsonschema.validate(json.loads(call.arguments), WEATHER)
            found[fmt, backend] = found.get((fmt, backend), 0) + len(calls)
        assert len(found) == 6 and all(n >= 2 for n in found.values()), found
        assert llm.engine.core.structured._backend.compiled_by == {"guidance": 3,
                                                                    "xgrammar": 3}
    finally:
        llm.shutdown()
