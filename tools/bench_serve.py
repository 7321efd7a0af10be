"""Online serving benchmark (BENCHMARKS.md, workload 4), against tidal or any OpenAI-compatible
server.

    python tools/bench_serve.py --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --input-len 128 --output-len 64 --request-rate inf [--max-concurrency 32]

Requests are POSTed to ``/v1/completions`` with ``stream=true``,
``stream_options.include_usage=true`` and ``ignore_eos=true``; arrivals are all at t=0
(``--request-rate inf``) or gamma-distributed (``--burstiness`` 1 = Poisson) and rescaled so the
last send is at N/rate. Timings are client-side ``time.perf_counter``:

    TTFT = first chunk with text - send          ITL  = gaps between chunks with text
    E2EL = last chunk - send                     TPOT = (E2EL - TTFT) / (output tokens - 1)

with token counts from the server's ``usage``. An untimed lone request first warms the server
up and measures the batch-1 decode rate of this same run: the reference the result is reported
against (a client cannot measure the server's hardware ceiling). Prints a human table on stderr
and one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

# Common short English words: roughly one token each in most BPE vocabularies, so a prompt of
# N words is about N tokens (the exact count comes back in ``usage``).
_WORDS = ("the of and to in is was for on are as with his they at be this from have or by one "
          "had not but what all were when we there can an your which their said if do will each "
          "about how up out them then she many some so these would other into has more her two "
          "like him see time could no make than first been its who now people my made over did "
          "down only way find use may water long little very after words called just where most "
          "know get through back much go good new write our used me man day too any same right "
          "look think also around another came come work three word must because does part").split()


@dataclass(slots=True)
class Result:
    ok: bool
    send: float = 0.0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2el is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


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


async def one_request(session: aiohttp.ClientSession, args: argparse.Namespace,
                      prompt: str | list[int], max_tokens: int) -> Result:
    body = {"model": args.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "temperature": args.temperature}
    result = Result(ok=False)
    result.send = time.perf_counter()
    last_text = None
    try:
        async with session.post(args.base_url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return result
            last = result.send
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return result
                last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"].get("prompt_tokens", 0)
                    result.output_tokens = chunk["usage"].get("completion_tokens", 0)
                if any(c.get("text") for c in chunk.get("choices") or []):
                    if result.ttft is None:
                        result.ttft = now - result.send
                    else:
                        result.itl.append(now - last_text)
                    last_text = now
            result.e2el = last - result.send
            result.ok = result.ttft is not None
            if not result.ok:
                result.error = "the stream carried no text"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)
    out_lens = [max(1, int(round(args.output_len * (1 + rng.uniform(-args.range_ratio,
                                                                      args.range_ratio)))))
                for _ in prompts]
    offsets = arrival_times(len(prompts), args.request_rate, args.burstiness,
                            np.random.default_rng(args.seed))
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout,
                                     connector=connector) as session:
        server = await server_info(session, args)
        lone = await one_request(session, args, prompts[0], args.output_len)
        if not lone.ok:
            raise SystemExit(f"bench_serve: the warm-up request failed: {lone.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        start = time.perf_counter()

        async def scheduled(i: int) -> Result:
            delay = start + offsets[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                return await one_request(session, args, prompts[i], out_lens[i])
            async with sem:
                return await one_request(session, args, prompts[i], out_lens[i])

        results = await asyncio.gather(*[scheduled(i) for i in range(len(prompts))])
        duration = time.perf_counter() - start
    return report(args, results, duration, lone, server)


async def server_info(session: aiohttp.ClientSession, args: argparse.Namespace) -> dict:
    info: dict = {"base_url": args.base_url}
    try:
        async with session.get(args.base_url + "/v1/models") as resp:
            models = (await resp.json()).get("data") or []
        if args.model is None:
            if not models:
                raise SystemExit("bench_serve: the server lists no model; pass --model")
            args.model = models[0]["id"]
        info["model"] = args.model
        info["max_model_len"] = next((m.get("max_model_len") for m in models
                                      if m.get("id") == args.model), None)
    except (aiohttp.ClientError, ValueError) as exc:
        raise SystemExit(f"bench_serve: cannot reach {args.base_url}: {exc}") from None
    try:
        async with session.get(args.base_url + "/version") as resp:
            if resp.status == 200:
                info["version"] = (await resp.json()).get("version")
    except (aiohttp.ClientError, ValueError):
        pass
    return info


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    arr = np.asarray(values) * scale
    return {"mean": float(arr.mean()), "median": float(np.median(arr)),
            "p90": float(np.percentile(arr, 90)), "p99": float(np.percentile(arr, 99))}


def _slo_ok(r: Result, slos: dict[str, float]) -> bool:
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el}
    return all(got[k] is not None and got[k] * 1000.0 <= v for k, v in slos.items())


def report(args: argparse.Namespace, results: list[Result], duration: float, lone: Result,
           server: dict) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    slos = parse_goodput(args.goodput)
    lone_rate = (lone.output_tokens - 1) / (lone.e2el - lone.ttft) if (
        lone.tpot and lone.e2el and lone.ttft is not None and lone.e2el > lone.ttft) else None
    output_tps = out_tokens / duration
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
            "e2el_ms": _stats([r.e2el for r in ok if r.e2el is not None]),
        },
        "ratio": {"output_throughput_vs_lone_stream": (output_tps / lone_rate)
                  if lone_rate else None},
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
    lone = rep["ceiling"]["lone_output_tok_s"]
    ratio = rep["ratio"]["output_throughput_vs_lone_stream"]
    if lone:
        lines.append(f"lone stream tok/s {lone:.1f}  (batched output is {ratio:.1f}x)")
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
    p.add_argument("--device-note", default=None,
                   help="what the server runs on (free text, copied into the JSON)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    return p


def main() -> None:
    args = build_parser().parse_args()
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        raise SystemExit("bench_serve: --num-prompts, --input-len and --output-len must be >= 1")
    rep = asyncio.run(run(args))
    print_table(rep)
    text = json.dumps(rep, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
