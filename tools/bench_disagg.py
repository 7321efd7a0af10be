"""Disaggregated prefill/decode benchmark (issue 27's 2-GPU case; a CPU smoke run).

    python tools/bench_disagg.py --tokenizer tests/data/qwen3 [--shape llama-3.1-8b]

1. Transfer bandwidth: the P2pConnector's transport (``engine_core/kv_transfer/p2p_transport``)
   pulls one long request's KV (``--prompt-len`` tokens, every layer of the shape's cache
   layout, bf16) from a cache on the first device into one on the second, as a decode instance
   pulls from a prefill instance; against the plain device-to-device copy of the same bytes
   measured in the same run (GPU 0 -> GPU 1; a host memcpy on a CPU). ``--transport``: nccl
   (default with 2 GPUs: the producer runs in its own process on GPU 0, one NCCL rank each),
   gloo (default otherwise) or zmq; the zmq transport (staged through host memory) is measured
   too, for reference. The long prompt's blocks are one run on both sides, so a pair sends them
   cache to cache (``direct_fraction``); ``--min-direct-bytes 1e18`` stages every block (the
   path before direct runs); ``--nccl-raw`` adds plain NCCL receives of the same bytes over
   the same pair, as one receive (``nccl_raw_GBps``: the transport's ceiling) and as many as
   the pull's sends (``nccl_raw_pull_ops_GBps``: the cost of the operations alone).
2. Decode under long prompts: ``--streams`` requests decode (``--stream-prompt-len`` prompt,
   ``--stream-tokens`` output each) while long prompts (``--prompt-len`` tokens, a few output
   tokens) arrive every ``--long-interval`` s. Colocated: one ``tidal serve`` (GPU 0) does it
   all. Disaggregated: a prefill ``tidal serve`` (kv_producer, GPU 0), a decode ``tidal serve``
   (kv_consumer, GPU 1, pulling over ``--transport`` in the background) and
   ``tidal disagg-proxy``. Inter-token latency p99 of the streams
   (client-side chunk gaps) and end-to-end output throughput, both setups.

Targets (2 GPUs of one host, Llama-3.1-8B shape, dummy bf16 weights): transfer bandwidth >= 80 %
of the device-to-device copy; decode ITL p99 disaggregated <= 0.5x colocated. Prints one JSON
object with verdicts. ``--smoke`` runs a tiny shape on a CPU (its figures mean nothing): the
transfer on host memory and both serving setups with a few streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
from bench_common import SHAPES, device_name, dump, judge, write_model_dir

from tidal.engine_core.kv_transfer.p2p_connector import DEFAULT_NCCL_STREAMS
from tidal.engine_core.kv_transfer.p2p_direct_runs import DIRECT_MIN_BYTES
from tidal.engine_core.kv_transfer.p2p_transport import KVPullClient, KVSendServer

BLOCK = 16
TARGETS = {
    "transfer_vs_copy": (">=", 0.8, "KV transfer bandwidth / device-to-device copy bandwidth"),
    "itl_p99_ratio": ("<=", 0.5, "decode ITL p99 disaggregated / colocated"),
}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- 1. transfer bandwidth ---------------------------------------------------------------------


def _devices() -> tuple[torch.device, torch.device]:
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return torch.device("cuda:0"), torch.device("cuda:1")
    if torch.cuda.is_available():
        return torch.device("cuda:0"), torch.device("cuda:0")
    return torch.device("cpu"), torch.device("cpu")


def _sync(*devices: torch.device) -> None:
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _layout(args: argparse.Namespace) -> tuple[int, tuple[int, ...], int]:
    """(layers, one layer's cache shape, blocks of one long prompt)."""
    shape = SHAPES[args.shape]
    heads = shape["num_key_value_heads"]
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    blocks = -(-args.prompt_len // BLOCK)
    return shape["num_hidden_layers"], (2, blocks + 4, BLOCK, heads, head_dim), blocks


def _timed_pulls(client: KVPullClient, address: str, args: argparse.Namespace, blocks: int,
                 dst_dev: torch.device, prefix: str = "",
                 phases: list[dict[str, float]] | None = None,
                 serve_phases: Callable[[], dict[str, float]] | None = None) -> list[float]:
    """Each rep pulls request ``{prefix}r{rep}`` (the producer's blocks 0.., into local 4..):
    the seconds of each after the first (a warm-up, which also builds a pair); ``phases``
    collects each timed pull's host phases (``KVPullClient.last_phases_ms``), with the
    producer's (``serve_phases``: its ``KVSendServer.last_serve_ms``, from the last chunk's
    arrival there) as ``producer_*``."""
    times = []
    local = list(range(4, blocks + 4))  # other pool blocks than the source's
    for rep in range(args.reps + 1):
        _sync(dst_dev)
        start = time.perf_counter()
        client.pull(address, f"{prefix}r{rep}", 0, local, "d")
        _sync(dst_dev)
        if rep:
            times.append(time.perf_counter() - start)
            if phases is not None:
                phases.append(dict(client.last_phases_ms))
                if serve_phases is not None:
                    phases[-1].update({f"producer_{k}": v for k, v in serve_phases().items()})
    return times


def _median_phases(phases: list[dict[str, float]]) -> dict[str, float]:
    """Each phase's median over the pulls (ms from the pull's start)."""
    keys = dict.fromkeys(k for p in phases for k in p)
    return {k: round(statistics.median(p[k] for p in phases if k in p), 3) for k in keys}


def _pull_in_process(args: argparse.Namespace, backend: str, src_dev: torch.device,
                     dst_dev: torch.device
                     ) -> tuple[list[float], bool, float, dict[str, float]]:
    layers, cache, blocks = _layout(args)
    src = [torch.randn(cache, device=src_dev).to(torch.bfloat16) for _ in range(layers)]
    dst = [torch.zeros(cache, dtype=torch.bfloat16, device=dst_dev) for _ in range(layers)]
    server = KVSendServer(src, f"tcp://127.0.0.1:{free_port()}", args.send_buffer, 600.0,
                          int(args.min_direct_bytes))
    client = KVPullClient(dst, 600.0, backend, min_direct_bytes=int(args.min_direct_bytes))
    try:
        for rep in range(args.reps + 1):
            server.register(f"r{rep}", list(range(blocks)), "d", ready=True)
        _sync(src_dev)
        phases: list[dict[str, float]] = []
        times = _timed_pulls(client, server.address, args, blocks, dst_dev, phases=phases,
                             serve_phases=lambda: server.last_serve_ms)
        ok = all(torch.equal(d[:, 4:blocks + 4].cpu(), s_[:, :blocks].cpu())
                 for s_, d in zip(src, dst))
        direct = client.bytes_direct / max(1, client.bytes_received)
    finally:
        client.close()
        server.close()
    return times, ok, direct, _median_phases(phases)


# The producer of an NCCL pull: its own process (one NCCL rank per process and GPU). Its cache
# is filled from a seeded CUDA generator; it prints each layer's checksum of the pulled blocks.
_PRODUCER = """
import json, sys, torch
from tidal.engine_core.kv_transfer.p2p_transport import KVSendServer
torch.cuda.set_device(0)
layers, cache, blocks, reps, port, buffer, min_direct, streams = json.loads(sys.argv[1])
g = torch.Generator(device="cuda:0").manual_seed(0)
src = [torch.randn(cache, generator=g, device="cuda:0").to(torch.bfloat16) for _ in range(layers)]
server = KVSendServer(src, f"tcp://127.0.0.1:{port}", buffer, 600.0, min_direct)
for n in streams:
    for rep in range(reps + 1):
        server.register(f"s{n}r{rep}", list(range(blocks)), "d", ready=True)
torch.cuda.synchronize()
sums = [float(c[:, :blocks].double().sum()) for c in src]
print(json.dumps(sums), flush=True)
line = sys.stdin.readline()
while line.startswith(("raw", "phases")):
    if line.startswith("phases"):  # the last chunk's host phases here
        print(json.dumps(server.last_serve_ms), flush=True)
        line = sys.stdin.readline()
        continue
    # The NCCL ceiling: tensors over the pair the first pulls built (the only one so far), on
    # its first communicator, no protocol around them: "raw N BYTES" sends N of BYTES each.
    n, nbytes = map(int, line.split()[1:])
    pair = next(iter(server._pairs.values()))
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    works = [pair.start_send(buf) for _ in range(n)]
    for w in works:
        pair.finish(w, "send")
    torch.cuda.synchronize()
    print("raw-done", flush=True)
    line = sys.stdin.readline()
server.close()
"""


def _raw_nccl(client: KVPullClient, address: str, proc: subprocess.Popen, reps: int,
              nbytes: int, ops: int = 1) -> list[float]:
    """Seconds of each plain receive of ``nbytes`` over the pull's own NCCL pair (after a
    warm-up), as ``ops`` receives one after another on its first communicator: what NCCL
    itself does between the two GPUs, the pull's ceiling (with ``ops`` = the pull's sends:
    the ceiling of that many operations, no protocol)."""
    _, group = client._pairs[address]
    assert proc.stdin is not None and proc.stdout is not None
    part = nbytes // ops
    proc.stdin.write(f"raw {(reps + 1) * ops} {part}\n")
    proc.stdin.flush()
    buf = torch.empty(part * ops, dtype=torch.uint8, device="cuda:1")
    views = [buf[i * part:(i + 1) * part] for i in range(ops)]
    times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize(1)
        start = time.perf_counter()
        # (One communicator runs its operations in order: the last one done, all are.)
        works = [group.start_recv(v) for v in views]
        group.finish(works[-1], "receive")
        torch.cuda.synchronize(1)
        if rep:
            times.append(time.perf_counter() - start)
    if proc.stdout.readline().strip() != "raw-done":
        raise RuntimeError("the NCCL producer did not finish its raw sends")
    return times


def _ask_phases(proc: subprocess.Popen) -> dict[str, float]:
    """The NCCL producer's host phases of the last chunk it served."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("phases\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _pull_nccl(args: argparse.Namespace, pair_bytes: dict[int, int]
               ) -> tuple[dict[int, list[float]], bool, float, tuple[list[float], list[float]],
                          dict[int, dict[str, float]]]:
    """Producer on GPU 0 (a subprocess), consumer here on GPU 1: the pulls with each number
    of NCCL communicators per pair in ``--nccl-streams`` (a fresh pair each), and, with
    ``--nccl-raw``, plain NCCL receives of the same bytes over the first pair;
    ``pair_bytes`` gets each pair's device memory outside torch's allocator."""
    layers, cache, blocks = _layout(args)
    nbytes = nbytes_of(layers, cache, blocks)
    port = free_port()
    streams = list(dict.fromkeys(int(n) for n in str(args.nccl_streams).split(",")))
    spec = json.dumps([layers, list(cache), blocks, args.reps, port, args.send_buffer,
                       int(args.min_direct_bytes), streams])
    proc = subprocess.Popen([sys.executable, "-c", _PRODUCER, spec], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    address = f"tcp://127.0.0.1:{port}"
    times: dict[int, list[float]] = {}
    phases: dict[int, list[dict[str, float]]] = {}
    raw: list[float] = []
    raw_ops: list[float] = []
    direct = 0.0
    ok = True
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the NCCL producer exited ({proc.wait()})")
        sums = json.loads(line)
        dst_dev = torch.device("cuda:1")
        dst = [torch.zeros(cache, dtype=torch.bfloat16, device=dst_dev) for _ in range(layers)]
        for k, n in enumerate(streams):
            for d in dst:
                d.zero_()
            client = KVPullClient(dst, 600.0, "nccl", n,
                                  min_direct_bytes=int(args.min_direct_bytes))
            torch.cuda.synchronize(dst_dev)
            free, reserved = torch.cuda.mem_get_info(dst_dev)[0], \
                torch.cuda.memory_reserved(dst_dev)
            try:
                phases[n] = []
                times[n] = _timed_pulls(client, address, args, blocks, dst_dev, f"s{n}",
                                        phases[n], lambda: _ask_phases(proc))
                # What the pair's communicators hold on this GPU beyond torch's own memory
                # (NCCL's buffers: allocated after an engine has sized its KV cache).
                pair_bytes[n] = free - torch.cuda.mem_get_info(dst_dev)[0] - \
                    (torch.cuda.memory_reserved(dst_dev) - reserved)
                direct = client.bytes_direct / max(1, client.bytes_received)
                if args.nccl_raw and k == 0:
                    raw = _raw_nccl(client, address, proc, args.reps, nbytes)
                    # The same bytes as the pull's sends (each layer's K and V).
                    raw_ops = _raw_nccl(client, address, proc, args.reps, nbytes, 2 * layers)
            finally:
                client.close()
            got = [float(d[:, 4:blocks + 4].double().sum()) for d in dst]
            ok = ok and all(abs(a - b) <= 1e-6 * max(1.0, abs(a)) for a, b in zip(got, sums))
            progress(f"  {n} NCCL stream(s): pull "
                     f"{nbytes / statistics.median(times[n]) / 1e9:.1f} GB/s; host phases "
                     f"(ms from the pull's start): {_median_phases(phases[n])}")
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(60)
    return times, ok, direct, (raw, raw_ops), {n: _median_phases(p) for n, p in phases.items()}


def nbytes_of(layers: int, cache: tuple[int, ...], blocks: int) -> int:
    return blocks * layers * math.prod(cache[2:]) * 2 * 2  # K and V, bf16


def transfer(args: argparse.Namespace) -> dict[str, Any]:
    layers, cache, blocks = _layout(args)
    src_dev, dst_dev = _devices()
    nbytes = nbytes_of(layers, cache, blocks)
    backend = args.transport
    out: dict[str, Any] = {"devices": [str(src_dev), str(dst_dev)], "transport": backend,
                           "bytes": nbytes, "blocks": blocks, "layers": layers,
                           "send_buffer_bytes": int(args.send_buffer),
                           "min_direct_bytes": int(args.min_direct_bytes)}
    raw: list[float] = []
    raw_ops: list[float] = []
    if backend == "nccl":
        pair_bytes: dict[int, int] = {}
        by_streams, ok, direct, (raw, raw_ops), phases = _pull_nccl(args, pair_bytes)
        out["pair_device_MiB_by_nccl_streams"] = {
            n: round(b / 2**20, 1) for n, b in pair_bytes.items()}
        out["pull_GBps_by_nccl_streams"] = {
            n: round(nbytes / statistics.median(t) / 1e9, 3) for n, t in by_streams.items()}
        # Host ms from a pull's start to its first reply, all receives posted, all landed.
        out["pull_phases_ms_by_nccl_streams"] = phases
        # The headline: the connector's default number of communicators (else the first).
        streams = DEFAULT_NCCL_STREAMS if DEFAULT_NCCL_STREAMS in by_streams \
            else next(iter(by_streams))
        out["nccl_streams"] = streams
        times = by_streams[streams]
    else:
        times, ok, direct, phases_in = _pull_in_process(args, backend, src_dev, dst_dev)
        out["pull_phases_ms"] = phases_in
    # The share of the bytes sent cache to cache (runs consecutive on both sides), not staged.
    out["direct_fraction"] = round(direct, 4)
    if not ok:
        raise RuntimeError(f"the {backend} pull delivered other bytes than the producer holds")
    # The ceiling: the same bytes as one plain copy between the two devices (a host memcpy).
    a = torch.empty(nbytes, dtype=torch.uint8, device=src_dev)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst_dev)
    copies = []
    for rep in range(args.reps + 1):
        _sync(src_dev, dst_dev)
        start = time.perf_counter()
        b.copy_(a)
        _sync(src_dev, dst_dev)
        if rep:
            copies.append(time.perf_counter() - start)
    del a, b
    pull_gbps = nbytes / statistics.median(times) / 1e9
    copy_gbps = nbytes / statistics.median(copies) / 1e9
    out.update({"pull_s": [round(t, 5) for t in times], "pull_GBps": round(pull_gbps, 3),
                "copy_s": [round(t, 5) for t in copies], "copy_GBps": round(copy_gbps, 3),
                "ratio": round(pull_gbps / copy_gbps, 4)})
    if raw:
        out["nccl_raw_GBps"] = round(nbytes / statistics.median(raw) / 1e9, 3)
    if raw_ops:
        # As many receives as the pull's sends, back to back: the per-operation cost alone.
        out["nccl_raw_pull_ops"] = 2 * layers
        out["nccl_raw_pull_ops_GBps"] = round(nbytes / statistics.median(raw_ops) / 1e9, 3)
    if backend != "zmq":
        zmq_times, ok, _, _ = _pull_in_process(args, "zmq", src_dev, dst_dev)
        out["zmq_pull_GBps"] = round(nbytes / statistics.median(zmq_times) / 1e9, 3)
    return out


# --- 2. decode ITL under long prompts ----------------------------------------------------------


class Proc:
    def __init__(self, cmd: list[str], port: int, log: Path, env: dict[str, str]) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.url} did not become healthy in {timeout} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _serve(args: argparse.Namespace, model: str, log: Path, gpu: int | None,
           kv: dict[str, Any] | None = None) -> Proc:
    port = free_port()
    cmd = [sys.executable, "-m", "tidal.frontend.cli", "serve", model, "--port", str(port),
           "--load-format", "dummy", "--max-model-len", str(args.prompt_len + 256),
           *args.engine_flags.split()]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return Proc(cmd, port, log, env)


async def _stream(session: Any, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the chunks with text of one streamed completion."""
    body = {"model": "", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:300]!r}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text"):
                    times.append(time.perf_counter())
    return times


async def _workload(args: argparse.Namespace, url: str) -> dict[str, Any]:
    import aiohttp

    rng = random.Random(0)
    top = min(SHAPES[args.shape]["vocab_size"] - 1, 10000)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, top) for _ in range(n)]

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await _stream(session, url, prompt(args.stream_prompt_len), 4)  # warm-up
        start = time.perf_counter()
        streams = [asyncio.create_task(_stream(session, url, prompt(args.stream_prompt_len),
                                               args.stream_tokens))
                   for _ in range(args.streams)]
        longs = []
        while not all(s.done() for s in streams) and len(longs) < args.long_count:
            await asyncio.sleep(args.long_interval)
            longs.append(asyncio.create_task(_stream(session, url, prompt(args.prompt_len),
                                                     args.long_tokens)))
        stream_times = await asyncio.gather(*streams)
        long_times = await asyncio.gather(*longs)
        wall = time.perf_counter() - start
    gaps = [b - a for t in stream_times for a, b in zip(t, t[1:])]
    gaps.sort()
    tokens = sum(len(t) for t in stream_times) + sum(len(t) for t in long_times)
    return {"itl_p99_ms": round(gaps[int(0.99 * (len(gaps) - 1))] * 1e3, 3) if gaps else None,
            "itl_median_ms": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
            "long_prompts": len(longs), "output_tokens": tokens, "wall_s": round(wall, 3),
            "output_tok_s": round(tokens / wall, 2)}


