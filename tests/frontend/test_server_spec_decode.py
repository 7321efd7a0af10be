"""The OpenAI server with speculative decoding (``--speculative-config``): streamed text, stop
strings and finish reasons identical to a server without it (several tokens a step arrive as
ordered deltas), vLLM's spec-decode counters in ``/metrics``, logprobs, and constrained
output (``response_format``, a regex) identical to the plain server's."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest

from server_harness import API_KEY, SMALL_ENGINE, generation_server, require_smollm2, \
    shared_server

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
PROMPT = ("Copy the list: red, green, blue, yellow, red, green, blue, yellow, red, green, "
          "blue, yellow, red, green,")


@pytest.fixture(scope="module")
def spec_server():
    require_smollm2()
    return shared_server([*SMALL_ENGINE, "--speculative-config", json.dumps(NGRAM)])


def _stream(server, **kw) -> tuple[list[str], str | None]:
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                           timeout=120)
    pieces, finish = [], None
    for chunk in client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                           stream=True, **kw):
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    return pieces, finish


def _accepted(server) -> float:
    """Accepted draft tokens so far (no series before the first verify step)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    assert "# TYPE tidal:spec_decode_num_drafts" in text
    assert "# TYPE tidal:spec_decode_off_steps_total counter" in text  # the off-switch's
    found = re.findall(r"^tidal:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", text,
                       re.M)
    return sum(map(float, found))


@pytest.mark.slow
def test_streamed_text_and_stops_identical_to_plain_server(spec_server):
    plain = generation_server()
    before = _accepted(spec_server)
    for kw in ({"max_tokens": 32}, {"max_tokens": 32, "stop": [" yellow, red"]}):
        want, want_finish = _stream(plain, **kw)
        got, got_finish = _stream(spec_server, **kw)
        assert "".join(got) == "".join(want), kw
        assert got_finish == want_finish == ("stop" if "stop" in kw else "length"), kw
        assert len(got) > 1  # streamed in pieces
    assert _accepted(spec_server) > before


@pytest.mark.slow
def test_constrained_output_identical_logprobs_served(spec_server):
    plain = generation_server()
    schema = {"type": "object", "properties": {"colors": {"type": "array", "maxItems": 6,
              "items": {"enum": ["red", "green", "blue", "yellow"]}}},
              "required": ["colors"], "additionalProperties": False}
    texts = {}
    for name, server in (("plain", plain), ("spec", spec_server)):
        client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                               timeout=120)
        chat = client.chat.completions.create(
            model=MODEL, temperature=0, max_tokens=64,
            messages=[{"role": "user", "content": PROMPT + " as JSON"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "colors", "schema": schema}})
        rx = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                       temperature=0,
                                       extra_body={"structured_outputs": {
                                           "regex": r"( (red|green|blue|yellow),){2,8}"}})
        texts[name] = (chat.choices[0].message.content, rx.choices[0].text)
    assert texts["spec"] == texts["plain"]
    assert json.loads(texts["spec"][0])["colors"]
    # Logprobs work: one entry per token, several tokens a step or not.
    client = openai.OpenAI(base_url=spec_server.base_url, api_key=API_KEY, max_retries=0,
                           timeout=60)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    logprobs=1)
    assert len(out.choices[0].logprobs.token_logprobs) == out.usage.completion_tokens == 12
