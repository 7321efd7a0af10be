"""Benchmark: shared-memory broadcast ring vs multiprocessing.Queue vs plain ZeroMQ ipc.

One writer (this process) broadcasts to 1..N reader processes (spawn context). Each message is
two frames, like a tidal step message: a 16-byte header (seq, send time) and a body, sized so
the whole message is --small-bytes or --large-bytes. Transports:

  ring           tidal.worker.shm_broadcast, slots big enough for the message
  ring-overflow  the same ring with default 1 MiB slots, so large messages take the overflow path
  mp-queue       one multiprocessing.Queue per reader, the same (header, body) put to each
  zmq            one PUSH->PULL ipc:// socket per reader, the same frames sent to each

Throughput: messages/s from the first send to the last message received by the slowest reader;
GB/s is payload per reader stream (aggregate delivered = that x readers). Readers check the seq
of every message; ring readers get zero-copy views (they do not copy the body), which is the
ring's intended use. Latency: one-way, send stamp to receive, CLOCK_MONOTONIC (system-wide on
Linux), for small messages at a fixed pace: "hot" (gap shorter than the ring reader's spin, so
it is still polling) and "cold" (gap long enough that ring readers have gone to sleep). The
writer paces with time.sleep, so real gaps run ~50-100 us over the nominal one.

    python tools/bench_ring.py                 # defaults finish in well under a minute
    python tools/bench_ring.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import psutil
import zmq

from tidal.worker.shm_broadcast import RingHandle, ShmRingReader, ShmRingWriter

SPAWN = mp.get_context("spawn")
HDR = struct.Struct("<Qq")  # seq, send time (monotonic ns)
WAIT_S = 120.0


@dataclass(slots=True)
class Job:
    impl: str
    rank: int
    n_msgs: int  # after the warm-up message
    large: bool
    endpoint: str  # encoded ring handle (hex) or zmq address; unused for mp-queue


# ---------------------------------------------------------------- reader side

def _reader_main(job_b: bytes, queue: Any, conn: Connection) -> None:
    job = msgspec.msgpack.decode(job_b, type=Job)
    recv = _open_receiver(job, queue)
    hdr, _ = recv()  # warm-up: connections are up once this arrives
    conn.send_bytes(b"warm")
    latencies: list[int] = []
    expect = 1
    for _ in range(job.n_msgs):
        hdr, body_len = recv()
        now = time.monotonic_ns()
        seq, sent = HDR.unpack(hdr)
        if seq != expect:
            raise RuntimeError(f"{job.impl} reader {job.rank}: expected seq {expect}, got {seq}")
        expect += 1
        latencies.append(now - sent)
    conn.send_bytes(msgspec.msgpack.encode({"t_last": now, "latencies": latencies}))


def _open_receiver(job: Job, queue: Any) -> Any:
    """Returns a callable giving (header bytes, body length) for the next message."""
    if job.impl.startswith("ring"):
        handle = msgspec.msgpack.decode(bytes.fromhex(job.endpoint), type=RingHandle)
        reader = ShmRingReader.attach(handle, job.rank, f"bench-{job.rank}")

        def recv_ring() -> tuple[bytes, int]:
            hdr, body = reader.dequeue(timeout=WAIT_S)
            return bytes(hdr), len(body)
        return recv_ring
    if job.impl == "mp-queue":
        def recv_queue() -> tuple[bytes, int]:
            hdr, body = queue.get(timeout=WAIT_S)
            return hdr, len(body)
        return recv_queue
    sock = zmq.Context().socket(zmq.PULL)
    sock.connect(job.endpoint)
    copy = not job.large

    def recv_zmq() -> tuple[bytes, int]:
        hdr, body = sock.recv_multipart(copy=copy)
        return bytes(hdr), len(body)
    return recv_zmq


# ---------------------------------------------------------------- writer side

class Sender:
    """Sets up one transport to n readers and broadcasts (header, body) frames."""

    def __init__(self, impl: str, n_readers: int, msg_bytes: int, ring_slots: int) -> None:
        self.impl = impl
        self.queues: list[Any] = []
        self.socks: list[zmq.Socket] = []
        self.ring: ShmRingWriter | None = None
        self.endpoints = [""] * n_readers
        if impl == "ring":
            self.ring = ShmRingWriter.create(n_readers, slot_bytes=max(msg_bytes + 4096, 1 << 16),
                                             n_slots=ring_slots)
        elif impl == "ring-overflow":
            self.ring = ShmRingWriter.create(n_readers, n_slots=ring_slots)  # default 1 MiB slots
        elif impl == "mp-queue":
            self.queues = [SPAWN.Queue() for _ in range(n_readers)]
        elif impl == "zmq":
            self.ctx = zmq.Context()
            for r in range(n_readers):
                sock = self.ctx.socket(zmq.PUSH)
                sock.bind(f"ipc://@tidal-bench-{os.getpid()}-{r}")
                self.socks.append(sock)
                self.endpoints[r] = f"ipc://@tidal-bench-{os.getpid()}-{r}"
        else:
            raise ValueError(impl)
        if self.ring is not None:
            self.endpoints = [msgspec.msgpack.encode(self.ring.handle).hex()] * n_readers
        self.zmq_copy = msg_bytes < 65536

    def send(self, hdr: bytes, body: bytes) -> None:
        if self.ring is not None:
            self.ring.enqueue((hdr, body))
        elif self.queues:
            for q in self.queues:
                q.put((hdr, body))
        else:
            for sock in self.socks:
                sock.send_multipart((hdr, body), copy=self.zmq_copy)

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
        for q in self.queues:
            q.close()
            q.join_thread()
        for sock in self.socks:
            sock.close(linger=0)
        if self.socks:
            self.ctx.term()


def run_one(impl: str, n_readers: int, msg_bytes: int, n_msgs: int, ring_slots: int,
            gap_s: float | None = None) -> dict[str, Any]:
    """Broadcast n_msgs (plus one warm-up) and gather the readers' timings."""
    sender = Sender(impl, n_readers, msg_bytes, ring_slots)
    body = os.urandom(msg_bytes - HDR.size)
    procs, conns = [], []
    try:
        for r in range(n_readers):
            job = Job(impl, r, n_msgs, msg_bytes >= 65536, sender.endpoints[r])
            recv_end, send_end = SPAWN.Pipe(duplex=False)
            queue = sender.queues[r] if sender.queues else None
            p = SPAWN.Process(target=_reader_main, daemon=True,
                              args=(msgspec.msgpack.encode(job), queue, send_end))
            p.start()
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
        sender.send(HDR.pack(0, time.monotonic_ns()), body)
        for c in conns:
            if not c.poll(WAIT_S):
                raise RuntimeError(f"{impl}: reader did not start")
            c.recv_bytes()
        t0 = time.monotonic_ns()
        next_t = t0
        for seq in range(1, n_msgs + 1):
            if gap_s is not None:
                # Sleep rather than busy-wait: a pacing loop hogging a core would starve the
                # readers on a small box and measure contention instead of the transport.
                next_t += int(gap_s * 1e9)
                time.sleep(max(0.0, (next_t - time.monotonic_ns()) / 1e9))
            sender.send(HDR.pack(seq, time.monotonic_ns()), body)
        results = []
        for c in conns:
            if not c.poll(WAIT_S):
                raise RuntimeError(f"{impl}: reader did not finish")
            results.append(msgspec.msgpack.decode(c.recv_bytes()))
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        sender.close()
    seconds = (max(r["t_last"] for r in results) - t0) / 1e9
    lat_us = sorted(ns / 1e3 for r in results for ns in r["latencies"])
    return {"seconds": seconds, "latencies_us": lat_us}


