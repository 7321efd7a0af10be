"""Online serving benchmark (docs/BENCHMARKS.md, workload 4), against tidal or any
OpenAI-compatible server.

    python tools/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --input-len 128 --output-len 64 --request-rate inf [--max-concurrency 32]

Requests are POSTed to ``/v1/completions`` with ``stream=true``,
``stream_options.include_usage=true`` and ``ignore_eos=true``; arrivals are all at t=0
(``--request-rate inf``) or gamma-distributed (``--burstiness`` 1 = Poisson) and rescaled so the
last send is at N/rate. Timings are client-side ``time.perf_counter``:

    TTFT = first chunk with text - send          ITL  = gaps between chunks with text
    E2EL = last chunk - send                     TPOT = (E2EL - TTFT) / (output tokens - 1)

with token counts from the server's ``usage``. ITL is also split (``split_itl``): the steps that
finished another request's prompt, mixed prefill + decode steps (``itl_arrival_ms``: per
request and such step, the larger of the gap that ended with that first text and the one
before it), and the other gaps (``itl_no_arrival_ms``). A chunk's time is when the read that
completed it returned: chunks that arrive in one read share it (their ITL gap is 0). An untimed
lone request first warms the server up and measures the batch-1 decode rate of this same run:
the reference the result is reported against (a client cannot measure the server's hardware
ceiling). Prints a human table on stderr and one JSON object on stdout.

The load client must never be the bottleneck, so the timed requests run in ``--client-procs``
processes (spawned; uvloop where installed): request i goes to process i mod K with its arrival
offset, all processes start at one shared time, and the results are merged before the
statistics. ``auto`` gives each process at most 128 concurrent streams and uses at most half of
the cores, leaving the rest to a server on the same host. Each request is one HTTP/1.1
connection handled in the transport's callbacks (no task switch per chunk; chunks decoded with
msgspec, only the fields the timings read): on the 2-core CPU machine ~11 us of client CPU per
chunk that arrives in a read of its own and 0.25 ms per 16-token request, where aiohttp with
``json.loads`` took 23 us and 0.61 ms. ``--max-concurrency`` is split evenly across the
processes. The JSON's ``client`` object reports the client's own CPU use (user + sys of every
client process over the timed part: seconds, the fraction of the host's cores, and per process
the fraction of one core): a process near 1.0 means the client, not the server, may have set
the pace.

``run_bench(args)`` runs it from Python (``build_parser().parse_args([...])`` gives ``args``).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import math
import multiprocessing as mp
import os
import platform
import random
import ssl as ssl_module
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar, cast

import msgspec
import numpy as np

try:
    import uvloop
except ImportError:  # the client then runs on asyncio's own event loop
    uvloop = None  # type: ignore[assignment]

T = TypeVar("T")

# Common short English words: roughly one token each in most BPE vocabularies, so a prompt of
# N words is about N tokens (the exact count comes back in ``usage``).
_WORDS = ("the of and to in is was for on are as with his they at be this from have or by one "
          "had not but what all were when we there can an your which their said if do will each "
          "about how up out them then she many some so these would other into has more her two "
          "like him see time could no make than first been its who now people my made over did "
          "down only way find use may water long little very after words called just where most "
          "know get through back much go good new write our used me man day too any same right "
          "look think also around another came come work three word must because does part").split()

# ``auto`` client processes: at most this many concurrent streams each.
STREAMS_PER_CLIENT_PROC = 128


@dataclass(slots=True)
class Result:
    ok: bool
    send: float = 0.0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    # When the first text chunk and each later one (the end of each ``itl`` gap) arrived, in s
    # after the run's shared start (``_run_share`` shifts them from perf_counter), so the
    # gaps of different requests and client processes line up: ``split_itl``.
    first_at: float | None = None
    itl_at: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Workload:
    """The requests of one run: prompts, exact output lengths, send offsets (s)."""

    prompts: list[str | list[int]]
    out_lens: list[int]
    offsets: list[float]


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[str | list[int]]:
    prompts: list[str | list[int]] = []
    for _ in range(args.num_prompts):
        n = max(1, int(round(args.input_len * (1 + rng.uniform(-args.range_ratio,
                                                                args.range_ratio)))))
        if args.dataset == "random-ids":
            prompts.append([rng.randint(args.min_token_id, args.max_token_id) for _ in range(n)])
        else:
            prompts.append(" ".join(rng.choice(_WORDS) for _ in range(n)))
    return prompts


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Send offsets (s): all 0 for rate inf; else gamma gaps, rescaled to end at n / rate."""
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / rate) / times[-1]
    return times.tolist()


