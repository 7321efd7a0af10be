"""Plugins end to end through ``tidal serve``: the test plugin package
(``tests/plugins/tidal_test_plugins``, real entry points) registers a model family, a logits
processor, an IO processor and a stat logger, all exercised on one shared server; a general
plugin that fails stops start-up with its name. (LoRA resolvers: test_server_lora.py.)"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch

from server_harness import API_KEY, ServerProcess, shared_server
from plugins.plugin_env import plugin_env
from reference import hf_greedy, make_tiny_model

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3145, 314, 260, 1345, 30]  # token ids (SmolLM2's vocabulary)
N = 8


def _engine_flags(folder) -> list[str]:
    return [str(folder), "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20),
            "--cpu-threads", "1", "--api-server-count", "1"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_tokenizer):
    """A tiny Llama saved under the plugin's architecture name, and the greedy continuation
    (tokens) HF's Llama gives, with and without the banned token."""
    folder = tmp_path_factory.mktemp("plugin-model")
    tok = smollm2_tokenizer
    model = make_tiny_model("llama", folder, vocab_size=len(tok), hidden_size=32,
                            intermediate_size=64, num_hidden_layers=2,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tok.save_pretrained(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["TidalTestLlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    expected, _ = hf_greedy(model, PROMPT, N)
    banned = expected[0]
    site = tmp_path_factory.mktemp("plugin-site")
    stats = site / "stats.jsonl"
    env = plugin_env(site, TIDAL_TEST_STATS_FILE=str(stats), TIDAL_TEST_BANNED_ID=str(banned))
    return {"folder": folder, "model": model, "expected": expected, "banned": banned,
            "stats": stats, "env": env}


@pytest.fixture(scope="module")
def server(setup) -> ServerProcess:
    return shared_server(_engine_flags(setup["folder"]), env=setup["env"])


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def post(server: ServerProcess, path: str, body: object) -> tuple[int, str]:
    """(status, body text) of a JSON POST with the test key."""
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {API_KEY}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _tokens(choice) -> list[int]:
    return [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]


def _complete(client, **extra) -> list[int]:
    out = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT,
                                    max_tokens=N, temperature=0.0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True,
                                                "ignore_eos": True, **extra})
    return _tokens(out.choices[0])


@torch.no_grad()
def _hf_greedy_banned(model, prompt: list[int], n: int, banned: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logits[banned] = float("-inf")
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


def test_plugin_model_family_serves_like_hf_llama(setup, client):
    assert _complete(client) == setup["expected"]


def test_logits_processor_bans_its_token_only_where_named(setup, client):
    banned = setup["banned"]
    with_proc = _complete(client, logits_processors=["ban_token"])
    assert banned not in with_proc
    assert with_proc == _hf_greedy_banned(setup["model"], PROMPT, N, banned)
    # Even a +100 bias cannot bring it back: the processor runs before logit_bias.
    biased = _complete(client, logits_processors=["ban_token"],
                       logit_bias={str(banned): 100})
    assert banned not in biased
    assert _complete(client, logit_bias={str(banned): 100}) == [banned] * N


def test_unknown_logits_processor_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        _complete(client, logits_processors=["no_such_processor"])
    err = exc.value.body
    assert err["param"] == "logits_processors" and "no_such_processor" in err["message"]


def test_io_processor_endpoint(setup, server, client):
    status, text = post(server, "/v1/io_processor/token_counts",
                        {"texts": ["Hello there", "The sky is"], "max_tokens": 3})
    assert status == 200, text
    results = json.loads(text)["results"]
    assert [x["completion_tokens"] for x in results] == [3, 3]
    for text, res in zip(["Hello there", "The sky is"], results):
        ref = client.completions.create(model=client.models.list().data[0].id, prompt=text,
                                        max_tokens=3, temperature=0.0)
        assert res["text"] == ref.choices[0].text
        assert res["prompt_tokens"] == ref.usage.prompt_tokens
    status, text = post(server, "/v1/io_processor/token_counts", {"texts": 3})
    assert status == 400 and "texts" in json.loads(text)["error"]["message"]
    status, text = post(server, "/v1/io_processor/nope", {})
    assert status == 404 and "token_counts" in json.loads(text)["error"]["message"]


def test_stat_logger_plugin_receives_steps(setup, client):
    _complete(client)
    deadline = time.monotonic() + 10
    lines: list[dict] = []
    while time.monotonic() < deadline:
        if setup["stats"].exists():
            lines = [json.loads(x) for x in setup["stats"].read_text().splitlines()]
            if sum(x["finished"] for x in lines) >= 1:
                break
        time.sleep(0.2)
    assert lines, "the stat logger plugin wrote nothing"
    assert sum(x["generation_tokens"] for x in lines) >= N
    assert sum(x["finished"] for x in lines) >= 1


def test_failing_general_plugin_stops_start_up_named(setup):
    env = dict(setup["env"], TIDAL_TEST_PLUGIN_FAIL="general")
    with pytest.raises(RuntimeError, match="test_models") as exc:
        ServerProcess(_engine_flags(setup["folder"]), env=env).start(timeout=60)
    assert "told to fail" in str(exc.value)
