"""The command lines: ``tidal serve`` flags of the serving path (API server count and its
default, stream interval; bad values refused with a message naming the flag); every flag of
``tidal serve``, ``tidal generate`` and ``engine-core`` documented with its default; boolean
engine flags that turn off as well as on; log levels that reach the engine process;
``tidal generate`` writing only the text to stdout; a clear message for an unreachable
engine-core."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import subprocess
import sys

import pytest

from tidal.engine_core import cli as engine_cli
from tidal.engine_core.config import EngineArgs
from tidal.frontend.cli import _api_server_count, _server_settings, build_parser
from tidal.frontend.server.api_servers import MAX_DEFAULT_API_SERVERS, default_api_server_count


def _serve(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_serving_flags_reach_the_settings():
    ns = _serve("--stream-interval", "4", "--api-server-count", "3")
    assert _server_settings(ns).stream_interval == 4
    assert _api_server_count(ns, EngineArgs()) == 3
    assert _server_settings(_serve()).stream_interval == 1


@pytest.mark.parametrize("flags, match", [
    (("--stream-interval", "0"), "--stream-interval must be >= 1"),
    (("--api-server-count", "0"), "--api-server-count must be >= 1"),
])
def test_bad_values_are_refused(flags, match):
    ns = _serve(*flags)
    with pytest.raises(SystemExit, match=match):
        _server_settings(ns)
        _api_server_count(ns, EngineArgs())


def test_default_api_server_count_follows_the_cores():
    assert default_api_server_count(1, cpus=2) == 1  # CI-sized machines: one process
    assert default_api_server_count(1, cpus=6) == 1
    assert default_api_server_count(1, cpus=16) == 6  # one H100 host
    assert default_api_server_count(2, cpus=16) == 6
    assert default_api_server_count(4, cpus=16) == 5
    assert default_api_server_count(1, cpus=128) == MAX_DEFAULT_API_SERVERS


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {"tidal serve": sub.choices["serve"], "tidal generate": sub.choices["generate"],
            "tidal disagg-proxy": sub.choices["disagg-proxy"],
            "engine-core": engine_cli.build_parser()}


@pytest.mark.parametrize("command", ["tidal serve", "tidal generate", "tidal disagg-proxy",
                                     "engine-core"])
def test_every_flag_has_a_help_line_with_its_default(command):
    parser = _commands()[command]
    assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{command} {name} has no help line"
        text = formatter._expand_help(action)  # also checks the %-formatting
        if action.option_strings or action.nargs == "?":  # not a required positional
            assert "default" in text, f"{command} {name}: the help does not say its default"
    shown = parser.format_help()
    # A default decided at start-up is explained in words, never shown as "None".
    assert "(default: None)" not in shown and "default: None" not in shown


def test_every_engine_argument_has_a_flag():
    parser = engine_cli.build_parser()
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in dataclasses.fields(EngineArgs)} <= dests


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(EngineArgs)
                                   if str(f.type) in ("bool", "bool | None")])
def test_boolean_engine_flags_turn_on_and_off(field):
    flag = "--" + field.replace("_", "-")
    parse = engine_cli.build_parser().parse_args
    default = getattr(EngineArgs(), field)
    assert getattr(engine_cli.engine_args_from(parse([])), field) is default
    assert getattr(engine_cli.engine_args_from(parse([flag])), field) is True
    no = flag.replace("--", "--no-", 1)
    assert getattr(engine_cli.engine_args_from(parse([no])), field) is False


def test_engine_core_log_level(monkeypatch, capsys):
    parse = engine_cli.build_parser().parse_args
    assert parse(["--log-level", "debug"]).log_level == "debug"
    monkeypatch.setenv("TIDAL_LOG_LEVEL", "WARNING")
    assert engine_cli.build_parser().parse_args([]).log_level == "warning"
    with pytest.raises(SystemExit):
        parse(["--log-level", "verbose"])
    assert "--log-level" in capsys.readouterr().err
    # main() hands the level on to the processes it starts (they read $TIDAL_LOG_LEVEL).
    assert engine_cli.main(["--log-level", "error", "--model", "/nonexistent/model"]) == 2
    assert os.environ["TIDAL_LOG_LEVEL"] == "ERROR"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("TIDAL_LOG_LEVEL", None)
    return subprocess.Popen([sys.executable, "-m", "tidal.frontend.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen[str], timeout: float = 180) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


@pytest.mark.slow
def test_unreachable_engine_core_is_named_with_what_to_do():
    address = f"tcp://127.0.0.1:{_free_port()}"
    code, _, err = _finish(_start("serve", "--engine-address", address,
                                  "--engine-connect-timeout", "0.5", "--port", str(_free_port()),
                                  "--api-server-count", "1"))
    assert code == 1
    assert f"could not connect to the engine-core at {address}" in err
    assert f"engine-core --listen {address}" in err
    assert "cannot start" not in err


def test_engine_connect_timeout_must_be_positive():
    with pytest.raises(SystemExit, match="--engine-connect-timeout must be > 0"):
        _server_settings(_serve("--engine-connect-timeout", "0"))


_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (DEBUG|INFO|WARNING|ERROR) ", re.M)
SMALL = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--cpu-threads", "1"]


@pytest.mark.slow
def test_generate_writes_only_the_text_to_stdout(smollm2_llm):
    from tidal.frontend import SamplingParams

    prompt = "The sky is"
    expected = smollm2_llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
    # Two runs side by side: the default log level, and --log-level warning, which must
    # reach the engine and worker processes too.
    loud = _start("generate", prompt, "--max-tokens", "8", *SMALL)
    quiet = _start("generate", prompt, "--max-tokens", "8", "--log-level", "warning", *SMALL)
    (code, out, err), (quiet_code, quiet_out, quiet_err) = _finish(loud), _finish(quiet)
    assert code == 0, err
    assert out == expected + "\n"
    # The log went to stderr, from this process and from the engine's.
    assert "EngineCore[" in err and " INFO tidal.frontend" in err
    assert _LOG_LINE.search(err) and not _LOG_LINE.search(out)
    assert quiet_code == 0, quiet_err
    assert quiet_out == expected + "\n"
    assert " INFO " not in quiet_err, quiet_err