def make_workload(args: argparse.Namespace) -> Workload:
    """The run's requests, a function of the arguments and ``--seed`` alone (an offline run
    can rebuild the same ones)."""
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)
    out_lens = [max(1, int(round(args.output_len * (1 + rng.uniform(-args.range_ratio,
                                                                      args.range_ratio)))))
                for _ in prompts]
    offsets = arrival_times(len(prompts), args.request_rate, args.burstiness,
                            np.random.default_rng(args.seed))
    return Workload(prompts, out_lens, offsets)


class _Choice(msgspec.Struct):
    text: str | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Chunk(msgspec.Struct):
    """What the timings read of a streamed chunk; msgspec skips every other field unparsed
    (a quarter of ``json.loads``' cost per chunk)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_encode = msgspec.json.Encoder().encode
_JSON_HEADERS = {"Content-Type": "application/json"}


class _Stream:
    """Folds the SSE lines of one response into its ``Result``."""

    __slots__ = ("result", "last", "last_text", "done")

    def __init__(self, result: Result) -> None:
        self.result = result
        self.last = result.send  # the last data chunk
        self.last_text = 0.0  # the last chunk with text
        self.done = False  # [DONE] or an error seen

    def feed(self, lines: list[bytes], now: float) -> None:
        """``lines`` arrived by ``now``."""
        result = self.result
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.done = True
                return
            try:
                chunk = _decode_chunk(payload)
            except msgspec.DecodeError as exc:
                result.error = f"unreadable chunk ({exc}): {payload[:200]!r}"
                self.done = True
                return
            if chunk.error is not None:
                err = chunk.error
                result.error = str(err.get("message", err) if isinstance(err, dict)
                                   else err)[:300]
                self.done = True
                return
            self.last = now
            if chunk.usage is not None:
                result.prompt_tokens = chunk.usage.prompt_tokens
                result.output_tokens = chunk.usage.completion_tokens
            if chunk.choices and any(c.text for c in chunk.choices):
                if result.ttft is None:
                    result.ttft = now - result.send
                    result.first_at = now
                else:
                    result.itl.append(now - self.last_text)
                    result.itl_at.append(now)
                self.last_text = now


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where completions are POSTed: the address, TLS, and the request head up to the body's
    length, built once per run."""

    host: str
    port: int
    ssl: ssl_module.SSLContext | None
    head: bytes

    @classmethod
    def of(cls, args: argparse.Namespace) -> Endpoint:
        url = urllib.parse.urlsplit(args.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise SystemExit(f"bench_serve: --base-url must be http(s)://HOST[:PORT][/PATH], got "
                             f"{args.base_url!r}")
        tls = url.scheme == "https"
        auth = f"Authorization: Bearer {args.api_key}\r\n" if args.api_key else ""
        head = (f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\n"
                f"{auth}Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                "Connection: close\r\nContent-Length: ")
        return cls(url.hostname, url.port or (443 if tls else 80),
                   ssl_module.create_default_context() if tls else None, head.encode())


class _SSEConnection(asyncio.Protocol):
    """One streamed completion on its own HTTP/1.1 connection. Everything happens in the
    transport's callbacks (no task switch per chunk): the response head is parsed, chunked
    transfer encoding undone, and the SSE lines of each read fed to the ``_Stream`` with the
    read's time. ``done`` resolves when the connection is closed."""

    def __init__(self, request: bytes, stream: _Stream, done: asyncio.Future[None],
                 read_timeout: float) -> None:
        self.request = request
        self.stream = stream
        self.done = done
        self.read_timeout = read_timeout
        self.transport: asyncio.Transport | None = None
        self.status = 0  # 0 until the head is in
        self.raw = b""  # received, not decoded yet
        self.body = b""  # decoded body of a non-200 answer
        self.tail = b""  # decoded, an incomplete SSE line
        self.chunked = False
        self.left = -1  # chunked: bytes left of the current chunk (-1: a size line is next);
        # otherwise bytes left of a Content-Length body (-1: until the connection closes)
        self.complete = False  # the body ended as its framing says
        self.last_read = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.transport.write(self.request)
        self.last_read = time.perf_counter()
        self.timer = asyncio.get_running_loop().call_later(self.read_timeout, self._check_idle)

    def _check_idle(self) -> None:
        idle = time.perf_counter() - self.last_read
        if idle >= self.read_timeout:
            self.stream.result.error = f"TimeoutError: no data for {self.read_timeout:g} s"
            self._close()
        else:
            self.timer = asyncio.get_running_loop().call_later(self.read_timeout - idle,
                                                               self._check_idle)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        now = self.last_read = time.perf_counter()
        raw = self.raw + data if self.raw else data
        if not self.status:
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                self.raw = raw
                return
            self._head(raw[:end].decode("latin-1"))
            raw = raw[end + 4:]
        body, self.raw = self._unframe(raw) if self.chunked else self._plain(raw)
        if self.status != 200:
            self.body += body
        elif body:
            lines = (self.tail + body if self.tail else body).split(b"\n")
            self.tail = lines.pop()
            self.stream.feed(lines, now)
        if self.complete or self.stream.done:
            self._close()

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        self.status = int(lines[0].split()[1])
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self.chunked = True
            elif name == "content-length":
                self.left = int(value)
        if self.chunked:
            self.left = -1

    def _plain(self, raw: bytes) -> tuple[bytes, bytes]:
        if self.left >= 0:
            raw = raw[:self.left]
            self.left -= len(raw)
            self.complete = self.left == 0
        return raw, b""

    def _unframe(self, raw: bytes) -> tuple[bytes, bytes]:
        """The body bytes of the complete or partial chunks in ``raw``, and what remains of
        ``raw`` (an incomplete size line or the CRLF after a chunk's data)."""
        out = []
        pos, n = 0, len(raw)
        while pos < n and not self.complete:
            if self.left > 0:
                take = raw[pos:pos + self.left]
                out.append(take)
                pos += len(take)
                self.left -= len(take)
                continue
            if self.left == 0:  # the CRLF after a chunk's data
                if n - pos < 2:
                    break
                pos += 2
                self.left = -1
                continue
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";", 1)[0], 16)
            pos = eol + 2
            if size == 0:  # the last chunk (trailers, if any, are not read)
                self.complete = True
            else:
                self.left = size
        return b"".join(out), raw[pos:]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        result = self.stream.result
        # Without chunking or a length, the body ends when the connection does.
        ended = self.complete or self.stream.done or (self.status and not self.chunked
                                                      and self.left < 0)
        if ended and self.status == 200 and self.tail and not self.stream.done:
            self.stream.feed([self.tail], time.perf_counter())  # the last line had no newline
        if result.error is None:
            if self.status not in (0, 200):
                result.error = f"HTTP {self.status}: {self.body[:300].decode(errors='replace')}"
            elif not ended:
                result.error = f"the connection closed mid-response ({exc or 'EOF'})"
        if not self.done.done():
            self.done.set_result(None)


