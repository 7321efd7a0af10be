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

from tidal.engine_core import envs, stack_dump
from tidal.engine_core.cli import HelpFormatter, apply_log_level
from tidal.engine_core.config import EngineArgs

logger = logging.getLogger("tidal.cli")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    # One flag per EngineArgs field, spelled as vLLM's (shared with the engine-core command).
    from tidal.engine_core.cli import add_engine_args, add_log_level_arg

    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF model folder or .gguf file (default: the bundled "
                        "SmolLM2-135M-Instruct); same as --model")
    add_log_level_arg(p)
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
                           formatter_class=HelpFormatter)
    _engine_flags(serve)
    s = serve.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (0.0.0.0: every interface)")
    s.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (or set TIDAL_API_KEY); "
                        "default: no key")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    s.add_argument("--engine-address", default=None,
                   help="connect to a running `engine-core` at this address (tcp://HOST:PORT "
                        "or ipc://PATH) instead of starting an engine; default: start one")
    s.add_argument("--engine-connect-timeout", type=float, default=30.0,
                   help="seconds to wait for the engine-core at --engine-address to answer "
                        "(it answers once it has loaded its model)")
    s.add_argument("--engine-stall-timeout", type=float, default=60.0,
                   help="seconds requests may wait with no engine step finished before "
                        "/health answers 503 engine_stalled (200 again once steps resume; "
                        "requests in flight carry on); default: 60, longer than any healthy "
                        "step (a JIT compile or a full GC included), yet short enough for a "
                        "load balancer to route around a stopped or stuck engine well before "
                        "clients time out")
    s.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (file or inline) overriding the model's; "
                        "default: the model's")
    s.add_argument("--max-request-bytes", type=int, default=None,
                   help="largest request body accepted, in bytes (413 above); default: "
                        "4 MiB")
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
    s.add_argument("--metrics-prefix", default="tidal",
                   help="name prefix of the /metrics families ('{prefix}:num_requests_running', "
                        "...); the families are vLLM's (names, labels, buckets), so 'vllm' "
                        "makes dashboards and alerts written for vLLM work unchanged")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open connections per API server process; at the bound a new "
                        "connection closes the longest-idle one (no request in progress), or "
                        "gets an immediate 503 if all are busy; default: the open-file limit "
                        "(raised to its hard limit at start-up) less an eighth (at least 256 "
                        "kept free), at most 65536")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has, from opening or from the first byte of its "
                        "next request, to send a complete request header; then it is closed")
    s.add_argument("--body-timeout", type=float, default=60.0,
                   help="seconds a request body has to arrive after its header; then the "
                        "request gets a 408 and the connection is closed")
    s.add_argument("--keep-alive-timeout", type=float, default=75.0,
                   help="seconds an idle kept-alive connection stays open (keep it above your "
                        "load balancer's idle timeout)")
    s.add_argument("--root-path", default="",
                   help="URL path prefix under which a proxy publishes the server (vLLM's "
                        "--root-path), e.g. /llm: every route answers both at /llm/... and at "
                        "its own path (for a proxy that strips the prefix); default: none")
    s.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count generation requests in flight (completions, chat, embeddings; "
                        "over every API server process) for GET /load; without it /load "
                        "reports 0, as in vLLM")
    s.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details (how many prompt tokens came from the "
                        "prefix cache) to responses")
    s.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="show logprob tokens as 'token_id:<id>' (a request's own "
                        "return_tokens_as_token_ids overrides this)")
    # --reasoning-parser is an engine flag (EngineArgs.reasoning_parser): the engine core
    # needs it too, for grammars after the thinking and thinking budgets.
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls out of chat outputs for tools with tool_choice "
                        "\"auto\" (needs --tool-call-parser)")
    s.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call format: hermes, llama3_json, mistral, pythonic, "
                        "openai (gpt-oss harmony, with --reasoning-parser gpt_oss), or one a "
                        "--tool-parser-plugin registers (default: none)")
    s.add_argument("--tool-parser-plugin", default=None, metavar="PATH",
                   help="a Python file that registers tool parsers "
                        "(tidal.frontend.tool_parsers.register_tool_parser; default: none)")
    s.add_argument("--max-stored-responses", type=int, default=1000, metavar="N",
                   help="/v1/responses kept in memory for previous_response_id and GET "
                        "(per API server process; least recently used evicted first; 0: "
                        "none; default: 1000)")
    s.add_argument("--max-stored-response-bytes", type=int, default=64 << 20, metavar="BYTES",
                   help="the bytes those stored responses may take in all (default: 64 MiB)")
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters served by name (needs --enable-lora): name=path, or the "
                        "JSON form {\"name\": ..., \"path\": ..., \"base_model_name\": ...}; "
                        "default: none")
    s.add_argument("--lora-resolver-dir", default=None, metavar="DIR",
                   help="an unknown model name NAME is the LoRA adapter in DIR/NAME, loaded on "
                        "first use (needs --enable-lora); default: none")
    # (--disable-log-stats is an engine flag: no stats line, no stat logger plugins)

    gen = sub.add_parser("generate", help="generate from one prompt and stream it to stdout",
                         description="Generate a continuation of one prompt and stream the text "
                                     "to stdout (log lines go to stderr).",
                         formatter_class=HelpFormatter)
    gen.add_argument("prompt", help="the text to continue (with --chat: the user's message)")
    _engine_flags(gen)
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message")

    proxy = sub.add_parser(
        "disagg-proxy", formatter_class=HelpFormatter,
        help="one OpenAI endpoint over a prefill and a decode instance (disaggregated serving)",
        description="Send each completion to the prefill instance for one token, then to the "
                    "decode instance with the prefill's kv_transfer_params (its KV is pulled, "
                    "not recomputed); relay the decode instance's answer.")
    from tidal.engine_core.cli import add_log_level_arg
    from tidal.frontend.disagg_proxy import add_proxy_args

    add_proxy_args(proxy)
    add_log_level_arg(proxy)
    return parser


