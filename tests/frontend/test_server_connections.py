"""The connection guard of the HTTP server (``frontend/server/connections.py``) on a real socket
in this process, over the real app and a scripted fake engine (no model): header, body and
keep-alive timeouts, a stream that outlives all of them, the connection bound (idle
connections make room, busy ones never do, a newcomer gets a 503 when all are busy), malformed
requests answered in OpenAI's envelope without echoing them, ``--root-path``, ``GET /load``,
and the open-file limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import resource
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import uvloop
from aiohttp import web

from test_server_unit import FakeEngine
from tidal.frontend.server.admission import AdmissionBoard
from tidal.frontend.server.app import build_app, create_state
from tidal.frontend.server.connections import (
    ConnectionLimits,
    GuardedAppRunner,
    GuardedServer,
    default_max_connections,
    raise_fd_limit,
)
from tidal.frontend.server.state import ServerSettings, normalize_root_path

KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _run(coro):
    return uvloop.run(coro)  # the server's own event loop (its transports behave differently)


async def _slow_stream(request: web.Request) -> web.StreamResponse:
    """Six chunks, 0.25 s apart: longer than every timeout the tests set."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(6):
        await resp.write(f"data: {i}\n\n".encode())
        await asyncio.sleep(0.25)
    await resp.write_eof()
    return resp


@contextlib.asynccontextmanager
async def _server(limits: ConnectionLimits, board: AdmissionBoard | None = None,
                  engine: FakeEngine | None = None, **settings: Any,
                  ) -> AsyncIterator[tuple[str, GuardedServer, FakeEngine]]:
    engine = engine or FakeEngine()
    state = create_state(engine, ServerSettings(api_key=KEY, **settings),  # type: ignore
                         board)
    app = build_app(state)
    app.router.add_get("/test/slow-stream", _slow_stream)
    runner = GuardedAppRunner(app, limits, on_error=state.metrics.error,
                              handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    server = runner.server
    assert isinstance(server, GuardedServer)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, engine
    finally:
        await runner.cleanup()


def _limits(**kw: float) -> ConnectionLimits:
    base = dict(max_connections=64, header_timeout=5.0, body_timeout=5.0,
                keep_alive_timeout=5.0)
    base.update(kw)
    return ConnectionLimits(**base)  # type: ignore[arg-type]


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _read_all(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout)


def _split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _envelope(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# --- header, body and keep-alive timeouts --------------------------------------------------------


def test_slow_header_is_closed_with_408_and_a_silent_socket_without_a_word():
    async def go():
        async with _server(_limits(header_timeout=0.5)) as (url, server, _):
            partial_r, partial_w = await _open(url)
            partial_w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            silent_r, _silent_w = await _open(url)
            start = time.monotonic()
            raw = await _read_all(partial_r)
            waited = time.monotonic() - start
            status, headers, body = _split(raw)
            assert status == 408 and headers["connection"] == "close"
            assert _envelope(body)["code"] == "header_timeout"
            assert 0.4 <= waited < 2.0, waited
            assert await _read_all(silent_r) == b""  # closed, nothing sent
            assert server.header_timeouts == 2
            # The server still serves.
            async with aiohttp.ClientSession() as s, s.get(url + "/version") as resp:
                assert resp.status == 200

    _run(go())


def test_keep_alive_is_not_a_header_timeout_and_idle_connections_close_after_it():
    async def go():
        async with _server(_limits(header_timeout=0.3, keep_alive_timeout=1.2)) as (url, server,
                                                                                   _):
            reader, writer = await _open(url)
            request = b"GET /version HTTP/1.1\r\nHost: x\r\n\r\n"
            for i in range(2):
                if i:
                    await asyncio.sleep(0.6)  # idle past the header timeout: still open
                writer.write(request)
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                status, headers, _ = _split(head)
                assert status == 200
                await reader.readexactly(int(headers["content-length"]))
            assert server.header_timeouts == 0
            start = time.monotonic()
            assert await _read_all(reader) == b""  # the keep-alive timeout closes it
            assert 0.9 <= time.monotonic() - start < 3.0

    _run(go())


def test_a_stream_outlives_every_timeout():
    async def go():
        limits = _limits(header_timeout=0.3, body_timeout=0.3, keep_alive_timeout=0.3)
        async with _server(limits) as (url, server, _):
            async with aiohttp.ClientSession() as s, s.get(url + "/test/slow-stream",
                                                           headers=AUTH) as resp:
                body = await resp.text()
            assert body == "".join(f"data: {i}\n\n" for i in range(6))
            assert server.header_timeouts == server.body_timeouts == 0

    _run(go())


def test_a_trickling_body_gets_408_in_the_envelope():
    async def go():
        async with _server(_limits(body_timeout=0.5)) as (url, server, _):
            reader, writer = await _open(url)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k"
                         b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                         b'{"prompt": ')
            start = time.monotonic()
            raw = await _read_all(reader)
            status, _, body = _split(raw)
            assert status == 408, raw
            err = _envelope(body)
            assert err["code"] == "body_timeout" and "--body-timeout" in err["message"]
            assert 0.4 <= time.monotonic() - start < 2.5
            assert server.body_timeouts == 1
            # A body that arrives in time is served.
            payload = {"model": "fake", "prompt": "hi", "max_tokens": 3}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=payload,
                                                            headers=AUTH) as resp:
                assert resp.status == 200, await resp.text()

    _run(go())