async def one_request(endpoint: Endpoint, args: argparse.Namespace,
                      prompt: str | list[int], max_tokens: int) -> Result:
    """One streamed completion on a fresh connection, timed as the module says."""
    body = _encode({"model": args.model, "prompt": prompt, "max_tokens": max_tokens,
                    "stream": True, "stream_options": {"include_usage": True},
                    "ignore_eos": True, "temperature": args.temperature})
    request = b"%s%d\r\n\r\n%s" % (endpoint.head, len(body), body)
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    result = Result(ok=False)
    result.send = time.perf_counter()
    stream = _Stream(result)
    try:
        await loop.create_connection(
            lambda: _SSEConnection(request, stream, done, args.timeout), endpoint.host,
            endpoint.port, ssl=endpoint.ssl)
        await done
    except OSError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    if result.error is None:
        result.e2el = stream.last - result.send
        result.ok = result.ttft is not None
        if not result.ok:
            # (Its usage tells an empty answer from tokens that decode to no text, e.g.
            # special tokens from dummy weights.)
            result.error = (f"the stream carried no text ({result.output_tokens} output "
                            "tokens in its usage)")
    return result


def run_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop where installed."""
    if uvloop is not None:
        return uvloop.run(coro)
    return asyncio.run(coro)


@dataclass(slots=True)
class _Share:
    """One client process's part of a run: the requests' indices in the workload, their
    prompts, output lengths and send offsets, and the process's concurrency cap."""

    indices: list[int]
    prompts: list[str | list[int]]
    out_lens: list[int]
    offsets: list[float]
    max_concurrency: int | None