# ---------------------------------------------------------------- driver

def machine() -> dict[str, Any]:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "cpu_model": model,
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "pyzmq": zmq.pyzmq_version(),
        "libzmq": zmq.zmq_version(),
        # Other work on the box skews these numbers; record how busy it was at the end.
        "loadavg_1m_5m": [round(x, 2) for x in os.getloadavg()[:2]],
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default="ring,ring-overflow,mp-queue,zmq")
    ap.add_argument("--readers", default="1,2", help="comma-separated reader counts")
    ap.add_argument("--small-bytes", type=int, default=1024)
    ap.add_argument("--large-bytes", type=int, default=4 << 20)
    ap.add_argument("--small-count", type=int, default=20000)
    ap.add_argument("--large-count", type=int, default=100)
    ap.add_argument("--hot-gap-us", type=float, default=200.0,
                    help="latency pacing inside the ring reader's 0.5 ms spin window")
    ap.add_argument("--hot-count", type=int, default=2000)
    ap.add_argument("--cold-gap-ms", type=float, default=5.0,
                    help="latency pacing long enough that ring readers are asleep")
    ap.add_argument("--cold-count", type=int, default=300)
    ap.add_argument("--ring-slots", type=int, default=8,
                    help="ring depth; slots: max(msg + 4 KiB, 64 KiB), 1 MiB for ring-overflow")
    ap.add_argument("--json", help="also write the JSON result to this file")
    args = ap.parse_args(argv)
    impls = args.impls.split(",")
    readers = [int(x) for x in args.readers.split(",")]

    results: list[dict[str, Any]] = []
    start = time.monotonic()
    for size, count in ((args.small_bytes, args.small_count), (args.large_bytes, args.large_count)):
        for n in readers:
            for impl in impls:
                if impl == "ring-overflow" and size <= (1 << 20) - 4096:
                    continue  # would not overflow; identical to "ring"
                out = run_one(impl, n, size, count, args.ring_slots)
                results.append({
                    "kind": "throughput", "impl": impl, "readers": n, "msg_bytes": size,
                    "messages": count, "seconds": round(out["seconds"], 4),
                    "msgs_per_s": round(count / out["seconds"], 1),
                    "gb_per_s_per_reader": round(count * size / out["seconds"] / 1e9, 3),
                })
                print(f"  throughput {impl:>13} readers={n} {size:>8} B: "
                      f"{results[-1]['msgs_per_s']:>10.0f} msg/s", file=sys.stderr)
    for regime, gap_s, count in (("hot", args.hot_gap_us / 1e6, args.hot_count),
                                 ("cold", args.cold_gap_ms / 1e3, args.cold_count)):
        for impl in impls:
            if impl == "ring-overflow":
                continue
            lat = run_one(impl, 1, args.small_bytes, count, args.ring_slots, gap_s)["latencies_us"]
            results.append({
                "kind": "latency", "impl": impl, "readers": 1, "msg_bytes": args.small_bytes,
                "regime": regime, "gap_us": round(gap_s * 1e6, 1), "messages": count,
                "median_us": round(statistics.median(lat), 1),
                "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 1),
            })
            print(f"  latency {regime} {impl:>13}: median {results[-1]['median_us']} us",
                  file=sys.stderr)

    report = {
        "workload": {k: v for k, v in vars(args).items() if k != "json"}
        | {"message": "2 frames: 16-byte header + body; sizes are totals",
           "wall_s": round(time.monotonic() - start, 1)},
        "machine": machine(),
        "results": results,
    }
    text = json.dumps(report)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print_table(results)


def print_table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'impl':>14} {'readers':>7} {'msg size':>9} {'msgs/s':>11} {'GB/s/reader':>12}")
    for r in results:
        if r["kind"] == "throughput":
            b = r["msg_bytes"]
            size = f"{b // 1024} KiB" if b < 1 << 20 else f"{b >> 20} MiB"
            print(f"{r['impl']:>14} {r['readers']:>7} {size:>9} {r['msgs_per_s']:>11.0f} "
                  f"{r['gb_per_s_per_reader']:>12.3f}")
    print(f"\n{'impl':>14} {'regime':>7} {'gap':>9} {'median us':>11} {'p99 us':>12}")
    for r in results:
        if r["kind"] == "latency":
            print(f"{r['impl']:>14} {r['regime']:>7} {r['gap_us']:>7.0f}us {r['median_us']:>11.1f} "
                  f"{r['p99_us']:>12.1f}")


if __name__ == "__main__":
    main()
