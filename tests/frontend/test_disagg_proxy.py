"""``tidal disagg-proxy`` against stand-in instances (small aiohttp apps, no engines): what it
sends each side, the prefill answer's params reaching the decode side, streamed answers
relayed as they come, errors as envelopes, the fallback when the prefill kept no KV, and
/health. Plus the server-side check of ``kv_transfer_params`` (frontend/server)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from server_harness import free_port
from tidal.engine_core.kv_transfer_config import KVTransferConfig
from tidal.frontend.disagg_proxy import Proxy, ProxyConfig, prefill_body
from tidal.frontend.server.errors import APIError
from tidal.frontend.server.kv_transfer_params import check_request_params

PARAMS = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
          "remote_request_id": "r", "remote_num_tokens": 3, "remote_digest": "d"}


def test_prefill_body_asks_one_whole_token_and_keeps_the_rest():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "min_tokens": 5,
            "stream_options": {"include_usage": True}, "temperature": 0.0}
    out = prefill_body(body, chat=False)
    assert out == {"prompt": "x", "temperature": 0.0, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}
    chat = prefill_body({"messages": [], "max_tokens": 9}, chat=True)
    assert chat["max_completion_tokens"] == 1 and "max_tokens" not in chat
    assert body["max_tokens"] == 50  # the client's request is left as it was


class Upstreams:
    """A prefill and a decode stand-in recording what they were sent."""

    def __init__(self) -> None:
        self.prefill_got: list[dict] = []
        self.decode_got: list[dict] = []
        self.prefill_answer: dict[str, Any] | None = PARAMS
        self.prefill_status = 200

    async def prefill(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.prefill_got.append(body)
        if self.prefill_status != 200:
            return web.json_response({"error": {"message": "bad", "type": "x",
                                                "param": "temperature", "code": None}},
                                     status=self.prefill_status)
        return web.json_response({"choices": [{"text": "a"}],
                                  "kv_transfer_params": self.prefill_answer})

    async def decode(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.decode_got.append(body)
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "whole"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in ("one", "two"):
            await resp.write(f"data: {json.dumps({'choices': [{'text': word}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")


async def _site(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def _scenario() -> None:
    up = Upstreams()
    pre_app, dec_app = web.Application(), web.Application()
    for app, handler in ((pre_app, up.prefill), (dec_app, up.decode)):
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        app.router.add_get("/health", up.health)
    pre_runner, pre_url = await _site(pre_app)
    dec_runner, dec_url = await _site(dec_app)
    proxy_runner, url = await _site(Proxy(ProxyConfig(pre_url, dec_url)).app())
    try:
        async with aiohttp.ClientSession() as s:
            body = {"model": "m", "prompt": "hi", "max_tokens": 7}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200 and (await r.json())["choices"][0]["text"] == "whole"
            assert up.prefill_got[-1]["max_tokens"] == 1
            assert up.prefill_got[-1]["kv_transfer_params"] == {"do_remote_decode": True}
            assert up.decode_got[-1] == dict(body, kv_transfer_params=PARAMS)
            # Streamed: the decode side's events come through as they are.
            async with s.post(url + "/v1/chat/completions",
                              json={"messages": [], "stream": True}) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                text = (await r.read()).decode()
            assert text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")
            assert up.prefill_got[-1]["stream"] is False
            assert up.decode_got[-1]["stream"] is True
            # No params from the prefill: the decode side gets the plain request.
            up.prefill_answer = None
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
            assert "kv_transfer_params" not in up.decode_got[-1]
            # The prefill's error is the client's error.
            up.prefill_status = 400
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "temperature"
            n_decoded = len(up.decode_got)
            async with s.post(url + "/v1/completions", data=b"[1, 2]") as r:
                assert r.status == 400 and "error" in await r.json()
            async with s.post(url + "/v1/completions",
                              json=dict(body, kv_transfer_params={})) as r:
                assert (await r.json())["error"]["param"] == "kv_transfer_params"
            assert len(up.decode_got) == n_decoded
            async with s.get(url + "/health") as r:
                assert r.status == 200
            up.prefill_status = 200
            await dec_runner.cleanup()  # the decode instance goes away
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 502
                assert "decode" in (await r.json())["error"]["message"]
            async with s.get(url + "/health") as r:
                assert r.status == 503 and (await r.json())["decode"] == 0
    finally:
        for runner in (proxy_runner, pre_runner, dec_runner):
            await runner.cleanup()


def test_proxy_against_stand_in_instances():
    asyncio.run(_scenario())


def _state(kv: KVTransferConfig | None) -> Any:
    return SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(kv_transfer=kv)))


@pytest.mark.parametrize("kv, params, n, match", [
    (None, {"do_remote_decode": True}, 1, "needs a server started"),
    (KVTransferConfig(kv_connector="OffloadingConnector"), {"do_remote_decode": True}, 1,
     "needs a server started"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_consumer"),
     {"do_remote_decode": True}, 1, "needs a prefill instance"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_producer"), PARAMS, 1,
     "needs a decode instance"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_producer"),
     {"do_remote_decode": True}, 2, "n=1"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_both"),
     {"do_remote_prefill": True}, 1, "needs remote_host"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_both"),
     {"do_remote_decode": 1}, 1, "must be a boolean"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_both"),
     {"shiny": True}, 1, "unknown key"),
    (KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_both"),
     dict(PARAMS, remote_port=70000), 1, "remote_port"),
])
def test_bad_kv_transfer_params_are_a_400_naming_the_field(kv, params, n, match):
    with pytest.raises(APIError, match=match) as err:
        check_request_params(_state(kv), params, n, 1)
    assert err.value.status == 400 and err.value.param == "kv_transfer_params"


def test_good_kv_transfer_params_pass():
    kv = KVTransferConfig(kv_connector="P2pConnector", kv_role="kv_both")
    assert check_request_params(_state(kv), PARAMS, 1, 1) == PARAMS
    assert check_request_params(_state(None), None, 4, 2) is None