async def _run_share(args: argparse.Namespace, share: _Share,
                     start_wall: float) -> tuple[list[Result], float, float]:
    """Send the share's requests at the shared start (``time.time()``) + their offsets; return
    the results, the end of the last one (s after the start) and this process's CPU seconds
    (user + sys) from the start to that end."""
    start = time.perf_counter() + (start_wall - time.time())
    endpoint = Endpoint.of(args)
    sem = asyncio.Semaphore(share.max_concurrency) if share.max_concurrency else None

    async def scheduled(j: int) -> Result:
        delay = start + share.offsets[j] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            return await one_request(endpoint, args, share.prompts[j], share.out_lens[j])
        async with sem:
            return await one_request(endpoint, args, share.prompts[j], share.out_lens[j])

    cpu_at_start: list[float] = []
    asyncio.get_running_loop().call_later(max(0.0, start - time.perf_counter()),
                                          lambda: cpu_at_start.append(time.process_time()))
    results = await asyncio.gather(*[scheduled(j) for j in range(len(share.indices))])
    end = time.perf_counter() - start
    for r in results:
        if r.first_at is not None:
            r.first_at -= start
        r.itl_at = [t - start for t in r.itl_at]
    return list(results), end, time.process_time() - cpu_at_start[0]


def _client_process(conn: Connection, args: argparse.Namespace, share: _Share) -> None:
    """A client process: say it is ready, wait for the start time, run, send the results."""
    conn.send(None)
    start_wall = conn.recv()
    conn.send(run_loop(_run_share(args, share, start_wall)))
    conn.close()


