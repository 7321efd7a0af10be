"""The ``tidal`` command.

    tidal serve [MODEL] [--port 8000] [--api-key KEY] ...   OpenAI-compatible server
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


def _start_engine(engine_args: EngineArgs, address: str | None) -> Any:
    from tidal.frontend.async_llm import AsyncLLM, EngineDeadError
    from tidal.frontend.mp_client import EngineStartupError

    try:
        if address is None:
            return AsyncLLM.from_engine_args(engine_args)
        # The engine's own config (model, limits) wins; only the tokenizer may be overridden,
        # for a frontend on a host where the engine's model path does not exist.
        return AsyncLLM.from_address(address, tokenizer=engine_args.tokenizer)
    except (ValueError, OSError, EngineStartupError, EngineDeadError) as exc:
        # ConfigError and a missing model are ValueError / FileNotFoundError.
        raise SystemExit(f"tidal: cannot start the engine: {exc}") from None


async def _serve(ns: argparse.Namespace) -> int:
    from tidal.frontend.server.app import bind_socket, serve
    from tidal.frontend.server.sampling import ServerLimits
    from tidal.frontend.server.state import ServerSettings

    limits = ServerLimits()
    if ns.max_request_bytes is not None:
        limits = ServerLimits(max_body_bytes=ns.max_request_bytes)
    settings = ServerSettings(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key or os.environ.get("TIDAL_API_KEY") or None,
        max_queued_requests=ns.max_queued_requests,
        shutdown_timeout=ns.shutdown_timeout,
        limits=limits,
        chat_template=_chat_template(ns.chat_template),
        access_log=ns.access_log,
    )
    sock = bind_socket(settings)
    try:
        engine = _start_engine(_engine_args(ns), ns.engine_address)
    except BaseException:
        sock.close()
        raise
    return await serve(engine, settings, sock)


async def _generate(ns: argparse.Namespace) -> int:
    from tidal.engine_core.sampling_params import OutputKind, SamplingParams

    engine = _start_engine(_engine_args(ns), None)
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

    runner = _serve if ns.command == "serve" else _generate
    try:
        code = uvloop.run(runner(ns))
    except ServerStartError as exc:
        raise SystemExit(f"tidal: {exc}") from None
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
