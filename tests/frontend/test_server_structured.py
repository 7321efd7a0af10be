"""Structured outputs through the OpenAI server, with the official ``openai`` client: every
request form (response_format json_schema / json_object, vLLM's structured_outputs, the
guided_* fields) on chat and completions, streamed or not, produces output that validates; a
bad schema / regex / grammar is a 400 naming the field and the problem, before the engine; two
forms at once are a 400; the parts not implemented yet stay rejected.

A tiny random-weight Llama with SmolLM2's tokenizer (and chat template) serves them: the
output is valid because the grammar forces it, whatever the weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
from aiohttp.test_utils import TestServer

from tidal.engine_core.config import EngineArgs
from tidal.frontend.async_llm import AsyncLLM
from tidal.frontend.server.app import build_app, create_state
from tidal.frontend.server.state import ServerSettings

MODEL = "tiny-smol"
SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 10},
    "temp": {"type": "integer", "minimum": -40, "maximum": 50},
    "sky": {"enum": ["clear", "cloudy", "rain"]}},
    "required": ["city", "temp", "sky"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(tiny_smol_path):
    eng = AsyncLLM.from_engine_args(EngineArgs(
        model=str(tiny_smol_path), served_model_name=MODEL, num_kv_blocks=256, max_num_seqs=16,
        max_model_len=256, cpu_threads=1, dtype="float32"))
    yield eng
    eng.shutdown()


def run(engine: AsyncLLM, body) -> Any:
    async def go():
        state = create_state(engine, ServerSettings())
        async with TestServer(build_app(state), handler_cancellation=True) as server:
            api = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="unused",
                                     max_retries=0, timeout=60)
            async with aiohttp.ClientSession() as http:
                async def post(path: str, payload: dict[str, Any]) -> tuple[int, dict]:
                    async with http.post(server.make_url(path), json=payload) as resp:
                        return resp.status, await resp.json()

                async def get(path: str) -> str:
                    async with http.get(server.make_url(path)) as resp:
                        return await resp.text()

                return await body(api, post, get)

    return asyncio.run(go())


@pytest.mark.slow
def test_every_form_produces_valid_output(engine):
    async def body(api: openai.AsyncOpenAI, post, get):
        chat = api.chat.completions.create
        common: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, max_tokens=64,
                                      temperature=1.0)
        results = await asyncio.gather(
            chat(**common, seed=1, response_format={"type": "json_schema", "json_schema": {
                "name": "weather", "schema": SCHEMA, "strict": True}}),
            chat(**common, seed=2, n=2, extra_body={"guided_json": SCHEMA}),
            chat(**common, seed=3, extra_body={"structured_outputs": {"json": SCHEMA}}),
            chat(**common, seed=4, extra_body={"guided_choice": ["sunny", "rainy day"]}),
            chat(**common, seed=5, extra_body={"guided_regex": r"[0-9]{2}:[0-9]{2}"}),
            chat(**common, seed=6, extra_body={"structured_outputs": {
                "grammar": 'start: "temp=" /[0-9]{1,2}/ "C"'}}),
            api.completions.create(model=MODEL, prompt="JSON:", max_tokens=64, seed=7,
                                   extra_body={"response_format": {
                                       "type": "json_schema",
                                       "json_schema": {"name": "w", "schema": SCHEMA}}}),
            api.completions.create(model=MODEL, prompt="Pick:", max_tokens=8, seed=8,
                                   extra_body={"guided_grammar": 'root ::= "up" | "down"'}),
            chat(**common, seed=9, response_format={"type": "json_object"}),
            _stream(api, dict(common, seed=10, extra_body={"guided_json": SCHEMA})),
        )
        return results, await get("/metrics")

    results, metrics = run(engine, body)
    (rf, guided, so_json, choice, regex, grammar, comp, comp_gbnf, obj, streamed) = results
    for resp in (rf, so_json):
        jsonschema.validate(json.loads(resp.choices[0].message.content), SCHEMA)
        assert resp.choices[0].finish_reason == "stop"
    assert len(guided.choices) == 2
    for c in guided.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert choice.choices[0].message.content in ("sunny", "rainy day")
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", regex.choices[0].message.content)
    assert re.fullmatch(r"temp=[0-9]{1,2}C", grammar.choices[0].message.content)
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)
    assert comp_gbnf.choices[0].text in ("up", "down")
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    jsonschema.validate(json.loads(streamed), SCHEMA)
    # /metrics: requests by kind and backend (n = 2 counts twice: each sequence has its own
    # grammar; auto sends every kind here to llguidance) and compile times by backend.
    counts = {(m.group(2), m.group(1)): float(m.group(3)) for m in re.finditer(
        r'^tidal:structured_output_requests_total\{backend="(\w+)",kind="(\w+)",'
        r'model_name="tiny-smol"\} (\S+)$', metrics, re.M)}
    expected = {("json", "guidance"): 6.0, ("choice", "guidance"): 1.0,
                ("regex", "guidance"): 1.0, ("grammar", "guidance"): 2.0,
                ("json_object", "guidance"): 1.0}
    assert counts == expected, metrics
    compiles = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tidal:structured_output_compile_seconds_count'
        r'\{backend="(\w+)",model_name="tiny-smol"\} (\S+)$', metrics, re.M)}
    assert set(compiles) == {"guidance"} and sum(compiles.values()) >= 5, metrics
    assert compiles["guidance"] >= 1, metrics


async def _stream(api: openai.AsyncOpenAI, kwargs: dict[str, Any]) -> str:
    parts = []
    async for chunk in await api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)


@pytest.mark.slow
def test_bad_specs_are_400s_naming_the_field(engine):
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "frobnicate"}}}},
         "response_format.json_schema.schema", "frobnicate"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar", "nothing_here"),
        ({"guided_choice": "notalist"}, "guided_choice", "list of strings"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}},
         "structured_outputs.structural_tag.triggers", "list"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<"], "structures": [
            {"begin": "x", "schema": {}, "end": ""}]}},
         "response_format.structures[0].begin", "does not start"),
        ({"structured_outputs": {"regex": "a", "backend": "outlines"}},
         "structured_outputs.backend", "xgrammar"),
        ({"structured_outputs": {"regex": "a", "disable_fallback": True}},
         "structured_outputs.disable_fallback", "backend"),
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "one structured"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "one structured"),
        ({"guided_json": SCHEMA, "min_tokens": 3}, "min_tokens", "structured outputs"),
        ({"structural_tag": {"x": 1}}, "structural_tag", "not supported"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "not supported"),
    ]

    async def body(api, post, get):
        out = []
        for extra, _, _ in bad:
            out.append(await post("/v1/chat/completions",
                                  {"model": MODEL, "messages": MESSAGES, "max_tokens": 4,
                                   **extra}))
        out.append(await post("/v1/completions", {"model": MODEL, "prompt": "x",
                                                  "guided_regex": "[z"}))
        ok = await post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES,
                                                 "max_tokens": 2,
                                                 "response_format": {"type": "text"}})
        return out, ok

    out, ok = run(engine, body)
    for (extra, param, words), (status, resp) in zip(bad, out):
        assert status == 400, (extra, resp)
        assert resp["error"]["param"] == param, (extra, resp)
        assert words in resp["error"]["message"], (extra, resp)
    assert out[-1][0] == 400 and out[-1][1]["error"]["param"] == "guided_regex"
    assert ok[0] == 200  # {"type": "text"} asks for nothing


@pytest.mark.slow
def test_structural_tags_and_a_per_request_backend(engine):
    """vLLM's structural_tag response format (and xgrammar's form) and structured_outputs.
    backend, on a server started with the default backend (auto); every output follows its
    spec. Without xgrammar installed, asking for it is a 400 naming the field."""
    has_xgrammar = importlib.util.find_spec("xgrammar") is not None
    tag = {"type": "structural_tag", "triggers": ["<"],
           "structures": [{"begin": "<w>", "schema": SCHEMA, "end": "</w>"}]}
    xgr_tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<"],
        "tags": [{"type": "tag", "begin": "<w>", "end": "</w>",
                  "content": {"type": "json_schema", "json_schema": SCHEMA}}]}}

    async def body(api, post, get):
        # "<" (SmolLM2's ids 44 and 2067) made likely: outputs hold tagged sections.
        bias = {"44": 10, "2067": 10}
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 64, "temperature": 1.0,
                "logit_bias": bias}
        comp = {"model": MODEL, "max_tokens": 64, "temperature": 1.0, "logit_bias": bias}
        reqs = [
            post("/v1/chat/completions", {**chat, "seed": 1, "response_format": tag}),
            post("/v1/completions", {**comp, "seed": 2, "prompt": "Weather:",
                                     "structured_outputs": {"structural_tag": json.dumps(tag),
                                                            "backend": "guidance"}}),
            post("/v1/chat/completions", {**chat, "seed": 3, "structured_outputs": {
                "regex": "[a-c]{3}", "backend": "guidance", "disable_fallback": True}}),
            post("/v1/chat/completions", {**chat, "seed": 4, "structured_outputs": {
                "choice": ["up", "down"], "backend": "xgrammar"}}),
            post("/v1/chat/completions", {**chat, "seed": 5, "response_format": xgr_tag}),
        ]
        return await asyncio.gather(*reqs)

    out = run(engine, body)
    tagged, tagged_guidance, guided, xgr_choice, xgr_form = out
    sections = 0
    for status, resp in (tagged, xgr_form) if has_xgrammar else (tagged,):
        assert status == 200, resp
        sections += _check_tags(resp["choices"][0]["message"]["content"], resp["choices"][0])
    assert tagged_guidance[0] == 200, tagged_guidance
    sections += _check_tags(tagged_guidance[1]["choices"][0]["text"],
                            tagged_guidance[1]["choices"][0])
    assert sections >= 2
    assert guided[0] == 200 and re.fullmatch("[a-c]{3}",
                                             guided[1]["choices"][0]["message"]["content"])
    if has_xgrammar:
        assert xgr_choice[0] == 200
        assert xgr_choice[1]["choices"][0]["message"]["content"] in ("up", "down")
    else:
        for status, resp in (xgr_choice, xgr_form):
            assert status == 400 and "xgrammar" in resp["error"]["message"], resp


def _check_tags(text: str, choice: dict[str, Any]) -> int:
    """Every "<" of ``text`` starts a <w>...</w> section holding JSON valid under SCHEMA; a
    cut one only at the end of an output stopped by max_tokens."""
    pos = sections = 0
    while (start := text.find("<", pos)) >= 0:
        end = text.find("</w>", start)
        if end < 0:
            assert choice["finish_reason"] == "length" and "<w>".startswith(
                text[start:start + 3]) or text.startswith("<w>", start), text
            return sections
        assert text.startswith("<w>", start), text
        jsonschema.validate(json.loads(text[start + 3:end]), SCHEMA)
        pos = end + 4
        sections += 1
    return sections
