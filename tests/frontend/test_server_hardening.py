"""``tidal serve`` under the attacks of issue 18 (items 1 and 4), end to end, plus ``--root-path``
and ``GET /load`` over two API server processes.

* A server started with the usual soft open-file limit of 1,024 raises it to the hard limit,
  then holds more than 1,024 connections per process while 2,400 connections send half a
  header and stop; requests through the official ``openai`` client keep succeeding meanwhile,
  and every half-header connection is closed by the header timeout (or earlier, to make room).
* A body nested 1,000 deep is a 400 ``invalid_json``; a header over 8 KiB is a 431 in OpenAI's
  envelope that does not echo the header.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket
import time

import aiohttp
import psutil
import pytest

from server_harness import SMALL_ENGINE, ServerProcess, generation_server, require_smollm2

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
ROOT = "/proxy/tidal"
FLOOD = 2400  # half-header connections, about 1,200 per API server process
MAX_CONNECTIONS = 1100  # per process: above the 1,024 the server was started with
HEADER_TIMEOUT = 3.0
STARTED_SOFT_LIMIT = 1024


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_deep_json_and_huge_headers_get_the_envelope():
    server = generation_server()
    depth = 1000
    body = b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize",
                 "/detokenize"):
        raw = _raw(server.port, b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key"
                   b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                   b"Connection: close\r\n\r\n%s" % (path.encode(), len(body), body))
        head, _, payload = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), (path, raw[:300])
        assert json.loads(payload)["error"]["code"] == "invalid_json", path

    secret = b"S3CRET" * 1500  # 9,000 bytes
    raw = _raw(server.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Token: " + secret
               + b"\r\n\r\n")
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].split()[1] == b"431", raw[:300]
    assert b"application/json" in head and b"S3CRET" not in raw
    assert json.loads(payload)["error"]["code"] == "header_too_large"

    # Load tracking is off on this server: /load answers 0, as vLLM's does.
    raw = _raw(server.port, b"GET /load HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert json.loads(raw.partition(b"\r\n\r\n")[2]) == {"server_load": 0}
    assert server.health() == 200


@pytest.fixture(scope="module")
def hardened():
    require_smollm2()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = FLOOD + 500  # this process holds the client end of every flood socket
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the open-file hard limit ({hard}) is below {need}")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))

    def start_low() -> None:  # the soft limit most systems start a service with
        resource.setrlimit(resource.RLIMIT_NOFILE, (STARTED_SOFT_LIMIT, hard))

    server = ServerProcess([*SMALL_ENGINE, "--api-server-count", "2",
                            "--max-connections", str(MAX_CONNECTIONS),
                            "--header-timeout", str(HEADER_TIMEOUT), "--root-path", ROOT,
                            "--enable-server-load-tracking"],
                           new_session=True, preexec_fn=start_low).start()
    try:
        server.api_pids = _wait_api_servers(server, 2)
        yield server
    finally:
        server.stop()


def _wait_api_servers(server: ServerProcess, n: int, timeout: float = 90.0) -> list[int]:
    """The pids of the API server processes once ``n`` of them listen on the port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = []
        for child in psutil.Process(server.pid).children():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
                       for c in child.net_connections("tcp")):
                    pids.append(child.pid)
            except psutil.Error:
                pass
        if len(pids) == n:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"{n} API server processes did not listen in {timeout} s")


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits", encoding="ascii") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no open-file limit")


async def _completions(base_url: str, n: int) -> list[str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="test-key", max_retries=0)
    try:
        outs = await asyncio.gather(*(client.completions.create(
            model=MODEL, prompt=f"Count to {i}:", max_tokens=4, temperature=0)
            for i in range(n)))
        return [o.choices[0].text for o in outs]
    finally:
        await client.close()


def test_half_header_flood_beyond_1024_connections(hardened):
    server = hardened
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    for pid in server.api_pids:  # started at 1,024; raised at start-up
        assert _soft_nofile(pid) == hard
    assert f"from {STARTED_SOFT_LIMIT} to the hard limit" in server.log_path.read_text()

    async def go():
        opened_at: list[float] = []
        conns = []
        for _ in range(FLOOD):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            conns.append((reader, writer))
            opened_at.append(time.monotonic())
        await asyncio.sleep(0.3)
        # Each process holds more descriptors than the limit it was started with.
        fds = [psutil.Process(pid).num_fds() for pid in server.api_pids]
        assert all(n > STARTED_SOFT_LIMIT for n in fds), fds
        # Clients with a request to send are served meanwhile (behind the proxy prefix and
        # without it).
        texts = await _completions(server.url + ROOT + "/v1", 4)
        texts += await _completions(server.base_url, 2)
        assert all(isinstance(t, str) for t in texts) and len(texts) == 6

        async def closed(i: int) -> tuple[float, bytes]:
            data = await asyncio.wait_for(conns[i][0].read(), HEADER_TIMEOUT + 10)
            return time.monotonic() - opened_at[i], data

        results = await asyncio.gather(*(closed(i) for i in range(FLOOD)))
        for _, writer in conns:
            writer.close()
        timed_out = [(t, d) for t, d in results if d]
        # The ones still held when the header timeout struck got a 408 in the envelope, not
        # before it.
        assert len(timed_out) >= 2 * MAX_CONNECTIONS - 20
        for waited, data in timed_out:
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), data[:200]
            assert json.loads(body)["error"]["code"] == "header_timeout"
            assert waited >= HEADER_TIMEOUT - 0.5
        # The server is healthy and serves afterwards.
        assert await _completions(server.base_url, 1)

    asyncio.run(go())
    assert server.health() == 200


def test_load_is_the_total_over_api_server_processes(hardened):
    server = hardened

    async def go():
        client = openai.AsyncOpenAI(base_url=server.url + ROOT + "/v1", api_key="test-key",
                                    max_retries=0)
        # A new connection per poll, so the polls land on both processes.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            async def load(path: str = "/load") -> int:
                async with http.get(server.url + path) as resp:
                    assert resp.status == 200
                    return (await resp.json())["server_load"]

            assert await load() == 0
            streams = [await client.completions.create(
                model=MODEL, prompt=f"Story {i}:", max_tokens=400, stream=True,
                extra_body={"ignore_eos": True}) for i in range(3)]
            for stream in streams:  # each has started
                await stream.__anext__()
            assert [await load(p) for p in ("/load", ROOT + "/load") * 4] == [3] * 8
            for stream in streams:
                await stream.close()
            deadline = time.monotonic() + 10
            while await load() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert await load() == 0
        await client.close()

    asyncio.run(go())