# --- the connection bound ------------------------------------------------------------------------


def test_idle_connections_make_room_for_new_ones():
    async def go():
        async with _server(_limits(max_connections=4)) as (url, server, _):
            idle = []
            for _ in range(4):
                r, w = await _open(url)
                w.write(b"GET /version HTTP/1.1\r\nHost: x\r\n")  # half a header, then nothing
                idle.append((r, w))
            await asyncio.sleep(0.2)
            assert server.num_open == 4
            # Three clients, each on a new connection it keeps, each evicting the oldest idle
            # one (the kept-alive clients are younger, so the half-sent headers go first).
            async with contextlib.AsyncExitStack() as stack:
                for _ in range(3):
                    s = await stack.enter_async_context(aiohttp.ClientSession())
                    async with s.get(url + "/v1/models", headers=AUTH) as resp:
                        assert resp.status == 200
                assert [await _read_all(r, 2.0) for r, _ in idle[:3]] == [b""] * 3
                assert server.num_evicted == 3 and server.num_refused == 0
                assert server.num_open == 4

    _run(go())


def test_busy_connections_are_never_evicted_and_a_newcomer_gets_503():
    async def go():
        async with _server(_limits(max_connections=2)) as (url, server, _):
            async with aiohttp.ClientSession() as s1, aiohttp.ClientSession() as s2:
                streams = [asyncio.create_task(_fetch(s, url + "/test/slow-stream"))
                           for s in (s1, s2)]
                await asyncio.sleep(0.3)  # both streaming: every slot is busy
                reader, writer = await _open(url)
                writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                start = time.monotonic()
                raw = await _read_all(reader)
                assert time.monotonic() - start < 1.0
                status, headers, body = _split(raw)
                assert status == 503 and headers["retry-after"] == "1"
                assert headers["connection"] == "close"
                assert _envelope(body)["code"] == "too_many_connections"
                # The streams were not harmed.
                expected = "".join(f"data: {i}\n\n" for i in range(6))
                assert await asyncio.gather(*streams) == [expected, expected]
            assert server.num_refused == 1 and server.num_evicted == 0
            await asyncio.sleep(0.1)
            async with aiohttp.ClientSession() as s, s.get(url + "/v1/models",
                                                           headers=AUTH) as resp:
                assert resp.status == 200

    _run(go())


def test_refused_connections_hold_descriptors_only_briefly_and_in_bounded_number():
    async def go():
        limits = _limits(max_connections=1)
        async with _server(limits) as (url, server, _):
            async with aiohttp.ClientSession() as s:
                stream = asyncio.create_task(_fetch(s, url + "/test/slow-stream"))
                await asyncio.sleep(0.3)
                # Clients that connect and never read: the first refusal_burst ones get the
                # 503 and are held (to be read), the rest are reset at once.
                conns = [await _open(url) for _ in range(limits.refusal_burst + 8)]
                await asyncio.sleep(0.2)
                assert server.num_refusing == limits.refusal_burst
                start = time.monotonic()
                answers = []
                for reader, _ in conns:
                    try:
                        answers.append(await _read_all(reader))
                    except ConnectionResetError:
                        answers.append(b"")
                assert sum(a.startswith(b"HTTP/1.1 503") for a in answers) == \
                    limits.refusal_burst
                assert all(a == b"" for a in answers if not a.startswith(b"HTTP/1.1 503"))
                assert time.monotonic() - start < 2.0
                for _, writer in conns:  # as a client does once it has its answer
                    writer.close()
                await asyncio.sleep(0.2)
                assert server.num_refusing == 0
                assert server.num_refused == len(conns)
                await stream

    _run(go())


async def _fetch(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, headers=AUTH) as resp:
        return await resp.text()


def test_default_bound_follows_the_open_file_limit():
    assert default_max_connections(1024) == 768
    assert default_max_connections(20000) == 20000 - 2500
    assert default_max_connections(1 << 24) == 65536
    assert default_max_connections(100) == 1


