"""The request's reasoning effort (chat's ``reasoning_effort``, the Responses API's
``reasoning.effort``): the template variable ``reasoning_effort`` where the server's prompt
renderer reads it (a chat template that mentions it, or the harmony renderer of a gpt-oss
server), a 400 elsewhere (it would change nothing), and a 400 for an unknown value or one that
disagrees with ``chat_template_kwargs``. With the official ``openai`` client."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import openai
import pytest
from test_server_responses import ScriptedEngine, _run

from tidal.frontend.server.serving_chat import reads_reasoning_effort

# A template that reads the variable (the scripted engine renders the last message itself:
# only what reaches apply_chat_template matters here).
READS = "{{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "plain"}]


def test_the_effort_reaches_a_template_that_reads_it():
    engine = ScriptedEngine()

    async def body(api: openai.AsyncOpenAI, client: Any):
        chat = await api.chat.completions.create(model="fake", messages=MESSAGES,
                                                 reasoning_effort="low", max_tokens=8)
        chat_kwargs = engine.rendered[-1]["kwargs"]
        resp = await api.responses.create(model="fake", input="plain",
                                          reasoning={"effort": "high"})
        resp_kwargs = engine.rendered[-1]["kwargs"]
        same = await api.chat.completions.create(
            model="fake", messages=MESSAGES, reasoning_effort="medium", max_tokens=8,
            extra_body={"chat_template_kwargs": {"reasoning_effort": "medium"}})
        return chat, chat_kwargs, resp, resp_kwargs, same

    chat, chat_kwargs, resp, resp_kwargs, same = _run(engine, body, chat_template=READS)
    assert chat.choices[0].message.content
    assert chat_kwargs == {"reasoning_effort": "low"}
    assert resp_kwargs == {"reasoning_effort": "high"}
    assert resp.reasoning.effort == "high"
    assert same.choices[0].message.content


@pytest.mark.parametrize("template,kw,param,says", [
    (None, {"reasoning_effort": "low"}, "reasoning_effort", "change nothing"),
    (READS, {"reasoning_effort": "max"}, "reasoning_effort", "low, medium, high"),
    (READS, {"reasoning_effort": "low",
             "extra_body": {"chat_template_kwargs": {"reasoning_effort": "high"}}},
     "reasoning_effort", "disagree"),
])
def test_an_effort_that_cannot_act_is_a_400(template, kw, param, says):
    async def body(api: openai.AsyncOpenAI, client: Any):
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model="fake", messages=MESSAGES, max_tokens=8,
                                              **kw)
        with pytest.raises(openai.BadRequestError) as resp_err:
            await api.responses.create(model="fake", input="plain",
                                       reasoning={"effort": kw["reasoning_effort"]},
                                       **{k: v for k, v in kw.items() if k == "extra_body"})
        return err.value.body, resp_err.value.body

    settings = {} if template is None else {"chat_template": template}
    chat, resp = _run(ScriptedEngine(), body, **settings)
    assert chat["param"] == param and says in chat["message"], chat
    assert resp["param"] == "reasoning.effort" and says in resp["message"], resp


def test_which_renderers_read_it():
    def state(template: Any, parser: str | None = None) -> Any:
        tok = SimpleNamespace(chat_template=template)
        return SimpleNamespace(tokenizer=tok, settings=SimpleNamespace(
            chat_template=None, reasoning_parser=parser, tool_call_parser=None))

    assert reads_reasoning_effort(state("{{ reasoning_effort }}"))
    assert reads_reasoning_effort(state({"default": "x", "tool_use": "{{ reasoning_effort }}"}))
    assert not reads_reasoning_effort(state("{{ messages }}"))
    assert not reads_reasoning_effort(state(None))
    assert reads_reasoning_effort(state(None, "gpt_oss"))  # the harmony renderer
    assert not reads_reasoning_effort(state("{{ messages }}", "gpt_oss"))  # its own template


def test_anthropic_output_config_effort():
    """Anthropic's ``output_config.effort`` is the same variable (official ``anthropic``
    client): read by the template, or a 400 naming ``output_config.effort``."""
    import anthropic
    from test_server_anthropic import ScriptedEngine as AnthropicEngine
    from test_server_anthropic import _ask
    from test_server_anthropic import _run as run_anthropic

    engine = AnthropicEngine()

    async def body(api: anthropic.AsyncAnthropic, client: Any):
        made = await api.messages.create(**_ask("plain"),
                                         extra_body={"output_config": {"effort": "high"}})
        return made, engine.rendered[-1]["kwargs"]

    made, kwargs = run_anthropic(engine, body, chat_template=READS)
    assert made.content and kwargs == {"reasoning_effort": "high"}

    async def refused(api: anthropic.AsyncAnthropic, client: Any):
        with pytest.raises(anthropic.BadRequestError) as err:
            await api.messages.create(**_ask("plain"),
                                      extra_body={"output_config": {"effort": "high"}})
        return err.value.body

    error = run_anthropic(AnthropicEngine(), refused)
    assert "output_config.effort" in error["error"]["message"]


def test_other_endpoints_refuse_it():
    """Completions and /tokenize take no reasoning effort (a 400, not ignored); the Responses
    API takes it as reasoning.effort only."""
    async def body(api: openai.AsyncOpenAI, client: Any):
        out = []
        for path, payload in (("/v1/completions", {"prompt": "plain"}),
                              ("/tokenize", {"prompt": "plain"}),
                              ("/v1/responses", {"input": "plain"})):
            resp = await client.post(path, json={**payload, "reasoning_effort": "low"})
            out.append((resp.status, (await resp.json())["error"]["param"]))
        return out

    assert _run(ScriptedEngine(), body, chat_template=READS) == [
        (400, "reasoning_effort")] * 3
