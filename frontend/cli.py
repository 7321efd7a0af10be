"""The ``tidal`` command.

    tidal serve [MODEL] [--port 8000] [--api-key KEY] ...   OpenAI-compatible server
    tidal serve ... --api-server-count 4                     ... over four API server processes
    tidal generate "The sky is" [MODEL] [--max-tokens 32]   one prompt, streamed to stdout

Flags are named as vLLM's; ``tidal serve --help`` lists them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from tidal.engine_core.config import EngineArgs
from tidal.engine_core.envs import log_level

logger = logging.getLogger("tidal.cli")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    # One flag per EngineArgs field, spelled as vLLM's (shared with the engine-core command).
    from tidal.engine_core.cli import add_engine_args

    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct); same as --model")
    p.add_argument("--log-level", default=log_level().lower(),
                   choices=("debug", "info", "warning", "error"))
    add_engine_args(p)


def _engine_args(ns: argparse.Namespace) -> EngineArgs:
    from tidal.engine_core.cli import engine_args_from

    if ns.model_pos is not None:
        if ns.model is not None and ns.model != ns.model_pos:
            raise SystemExit("tidal: give the model once, as MODEL or as --model")
        ns.model = ns.model_pos
    return engine_args_from(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidal", description="tidal LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    _engine_flags(serve)
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set TIDAL_API_KEY)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--engine-address", default=None,
                   help="connect to a running `engine-core` at this address instead of "
                        "starting an engine")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or inline) overriding the model's")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted (413 above)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument("--api-server-count", type=int, default=None,
                   help="API server processes sharing the port over one engine (each "
                        "tokenizes, detokenizes and streams its own requests); default: from "
                        "the CPU count, two cores per process after the engine's (1 on a "
                        "machine of up to 6 cores)")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk: a stream sends its first token at once, "
                        "then every N tokens and at the end (1: every token); larger values "
                        "cost the server less per token")

    gen = sub.add_parser("generate", help="generate from one prompt and stream it to stdout")
    gen.add_argument("prompt")
    _engine_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _chat_template(value: str | None) -> str | None:
    if value is None or "{" in value:
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise SystemExit(f"tidal: cannot read --chat-template {value}: {exc.strerror}") from None


def _start_engine(engine_args: EngineArgs, address: str | None, stream_interval: int = 1) -> Any:
    from tidal.frontend.async_llm import AsyncLLM, EngineDeadError
    from tidal.frontend.mp_client import EngineStartupError

    try:
        if address is None:
            return AsyncLLM.from_engine_args(engine_args, stream_interval=stream_interval)
        # The engine's own config (model, limits) wins; only the tokenizer may be overridden,
        # for a frontend on a host where the engine's model path does not exist.
        return AsyncLLM.from_address(address, tokenizer=engine_args.tokenizer,
                                     stream_interval=stream_interval)
    except (ValueError, OSError, EngineStartupError, EngineDeadError) as exc:
        # ConfigError and a missing model are ValueError / FileNotFoundError.
        raise SystemExit(f"tidal: cannot start the engine: {exc}") from None


def _server_settings(ns: argparse.Namespace) -> Any:
    from tidal.frontend.server.sampling import ServerLimits
    from tidal.frontend.server.state import ServerSettings

    if ns.stream_interval < 1:
        raise SystemExit(f"tidal: --stream-interval must be >= 1, got {ns.stream_interval}")
    limits = ServerLimits()
    if ns.max_request_bytes is not None:
        limits = ServerLimits(max_body_bytes=ns.max_request_bytes)
    return ServerSettings(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key or os.environ.get("TIDAL_API_KEY") or None,
        max_queued_requests=ns.max_queued_requests,
        shutdown_timeout=ns.shutdown_timeout,
        limits=limits,
        chat_template=_chat_template(ns.chat_template),
        access_log=ns.access_log,
        stream_interval=ns.stream_interval,
    )


def _api_server_count(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from tidal.frontend.server.api_servers import default_api_server_count

    if ns.api_server_count is not None:
        if ns.api_server_count < 1:
            raise SystemExit(f"tidal: --api-server-count must be >= 1, got "
                             f"{ns.api_server_count}")
        logger.info("API server processes: %d (--api-server-count)", ns.api_server_count)
        return ns.api_server_count
    world = 1 if ns.engine_address else (engine_args.tensor_parallel_size
                                         * engine_args.pipeline_parallel_size)
    count = default_api_server_count(world)
    logger.info("API server processes: %d (the default for %d CPU cores; --api-server-count "
                "sets it)", count, len(os.sched_getaffinity(0)))
    return count


def _serve_many(ns: argparse.Namespace, engine_args: EngineArgs, count: int) -> int:
    from tidal.engine_core.config import ConfigError
    from tidal.frontend.server import api_servers

    try:
        return api_servers.run(engine_args, _server_settings(ns), count, ns.engine_address)
    except (ConfigError, ValueError, OSError) as exc:
        raise SystemExit(f"tidal: cannot start the engine: {exc}") from None


async def _serve(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from tidal.frontend.server.app import bind_socket, serve

    settings = _server_settings(ns)
    sock = bind_socket(settings)
    try:
        engine = _start_engine(engine_args, ns.engine_address, settings.stream_interval)
    except BaseException:
        sock.close()
        raise
    return await serve(engine, settings, sock)


async def _generate(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from tidal.engine_core.sampling_params import OutputKind, SamplingParams

    engine = _start_engine(engine_args, None)
    try:
        params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature,
                                output_kind=OutputKind.DELTA)
        prompt: str | list[int] = ns.prompt
        if ns.chat:
            prompt = await engine.apply_chat_template([{"role": "user", "content": ns.prompt}])
        async for out in engine.generate(prompt, params, "generate-0"):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0


def main(argv: list[str] | None = None) -> None:
    ns = build_parser().parse_args(argv)
    _setup_logging(ns.log_level)
    import uvloop

    from tidal.frontend.server.app import ServerStartError

    engine_args = _engine_args(ns)
    try:
        if ns.command == "serve" and (count := _api_server_count(ns, engine_args)) > 1:
            code = _serve_many(ns, engine_args, count)
        else:
            runner = _serve if ns.command == "serve" else _generate
            code = uvloop.run(runner(ns, engine_args))
    except ServerStartError as exc:
        raise SystemExit(f"tidal: {exc}") from None
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