def _setup_logging(level: str) -> None:
    apply_log_level(level)  # the engine and worker processes started from here log alike
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stack_dump.install()


def _chat_template(value: str | None) -> str | None:
    if value is None or "{" in value:
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise SystemExit(f"tidal: cannot read --chat-template {value}: {exc.strerror}") from None


def _start_engine(engine_args: EngineArgs, address: str | None, stream_interval: int = 1,
                  connect_timeout: float | None = None) -> Any:
    from tidal.frontend.async_llm import AsyncLLM, EngineDeadError
    from tidal.frontend.mp_client import EngineStartupError

    try:
        if address is None:
            return AsyncLLM.from_engine_args(engine_args, stream_interval=stream_interval)
        # The engine's own config (model, limits) wins; only the tokenizer may be overridden,
        # for a frontend on a host where the engine's model path does not exist.
        return AsyncLLM.from_address(address, tokenizer=engine_args.tokenizer,
                                     timeout_s=connect_timeout, stream_interval=stream_interval)
    except (ValueError, OSError, EngineStartupError, EngineDeadError) as exc:
        if address is not None:
            raise SystemExit(
                f"tidal: could not connect to the engine-core at {address} ({exc}).\n"
                f"Start it first (`engine-core --listen {address} [engine flags]`), check the "
                "address and that this host can reach it, or leave out --engine-address to "
                "start an engine in this server. An engine-core answers once its model is "
                "loaded: --engine-connect-timeout SECONDS waits longer.") from None
        # ConfigError and a missing model are ValueError / FileNotFoundError.
        raise SystemExit(f"tidal: cannot start the engine: {exc}") from None


