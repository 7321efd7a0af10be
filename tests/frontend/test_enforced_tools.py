"""The pieces of grammar-enforced tool calls without a server: the schema a required /
named tool_choice holds the output to (checked with ``jsonschema`` as the reference), the
reader of that output, ``check_tools``' choices and 400s, the structural tag of strict tools
under "auto" (run through llguidance with SmolLM2's tokenizer), and the rendering of a
tool-calling conversation through real chat templates (SmolLM2's, and a Hermes-style one that
shows calls and results)."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import msgspec
import pytest

from tidal.frontend.server.chat_parsing import ChatParsers, check_tools
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.openai_protocol import ChatCompletionRequest, ChatMessage
from tidal.frontend.server.serving_chat import messages_to_dicts
from tidal.frontend.tokenizer import apply_chat_template
from tidal.frontend.tool_parsers.enforced import (
    NO_PARAMETERS,
    EnforcedToolParser,
    ToolSpecError,
    enforce_named,
    enforce_required,
    parameters_schema,
)
from tidal.frontend.tool_parsers.marked import HermesToolParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "now": NO_PARAMETERS}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_takes_calls_of_the_tools_only(parallel):
    schema = json.loads(enforce_required(SCHEMAS, parallel).spec.json)
    one = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    two = one + [{"name": "now", "parameters": {}}]
    jsonschema.validate(one, schema)
    bad = [[], [{"name": "get_weather", "parameters": {"town": "Paris"}}],
           [{"name": "now", "parameters": {"city": "Paris"}}],
           [{"name": "other", "parameters": {}}], [{"name": "now"}],
           [{"name": "now", "parameters": {}, "extra": 1}]]
    if parallel:
        jsonschema.validate(two, schema)
    else:
        bad.append(two)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)


def test_named_spec_is_the_function_parameters():
    enforced = enforce_named("get_weather", WEATHER)
    assert enforced.named == "get_weather" and json.loads(enforced.spec.json) == WEATHER


def test_parameters_schema_is_checked():
    assert parameters_schema(None, "p") == NO_PARAMETERS
    # "type" may be left out: arguments are an object either way.
    assert parameters_schema({"properties": {"a": {"type": "integer"}}}, "p")["type"] == "object"
    for bad, says in [({"type": "array"}, "JSON object"),
                      ({"type": "object", "properties": {"a": {"type": "nope"}}},
                       "not a valid JSON schema"),
                      ({"type": "object", "properties": 5}, "not a valid JSON schema")]:
        with pytest.raises(ToolSpecError, match=says) as err:
            parameters_schema(bad, "tools[3].function.parameters")
        assert err.value.param == "tools[3].function.parameters"


def _stream(parser: EnforcedToolParser, text: str, step: int):
    calls: dict[int, list[str]] = {}
    content = []
    for i in range(0, len(text) + 1, step):
        msg = parser.extract_tool_calls_streaming(text[i:i + step])
        for m in (msg,) if msg is not None else ():
            content.append(m.content or "")
            for d in m.tool_calls:
                slot = calls.setdefault(d.index, [d.name or "", ""])
                slot[1] += d.arguments or ""
    msg = parser.finish_streaming()
    if msg is not None:
        content.append(msg.content or "")
    return "".join(content), [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("text,calls,content,failures", [
    ('[{"name": "get_weather", "parameters": {"city": "a\\"}]"}}, '
     '{"parameters": {}, "name": "now"}]',
     [("get_weather", '{"city": "a\\"}]"}'), ("now", "{}")], "", 0),
    # Cut by max_tokens: the call whose name arrived, with its arguments so far.
    ('[{"name": "get_weather", "parameters": {"ci', [("get_weather", '{"ci')], "", 0),
    ('[{"name": "get_wea', [], "", 0),
    # Not what the grammar allows (a stop string could cut it): the rest is content.
    ('[{"name": "now", "parameters": {}}] and more', [("now", "{}")], "and more", 1),
    ('[{"nom": "now"}]', [], '[{"nom": "now"}]', 1),
    ('[{"name": "now", "parameters": {}}, {"nom": 1}]', [("now", "{}")], '{"nom": 1}]', 1),
])
def test_required_output_is_read_whole_and_streamed_alike(text, calls, content, failures):
    whole_parser = EnforcedToolParser()
    body, whole = whole_parser.extract_tool_calls(text)
    assert [(c.name, c.arguments) for c in whole] == calls
    assert (body or "") == content and whole_parser.failures == failures
    for step in (1, 3, 7):
        assert _stream(EnforcedToolParser(), text, step) == (content, calls)


def test_named_output_is_the_arguments():
    parser = EnforcedToolParser(named="get_weather")
    body, calls = parser.extract_tool_calls('{"city": "Paris"}')
    assert body is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')]
    assert _stream(EnforcedToolParser(named="get_weather"), '{"city": "Paris"}', 4) == (
        "", [("get_weather", '{"city": "Paris"}')])


CALL_ARGS = {"city": "Zürich", "note": 'a "quoted" </tool_call>'}
CONVERSATION = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_7", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(CALL_ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_7", "content": "sunny, 21 C"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
# A Hermes-style template (tools in the system turn, calls as <tool_call> JSON, results as
# <tool_response>), written for this test.
HERMES_STYLE = (
    "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}"
    "{{ t.function | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response id=\"{{ m.tool_call_id }}\">"
    "\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _render(tokenizer, template: str | None) -> str:
    messages = msgspec.convert(CONVERSATION, list[ChatMessage])
    ids = apply_chat_template(tokenizer, messages_to_dicts(messages), True, template,
                              tools=TOOLS)
    return tokenizer.decode(ids)


def test_tool_conversation_renders_through_smollm2_template(smollm2_tokenizer):
    text = _render(smollm2_tokenizer, None)
    # SmolLM2's template knows no tools: the result is a turn of its own, the call is dropped.
    assert "<|im_start|>tool\nsunny, 21 C<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tool_conversation_renders_through_a_hermes_style_template(smollm2_tokenizer):
    text = _render(smollm2_tokenizer, HERMES_STYLE)
    assert '<tool_response id="call_7">\nsunny, 21 C\n</tool_response>' in text
    assert json.loads(text.split("Tools:\n", 1)[1].split("\n", 1)[0]) == TOOLS[0]["function"]
    # The earlier call comes back as the Hermes parser reads it: same name, same arguments.
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    _, calls = HermesToolParser().extract_tool_calls(turn)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", CALL_ARGS)]


def _request(**kw: Any) -> ChatCompletionRequest:
    return msgspec.convert({"messages": [{"role": "user", "content": "hi"}], **kw},
                           ChatCompletionRequest)


STRICT_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "strict": True}},
    {"type": "function", "function": {"name": "now"}},
]
HERMES = ChatParsers(tools=HermesToolParser)


def test_required_and_named_need_no_tool_parser():
    for choice, named in [("required", None),
                          ({"type": "function", "function": {"name": "now"}}, "now")]:
        tools = check_tools(_request(tools=STRICT_TOOLS, tool_choice=choice), ChatParsers())
        assert tools.parse and tools.enforced is not None and tools.enforced.named == named
        assert tools.enforced.spec.kind == "json"
        assert isinstance(tools.enforced.parser(), EnforcedToolParser)
    none = check_tools(_request(tools=STRICT_TOOLS, tool_choice="none"), ChatParsers())
    assert none.enforced is None and not none.parse


def _accepts(tokenizer, ll_tokenizer, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher

    m = LLMatcher(ll_tokenizer, grammar)
    return m.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and \
        not m.is_error() and m.is_accepting()


def test_auto_with_strict_tools_enforces_each_hermes_call(smollm2_tokenizer):
    """Free text stays free; a call the model opens must be one of the tools, its arguments
    under the strict tool's schema (any object for the others); the reader is the server's
    hermes parser."""
    tools = check_tools(_request(tools=STRICT_TOOLS), HERMES)
    assert tools.parse and tools.enforced is not None
    spec = tools.enforced.spec
    assert spec.kind == "structural_tag" and isinstance(tools.enforced.parser(),
                                                        HermesToolParser)

    def call(name: str, args: dict[str, Any]) -> str:
        return ('<tool_call>\n' + json.dumps({"name": name, "arguments": args},
                                             ensure_ascii=False) + "\n</tool_call>")

    good = ["Just text, no call.",
            "Sure. " + call("get_weather", {"city": "Zürich"}) + " and "
            + call("now", {"anything": [1, 2]}),
            call("now", {})]
    bad = ["x " + call("get_weather", {"town": "Paris"}),
           "x " + call("get_weather", {"city": 5}),
           "x " + call("send_mail", {}),
           "x <tool_call>\nnot json"]
    import llguidance.hf

    from tidal.engine_core.structured_output.spec import to_grammar

    ll_tokenizer, grammar = llguidance.hf.from_tokenizer(smollm2_tokenizer), to_grammar(spec)
    for text in good:
        assert _accepts(smollm2_tokenizer, ll_tokenizer, grammar, text), text
        _, calls = HermesToolParser().extract_tool_calls(text)
        for c in calls:
            if c.name == "get_weather":
                jsonschema.validate(json.loads(c.arguments), WEATHER)
    for text in bad:
        assert not _accepts(smollm2_tokenizer, ll_tokenizer, grammar, text), text


@pytest.mark.parametrize("kw,parsers,param,says", [
    ({"tools": STRICT_TOOLS}, ChatParsers(), "tools[0].function.strict", "hermes"),
    ({"tools": STRICT_TOOLS, "response_format": {"type": "json_object"}}, HERMES,
     "tools[0].function.strict", "response_format"),
    ({"tools": STRICT_TOOLS, "tool_choice": "required", "guided_regex": "a"}, HERMES,
     "tool_choice", "guided_regex"),
    ({"tools": STRICT_TOOLS[:1] * 2, "tool_choice": "required"}, HERMES,
     "tools[1].function.name", "two tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}],
      "tool_choice": "required"}, HERMES,
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}]}, HERMES,
     "tools[0].function.parameters", "not a valid JSON schema"),
])
def test_check_tools_400s(kw, parsers, param, says):
    with pytest.raises(APIError) as err:
        check_tools(_request(**kw), parsers)
    assert err.value.status == 400 and err.value.param == param and says in str(err.value), \
        str(err.value)


def test_schemas_no_grammar_holds_to_are_not_compiled():
    """Under "auto" (no strict tool) and "none" the schemas only reach the template: a valid
    one the grammar backends cannot enforce (uniqueItems) is not refused."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}]
    for choice in ("auto", "none"):
        assert check_tools(_request(tools=tools, tool_choice=choice), HERMES).tools
    with pytest.raises(APIError) as err:
        check_tools(_request(tools=tools, tool_choice="required"), HERMES)
    assert err.value.param == "tools[0].function.parameters"