def client_procs(args: argparse.Namespace) -> int:
    """``--client-procs``, or for ``auto`` enough processes that none holds more than
    ``STREAMS_PER_CLIENT_PROC`` concurrent streams, at most half of the cores."""
    streams = min(args.num_prompts, args.max_concurrency or args.num_prompts)
    if args.client_procs == "auto":
        k = min(math.ceil(streams / STREAMS_PER_CLIENT_PROC), (os.cpu_count() or 1) // 2)
    else:
        k = int(args.client_procs)
    return max(1, min(k, streams))


def _shares(workload: Workload, k: int, max_concurrency: int | None) -> list[_Share]:
    shares = []
    for p in range(k):
        idx = list(range(p, len(workload.prompts), k))
        cap = None if not max_concurrency else max_concurrency // k + (p < max_concurrency % k)
        shares.append(_Share(idx, [workload.prompts[i] for i in idx],
                             [workload.out_lens[i] for i in idx],
                             [workload.offsets[i] for i in idx], cap))
    return shares


def _prepare(args: argparse.Namespace, workload: Workload) -> tuple[dict, Result]:
    """The server's description (fills ``args.model``), then the untimed lone request."""
    server = server_info(args)
    lone = run_loop(one_request(Endpoint.of(args), args, workload.prompts[0], args.output_len))
    if not lone.ok:
        raise SystemExit(f"bench_serve: the warm-up request failed: {lone.error}")
    return server, lone


def run_bench(args: argparse.Namespace, on_start: Callable[[], None] | None = None,
              on_end: Callable[[], None] | None = None) -> dict:
    """One benchmark run: the warm-up here, the timed requests in ``client_procs(args)``
    spawned processes; returns the report. ``on_start`` / ``on_end`` are called as the timed
    part starts and once every client process has finished (e.g. to sample the server's CPU
    time). Raises ``TimeoutError`` when the timed part outlasts ``args.time_limit`` seconds
    (the client processes are stopped)."""
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        raise SystemExit("bench_serve: --num-prompts, --input-len and --output-len must be >= 1")
    if args.client_procs != "auto" and not (args.client_procs.isdigit()
                                            and int(args.client_procs) >= 1):
        raise SystemExit(f"bench_serve: --client-procs takes auto or a count >= 1, got "
                         f"{args.client_procs!r}")
    workload = make_workload(args)
    server, lone = _prepare(args, workload)
    k = client_procs(args)
    shares = _shares(workload, k, args.max_concurrency)
    ctx = mp.get_context("spawn")
    procs: list[tuple[Any, Connection]] = []
    try:
        for share in shares:
            conn, child = ctx.Pipe()
            proc = ctx.Process(target=_client_process, args=(child, args, share), daemon=True,
                               name="bench_serve-client")
            proc.start()
            child.close()
            procs.append((proc, conn))
        for _, conn in procs:  # imported and ready
            if not conn.poll(120.0):
                raise RuntimeError("bench_serve: a client process did not start in 120 s")
            try:
                conn.recv()
            except EOFError:
                raise RuntimeError("bench_serve: a client process died starting") from None
        start_wall = time.time() + 0.2  # time to create every task before the start
        for _, conn in procs:
            conn.send(start_wall)
        if on_start is not None:
            on_start()
        deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
        pending = {conn: i for i, (_, conn) in enumerate(procs)}
        answers: list[Any] = [None] * k
        while pending:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"bench_serve: the run outlasted --time-limit "
                                   f"{args.time_limit} s ({len(pending)} of {k} client "
                                   f"processes unfinished)")
            for ready in wait(list(pending), timeout=left):
                conn = cast(Connection, ready)
                try:
                    answers[pending.pop(conn)] = conn.recv()
                except EOFError:
                    raise RuntimeError("bench_serve: a client process died") from None
        if on_end is not None:
            on_end()
    finally:
        for proc, conn in procs:
            conn.close()
            if proc.is_alive():
                proc.terminate()
            proc.join()
    by_index: dict[int, Result] = {}
    per_proc = []
    for share, (rs, end, cpu) in zip(shares, answers):
        by_index.update(zip(share.indices, rs))
        per_proc.append({"requests": len(rs), "cpu_s": cpu, "busy": cpu / end if end else None})
    duration = max(end for _, end, _ in answers)
    cpus = os.cpu_count() or 1
    cpu_total = sum(p["cpu_s"] for p in per_proc)
    client = {
        "procs": k, "procs_chosen": "auto" if args.client_procs == "auto" else "given",
        "event_loop": "uvloop" if uvloop is not None else "asyncio", "host_cpus": cpus,
        "cpu_s": cpu_total, "cpu_fraction_of_host": cpu_total / (duration * cpus),
        "max_proc_busy": max((p["busy"] or 0.0) for p in per_proc), "per_proc": per_proc,
    }
    results = [by_index[i] for i in range(len(workload.prompts))]
    return report(args, results, duration, lone, server, client)