def _server_settings(ns: argparse.Namespace) -> Any:
    from tidal.frontend.server.sampling import ServerLimits
    from tidal.frontend.server.state import ServerSettings, normalize_root_path

    if ns.stream_interval < 1:
        raise SystemExit(f"tidal: --stream-interval must be >= 1, got {ns.stream_interval}")
    from tidal.frontend.server.metrics import check_prefix

    try:
        check_prefix(ns.metrics_prefix)
    except ValueError as exc:
        raise SystemExit(f"tidal: --metrics-prefix: {exc}") from None
    if not ns.engine_stall_timeout > 0:
        raise SystemExit(f"tidal: --engine-stall-timeout must be > 0 seconds, got "
                         f"{ns.engine_stall_timeout}")
    if not ns.engine_connect_timeout > 0:
        raise SystemExit(f"tidal: --engine-connect-timeout must be > 0, got "
                         f"{ns.engine_connect_timeout}")
    for flag in ("header_timeout", "body_timeout", "keep_alive_timeout"):
        if not getattr(ns, flag) > 0:
            raise SystemExit(f"tidal: --{flag.replace('_', '-')} must be > 0 seconds, got "
                             f"{getattr(ns, flag)}")
    if ns.max_stored_responses < 0 or ns.max_stored_response_bytes < 0:
        raise SystemExit("tidal: --max-stored-responses and --max-stored-response-bytes must "
                         "be >= 0")
    if ns.max_connections is not None and ns.max_connections < 1:
        raise SystemExit(f"tidal: --max-connections must be >= 1, got {ns.max_connections}")
    try:
        root_path = normalize_root_path(ns.root_path)
    except ValueError as exc:
        raise SystemExit(f"tidal: --root-path: {exc}") from None
    from tidal.frontend.server.chat_parsing import server_parsers

    try:
        server_parsers(ns.reasoning_parser, ns.tool_call_parser, ns.enable_auto_tool_choice,
                       ns.tool_parser_plugin)
    except ValueError as exc:
        raise SystemExit(f"tidal: {exc}") from None
    from tidal.frontend.server.lora_models import parse_lora_modules

    try:
        lora_modules = parse_lora_modules(ns.lora_modules)
    except ValueError as exc:
        raise SystemExit(f"tidal: {exc}") from None
    if (lora_modules or ns.lora_resolver_dir) and not ns.engine_address \
            and not getattr(ns, "enable_lora", False):
        raise SystemExit("tidal: --lora-modules and --lora-resolver-dir need --enable-lora")
    if ns.lora_resolver_dir is not None and not os.path.isdir(ns.lora_resolver_dir):
        raise SystemExit(f"tidal: --lora-resolver-dir {ns.lora_resolver_dir} is not a folder")
    limits = ServerLimits()
    if ns.max_request_bytes is not None:
        limits = ServerLimits(max_body_bytes=ns.max_request_bytes)
    return ServerSettings(
        host=ns.host,
        port=ns.port,
        api_key=ns.api_key or envs.api_key(),
        max_queued_requests=ns.max_queued_requests,
        shutdown_timeout=ns.shutdown_timeout,
        limits=limits,
        chat_template=_chat_template(ns.chat_template),
        access_log=ns.access_log,
        stream_interval=ns.stream_interval,
        metrics_prefix=ns.metrics_prefix,
        engine_connect_timeout=ns.engine_connect_timeout,
        engine_stall_timeout=ns.engine_stall_timeout,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
        return_tokens_as_token_ids=ns.return_tokens_as_token_ids,
        reasoning_parser=ns.reasoning_parser,
        tool_call_parser=ns.tool_call_parser,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_parser_plugin=ns.tool_parser_plugin,
        max_stored_responses=ns.max_stored_responses,
        max_stored_response_bytes=ns.max_stored_response_bytes,
        max_connections=ns.max_connections,
        header_timeout=ns.header_timeout,
        body_timeout=ns.body_timeout,
        keep_alive_timeout=ns.keep_alive_timeout,
        root_path=root_path,
        enable_server_load_tracking=ns.enable_server_load_tracking,
        lora_modules=tuple(lora_modules),
        lora_resolver_dir=ns.lora_resolver_dir,
        allow_runtime_lora_updating=envs.allow_runtime_lora_updating(),
        disable_log_stats=ns.disable_log_stats,
    )


def _api_server_count(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    from tidal.frontend.server.api_servers import default_api_server_count

    if envs.allow_runtime_lora_updating():
        # Each API server process keeps its own adapter table: one that loads an adapter at
        # run time cannot tell the others.
        if ns.api_server_count is not None and ns.api_server_count > 1:
            raise SystemExit("tidal: TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1 needs one API server "
                             "process (--api-server-count 1): the others would not see the "
                             "adapters it loads")
        logger.info("API server processes: 1 (TIDAL_ALLOW_RUNTIME_LORA_UPDATING=1)")
        return 1
    if ns.api_server_count is not None:
        if ns.api_server_count < 1:
            raise SystemExit(f"tidal: --api-server-count must be >= 1, got "
                             f"{ns.api_server_count}")
        logger.info("API server processes: %d (--api-server-count)", ns.api_server_count)
        return ns.api_server_count
    world = 1 if ns.engine_address else (engine_args.tensor_parallel_size
                                         * engine_args.pipeline_parallel_size
                                         * engine_args.data_parallel_size)
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
        engine = _start_engine(engine_args, ns.engine_address, settings.stream_interval,
                               settings.engine_connect_timeout)
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
    if ns.command == "disagg-proxy":  # no engine of its own
        from tidal.frontend.disagg_proxy import run_proxy

        sys.exit(run_proxy(ns))
    from tidal.engine_core.plugins import PluginError, load_general_plugins

    try:
        load_general_plugins()  # before anything reads the model's config
    except PluginError as exc:
        raise SystemExit(f"tidal: {exc}") from None
    import uvloop

    from tidal.frontend.server.app import ServerStartError

    engine_args = _engine_args(ns)
    try:
        if engine_args.data_parallel_size > 1 and getattr(ns, "engine_address", None):
            raise SystemExit("tidal: --data-parallel-size with --engine-address is not yet "
                             "supported: `tidal serve --data-parallel-size N` starts the N "
                             "EngineCores itself")
        # Data-parallel ranks are started and watched by the multi-process supervisor, also
        # with one API server.
        if ns.command == "serve" and ((count := _api_server_count(ns, engine_args)) > 1
                                      or engine_args.data_parallel_size > 1):
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
