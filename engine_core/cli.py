"""``engine-core``: run an EngineCore alone, for frontends to connect to by address.

    engine-core --model PATH --listen tcp://127.0.0.1:5555 [engine flags]
    engine-core --model PATH --listen 5555          # the same
    engine-core --model PATH                        # ipc:// in a fresh temporary directory

Frontends connect with ``AsyncLLM.from_address(ADDRESS)``; several may share one engine. TCP
binds loopback unless the address names another host (``tcp://*:5555`` binds every interface:
there is no authentication, so only do that on a trusted network). The log shows each start-up
phase with its duration, then ``EngineCore serving at ADDRESS``. SIGTERM or Ctrl-C shut down
gracefully (connected frontends are told); the exit code is 0 then, 1 if the engine failed.

The engine flags are ``EngineArgs``' fields, spelled ``--field-name`` (``add_engine_args``
builds them, so other command lines can reuse it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from tidal.engine_core.config import ConfigError, EngineArgs

logger = logging.getLogger("tidal.engine_core.cli")

_HELP = {
    "model": "an HF model folder (config.json + *.safetensors) or a .gguf file",
    "num_kv_blocks": "force the number of KV cache blocks instead of measuring",
    "distributed_executor_backend": "uni | mp | ray | noop (no model: overhead benchmarks)",
    "hf_overrides": "JSON object applied to the model's HF config",
    "cpu_threads": "torch threads of a CPU worker",
}


def _parser_type(annotation: str) -> Any:
    """argparse ``type`` of an ``EngineArgs`` field from its (string) annotation."""
    base = annotation.replace(" | None", "").strip()
    if base.startswith("dict"):
        return json.loads
    return {"int": int, "float": float, "str": str}.get(base, str)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per ``EngineArgs`` field, defaults from the dataclass."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        annotation = str(f.type)
        default = EngineArgs.__dataclass_fields__[f.name].default
        if default is dataclasses.MISSING:
            default = None  # default_factory fields (hf_overrides): unset means the factory's
        helptext = _HELP.get(f.name, "")
        if annotation == "bool":
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                               default=default, help=helptext or None)
        else:
            # The parsers use ArgumentDefaultsHelpFormatter: it appends the default to a help
            # text (and skips a flag without one).
            group.add_argument(flag, dest=f.name, type=_parser_type(annotation), default=default,
                               help=helptext or "default: %(default)s")


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if values.get("hf_overrides") is None:
        values.pop("hf_overrides")
    return EngineArgs.from_kwargs(**values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="engine-core", description="Run a tidal EngineCore for frontends to connect to.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--listen", default=None,
                        help="tcp://HOST:PORT, ipc://PATH or a port (loopback); port 0 picks a "
                             "free one; default: ipc:// in a temporary directory")
    add_engine_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tidal.engine_core.core_proc import serve, setup_logging
    from tidal.engine_core.sockets import normalize_address

    ns = build_parser().parse_args(argv)
    setup_logging("engine-core")
    start = time.perf_counter()
    try:
        args = engine_args_from(ns)
        config = args.create_config()
        listen = normalize_address(ns.listen) if ns.listen else None
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        logger.error("%s", exc)
        return 2
    logger.info("start-up: config resolved in %.2f s: %s (%s, %s) on %s, executor %s",
                time.perf_counter() - start, config.model.served_model_name,
                config.model.load_format, config.model.dtype, config.runner.device,
                config.parallel.distributed_executor_backend)
    tmpdir = None
    if listen is None:
        tmpdir = tempfile.mkdtemp(prefix="tidal-engine-")
        listen = f"ipc://{tmpdir}/engine.sock"
    try:
        return serve(config, listen)
    finally:
        if tmpdir is not None:
            shutil.rmtree(tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