def _get_json(args: argparse.Namespace, path: str) -> Any:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    req = urllib.request.Request(args.base_url + path, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def server_info(args: argparse.Namespace) -> dict:
    """The server's model list (``args.model`` defaults to its first model) and version."""
    info: dict = {"base_url": args.base_url}
    try:
        models = _get_json(args, "/v1/models").get("data") or []
    except (OSError, ValueError) as exc:
        raise SystemExit(f"bench_serve: cannot reach {args.base_url}: {exc}") from None
    if args.model is None:
        if not models:
            raise SystemExit("bench_serve: the server lists no model; pass --model")
        args.model = models[0]["id"]
    info["model"] = args.model
    info["max_model_len"] = next((m.get("max_model_len") for m in models
                                  if m.get("id") == args.model), None)
    try:
        info["version"] = _get_json(args, "/version").get("version")
    except (OSError, ValueError):
        pass
    return info


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def split_itl(results: list[Result], window: float) -> tuple[list[float], list[float]]:
    """Each request's ITL gaps in two: one value per step that finished another request's
    prompt (a mixed prefill + decode step, issue 25's "ITL of mixed steps"), the larger of the
    gap that ended as that request's first text arrived (``window`` s of client-side skew
    allowed) and the gap before it, since with async scheduling a mixed step's cost lands in
    either (a step whose host-side launch is slow delays the previous step's output); and every
    gap of neither kind. A prompt chunked over several steps counts at its last chunk's step
    only."""
    firsts = sorted((r.first_at, i) for i, r in enumerate(results) if r.first_at is not None)
    keys = [t for t, _ in firsts]
    arrival: list[float] = []
    rest: list[float] = []
    for i, r in enumerate(results):
        marked: set[int] = set()
        for k, (gap, end) in enumerate(zip(r.itl, r.itl_at)):
            lo, hi = end - gap + window, end + window
            j = bisect.bisect_right(keys, lo)
            while j < len(keys) and keys[j] <= hi:
                if firsts[j][1] != i:
                    arrival.append(max(gap, r.itl[k - 1]) if k else gap)
                    marked.update((k, k - 1))
                    break
                j += 1
        rest.extend(g for k, g in enumerate(r.itl) if k not in marked)
    return arrival, rest


def _slo_ok(r: Result, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all((x := got[k]) is not None and x * 1000.0 <= v for k, v in slos.items())


def report(args: argparse.Namespace, results: list[Result], duration: float, lone: Result,
           server: dict, client: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    slos = parse_goodput(args.goodput)
    lone_rate = (lone.output_tokens - 1) / (lone.e2el - lone.ttft) if (
        lone.tpot and lone.e2el and lone.ttft is not None and lone.e2el > lone.ttft) else None
    output_tps = out_tokens / duration
    itl_arrival, itl_rest = split_itl(ok, args.arrival_window_ms / 1000.0)
    errors = sorted({r.error for r in results if r.error})[:5]
    return {
        "benchmark": "serve",
        "workload": {
            "endpoint": "/v1/completions", "dataset": args.dataset,
            "num_prompts": args.num_prompts, "input_len": args.input_len,
            "output_len": args.output_len, "range_ratio": args.range_ratio,
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
            "temperature": args.temperature, "ignore_eos": True, "seed": args.seed,
        },
        "server": server,
        "device": {"client_host": platform.node(), "client_cpus": os.cpu_count(),
                   "note": args.device_note},
        "ceiling": {
            "kind": "lone-request decode rate, measured in this run (warm-up request)",
            "lone_ttft_ms": None if lone.ttft is None else lone.ttft * 1000,
            "lone_tpot_ms": None if lone.tpot is None else lone.tpot * 1000,
            "lone_output_tok_s": lone_rate,
        },
        "result": {
            "duration_s": duration,
            "completed": len(ok),
            "failed": len(results) - len(ok),
            "errors": errors,
            "total_input_tokens": in_tokens,
            "total_output_tokens": out_tokens,
            "request_throughput": len(ok) / duration,
            "output_throughput": output_tps,
            "total_token_throughput": (in_tokens + out_tokens) / duration,
            "goodput": (sum(_slo_ok(r, slos) for r in ok) / duration) if slos else None,
            "goodput_slos_ms": slos or None,
            "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
            "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
            "itl_ms": _stats([g for r in ok for g in r.itl]),
            "itl_arrival_ms": _stats(itl_arrival),
            "itl_no_arrival_ms": _stats(itl_rest),
            "itl_arrival_gaps": len(itl_arrival),
            "itl_arrival_window_ms": args.arrival_window_ms,
            "e2el_ms": _stats([r.e2el for r in ok if r.e2el is not None]),
        },
        "ratio": {"output_throughput_vs_lone_stream": (output_tps / lone_rate)
                  if lone_rate else None},
        "client": client,
    }


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"bench_serve: --goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def print_table(rep: dict) -> None:
    r = rep["result"]
    w = rep["workload"]
    lines = [
        f"{'=' * 20} Serving benchmark {'=' * 20}",
        f"server            {rep['server'].get('base_url')}  model {rep['server'].get('model')}",
        f"workload          {w['num_prompts']} prompts, in ~{w['input_len']} / out "
        f"{w['output_len']} tokens, rate {w['request_rate']}, burstiness {w['burstiness']}, "
        f"max concurrency {w['max_concurrency'] or '-'}",
        f"completed/failed  {r['completed']} / {r['failed']}",
        f"duration (s)      {r['duration_s']:.2f}",
        f"requests/s        {r['request_throughput']:.2f}",
        f"output tok/s      {r['output_throughput']:.1f}",
        f"total tok/s       {r['total_token_throughput']:.1f}",
    ]
    if r["goodput"] is not None:
        lines.append(f"goodput (req/s)   {r['goodput']:.2f}  for {r['goodput_slos_ms']}")
    lines.append(f"{'metric (ms)':<18}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        s = r[key]
        cells = "".join(f"{s[k]:>10.1f}" if s[k] is not None else f"{'-':>10}"
                        for k in ("mean", "median", "p90", "p99"))
        lines.append(f"{key[:-3].upper():<18}{cells}")
    for key, label in (("itl_arrival_ms", "ITL arrival"), ("itl_no_arrival_ms", "ITL other")):
        s = r.get(key)
        if s and s["median"] is not None:
            cells = "".join(f"{s[k]:>10.1f}" for k in ("mean", "median", "p90", "p99"))
            lines.append(f"{label:<18}{cells}")
    lone = rep["ceiling"]["lone_output_tok_s"]
    ratio = rep["ratio"]["output_throughput_vs_lone_stream"]
    if lone:
        lines.append(f"lone stream tok/s {lone:.1f}  (batched output is {ratio:.1f}x)")
    c = rep["client"]
    lines.append(f"client            {c['procs']} process(es) ({c['event_loop']}), CPU "
                 f"{c['cpu_s']:.2f} s = {c['cpu_fraction_of_host']:.2f} of {c['host_cpus']} "
                 f"cores; busiest process {c['max_proc_busy']:.2f} of a core")
    if c["max_proc_busy"] > 0.9:
        lines.append("warning: a client process was saturated; the client may have set the "
                     "pace (raise --client-procs)")
    for err in r["errors"]:
        lines.append(f"error: {err}")
    print("\n".join(lines), file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's root (without /v1)")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=("random", "random-ids"), default="random",
                   help="random: text of common words; random-ids: token-id prompts")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly in [len*(1-r), len*(1+r)]")
    p.add_argument("--min-token-id", type=int, default=100)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests/s; inf sends everything at t=0")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--goodput", nargs="*", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the next chunk of a stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-procs", default="auto",
                   help="client processes for the timed requests; auto: one per "
                        f"{STREAMS_PER_CLIENT_PROC} concurrent streams, at most half the cores")
    p.add_argument("--arrival-window-ms", type=float, default=0.5,
                   help="skew allowed between a gap's end and another request's first text for "
                        "the gap to count as an arrival (mixed-step) gap")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds the timed requests may take before the run is abandoned")
    p.add_argument("--device-note", default=None,
                   help="what the server runs on (free text, copied into the JSON)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    return p


def main() -> None:
    args = build_parser().parse_args()
    rep = run_bench(args)
    print_table(rep)
    text = json.dumps(rep, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