def test_soft_open_file_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 300:
        pytest.skip(f"hard limit {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert raise_fd_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# --- malformed HTTP ------------------------------------------------------------------------------


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET /version HTTP/1.1\r\nHost: x\r\nX-Big: " + b"SECRETVALUE" * 900 + b"\r\n\r\n", 431),
    (b"GET /version HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(200))
     + b"\r\n", 431),
    (b"GET /" + b"SECRETVALUE" * 900 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),
    (b"\x16\x03\x01SECRETVALUE\r\n\r\n", 400),
    (b"GET /version HTTP/1.1\r\nHost: x\r\nBad Header SECRETVALUE\r\n\r\n", 400),
], ids=["long-field", "many-fields", "long-url", "tls", "bad-header"])
def test_malformed_requests_get_the_envelope_and_nothing_echoed(request_bytes, status):
    async def go():
        async with _server(_limits()) as (url, _, _):
            reader, writer = await _open(url)
            writer.write(request_bytes)
            raw = await _read_all(reader)
            got, headers, body = _split(raw)
            assert got == status, raw[:300]
            assert headers["content-type"].startswith("application/json")
            err = _envelope(body)
            assert err["code"] == ("header_too_large" if status == 431 else "bad_http_request")
            assert b"SECRETVALUE" not in raw
            async with aiohttp.ClientSession() as s, s.get(url + "/version") as resp:
                assert resp.status == 200

    _run(go())


# --- --root-path and /load ------------------------------------------------------------------------


def test_root_path_serves_each_route_with_and_without_the_prefix():
    async def go():
        async with _server(_limits(), root_path="/proxy/llm") as (url, _, _):
            async with aiohttp.ClientSession() as s:
                for path in ("/v1/models", "/proxy/llm/v1/models"):
                    async with s.get(url + path, headers=AUTH) as resp:
                        assert resp.status == 200, path
                        assert (await resp.json())["data"][0]["id"] == "fake"
                payload = {"model": "fake", "prompt": "hi", "max_tokens": 3}
                async with s.post(url + "/proxy/llm/v1/completions", json=payload,
                                  headers=AUTH) as resp:
                    assert resp.status == 200
                # Public routes stay public under the prefix; the rest want the key.
                async with s.get(url + "/proxy/llm/version") as resp:
                    assert resp.status == 200
                async with s.get(url + "/proxy/llm/v1/models") as resp:
                    assert resp.status == 401
                for path in ("/proxy/llmx/v1/models", "/proxy/v1/models", "/llm/v1/models"):
                    async with s.get(url + path, headers=AUTH) as resp:
                        assert resp.status == 404, path
                        assert (await resp.json())["error"]["code"] == "not_found"

    _run(go())


def test_root_path_flag_values():
    assert normalize_root_path("") == normalize_root_path("/") == ""
    assert normalize_root_path("/a/b/") == "/a/b"
    for bad in ("a", "/a?b", "/a//b", "/a/../b", "/a b"):
        with pytest.raises(ValueError):
            normalize_root_path(bad)


def test_load_counts_generation_requests_in_flight_over_every_process():
    async def go():
        memory = AdmissionBoard.allocate(2, multiprocessing.get_context("spawn"))
        other = AdmissionBoard.attach(memory, 1)  # a second API server process's row
        board = AdmissionBoard.attach(memory, 0)
        async with _server(_limits(), board=board, enable_server_load_tracking=True) as (
                url, _, engine):
            async with aiohttp.ClientSession() as s:
                async def load() -> int:
                    async with s.get(url + "/load") as resp:  # public, like /health
                        assert resp.status == 200
                        return (await resp.json())["server_load"]

                assert await load() == 0
                payload = {"model": "fake", "prompt": "hang", "max_tokens": 3, "stream": True}
                hung = [asyncio.create_task(s.post(url + "/v1/completions", json=payload,
                                                   headers=AUTH)) for _ in range(2)]
                deadline = time.monotonic() + 5
                while await load() != 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert await load() == 2
                other.add_load(3)
                assert await load() == 5
                other.add_load(-3)
                # Other endpoints are not counted.
                async with s.get(url + "/v1/models", headers=AUTH):
                    assert await load() == 2
                for task in hung:
                    (await task).close()  # the client goes away: the handlers end
                deadline = time.monotonic() + 5
                while await load() != 0 and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                assert await load() == 0
            assert engine.cancelled

    _run(go())


def test_load_without_tracking_reports_zero_as_vllm_does():
    async def go():
        async with _server(_limits()) as (url, _, _):
            async with aiohttp.ClientSession() as s:
                payload = {"model": "fake", "prompt": "hang", "max_tokens": 3, "stream": True}
                hung = asyncio.create_task(s.post(url + "/v1/completions", json=payload,
                                                  headers=AUTH))
                await asyncio.sleep(0.2)
                async with s.get(url + "/load") as resp:
                    assert resp.status == 200 and await resp.json() == {"server_load": 0}
                (await hung).close()

    _run(go())
