"""Disaggregated prefill/decode end to end: a prefill ``tidal serve`` (kv_producer), a decode
``tidal serve`` (kv_consumer) and ``tidal disagg-proxy`` in front, on a tiny random-weight model.
Through the proxy, greedy outputs (whole and streamed) equal the decode instance computing the
prompt itself, and the decode instance really loaded the prompt's blocks (usage cached_tokens,
pulled over the gloo transport);
errors of either side reach the client as OpenAI envelopes; a killed producer means the decode
instance recomputes (same answer) and the proxy's /health turns 503.

One set of processes for the module; the last test kills the producer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from server_harness import ServerProcess, free_port

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

BS = 16  # the engines' block size
ENGINE = ["--max-model-len", "512", "--kv-cache-memory-bytes", str(32 << 20),
          "--cpu-threads", "1", "--enable-prompt-tokens-details"]
PROMPTS = [" ".join(f"word{i * 7 + j}" for j in range(n)) for i, n in enumerate((20, 45, 9))]
MAX_TOKENS = 8


def _kv(role: str, port: int, **extra) -> list[str]:
    return ["--kv-transfer-config", json.dumps({
        "kv_connector": "P2pConnector", "kv_role": role, "kv_port": port,
        "kv_connector_extra_config": extra})]


class ProxyProcess:
    def __init__(self, prefill: str, decode: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tidal.frontend.cli", "disagg-proxy", "--prefill", prefill,
             "--decode", decode, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            if _get(self.url + "/health")[0] == 200:
                return
            time.sleep(0.2)
        raise AssertionError("the proxy did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _get(url: str) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return None, b""


def _post(url: str, body: object, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def disagg(tiny_smol_path):
    model = str(tiny_smol_path)
    # Every run of blocks goes cache to cache (the tiny model's slices are far below the
    # default threshold), so a prompt's pull into fresh blocks is posted (its receives first).
    producer = ServerProcess([model, *ENGINE, *_kv("kv_producer", free_port(),
                                                    min_direct_bytes=1)], api_key=None)
    # The decode side pulls over a two-rank gloo pair, in the background (the zmq transport
    # and synchronous pulls are covered in tests/engine_core/kv_transfer).
    consumer = ServerProcess([model, *ENGINE, *_kv("kv_consumer", free_port(),
                                                    pull_timeout_s=1.5, transport="gloo",
                                                    min_direct_bytes=1)],
                             api_key=None)
    proxy = None
    try:
        with ThreadPoolExecutor(2) as pool:  # both engines start side by side
            for f in [pool.submit(producer.start), pool.submit(consumer.start)]:
                f.result()
        proxy = ProxyProcess(producer.url, consumer.url)
        proxy.wait_healthy()
        yield producer, consumer, proxy
    finally:
        if proxy is not None:
            proxy.stop()
        producer.stop()
        consumer.stop()


def _reference(consumer: ServerProcess, path: str, body: dict, salt: str) -> dict:
    """The decode instance computing the prompt itself (a cache salt of its own: no hits)."""
    status, out = _post(consumer.url + path, dict(body, cache_salt=salt))
    assert status == 200, out
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    return out


def test_whole_completions_match_one_engine_and_skip_the_prefill(disagg):
    _, consumer, proxy = disagg
    for i, prompt in enumerate(PROMPTS):
        body = {"model": "", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}
        ref = _reference(consumer, "/v1/completions", body, f"ref{i}")
        status, got = _post(proxy.url + "/v1/completions", body)
        assert status == 200, got
        assert got["choices"][0]["text"] == ref["choices"][0]["text"]
        n = got["usage"]["prompt_tokens"]
        # The decode instance loaded the prompt's whole blocks (one token left to compute).
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // BS * BS
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
    assert any((n - 1) // BS for n in [len(p.split()) for p in PROMPTS])


def test_streamed_chat_matches_one_engine(disagg):
    _, consumer, proxy = disagg
    messages = [{"role": "user", "content": PROMPTS[1]}]
    ref = _reference(consumer, "/v1/chat/completions",
                     {"model": "", "messages": messages, "max_tokens": MAX_TOKENS,
                      "temperature": 0.0}, "chat-ref")
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused")
    stream = client.chat.completions.create(model="", messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0.0, stream=True,
                                            stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == ref["choices"][0]["message"]["content"]
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    client.close()


def test_errors_come_back_as_envelopes(disagg):
    producer, consumer, proxy = disagg
    # The prefill instance's own 400, relayed with the field it names.
    status, err = _post(proxy.url + "/v1/completions",
                        {"model": "", "prompt": "hi", "temperature": "hot"})
    assert status == 400 and err["error"]["param"] == "temperature"
    status, err = _post(proxy.url + "/v1/completions", None, raw=b"{not json")
    assert status == 400 and err["error"]["code"] == "invalid_json"
    status, err = _post(proxy.url + "/v1/completions",
                        {"model": "", "prompt": "hi", "kv_transfer_params": {"x": 1}})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params"
    # On the instances: the wrong role, malformed params, n > 1: a 400 naming the field.
    for url, params, extra in [
        (consumer.url, {"do_remote_decode": True}, {}),
        (producer.url, {"do_remote_prefill": True, "remote_host": "127.0.0.1"}, {}),
        (producer.url, {"do_remote_decode": "yes"}, {}),
        (producer.url, {"do_remote_decode": True}, {"n": 2}),
    ]:
        status, err = _post(url + "/v1/completions", {"model": "", "prompt": "hi",
                                                      "kv_transfer_params": params, **extra})
        assert status == 400 and err["error"]["param"] == "kv_transfer_params", err
    # A producer address that is neither loopback nor allowed: the decode instance does not
    # connect wherever a client says (SSRF, forged KV).
    forged = {"do_remote_prefill": True, "remote_host": "10.1.2.3", "remote_port": 9,
              "remote_request_id": "x", "remote_num_tokens": 1, "remote_digest": "0"}
    status, err = _post(consumer.url + "/v1/completions", {
        "model": "", "prompt": "hi", "kv_transfer_params": forged})
    assert status == 400 and err["error"]["param"] == "kv_transfer_params", err
    assert "remote_host" in err["error"]["message"] and "allowed_producers" in \
        err["error"]["message"]
    # The producer's answer carries the params (vLLM's top-level field); it is pulled by
    # nobody here, so the producer releases it on its send timeout.
    status, out = _post(producer.url + "/v1/completions",
                        {"model": "", "prompt": PROMPTS[0], "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and out["kv_transfer_params"]["do_remote_prefill"] is True
    assert out["kv_transfer_params"]["remote_num_tokens"] == out["usage"]["prompt_tokens"]


def test_killed_producer_means_the_decode_side_recomputes(disagg):
    producer, consumer, proxy = disagg
    body = {"model": "", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    ref = _reference(consumer, "/v1/completions", body, "kill-ref")
    status, pre = _post(producer.url + "/v1/completions",
                        dict(body, max_tokens=1, cache_salt="kill",
                             kv_transfer_params={"do_remote_decode": True}))
    assert status == 200
    # The EngineCore holding the KV first (a process group of its own), then its frontend.
    engines = psutil.Process(producer.pid).children(recursive=True)
    assert engines
    for proc in engines:
        proc.kill()
    psutil.wait_procs(engines, timeout=10)
    producer.proc.kill()
    producer.proc.wait()
    status, got = _post(consumer.url + "/v1/completions",
                        dict(body, cache_salt="kill", kv_transfer_params=pre["kv_transfer_params"]))
    assert status == 200, got
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # recomputed
    assert _get(consumer.url + "/health")[0] == 200  # the failed pull harmed nothing
    status, _ = _get(proxy.url + "/health")
    assert status == 503
    status, err = _post(proxy.url + "/v1/completions", body)
    assert status == 502 and "prefill" in err["error"]["message"]