def serving(args: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    log = tmp / "servers.log"
    two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    gpu0, gpu1 = (0, 1) if two else (None, None)
    out: dict[str, Any] = {}
    try:
        progress("colocated: one server")
        one = _serve(args, model, log, gpu0)
        try:
            one.wait_healthy(args.start_timeout)
            out["colocated"] = asyncio.run(_workload(args, one.url))
        finally:
            one.stop()
        progress("disaggregated: prefill + decode + proxy")
        kv_port = free_port()
        prefill = _serve(args, model, log, gpu0, {"kv_connector": "P2pConnector",
                                                  "kv_role": "kv_producer", "kv_port": kv_port,
                                                  "kv_buffer_size": args.send_buffer})
        decode = _serve(args, model, log, gpu1, {
            "kv_connector": "P2pConnector", "kv_role": "kv_consumer", "kv_port": free_port(),
            "kv_connector_extra_config": {"transport": args.transport}})
        proxy = None
        try:
            prefill.wait_healthy(args.start_timeout)
            decode.wait_healthy(args.start_timeout)
            port = free_port()
            proxy = Proc([sys.executable, "-m", "tidal.frontend.cli", "disagg-proxy",
                          "--prefill", prefill.url, "--decode", decode.url, "--port", str(port)],
                         port, log, dict(os.environ))
            proxy.wait_healthy(60)
            out["disaggregated"] = asyncio.run(_workload(args, proxy.url))
        finally:
            for p in (proxy, decode, prefill):
                if p is not None:
                    p.stop()
    except BaseException:
        progress(log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)")
        raise
    finally:
        if args.server_log and log.exists():
            shutil.copyfile(log, args.server_log)
    return out


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    tr = result.get("transfer") or {}
    sv = result.get("serving") or {}
    colo = (sv.get("colocated") or {}).get("itl_p99_ms")
    dis = (sv.get("disaggregated") or {}).get("itl_p99_ms")
    return judge(TARGETS, {
        "transfer_vs_copy": tr.get("ratio"),
        "itl_p99_ratio": round(dis / colo, 4) if colo and dis is not None else None,
    })


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for the dummy shape "
                   "(the servers detokenize), e.g. tests/data/qwen3")
    p.add_argument("--prompt-len", type=int, default=8192, help="tokens of a long prompt")
    p.add_argument("--send-buffer", type=float, default=256e6,
                   help="the producer's send buffer (kv_buffer_size), bytes")
    p.add_argument("--min-direct-bytes", type=float, default=DIRECT_MIN_BYTES,
                   help="a run of blocks consecutive on both sides goes cache to cache when "
                   "each of its sends (one layer's K or V) is at least this many bytes; a huge "
                   "value stages every block (the path before direct runs)")
    p.add_argument("--nccl-raw", action="store_true",
                   help="with --transport nccl: also time plain NCCL receives of the same bytes "
                   "over the pull's pair (the transport's ceiling)")
    p.add_argument("--nccl-streams", default="1,2,4",
                   help="with --transport nccl: the NCCL communicators per pair to time the "
                   "pull with, comma-separated (a fresh pair each; the headline ratio uses the "
                   f"connector's default, {DEFAULT_NCCL_STREAMS})")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--transport", default=None, choices=["nccl", "gloo", "zmq"],
                   help="the P2P transport (default: nccl with 2 GPUs, else gloo)")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--stream-prompt-len", type=int, default=128)
    p.add_argument("--stream-tokens", type=int, default=512)
    p.add_argument("--long-interval", type=float, default=0.5,
                   help="seconds between long prompts (at 1 s, 64 streams of 256 tokens on two "
                   "H100s saw only 3 of them: too few to show in the colocated ITL p99)")
    p.add_argument("--long-count", type=int, default=16)
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--engine-flags", default="", help="more flags for every tidal serve")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--skip-serving", action="store_true", help="only the transfer bandwidth")
    p.add_argument("--smoke", action="store_true", help="tiny shape on a CPU")
    p.add_argument("--output", default=None)
    p.add_argument("--server-log", default=None,
                   help="copy the servers' combined log here (it lives in a temporary folder)")
    return p


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.smoke:
        args.shape, args.prompt_len, args.reps = "tiny", 256, 2
        args.streams, args.stream_prompt_len, args.stream_tokens = 2, 16, 8
        args.long_interval, args.long_count, args.long_tokens = 0.2, 2, 2
        args.send_buffer = min(args.send_buffer, 1 << 16)  # several chunks per pull
        args.engine_flags += (" --device cpu --kv-cache-memory-bytes 33554432 "
                              "--cpu-threads 1 --api-server-count 1")
        args.start_timeout = min(args.start_timeout, 180.0)
    if args.transport is None:
        two = torch.cuda.is_available() and torch.cuda.device_count() >= 2
        args.transport = "nccl" if two else "gloo"
    result: dict[str, Any] = {"device": device_name(), "shape": args.shape,
                              "prompt_len": args.prompt_len, "smoke": args.smoke}
    progress("transfer bandwidth")
    result["transfer"] = transfer(args)
    if not args.skip_serving:
        if not args.tokenizer:
            raise SystemExit("bench_disagg: --tokenizer DIR is needed for the serving part "
                             "(dummy weights, the servers detokenize), e.g. tests/data/qwen3")
        with tempfile.TemporaryDirectory(prefix="tidal-bench-disagg-") as tmp:
            model = write_model_dir(args.shape, Path(tmp) / args.shape, args.tokenizer)
            result["serving"] = serving(args, model, Path(tmp))
    result["verdicts"] = verdicts(result)
    return result


def main() -> None:
    args = build_parser().parse_args()
    dump(run(args), args.output)


if __name__ == "__main__":
    main()
