"""LoRA adapters over HTTP through the official ``openai`` client, on one shared server:
``--lora-modules`` (both forms), ``/v1/models`` with parents, a request's ``model`` picking an
adapter (outputs equal HF transformers + PEFT's), the filesystem resolver and a resolver plugin,
runtime load / unload (``TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1``), and the errors."""

from __future__ import annotations

import copy
import json
import shutil
import urllib.error
import urllib.request

import openai
import pytest
import torch

from plugins.plugin_env import plugin_env
from reference import hf_greedy, make_tiny_model
from server_harness import API_KEY, ServerProcess, shared_server

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3145, 314, 260, 1345, 30]
N = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _adapter(model, folder, seed: int, rank: int = 8) -> None:
    """A PEFT adapter with random, non-zero A and B, large enough to change greedy outputs."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    peft_model.save_pretrained(folder)


def _peft_greedy(model, folder) -> list[int]:
    from peft import PeftModel

    return hf_greedy(PeftModel.from_pretrained(copy.deepcopy(model), str(folder)).eval(),
                     PROMPT, N)[0]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, smollm2_tokenizer):
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    tok = smollm2_tokenizer
    model = make_tiny_model("llama", root / "base", vocab_size=len(tok), hidden_size=32,
                            intermediate_size=64, num_hidden_layers=2,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    tok.save_pretrained(root / "base")
    adapters = root / "adapters"
    _adapter(model, adapters / "a1", 1)
    _adapter(model, adapters / "a2", 2)
    _adapter(model, adapters / "too-big", 3, rank=32)  # over --max-lora-rank 16
    resolver_dir = root / "resolver"  # --lora-resolver-dir
    shutil.copytree(adapters / "a1", resolver_dir / "r1")
    plugin_dir = root / "plugin"  # the test resolver plugin's folder
    shutil.copytree(adapters / "a2", plugin_dir / "p2")
    expected = {"base": hf_greedy(model, PROMPT, N)[0],
                "a1": _peft_greedy(model, adapters / "a1"),
                "a2": _peft_greedy(model, adapters / "a2")}
    env = plugin_env(tmp_path_factory.mktemp("lora-site"), TIDAL_TEST_LORA_DIR=str(plugin_dir),
                     TIDAL_ALLOW_RUNTIME_LORA_UPDATING="1", TIDAL_PLUGINS="prefixed_dir")
    return {"root": root, "adapters": adapters, "resolver": resolver_dir,
            "expected": expected, "env": env}


@pytest.fixture(scope="module")
def server(setup) -> ServerProcess:
    a = setup["adapters"]
    return shared_server(
        [str(setup["root"] / "base"), "--max-model-len", "256", "--kv-cache-memory-bytes",
         str(64 << 20), "--cpu-threads", "1", "--served-model-name", "base",
         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
         "--lora-resolver-dir", str(setup["resolver"]),
         "--lora-modules", f"a1={a / 'a1'}", json.dumps({"name": "a2", "path": str(a / "a2")})],
        env=setup["env"])


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def post(server: ServerProcess, path: str, body: object) -> tuple[int, str]:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {API_KEY}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _greedy(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0.0,
                                    logprobs=0, extra_body={"return_tokens_as_token_ids": True,
                                                            "ignore_eos": True})
    assert out.model == model
    return [int(t.split(":", 1)[1]) for t in out.choices[0].logprobs.tokens]


def test_models_lists_adapters_with_their_parent(setup, client):
    cards = {m.id: m for m in client.models.list().data}
    assert {"base", "a1", "a2"} <= set(cards)
    for name in ("a1", "a2"):
        assert cards[name].parent == "base"
        assert cards[name].root == str(setup["adapters"] / name)
    assert cards["base"].parent is None


def test_adapter_by_model_name_equals_hf_peft(setup, client):
    exp = setup["expected"]
    assert exp["a1"] != exp["base"] and exp["a2"] != exp["base"]  # the adapters matter
    assert _greedy(client, "base") == exp["base"]
    assert _greedy(client, "a1") == exp["a1"]
    assert _greedy(client, "a2") == exp["a2"]


def test_chat_with_an_adapter(client):
    out = client.chat.completions.create(model="a1", max_tokens=4, temperature=0.0,
                                         messages=[{"role": "user", "content": "Hi"}])
    assert out.model == "a1" and out.choices[0].message.content is not None


def test_beam_search_with_an_adapter_is_a_400(client):
    """Not yet supported on either endpoint: a 400 naming the field, not a server error."""
    for create in (lambda: client.completions.create(
                       model="a1", prompt="Hi", max_tokens=4, n=2,
                       extra_body={"use_beam_search": True}),
                   lambda: client.chat.completions.create(
                       model="a1", max_tokens=4, n=2, extra_body={"use_beam_search": True},
                       messages=[{"role": "user", "content": "Hi"}])):
        with pytest.raises(openai.BadRequestError) as exc:
            create()
        assert exc.value.body["param"] == "use_beam_search"


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        _greedy(client, "no-such-adapter")
    assert exc.value.body["param"] == "model"


def test_filesystem_resolver_loads_dir_name(setup, client):
    assert _greedy(client, "r1") == setup["expected"]["a1"]  # DIR/r1 is a copy of a1
    assert "r1" in {m.id for m in client.models.list().data}
    with pytest.raises(openai.BadRequestError) as exc:
        _greedy(client, "../r1")
    assert exc.value.body["param"] == "model"


def test_resolver_plugin(setup, client):
    assert _greedy(client, "plugin-p2") == setup["expected"]["a2"]  # its folder: a copy of a2


def test_load_and_unload_at_run_time(setup, server, client):
    a = setup["adapters"]
    status, text = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "rt", "lora_path": str(a / "a2")})
    assert status == 200, text
    assert _greedy(client, "rt") == setup["expected"]["a2"]
    status, text = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "rt", "lora_path": str(a / "a1")})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_name"
    status, text = post(server, "/v1/unload_lora_adapter", {"lora_name": "rt"})
    assert status == 200, text
    with pytest.raises(openai.NotFoundError):
        _greedy(client, "rt")
    status, _ = post(server, "/v1/unload_lora_adapter", {"lora_name": "rt"})
    assert status == 404


def test_bad_adapters_are_400_and_the_server_carries_on(setup, server, client):
    a = setup["adapters"]
    status, text = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "missing", "lora_path": str(a / "nope")})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    status, text = post(server, "/v1/load_lora_adapter",
                        {"lora_name": "big", "lora_path": str(a / "too-big")})
    err = json.loads(text)["error"]
    assert status == 400 and "rank" in err["message"], text
    status, text = post(server, "/v1/load_lora_adapter", {"lora_path": str(a / "a1")})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_name"
    assert server.health() == 200
    assert _greedy(client, "a1") == setup["expected"]["a1"]
